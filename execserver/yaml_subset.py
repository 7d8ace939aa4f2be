"""The YAML that Codex skill files use, parsed without a YAML dependency.

The reference reads a ``SKILL.md`` front matter and a skill's
``agents/openai.yaml`` with a full YAML parser. Those files are small
hand-written documents: block mappings and sequences, plain, quoted and
block (``|``, ``>``) scalars, comments, and the occasional flow collection
(``[a, b]``, ``{k: v}``), rarely an anchor (``&name``) and its aliases
(``*name``). This module parses exactly that subset into
``dict``/``list``/``str``/``None`` (scalars stay strings: the caller wants
text, as the reference's ``String`` fields accept any scalar). Anything
outside it (tags, directives, multi-document streams, complex keys,
anchors and aliases inside flow collections) is a :class:`YamlError`, as
malformed YAML is; the caller reports such a file as invalid metadata. docs/protocol.md,
"capabilities/discoverV2", lists the subset.
"""

from __future__ import annotations

import re
from typing import Any, Final

#: Plain scalars YAML resolves to null.
_NULLS: Final = frozenset({"", "~", "null", "Null", "NULL"})
#: Characters that cannot start a plain scalar (YAML 1.2 c-indicator), bar
#: the ones handled before (quotes, flow openers, block scalar headers).
_RESERVED_START: Final = frozenset("@`!&*%|>")
_BLOCK_HEADER: Final = re.compile(r"^([|>])([+-]?)([1-9]?)([+-]?)$")
_ESCAPES: Final = {
    "0": "\0",
    "a": "\a",
    "b": "\b",
    "t": "\t",
    "\t": "\t",
    "n": "\n",
    "v": "\v",
    "f": "\f",
    "r": "\r",
    "e": "\x1b",
    " ": " ",
    '"': '"',
    "/": "/",
    "\\": "\\",
    "N": "\x85",
    "_": "\xa0",
    "L": "\u2028",
    "P": "\u2029",
}
_HEX_ESCAPES: Final = {"x": 2, "u": 4, "U": 8}


#: Unquoted scalars that are booleans (YAML 1.2 core schema), for callers
#: that want one.
BOOLEANS: Final = {
    "true": True,
    "True": True,
    "TRUE": True,
    "false": False,
    "False": False,
    "FALSE": False,
}


class YamlError(ValueError):
    """The text is not YAML this module accepts."""


class Quoted(str):
    """A quoted scalar's text: always a string, never a boolean or null."""

    __slots__ = ()


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _strip_comment(text: str) -> str:
    """``text`` without a trailing ``# comment`` (a ``#`` after a space, outside quotes)."""
    quote = ""
    for index, char in enumerate(text):
        if quote:
            if char == quote:
                quote = ""
            elif char == "\\" and quote == '"':
                continue
        elif char in "'\"" and (index == 0 or text[index - 1] in " \t[{,:"):
            quote = char
        elif char == "#" and (index == 0 or text[index - 1] in " \t"):
            return text[:index].rstrip()
    return text.rstrip()


def _split_key(text: str) -> tuple[str, str] | None:
    """``(key, rest)`` of a mapping entry ``key: rest`` / ``key:``; None if not one."""
    if text[:1] in ("'", '"'):
        end = _quoted_end(text, 0)
        key_text, after = text[: end + 1], text[end + 1 :]
        stripped = after.lstrip(" ")
        if not stripped.startswith(":") or (len(stripped) > 1 and stripped[1] not in " \t"):
            return None
        return _quoted(key_text), stripped[1:]
    for index, char in enumerate(text):
        if char == ":" and (index + 1 == len(text) or text[index + 1] in " \t"):
            key = text[:index].rstrip()
            if not key or key[0] in "[{?" or key.startswith("- "):
                return None
            return key, text[index + 1 :]
        if char == "#" and index and text[index - 1] in " \t":
            return None
    return None


def _quoted_end(text: str, start: int) -> int:
    quote = text[start]
    index = start + 1
    while index < len(text):
        char = text[index]
        if quote == '"' and char == "\\":
            index += 2
            continue
        if char == quote:
            if quote == "'" and text[index + 1 : index + 2] == "'":
                index += 2
                continue
            return index
        index += 1
    raise YamlError("unterminated quoted scalar")


