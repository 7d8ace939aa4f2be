"""Bearer tokens for the authentication tests: token files, tokens that almost
match, and waiting for a server's stderr to report a reload.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.harness import DEFAULT_TIMEOUT
from tests.support.polling import until
from tests.support.ws_harness import WsServerProcess

TOKEN = "s3cret-Token-0123456789abcdef"


OTHER = "another-token-for-rotation"


#: The right token but for its last byte.
NEAR_MISS = TOKEN[:-1] + ("g" if TOKEN[-1] != "g" else "h")


def token_file(tmp_path: Path, *tokens: str, mode: int = 0o600) -> Path:
    path = tmp_path / "tokens"
    path.write_text("# rotation: new token first\n" + "".join(t + "\n" for t in tokens))
    path.chmod(mode)
    return path


async def wait_stderr(server: WsServerProcess, needle: bytes) -> None:
    await until(lambda: needle in server.stderr, f"{needle!r} on stderr", timeout=DEFAULT_TIMEOUT)
