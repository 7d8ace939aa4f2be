"""The current dialect's ``environmentInfo``: the machine Codex runs commands on.

The reference's current release describes that machine in
``environment/info``'s result, also part of ``initialize``'s. A pure
function of the server's environment (no Twisted, no blocking work beyond
a few ``getcwd``/``gethostname`` calls). The ``envPolicy`` a child's
environment is built with is :mod:`execserver.env_policy` (the session's).
"""

from __future__ import annotations

import os
import pwd
import shutil
import sys
from collections.abc import Mapping
from typing import Final

from execserver import protocol as p
from execserver.codex import environment_config, watch
from execserver.fs.paths import path_to_uri

#: ``environmentInfo.executorVersion``: the reference release whose protocol
#: this server speaks, not this package's version (that is ``serverInfo``'s).
#: Codex decides by this version which executor features it may use (it
#: calls capabilities/discoverV2 only from 0.164.0 on); with it, Codex 0.171
#: uses exactly the methods this server implements (docs/protocol.md,
#: "Dialects").
EXECUTOR_VERSION: Final = "0.171.0"
#: The names ``environmentInfo.capabilities`` gives the optional methods:
#: ``fs/watchMissing``, ``capabilities/discoverV2``, ``environmentConfig/read``.
FS_WATCH_MISSING: Final = "fsWatchMissing"
CAPABILITY_DISCOVERY_V2: Final = "capabilityDiscoveryV2"
ENVIRONMENT_CONFIG_READ: Final = "environmentConfigRead"
#: ``http/request`` headers may take their value from the server's
#: environment (``valueEnvVar``, execserver.http_request).
HTTP_HEADER_ENV_VARS: Final = "httpHeaderEnvVars"
#: ``fs/open`` takes ``"mode": "replace"`` and ``fs/writeBlock`` writes its
#: blocks (execserver.fs.handles). Codex checks it before it opens a file for
#: writing by blocks ("exec-server does not support writable file streams").
FILE_WRITE_STREAMING: Final = "fileWriteStreaming"
#: ``fs/open`` honours its ``sandbox`` as every fs call does: the open is
#: checked (confined) by that permission profile, the blocks are then read or
#: written through the descriptor it opened. Codex checks it before it reads
#: a file by blocks under a sandbox ("selected executor does not support
#: sandboxed file streaming").
SANDBOXED_FILE_STREAMING: Final = "sandboxedFileStreaming"
#: ``capabilities/discoverV2`` scans confined to its ``sandbox`` (what the
#: profile may not read is not found, execserver.codex.capability_discovery).
#: Codex checks it before a discovery whose profile restricts reads ("exec-server
#: does not support sandboxed capability discovery").
CAPABILITY_DISCOVERY_SANDBOX: Final = "capabilityDiscoverySandbox"


def capabilities() -> dict[str, bool]:
    """Optional current-dialect methods this server implements, each ``true``.

    As ``environmentInfo.capabilities`` names them. Only what is implemented
    is listed; a client treats a missing name as false and does not call the
    method (fs/watchMissing needs inotify).
    """
    found = {FS_WATCH_MISSING: True} if watch.available() else {}
    found[CAPABILITY_DISCOVERY_V2] = True
    found[CAPABILITY_DISCOVERY_SANDBOX] = True
    found[ENVIRONMENT_CONFIG_READ] = True
    found[HTTP_HEADER_ENV_VARS] = True
    found[SANDBOXED_FILE_STREAMING] = True
    found[FILE_WRITE_STREAMING] = True
    return found


#: The shells the reference names from a login shell (others fall back to bash).
KNOWN_SHELLS: Final = frozenset({"bash", "zsh", "sh"})


def login_shell() -> str | None:
    """The user's login shell from the password database (None if unknown)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_shell or None
    except KeyError:
        return None


def shell_info(login: str | None) -> p.ShellInfo:
    """As codex exec-server 0.171.0 reports the shell (``$SHELL`` is not asked).

    The login shell when it is bash, zsh or sh and exists; else bash on
    ``PATH``; else ``/bin/sh``. (Measured: login shells /bin/sh, /bin/bash
    and /usr/bin/bash were reported as they are; /bin/dash and a missing
    /nonexistent/zsh as ``bash`` at ``/usr/bin/bash`` with PATH /usr/bin:/bin.)
    """
    if login and os.path.basename(login) in KNOWN_SHELLS and os.access(login, os.X_OK):
        return p.ShellInfo(os.path.basename(login), login)
    bash = shutil.which("bash")
    if bash is not None:
        return p.ShellInfo("bash", bash)
    return p.ShellInfo("sh", "/bin/sh")


def temporary_directory(environ: Mapping[str, str]) -> str | None:
    """``$TMPDIR`` made absolute (against the cwd) and normal, as the reference reads it.

    None when it is unset or empty (the reference's ``temporaryDirectories``
    is then ``[]`` and its ``tempDir`` ``/tmp``). Whether it exists is not
    asked, as the reference does not.
    """
    value = environ.get("TMPDIR", "")
    return os.path.normpath(os.path.abspath(value)) if value else None


def environment_info() -> p.EnvironmentInfo:
    # The home environmentConfig/read reports too: $HOME, else the password
    # database's (an empty $HOME is not a home).
    home = environment_config.user_home(os.environ) or "/"
    tmpdir = temporary_directory(os.environ)
    return p.EnvironmentInfo(
        shell=shell_info(login_shell()),
        executor_version=EXECUTOR_VERSION,
        cwd=path_to_uri(os.getcwd()),
        user_home_dir=path_to_uri(home),
        platform_os=sys.platform if sys.platform != "darwin" else "macos",
        prepend_path_dirs=[],
        temporary_directories=[] if tmpdir is None else [path_to_uri(tmpdir)],
        temp_dir=path_to_uri(tmpdir or "/tmp"),
        capabilities=capabilities(),
    )
