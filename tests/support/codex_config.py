"""Writing and reading the files of a Codex environment configuration, and a server serving one."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

from tests.support import codex_session
from tests.support.stdio_server import ServerProcess

CODEX_INIT = codex_session.CODEX_INIT


def write_file(path: Path, text: str) -> Path:
    """Write ``text`` to ``path``, making its directories; ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def serving(
    tmp_path: Path, init: Any = CODEX_INIT, **env: str
) -> AbstractAsyncContextManager[ServerProcess]:
    """A stdio server past the Codex handshake, its HOME and CODEX_HOME in ``tmp_path``."""
    server_env = {"HOME": str(tmp_path / "user"), "CODEX_HOME": str(tmp_path / "codex-home")}
    server_env.update(env)
    return codex_session.serving(init, server_env)


def read_params(
    cwd: str, config: Any = (("mcp_servers",),), requirements: Any = (("mcp_servers",),)
) -> Any:
    return {
        "cwd": cwd,
        "configPaths": [list(path) for path in config],
        "requirementsPaths": [list(path) for path in requirements],
    }
