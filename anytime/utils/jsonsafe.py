"""JSON from outside (a request body, a frame header): nesting bounded before the parser recurses into it.

Python's decoder recurses once per level of nesting; a body of a few hundred kilobytes of ``[`` reaches the
interpreter's recursion limit. The depth is measured first, on the bytes with their strings blanked out (a
bracket inside a string does not nest), by a regular expression and a cumulative sum, both linear and in C.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 64  # the framework's own documents nest a handful of levels; a client's never need more
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


def nesting_depth(data: bytes) -> int:
    """How deeply ``data``'s arrays and objects nest (strings ignored; unbalanced text gives its deepest opening)."""
    import numpy as np

    codes = np.frombuffer(_STRING.sub(b'""', data), dtype=np.uint8)
    steps = np.isin(codes, (ord("["), ord("{"))).astype(np.int64) - np.isin(codes, (ord("]"), ord("}")))
    return int(np.cumsum(steps).max(initial=0))


def loads_bounded(data: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(data)``, refused with ``ValueError`` (one sentence) when it nests deeper than ``max_depth``, is
    not UTF-8 or not JSON."""
    depth = nesting_depth(data)
    if depth > max_depth:
        raise ValueError(f"the JSON nests {depth} levels deep; at most {max_depth} are accepted")
    try:
        return json.loads(data)
    except (UnicodeDecodeError, RecursionError, json.JSONDecodeError):
        raise ValueError("the body is not valid JSON") from None
