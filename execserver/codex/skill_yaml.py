"""The YAML of Codex skill files, read with PyYAML's libyaml parser and no type resolution.

The reference reads a ``SKILL.md`` front matter and a skill's
``agents/openai.yaml`` with a full YAML parser into ``String`` fields. This
module parses with libyaml (PyYAML's C parser, ``CBaseLoader``: no Python
objects are built from tags, no implicit resolution) into
``dict``/``list``/``str``/``None``: scalars stay text, as the reference's
``String`` fields accept any scalar, except the plain ones YAML reads as
null; quoted scalars are :class:`Quoted`, so a caller that wants a boolean
can tell ``true`` from ``"true"``.

Refused, as :class:`YamlError` (the caller reports such a file as invalid
metadata): text that is not YAML, several documents, a key that is not a
scalar, a duplicate key (the reference's parser refuses both), an
application tag (``!name``), and nesting deeper than libyaml allows
(about 330 levels): skill files are small hand-written documents. An alias
is the anchored object itself, never a copy, so aliases of aliases stay
small.
"""

from __future__ import annotations

from typing import Any, Final

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

#: libyaml's parser when PyYAML was built with it (its wheels are); the
#: pure-Python one otherwise, with the same answers.
_BaseLoader: Final[type[Any]] = getattr(yaml, "CBaseLoader", yaml.BaseLoader)

#: Plain scalars YAML resolves to null.
_NULLS: Final = frozenset({"", "~", "null", "Null", "NULL"})
#: The tags a node may carry: the defaults (``!!str``, ``!!seq``,
#: ``!!map``), written or not. Anything else is an application tag.
_TAGS: Final = frozenset(
    {"tag:yaml.org,2002:str", "tag:yaml.org,2002:seq", "tag:yaml.org,2002:map"}
)

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


def _value(node: Node, built: dict[int, Any]) -> Any:
    """The node's value, each node built once (an alias is the same node object)."""
    known = built.get(id(node))
    if known is not None or id(node) in built:
        return known
    if node.tag not in _TAGS:
        raise YamlError(f"unsupported tag {node.tag}")
    if isinstance(node, ScalarNode):
        text: str = node.value
        if node.style in ("'", '"'):
            value: Any = Quoted(text)
        elif not node.style and text in _NULLS:  # plain: None (Python parser) or ""
            value = None
        else:
            value = text
        built[id(node)] = value
        return value
    if isinstance(node, SequenceNode):
        items: list[Any] = []
        built[id(node)] = items
        items.extend(_value(item, built) for item in node.value)
        return items
    if isinstance(node, MappingNode):
        table: dict[str, Any] = {}
        built[id(node)] = table
        for key_node, value_node in node.value:
            if not isinstance(key_node, ScalarNode):
                raise YamlError("a mapping key must be a scalar")
            # The key's text as written: ``null:`` is the key "null".
            key: str = key_node.value
            if key in table:
                raise YamlError(f"duplicate entry with key {key!r}")
            table[key] = _value(value_node, built)
        return table
    raise YamlError(f"unsupported node {type(node).__name__}")


def loads(text: str) -> Any:
    """The value of one YAML document (``None`` for an empty one; ``YamlError`` otherwise)."""
    try:
        root = yaml.compose(text, Loader=_BaseLoader)
    except yaml.YAMLError as exc:
        raise YamlError(_first_line(exc)) from None
    except RecursionError:
        # The pure-Python composer recurses per level; libyaml stops first.
        raise YamlError("nesting too deep") from None
    if root is None:
        return None
    try:
        return _value(root, {})
    except RecursionError:
        raise YamlError("nesting too deep") from None


def _first_line(exc: yaml.YAMLError) -> str:
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1} column {mark.column + 1}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
