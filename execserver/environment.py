"""The current dialect's environment methods and the child environment policy.

The reference's current release describes the machine it runs commands on
(``environment/info``, also part of ``initialize``'s result) and builds each
child's environment from the server's own through an ``envPolicy``. These
are pure functions of the server's environment (no Twisted, no blocking
work beyond a few ``getcwd``/``gethostname`` calls).
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from typing import Final

from execserver import capability_discovery, environment_config
from execserver import protocol as p
from execserver.fs import watch
from execserver.fs.paths import path_to_uri

#: ``environmentInfo.executorVersion``: the reference release whose protocol
#: this server speaks, not this package's version (that is ``serverInfo``'s).
#: Codex decides by this version which executor features it may use (it
#: calls capabilities/discoverV2 only from 0.164.0 on); with it, Codex 0.171
#: uses exactly the methods this server implements (docs/protocol.md,
#: "Dialects").
EXECUTOR_VERSION: Final = "0.171.0"
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


def capabilities() -> dict[str, bool]:
    """Optional current-dialect methods this server implements, each ``true``.

    As ``environmentInfo.capabilities`` names them. Only what is implemented
    is listed; a client treats a missing name as false and does not call the
    method (fs/watchMissing needs inotify).
    """
    found = {"fsWatchMissing": True} if watch.available() else {}
    found[capability_discovery.CAPABILITY] = True
    found[environment_config.CAPABILITY] = True
    return found


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


def _shell() -> p.ShellInfo:
    path = os.environ.get("SHELL") or shutil.which("bash") or "/bin/sh"
    return p.ShellInfo(os.path.basename(path), path)


def environment_info() -> p.EnvironmentInfo:
    # The home environmentConfig/read reports too: $HOME, else the password
    # database's (an empty $HOME is not a home).
    home = environment_config.user_home(os.environ) or "/"
    return p.EnvironmentInfo(
        shell=_shell(),
        executor_version=EXECUTOR_VERSION,
        cwd=path_to_uri(os.getcwd()),
        user_home_dir=path_to_uri(home),
        platform_os=sys.platform if sys.platform != "darwin" else "macos",
        prepend_path_dirs=[],
        temporary_directories=[],
        temp_dir=path_to_uri(tempfile.gettempdir()),
        capabilities=capabilities(),
    )
