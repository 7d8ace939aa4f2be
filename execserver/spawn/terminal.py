"""The terminal behind a PTY master: window size and EOF character."""

from __future__ import annotations

import fcntl
import struct
import termios


def set_window_size(fd: int, rows: int, cols: int) -> None:
    """Resize the terminal; the kernel sends SIGWINCH to its foreground group."""
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def terminal_eof_char(fd: int) -> bytes:
    """The EOF character (VEOF) of the terminal behind a PTY master.

    On Linux the master reports the line discipline settings the child set on
    its side (e.g. ``stty eof ^B``). Falls back to ^D, the default.
    """
    try:
        char = termios.tcgetattr(fd)[6][termios.VEOF]
    except (OSError, termios.error):
        return b"\x04"
    if isinstance(char, int):  # pragma: no cover - only in non-canonical layouts
        return bytes([char])
    # NUL is _POSIX_VDISABLE: the terminal has no EOF character; ^D is the
    # best guess of what the program reading it expects.
    return bytes(char) if char and char != b"\x00" else b"\x04"
