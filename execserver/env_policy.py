"""``process/start``'s ``envPolicy``: a child's environment built from the server's.

The reference's current dialect sends an ``envPolicy`` with each start: which
of the server's variables the child inherits (all, the core ones, none),
which are dropped (credentials by default), set, or kept exclusively; the
start's ``env`` is applied last (docs/protocol.md, "Dialects"). A pure
function, used by the session.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Mapping
from typing import Final

from execserver import protocol as p

#: Names the reference drops from an inherited environment unless the policy
#: sets ``ignoreDefaultExcludes`` (credentials are not passed on by default).
DEFAULT_EXCLUDES: Final = ("*KEY*", "*SECRET*", "*TOKEN*")
#: What ``inherit: "core"`` keeps of the server's environment: the
#: reference's list on Unix (its common ``PATH SHELL TMPDIR TEMP TMP`` and
#: the Unix ``HOME LANG LC_ALL LC_CTYPE LOGNAME USER``; ``USERNAME`` is
#: Windows-only there), matched case-sensitively.
CORE_VARIABLES: Final = (
    "PATH",
    "SHELL",
    "TMPDIR",
    "TEMP",
    "TMP",
    "HOME",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "LOGNAME",
    "USER",
)


def _matches(name: str, patterns: list[str] | tuple[str, ...]) -> bool:
    upper = name.upper()
    return any(fnmatch.fnmatchcase(upper, pattern.upper()) for pattern in patterns)


def build_env(
    policy: p.EnvPolicy | None, env: Mapping[str, str], base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The child's environment: ``env`` alone without a policy, else policy then ``env``."""
    if policy is None:
        return dict(env)
    server = os.environ if base is None else base
    if policy.inherit == "all":
        result = dict(server)
    elif policy.inherit == "core":
        result = {k: v for k, v in server.items() if k in CORE_VARIABLES}
    else:
        result = {}
    if not policy.ignore_default_excludes:
        result = {k: v for k, v in result.items() if not _matches(k, DEFAULT_EXCLUDES)}
    if policy.exclude:
        result = {k: v for k, v in result.items() if not _matches(k, policy.exclude)}
    result.update(policy.set)
    if policy.include_only:
        result = {k: v for k, v in result.items() if _matches(k, policy.include_only)}
    result.update(env)
    return result