def _fold_lines(lines: list[str]) -> str:
    """Join the lines of a multi-line flow scalar: one break is a space, n+1 are n newlines."""
    out = lines[0].rstrip(" \t") if lines else ""
    blanks = 0
    for line in lines[1:]:
        stripped = line.strip(" \t")
        if not stripped:
            blanks += 1
            continue
        out += ("\n" * blanks if blanks else " ") + stripped
        blanks = 0
    return out + "\n" * blanks


def _quoted(text: str) -> Quoted:
    """The value of a complete quoted scalar (``'…'`` or ``"…"``, maybe multi-line)."""
    quote, body = text[0], text[1:-1]
    if quote == "'":
        return Quoted(_fold_lines(body.split("\n")).replace("''", "'"))
    out: list[str] = []
    lines = body.split("\n")
    folded = _fold_lines(lines) if len(lines) > 1 else body
    index = 0
    while index < len(folded):
        char = folded[index]
        if char != "\\":
            out.append(char)
            index += 1
            continue
        code = folded[index + 1 : index + 2]
        if code in _HEX_ESCAPES:
            digits = folded[index + 2 : index + 2 + _HEX_ESCAPES[code]]
            if len(digits) != _HEX_ESCAPES[code] or not all(
                c in "0123456789abcdefABCDEF" for c in digits
            ):
                raise YamlError("invalid escape in double-quoted scalar")
            out.append(chr(int(digits, 16)))
            index += 2 + len(digits)
        elif code in _ESCAPES:
            out.append(_ESCAPES[code])
            index += 2
        else:
            raise YamlError("invalid escape in double-quoted scalar")
    return Quoted("".join(out))


def _plain(text: str) -> str | None:
    if text[:1] in _RESERVED_START:
        raise YamlError(f"unsupported plain scalar start {text[:1]!r}")
    if text.startswith(("- ", "? ")) or text in ("-", "?"):
        raise YamlError("unexpected block indicator in a scalar")
    if ": " in text or text.endswith(":") or " #" in text:
        raise YamlError("mapping values are not allowed in this context")
    return None if text in _NULLS else text


