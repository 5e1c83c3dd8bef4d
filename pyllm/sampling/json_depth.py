"""How deeply a JSON text nests, measured before parsing it: json.loads recurses once per
level, so a 10 KB string of brackets would otherwise end in a RecursionError."""

from __future__ import annotations

import json
import re
from typing import Any

# As serde_json's default (and llguidance's): real schemas and arguments nest a few
# tens of levels.
MAX_JSON_DEPTH = 128

# A string literal (skipped whole: brackets inside it do not nest), or one bracket.
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


def json_text_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in `text` (valid JSON or not)."""
    depth = deepest = 0
    for match in _TOKENS.finditer(text):
        char = match.group()
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def loads_bounded(text: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads, refusing (ValueError) text nested deeper than max_depth."""
    depth = json_text_depth(text)
    if depth > max_depth:
        raise ValueError(f"JSON nested {depth} levels deep; the limit is {max_depth}")
    return json.loads(text)
