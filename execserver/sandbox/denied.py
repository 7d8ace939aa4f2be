"""``sandboxDenied``: whether the sandbox probably stopped a command, as the reference guesses.

The reference (``is_likely_sandbox_denied``) has no certain signal: a
confined command that exited non-zero (and did not time out) was denied if
its output names a denial (the keywords below, case-insensitive), or, when
it does not, if it died of ``SIGSYS`` (exit code 159, a seccomp kill);
exit codes 2, 126 and 127 (shell misuse, not executable, not found) without
such words are ordinary failures.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

KEYWORDS: Final = (
    b"operation not permitted",
    b"permission denied",
    b"read-only file system",
    b"seccomp",
    b"sandbox",
    b"landlock",
    b"failed to write file",
)
_QUICK_REJECT: Final = (2, 126, 127)
_SIGSYS_EXIT: Final = 128 + 31


def likely_denied(exit_code: int | None, timed_out: bool, output: Iterable[bytes]) -> bool:
    """The reference's guess for a confined command's end (``output``: stdout, stderr, pty)."""
    if exit_code is None or exit_code == 0 or timed_out:
        return False
    # Chunks are searched joined: a keyword may straddle two reads.
    text = b"".join(output).lower()
    if any(word in text for word in KEYWORDS):
        return True
    if exit_code in _QUICK_REJECT:
        return False
    return exit_code == _SIGSYS_EXIT
