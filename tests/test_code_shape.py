"""The code's shape: no Python file in pyllm/ over 600 lines, no C++/CUDA file in csrc/
over 700, no Python function over 50, and one list of the GGUF quantized types per
language (csrc/quantization/gguf_formats.h; Python reads it through
torch.ops.pyllm.quant_types()). Each check is also run once on a violation, so that a
check that can no longer fail is noticed. Reads the sources only: nothing is imported."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYTHON_MAX_LINES = 600
CSRC_MAX_LINES = 700
FUNCTION_MAX_LINES = 50
CSRC_SUFFIXES = (".h", ".cpp", ".cu", ".cuh")

# GGML's quantized types: name, type id, weights per block, bytes per block (what the
# table says; here only to recognise copies of it).
QUANT_TYPES = (
    ("Q4_0", 2, 32, 18), ("Q4_1", 3, 32, 20), ("Q5_0", 6, 32, 22), ("Q5_1", 7, 32, 24),
    ("Q8_0", 8, 32, 34), ("Q4_K", 12, 256, 144), ("Q5_K", 13, 256, 176),
    ("Q6_K", 14, 256, 210), ("MXFP4", 39, 32, 17),
)  # fmt: skip


def python_files() -> list[pathlib.Path]:
    return sorted((ROOT / "pyllm").rglob("*.py"))


def csrc_files() -> list[pathlib.Path]:
    return sorted(p for p in (ROOT / "csrc").rglob("*") if p.suffix in CSRC_SUFFIXES)


def read(path: pathlib.Path) -> str:
    return path.read_text(encoding="utf-8")


def line_count(text: str) -> int:
    return len(text.splitlines())


def long_functions(source: str, limit: int = FUNCTION_MAX_LINES) -> list[tuple[str, int]]:
    """(name, lines) of each function longer than limit lines, from its def line (not its
    decorators) to its last line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append((node.name, lines))
    return found


def python_type_table(source: str) -> bool:
    """Whether a Python source holds a copy of the type list: a literal collection of
    three or more GGML type names, a name paired with its type id, or a K type's
    (block, bytes) pair."""
    names = {name for name, *_ in QUANT_TYPES}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            items = node.keys
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = node.elts
        else:
            continue
        listed = {i.value for i in items if isinstance(i, ast.Constant) and i.value in names}
        if len(listed) >= 3:
            return True
    for name, type_id, block, nbytes in QUANT_TYPES:
        if re.search(rf"['\"]{name}['\"]\s*[:,=]\s*\(?\s*{type_id}\b", source, re.IGNORECASE):
            return True
        if block == 256 and re.search(rf"\b{block}\s*,\s*{nbytes}\b", source):
            return True
    return False


def cpp_type_table(source: str) -> bool:
    """Whether a C++/CUDA source holds a copy of the type list: a type's name beside its
    id (an enum, a table row, a message listing them) or a K type's block and byte sizes
    on one line."""
    for name, type_id, block, nbytes in QUANT_TYPES:
        if re.search(rf"\b(k?{name}\W{{1,6}}{type_id}|{type_id}\W{{1,6}}k?{name})\b", source):
            return True
        if block == 256 and re.search(rf"\b{block}\b[^;\n]{{0,30}}\b{nbytes}\b", source):
            return True
    return False


def test_python_files_are_short():
    long = [
        (str(p.relative_to(ROOT)), n)
        for p in python_files()
        if (n := line_count(read(p))) > PYTHON_MAX_LINES
    ]
    assert long == [], f"Python files over {PYTHON_MAX_LINES} lines"


def test_csrc_files_are_short():
    long = [
        (str(p.relative_to(ROOT)), n)
        for p in csrc_files()
        if (n := line_count(read(p))) > CSRC_MAX_LINES
    ]
    assert long == [], f"csrc files over {CSRC_MAX_LINES} lines"


def test_python_functions_are_short():
    long = [(str(p.relative_to(ROOT)), f) for p in python_files() for f in long_functions(read(p))]
    assert long == [], f"functions over {FUNCTION_MAX_LINES} lines"


def test_one_quant_type_table_per_language():
    cpp = [str(p.relative_to(ROOT)) for p in csrc_files() if cpp_type_table(read(p))]
    python = [str(p.relative_to(ROOT)) for p in python_files() if python_type_table(read(p))]
    assert cpp == ["csrc/quantization/gguf_formats.h"]
    assert len(python) <= 1, python


# Each check against a violation.


def test_line_count_counts_lines():
    assert line_count("a\n" * (PYTHON_MAX_LINES + 1)) > PYTHON_MAX_LINES


def test_long_function_is_found():
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_MAX_LINES))
    source = f"@decorator\ndef f():\n{body}\n\ndef g():\n    return 1\n"
    assert long_functions(source) == [("f", FUNCTION_MAX_LINES + 1)]
    assert long_functions(source, FUNCTION_MAX_LINES + 1) == []


def test_python_type_table_is_found():
    assert python_type_table('T = {"Q4_0": (2, 32, 18), "Q8_0": (8, 32, 34)}\n')
    assert python_type_table('NAMES = ("F32", "Q8_0", "Q4_0", "Q4_K")\n')
    assert python_type_table('BY_NAME = {"q6_k": 14}\n')
    assert python_type_table("SIZES = {'x': (256, 210)}\n")
    assert not python_type_table('TYPES = dict(zip(*quant_types()))\nx = T["Q6_K"][0]\n')


def test_cpp_type_table_is_found():
    assert cpp_type_table("enum Type : int64_t { kQ4_0 = 2, kQ6_K = 14 };\n")
    assert cpp_type_table('{14, "Q6_K", 256, 210},\n')
    assert cpp_type_table("static constexpr int kBlockSize = 256, kTypeSize = 176;\n")
    assert cpp_type_table('"qtype (Q4_0=2, Q8_0=8, MXFP4=39)"\n')
    assert not cpp_type_table("if constexpr (T == kQ6_K) d = half_at(blk + F::kD);\n")
