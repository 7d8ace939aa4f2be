"""Fetch the real Codex CLI (a static Linux x86-64 binary) from the npm registry, cached.

usage: python -m tests.codex.fetch_codex [CACHE_DIR]  -> prints the binary's path

The package ``@openai/codex@VERSION-linux-x64`` is fetched with ``npm pack``
(the registry's own client) into CACHE_DIR (default: ``$EXEC_SERVER_CODEX_CACHE``
or ``~/.cache/exec-server-codex/VERSION``) and unpacked there; later calls
reuse it. Exits non-zero with the reason on stderr when it cannot be fetched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Final

VERSION: Final = "0.171.0"
PACKAGE: Final = f"@openai/codex@{VERSION}-linux-x64"
BINARY: Final = Path("package/vendor/x86_64-unknown-linux-musl/bin/codex")


class FetchError(Exception):
    """Why the Codex binary is not available."""


def default_cache() -> Path:
    configured = os.environ.get("EXEC_SERVER_CODEX_CACHE")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "exec-server-codex" / VERSION


def fetch(cache: Path | None = None, timeout: float = 300.0) -> Path:
    """The cached binary's path, fetching it first if needed (raises FetchError)."""
    cache = cache or default_cache()
    binary = cache / BINARY
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    npm = shutil.which("npm")
    if npm is None:
        raise FetchError("npm is not installed, so the Codex CLI cannot be fetched")
    cache.mkdir(parents=True, exist_ok=True)
    # Unpacked beside the cache and renamed into place: a fetch cut short
    # never leaves a half-unpacked binary that looks complete.
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        try:
            done = subprocess.run(
                [npm, "pack", "--silent", PACKAGE],
                cwd=scratch,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise FetchError(f"npm pack {PACKAGE} took more than {timeout:.0f} s") from None
        if done.returncode != 0:
            raise FetchError(f"npm pack {PACKAGE} failed: {done.stderr.strip()[-500:]}")
        tarballs = list(Path(scratch).glob("*.tgz"))
        if len(tarballs) != 1:
            raise FetchError(f"npm pack {PACKAGE} left {len(tarballs)} tarballs")
        with tarfile.open(tarballs[0]) as tar:
            tar.extractall(scratch, filter="tar")
        unpacked = Path(scratch) / BINARY
        if not unpacked.is_file():
            raise FetchError(f"{PACKAGE} has no {BINARY}")
        unpacked.chmod(0o755)
        target = cache / "package"
        if target.exists():
            shutil.rmtree(target)
        (Path(scratch) / "package").rename(target)
    return binary


def main(argv: list[str]) -> int:
    try:
        print(fetch(Path(argv[1]) if len(argv) > 1 else None))
    except FetchError as exc:
        print(f"fetch_codex: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