class _Flow:
    """A flow collection (``[…]``, ``{…}``) on one logical line."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def parse(self) -> Any:
        value = self._value()
        self._space()
        if self.pos != len(self.text):
            raise YamlError("unexpected text after a flow collection")
        return value

    def _space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t\n":
            self.pos += 1

    def _value(self) -> Any:
        self._space()
        char = self.text[self.pos : self.pos + 1]
        if char == "[":
            return self._collection("]")
        if char == "{":
            return self._collection("}")
        if char in ("'", '"'):
            end = _quoted_end(self.text, self.pos)
            value = _quoted(self.text[self.pos : end + 1])
            self.pos = end + 1
            return value
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in ",[]{}":
            if self.text[self.pos] == ":" and self.text[self.pos + 1 : self.pos + 2] in (
                " ",
                ",",
                "}",
                "]",
                "",
            ):
                break
            self.pos += 1
        return _plain(" ".join(self.text[start : self.pos].split()))

    def _collection(self, close: str) -> Any:
        self.pos += 1
        items: list[Any] = []
        mapping: dict[str, Any] = {}
        while True:
            self._space()
            if self.text[self.pos : self.pos + 1] == close:
                self.pos += 1
                return mapping if close == "}" else items
            value = self._value()
            self._space()
            if self.text[self.pos : self.pos + 1] == ":":
                self.pos += 1
                if not isinstance(value, str) or value in mapping:
                    raise YamlError("invalid or duplicate flow mapping key")
                mapping[value] = self._value()
            elif close == "}":
                if not isinstance(value, str) or value in mapping:
                    raise YamlError("invalid or duplicate flow mapping key")
                mapping[value] = None
            else:
                items.append(value)
            self._space()
            char = self.text[self.pos : self.pos + 1]
            if char == ",":
                self.pos += 1
            elif char != close:
                raise YamlError("unterminated flow collection")


class _Block:
    """Block structure over a list of lines (comments already allowed anywhere)."""

    def __init__(self, text: str) -> None:
        if "\t" in "".join(line[: _indent(line) + 1] for line in text.split("\n")):
            raise YamlError("tabs are not allowed for indentation")
        self.lines = text.split("\n")
        self.pos = 0
        #: Values of ``&name`` anchors, for ``*name`` aliases (block context).
        self.anchors: dict[str, Any] = {}
        #: Each line without its comment, scanned once: nested nodes on one
        #: line ("- - - x") look at it again at every level.
        self._content: dict[int, str] = {}

    def _line(self) -> str:
        """The current line without its comment."""
        content = self._content.get(self.pos)
        if content is None:
            content = self._content[self.pos] = _strip_comment(self.lines[self.pos])
        return content

    def _skip_blank(self) -> None:
        while self.pos < len(self.lines) and not self._line().strip():
            self.pos += 1

    def document(self) -> Any:
        # A document end marker ends the text (the rest must be blank).
        for index, line in enumerate(self.lines):
            if line.rstrip() == "...":
                if any(_strip_comment(rest).strip() for rest in self.lines[index + 1 :]):
                    raise YamlError("several documents are not supported")
                del self.lines[index:]
                break
        self._skip_blank()
        if self.pos < len(self.lines) and self.lines[self.pos].startswith(("%", "---", "...")):
            raise YamlError("directives and document markers are not supported")
        if self.pos == len(self.lines):
            return None
        value = self._node(_indent(self.lines[self.pos]))
        self._skip_blank()
        if self.pos != len(self.lines):
            raise YamlError("unexpected content after the document")
        return value

    def _node(self, indent: int) -> Any:
        content = self._line()[indent:]
        if content.startswith("- ") or content == "-":
            return self._sequence(indent)
        if _split_key(content) is not None:
            return self._mapping(indent)
        return self._scalar_lines(indent, content)

    def _sequence(self, indent: int) -> list[Any]:
        items: list[Any] = []
        while True:
            self._skip_blank()
            if self.pos == len(self.lines):
                return items
            line = self._line()
            if _indent(line) != indent or not (
                line[indent:].startswith("- ") or line[indent:] == "-"
            ):
                if _indent(line) > indent:
                    raise YamlError("bad indentation of a sequence entry")
                return items
            rest = line[indent + 1 :]
            inner = indent + 1 + _indent(rest)
            if not rest.strip():
                self.pos += 1
                items.append(self._child(indent))
            elif rest.lstrip(" ")[:1] in ("&", "*"):
                items.append(self._value_after_key(indent, rest))
            else:
                # "- key: v" starts a mapping indented at the text after "- ".
                # The rest has no comment left, so it is its own content.
                self.lines[self.pos] = " " * inner + rest.lstrip(" ")
                self._content[self.pos] = self.lines[self.pos]
                items.append(self._node(inner))

    def _mapping(self, indent: int) -> dict[str, Any]:
        mapping: dict[str, Any] = {}
        while True:
            self._skip_blank()
            if self.pos == len(self.lines):
                return mapping
            line = self._line()
            if _indent(line) < indent:
                return mapping
            if _indent(line) > indent:
                raise YamlError("bad indentation of a mapping entry")
            split = _split_key(line[indent:])
            if split is None:
                if line[indent:].startswith("- "):
                    return mapping
                raise YamlError("could not find expected ':'")
            key, rest = split
            if key in mapping:
                raise YamlError(f"duplicate entry with key {key!r}")
            mapping[key] = self._value_after_key(indent, rest)

    def _value_after_key(self, indent: int, rest: str) -> Any:
        text = rest.strip(" \t")
        anchor = None
        if text.startswith("&"):
            anchor, _, text = text[1:].partition(" ")
            text = text.strip(" \t")
            if not anchor:
                raise YamlError("an anchor needs a name")
        if text.startswith("*"):
            if text[1:] not in self.anchors or anchor is not None:
                raise YamlError(f"unknown alias {text!r}")
            self.pos += 1
            # The same object, not a copy: aliases of aliases cannot blow up
            # (readers only look at a few paths; nothing walks the whole tree).
            return self.anchors[text[1:]]
        if not text:
            self.pos += 1
            value = self._child(indent, sequence_may_align=True)
        elif (header := _BLOCK_HEADER.match(text)) is not None:
            self.pos += 1
            value = self._block_scalar(indent, header)
        else:
            value = self._scalar_lines(indent, text, after_key=True)
        if anchor is not None:
            self.anchors[anchor] = value
        return value

    def _child(self, indent: int, sequence_may_align: bool = False) -> Any:
        """The nested node after ``key:`` / ``-`` alone on a line; None if there is none."""
        self._skip_blank()
        if self.pos == len(self.lines):
            return None
        line = self._line()
        child = _indent(line)
        if child > indent:
            return self._node(child)
        if sequence_may_align and child == indent and line[indent:].startswith("- "):
            return self._sequence(indent)
        return None

    def _scalar_lines(self, indent: int, first: str, after_key: bool = False) -> Any:
        """A flow scalar or flow collection, continued on more-indented lines."""
        parts = [first.strip(" \t")]
        self.pos += 1
        while self.pos < len(self.lines):
            raw = self.lines[self.pos]
            stripped = self._line()
            if stripped.strip() and _indent(stripped) <= indent:
                break
            if not stripped.strip() and raw.strip() != "":
                break
            parts.append(raw)
            self.pos += 1
        while len(parts) > 1 and not parts[-1].strip():
            parts.pop()
            self.pos -= 1
        text = parts[0]
        if text[:1] in ("'", '"'):
            joined = "\n".join([parts[0], *(p.strip(" \t") for p in parts[1:])])
            end = _quoted_end(joined, 0)
            if _strip_comment(joined[end + 1 :]).strip():
                raise YamlError("unexpected text after a quoted scalar")
            return _quoted(joined[: end + 1])
        if text[:1] in ("[", "{"):
            return _Flow("\n".join(_strip_comment(p) for p in parts)).parse()
        if not after_key and len(parts) == 1 and _split_key(text) is not None:
            raise YamlError("mapping values are not allowed in this context")
        return _plain(_fold_lines([_strip_comment(p) for p in parts]))

    def _block_scalar(self, indent: int, header: re.Match[str]) -> str:
        style = header[1]
        chomp = header[2] or header[4]
        explicit = int(header[3]) if header[3] else 0
        body: list[str] = []
        block_indent = indent + explicit if explicit else 0
        while self.pos < len(self.lines):
            line = self.lines[self.pos]
            if line.strip():
                if not block_indent:
                    block_indent = _indent(line)
                    if block_indent <= indent:
                        break
                if _indent(line) < block_indent:
                    break
            body.append(line[block_indent:] if line.strip() else "")
            self.pos += 1
        trailing = 0
        while body and not body[-1]:
            body.pop()
            trailing += 1
        if not body:
            return ""
        text = "\n".join(body) if style == "|" else _fold_block(body)
        if chomp == "-":
            return text
        return text + "\n" * (1 + (trailing if chomp == "+" else 0))


def _fold_block(body: list[str]) -> str:
    """A folded (``>``) scalar's lines: a break between text lines is a space,
    blank lines are newlines, more-indented lines keep their breaks."""
    text = ""
    blanks = 0
    previous_more = False
    for index, line in enumerate(body):
        if not line:
            blanks += 1
            continue
        more = line.startswith((" ", "\t"))
        if index == blanks:
            text = "\n" * blanks + line
        elif blanks == 0 and not more and not previous_more:
            text += " " + line
        elif more or previous_more:
            text += "\n" * (blanks + 1) + line
        else:
            text += "\n" * blanks + line
        blanks = 0
        previous_more = more
    return text


def loads(text: str) -> Any:
    """The value of a YAML document of the supported subset (``YamlError`` otherwise)."""
    try:
        return _Block(text.replace("\r\n", "\n")).document()
    except RecursionError:
        # A skill file is up to 1 MiB: nesting deep enough to exhaust the
        # stack is malformed, not fatal.
        raise YamlError("nesting too deep") from None
