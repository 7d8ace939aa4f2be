"""Write TOML: the inverse of :mod:`tomllib` for the values it produces.

``environmentConfig/read`` answers with selected parts of TOML files as TOML
text (the reference serialises its parsed values again). Python reads TOML
(:mod:`tomllib`) but has no writer, so this is the small one needed: tables
become ``[a.b]`` sections, tables inside arrays inline tables, strings basic
strings with escapes. ``tomllib.loads(dumps(x)) == x`` for every value
:mod:`tomllib` can return (checked by a property test).
"""

from __future__ import annotations

import datetime
import math
import re
from collections.abc import Mapping
from typing import Any, Final

_BARE_KEY: Final = re.compile(r"[A-Za-z0-9_-]+")
#: What a basic string must escape (TOML 1.0: ``"``, ``\\`` and control characters).
_ESCAPES: Final = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n"}
_ESCAPES.update({"\f": "\\f", "\r": "\\r"})
_NEEDS_ESCAPE: Final = re.compile(r'["\\\x00-\x1f\x7f]')


def _string(text: str) -> str:
    def escape(match: re.Match[str]) -> str:
        char = match.group()
        return _ESCAPES.get(char) or f"\\u{ord(char):04x}"

    return '"' + _NEEDS_ESCAPE.sub(escape, text) + '"'


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _string(key)


def _float(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)  # "5.0", "1e+16", "-0.0": all TOML floats


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, Mapping):
        if not value:
            return "{}"
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_value(item) for item in value) + "]"
    raise TypeError(f"not a TOML value: {type(value).__name__}")


def _table(out: list[str], path: list[str], table: Mapping[str, Any]) -> None:
    plain = [(k, v) for k, v in table.items() if not isinstance(v, Mapping)]
    nested = [(k, v) for k, v in table.items() if isinstance(v, Mapping)]
    # A table holding only tables needs no header of its own (TOML defines
    # it implicitly); an empty one does, or it would vanish.
    if path and (plain or not nested):
        if out:
            out.append("")
        out.append("[" + ".".join(_key(part) for part in path) + "]")
    out.extend(f"{_key(k)} = {_value(v)}" for k, v in plain)
    for key, sub in nested:
        _table(out, [*path, key], sub)


def dumps(document: Mapping[str, Any]) -> str:
    """TOML text for a table (``""`` for an empty one), one trailing newline."""
    out: list[str] = []
    _table(out, [], document)
    return "\n".join(out) + "\n" if out else ""
