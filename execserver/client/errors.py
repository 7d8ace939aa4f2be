"""Typed exceptions raised by the exec-server client.

The classes are defined once, Twisted-free, in :mod:`execserver.clientcore.errors`
(the asyncio and blocking clients raise the same ones); this module keeps
their historical import path.
"""

from __future__ import annotations

from execserver.clientcore import errors as _errors
from execserver.clientcore.errors import *  # noqa: F403  (the errors' own __all__)

__all__ = list(_errors.__all__)
