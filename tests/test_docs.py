"""The documents keep up with the tree: the README stays short (details live under
docs/), docs/architecture.md names every module of the package, and the README's
Layout block names every module and folder of pyllm/ and nothing that does not exist."""

from __future__ import annotations

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "pyllm"
README = REPO / "README.md"
ARCHITECTURE = REPO / "docs" / "architecture.md"
README_MAX_LINES = 300

MODULES = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines < README_MAX_LINES, (
        f"README.md has {lines} lines; move details to a page under docs/ and link it"
    )


def missing_modules(text: str, modules: list[str]) -> list[str]:
    """The modules (paths under pyllm/) that `text` does not name in backticks."""
    named = set(re.findall(r"`([^`\s]+\.py)`", text))
    return [m for m in modules if m not in named]


def test_missing_modules_finds_one():
    text = "| `engine/stats.py` | counters |\n| `ops.py`, `kv_cache.py` | kernels |"
    modules = ["engine/stats.py", "engine/scheduler.py", "ops.py", "kv_cache.py"]
    assert missing_modules(text, modules) == ["engine/scheduler.py"]
    # A bare file name does not stand for a module in a subpackage.
    assert missing_modules("`stats.py`", ["engine/stats.py"]) == ["engine/stats.py"]


def test_architecture_names_every_module():
    assert "engine/llm_engine.py" in MODULES, "the module list missed files"
    missing = missing_modules(ARCHITECTURE.read_text(encoding="utf-8"), MODULES)
    assert missing == [], (
        f"docs/architecture.md does not name {missing} (one row each: `path` | job)"
    )


def layout_rows(readme: str) -> dict[str, str]:
    """The README's Layout block as {folder or path it starts with: its text}."""
    section = readme.split("\n## Layout\n", 1)[1]
    block = section.split("```\n", 2)[1]
    rows: dict[str, str] = {}
    key = ""
    for line in block.splitlines():
        if line and not line[0].isspace():
            key, _, line = line.partition(" ")
            rows[key] = ""
        rows[key] += " " + line.strip()
    return rows


NAME = re.compile(r"(?<![\w./-])([A-Za-z_][\w-]*\.(?:py|h|cpp|cuh|cu|sh|md)\b|[A-Za-z_][\w-]*/)")
NOT_PATHS = {"llama.cpp"}  # a project's name, not a file


def layout_names(rows: dict[str, str]) -> dict[str, set[str]]:
    """Folder (relative to the repository) -> the files and folders its row names."""
    names: dict[str, set[str]] = {}
    for key, text in rows.items():
        folder = key if key.endswith("/") else key.rpartition("/")[0] + "/"
        names.setdefault(folder, set()).update(set(NAME.findall(text)) - NOT_PATHS)
        if not key.endswith("/"):
            names[folder].add(key.rpartition("/")[2])
        parent, _, leaf = key.rstrip("/").rpartition("/")
        if parent and key.endswith("/"):
            names.setdefault(parent + "/", set()).add(leaf + "/")
    return names


def test_layout_names_parse():
    block = (
        "## Layout\n\n```\npkg/       a.py, b/ (x and y.h; vs llama.cpp)\n"
        "           c.py, z.cuh\npkg/d/     e.py\n```\n"
    )
    names = layout_names(layout_rows("\n" + block))
    assert names == {"pkg/": {"a.py", "b/", "y.h", "c.py", "z.cuh", "d/"}, "pkg/d/": {"e.py"}}


def test_layout_names_exist():
    names = layout_names(layout_rows(README.read_text(encoding="utf-8")))
    assert "pyllm/model/" in names, "the Layout block did not parse"
    absent = [
        f"{folder}{name}"
        for folder, found in names.items()
        for name in sorted(found)
        if not (REPO / folder / name).exists()
    ]
    assert absent == [], f"README's Layout block names what does not exist: {absent}"


@pytest.mark.parametrize(
    "folder",
    ["pyllm/"]
    + sorted(
        f"{p.relative_to(REPO).as_posix()}/"
        for p in PACKAGE.iterdir()
        if p.is_dir() and p.name != "__pycache__" and not p.name.startswith(".")
    ),
)
def test_layout_covers_package(folder):
    names = layout_names(layout_rows(README.read_text(encoding="utf-8"))).get(folder, set())
    entries = sorted(
        p.name + ("/" if p.is_dir() else "")
        for p in (REPO / folder).iterdir()
        if p.name not in ("__pycache__", "__init__.py")
        and not p.name.startswith(".")
        and (p.is_dir() or p.suffix == ".py")
    )
    missing = [e for e in entries if e not in names]
    assert missing == [], f"README's Layout row for {folder} does not name {missing}"
