"""Checking, at import, a private name of Twisted or Autobahn we rely on.

The modules that step off a public API (``spawn/overrides.py``,
``transports/autobahn_private.py``, ``writebuffer.py``) each check at import
that the names they use are still there with the signature they rely on,
and fall back to a public path if not; these are the helpers they share.
"""

from __future__ import annotations

import inspect


def parameters(func: object) -> list[str] | None:
    """The parameter names of ``func`` (``self`` included), or None if it has none to show."""
    if not callable(func):
        return None
    try:
        return list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return None


def code_names(func: object) -> frozenset[str]:
    """The global and attribute names ``func``'s own code uses (empty if it has no code)."""
    code = getattr(func, "__code__", None)
    return frozenset(code.co_names) if code is not None else frozenset()
