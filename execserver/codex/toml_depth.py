"""How deep a TOML document nests, and where it first goes too deep.

The reference's TOML parser refuses nesting deeper than
:data:`MAX_TOML_DEPTH` levels (tables and arrays); Python's ``tomllib``
recurses once per level and would raise ``RecursionError`` a few hundred
levels down, and what it builds from a 3,000-segment dotted key would
make every recursive walk after it fail the same way. A config is
therefore checked against the same limit: :func:`too_deep` walks a parsed
document without recursion, :func:`first_too_deep` scans the text (strings
and comments skipped) for the line and column to report.

Depth counts containers from the document's root table (depth 0): the
table of ``[a.b]`` is at depth 2, the array of ``x = [`` at root at depth 1,
each array or inline table inside another one level deeper, and the
intermediate tables of a dotted key ``a.b.c = 1`` one level each.
"""

from __future__ import annotations

from typing import Any, Final

#: The deepest nesting a config may have: the reference's toml parser's limit
#: (81 nested arrays, inline tables or table-header segments are refused).
MAX_TOML_DEPTH: Final = 80

#: The reference's texts: nesting in a value (arrays, inline tables), and
#: tables (headers, dotted keys).
VALUE_TOO_DEEP: Final = "cannot recurse further; max recursion depth met"
TABLES_TOO_DEEP: Final = "recursion limit"


def too_deep(document: dict[str, Any], limit: int = MAX_TOML_DEPTH) -> bool:
    """Whether a container of ``document`` is nested deeper than ``limit`` (iterative)."""
    stack: list[tuple[Any, int]] = [(document, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        children = value.values() if isinstance(value, dict) else value
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def first_too_deep(text: str, limit: int = MAX_TOML_DEPTH) -> tuple[int, int, str] | None:
    """``(line, column, message)`` (1-based) of the first container deeper than ``limit``."""
    return _Scanner(text, limit).run()


class _Scanner:
    """Just enough of TOML's lexical rules to follow nesting (not a validator)."""

    def __init__(self, text: str, limit: int) -> None:
        self.text = text
        self.limit = limit
        self.pos = 0
        self.line = 1
        self.line_start = 0

    def where(self, pos: int) -> tuple[int, int]:
        return self.line, pos - self.line_start + 1

    def newline(self) -> None:
        self.line += 1
        self.line_start = self.pos

    def skip_string(self) -> None:
        """Past the string starting at ``pos`` (basic, literal, multi-line)."""
        text = self.text
        quote = text[self.pos]
        triple = text.startswith(quote * 3, self.pos)
        end = quote * 3 if triple else quote
        self.pos += len(end)
        while self.pos < len(text):
            ch = text[self.pos]
            if ch == "\\" and quote == '"':
                self.pos += 2
                if text[self.pos - 1 : self.pos] == "\n":
                    self.newline()
                continue
            if text.startswith(end, self.pos):
                self.pos += len(end)
                if triple:
                    # Up to two more quotes belong to the string.
                    while self.pos < len(text) and text[self.pos] == quote:
                        self.pos += 1
                return
            self.pos += 1
            if ch == "\n":
                self.newline()
                if not triple:
                    return

    def skip_comment(self) -> None:
        end = self.text.find("\n", self.pos)
        self.pos = len(self.text) if end < 0 else end

    def run(self) -> tuple[int, int, str] | None:
        text, limit = self.text, self.limit
        table_depth = 0
        # Frames of open arrays and inline tables: (kind, depth).
        frames: list[tuple[str, int]] = []
        mode = "key"  # "key" (reading a key), "value" (a value is expected), "after"
        segments = 1
        key_start = 0
        # Whether the key being read has begun (a root line that starts with
        # "[" is a table header).
        key_begun = False
        value_depth = 0
        while self.pos < len(text):
            ch = text[self.pos]
            if ch == "\n":
                self.pos += 1
                self.newline()
                if not frames:
                    mode, segments, key_begun = "key", 1, False
                continue
            if ch in " \t\r":
                self.pos += 1
                continue
            if ch == "#":
                self.skip_comment()
                continue
            here = self.pos
            if mode == "key":
                if ch == "[" and not frames and not key_begun:
                    double = text.startswith("[[", here)
                    self.pos += 2 if double else 1
                    count = 1
                    while self.pos < len(text) and text[self.pos] not in "]\n":
                        if text[self.pos] in "\"'":
                            self.skip_string()
                            continue
                        if text[self.pos] == ".":
                            count += 1
                        self.pos += 1
                    table_depth = count + (1 if double else 0)
                    if table_depth > limit:
                        return (*self.where(here), TABLES_TOO_DEEP)
                    self.skip_comment()
                    continue
                if not key_begun:
                    key_start, key_begun = here, True
                if ch in "\"'":
                    self.skip_string()
                elif ch == ".":
                    segments += 1
                    self.pos += 1
                elif ch == "=":
                    base = frames[-1][1] if frames else table_depth
                    if base + segments - 1 > limit:
                        return (*self.where(key_start), TABLES_TOO_DEEP)
                    mode, value_depth = "value", base + segments
                    self.pos += 1
                elif ch == "}" and frames and frames[-1][0] == "table":
                    frames.pop()
                    mode = "after"
                    self.pos += 1
                else:
                    self.pos += 1
                continue
            if ch in "[{" and mode == "value":
                if value_depth > limit:
                    return (*self.where(here), VALUE_TOO_DEEP)
                self.pos += 1
                if ch == "[":
                    frames.append(("array", value_depth))
                    value_depth += 1
                else:
                    frames.append(("table", value_depth))
                    mode, segments, key_begun = "key", 1, False
                continue
            if ch in "]}":
                if frames:
                    frames.pop()
                mode = "after"
                self.pos += 1
                continue
            if ch == ",":
                self.pos += 1
                if frames and frames[-1][0] == "array":
                    mode, value_depth = "value", frames[-1][1] + 1
                elif frames:
                    mode, segments, key_begun = "key", 1, False
                continue
            if ch in "\"'":
                self.skip_string()
            else:
                self.pos += 1
                while self.pos < len(text) and text[self.pos] not in ",]}\n#\"' \t":
                    self.pos += 1
            mode = "after"
        return None
