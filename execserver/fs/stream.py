"""The streamed ``fs/writeFile`` decode: a long line's data written as it arrives.

A 16 MiB ``fs/writeFile`` is a 22 MiB line. Without this, the line is
gathered whole, then parsed, then decoded and written on the pool: the
decode and the write wait for the line's last byte. Here, once the head of
a long line shows an ``fs/writeFile`` request whose ``dataBase64`` string
has begun (:func:`start`), each piece of base64 text is decoded and written
into an unnamed temporary file (``O_TMPFILE``) in the target's directory as
soon as it arrives, on the reactor thread, between reads. When the line is
complete, the dispatcher parses a copy of it with that string cut out
(:func:`execserver.codec.decode_streamed`), and the pool only gives the
file its name and renames it over the target
(:func:`execserver.fs.ops.write_file` with ``streamed``).

This is only ever a head start. The line is still gathered whole (once, in
its mapping), and whenever anything is not certain, the sink is dropped
(its file closed, never named) and the line is handled as any line:

- streamed only if the head (before the data) names the method
  ``fs/writeFile`` and a ``path``, carries no ``sandbox``, ``offset``,
  ``append`` or ``truncate``, the path has no ``..``, the server has no
  sandbox floor, and the path's directory passes the inline rule's check
  (:mod:`execserver.fs.local`: local file systems only, no symlink on the
  way), made on the pool where the unnamed file is then opened; until it
  is, the text waits in the line and is decoded when it is;
- the text must be canonical base64 without JSON escapes (a ``\\/``, any
  other byte, padding before the end, set trailing bits stop the stream);
- the complete line must be an ``fs/writeFile`` request whose top-level
  ``dataBase64`` is that very string, without ``sandbox`` or a range, and
  the target's directory must still be the same directory.

So a streamed write's reply, and what a failure leaves, is exactly the
whole-line path's. A sandboxed request is never streamed; if its
``sandbox`` comes after the data (Codex sends ``"sandbox"`` last), its
bytes went to an unnamed file that is closed, never linked, when the line
ends. Only stdio lines stream (a WebSocket message arrives whole).
"""

from __future__ import annotations

import binascii
import contextlib
import ctypes
import os
import weakref
from typing import Any, Final

import msgspec
import pybase64

from execserver import protocol as p
from execserver.codec import SINK_HEAD_BYTES, MappedBuffer
from execserver.errors import RpcError
from execserver.fs import local
from execserver.fs.b64 import B64_SLICE, noncanonical_tail
from execserver.fs.local import Locality
from execserver.fs.paths import absolute_path, libc_function
from execserver.fs.pool import Runner

#: What precedes the data (looked for in a line's first SINK_HEAD_BYTES).
_NEEDLE: Final = b'"dataBase64":"'
#: Base64 text decoded per call (a multiple of 4: B64_SLICE bytes decoded).
TEXT_SLICE: Final = B64_SLICE // 3 * 4
_PAD: Final = ord("=")


class _HeadParams(msgspec.Struct, rename="camel"):
    path: str
    data_base64: str
    sandbox: Any = None


class _Head(msgspec.Struct):
    method: str
    params: _HeadParams


_head_decoder: Final = msgspec.json.Decoder(_Head)


def start(run: Runner, locality: Locality, buffer: MappedBuffer) -> StreamedWrite | None:
    """A sink for the long line in ``buffer`` if its head allows streaming (see above).

    Its file is opened on the pool (``run``), where the directory is
    verified first; the text that arrived by then is decoded from
    ``buffer`` at once, the rest as it comes.
    """
    head = buffer.head(SINK_HEAD_BYTES)
    at = head.find(_NEEDLE)
    if at < 0:
        return None
    opening = at + len(_NEEDLE) - 1
    try:
        # The head, closed after the data's opening quote as if the data
        # and the params ended there.
        parsed = _head_decoder.decode(head[: opening + 1] + b'"}}')
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None
    params = parsed.params
    if parsed.method != p.FS_WRITE_FILE or params.data_base64 != "" or params.sandbox is not None:
        return None
    try:
        path = absolute_path(params.path)
    except RpcError:
        return None
    directory = local.parent_of(path)
    if path == "/" or "/../" in path + "/":
        return None
    sink = StreamedWrite(path, directory, opening)
    opened = run(_open_unnamed, locality, path, directory)
    opened.addCallbacks(sink.opened, lambda _: sink.abort(), callbackArgs=(buffer,))
    return sink


def _open_unnamed(locality: Locality, path: str, directory: str) -> tuple[int, int, int] | None:
    """An unnamed file in ``directory`` and the directory's (device, inode), if it is local.

    On the pool: the inline rule's verification (local file systems only,
    no symlink on the way), then ``O_TMPFILE``.
    """
    locality.verify(directory)
    if not local.inline_eligible(locality, path, directory):
        return None
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o666)
    except OSError:
        return None  # not writable, or no O_TMPFILE here: the whole-line path
    try:
        st = os.stat(directory)
    except OSError:
        os.close(fd)
        return None
    if not _names_work.get(st.st_dev, True):
        os.close(fd)
        return None
    return fd, st.st_dev, st.st_ino


_linkat: Final = libc_function(
    "linkat",
    [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int],
    ctypes.c_int,
)
_AT_FDCWD: Final = -100
_AT_EMPTY_PATH: Final = 0x1000

#: Whether an unnamed file could be given a name, by device (learnt on the
#: first streamed write to it): where neither way works (below), nothing
#: more is streamed there.
_names_work: dict[int, bool] = {}


def name_unnamed(fd: int, path: str) -> None:
    """Give the ``O_TMPFILE`` file ``fd`` the name ``path`` (``OSError`` if it cannot be).

    ``linkat(fd, "", ..., AT_EMPTY_PATH)`` (allowed with
    ``CAP_DAC_READ_SEARCH``), else through ``/proc/self/fd`` (which some
    mount setups refuse with ``EXDEV``).
    """
    if _linkat is not None and _linkat(fd, b"", _AT_FDCWD, os.fsencode(path), _AT_EMPTY_PATH) == 0:
        return
    os.link(f"/proc/self/fd/{fd}", path, follow_symlinks=True)


class StreamedWrite:
    """The sink of one long ``fs/writeFile`` line: its data, decoded into a file.

    A :class:`execserver.codec.LongLineSink`. Holds the unnamed file's
    descriptor until :meth:`adopt` hands it over or :meth:`abort` (or
    garbage collection) closes it.
    """

    method = p.FS_WRITE_FILE

    def __init__(self, path: str, directory: str, opening: int) -> None:
        self.fd = -1
        self.path = path
        self.directory = directory
        self.directory_id = (-1, -1)
        self.opening = opening
        #: Offset of the first text byte not yet decoded; of the first not searched for a quote.
        self._decoded = opening + 1
        self._searched = opening + 1
        self._closing = -1
        self.size = 0
        self._failed = False
        self._close: weakref.finalize[Any, StreamedWrite] | None = None

    def opened(self, found: tuple[int, int, int] | None, buffer: MappedBuffer) -> None:
        """The pool opened the file (or found the directory unusable): catch up."""
        if found is None:
            self.abort()
            return
        fd, device, inode = found
        if self._failed or buffer.taken:
            # Dropped meanwhile, or the line ended first: the whole-line path.
            os.close(fd)
            self.abort()
            return
        self.fd = fd
        self.directory_id = (device, inode)
        self._close = weakref.finalize(self, os.close, fd)
        self.advance(buffer)

    def advance(self, buffer: MappedBuffer) -> None:
        """Decode and write what arrived of the text (all but its last quad until it ends)."""
        if self._failed or self._closing >= 0 or self.fd < 0:
            return
        end = buffer.size
        closing = buffer.find(b'"', self._searched, end)
        if closing >= 0:
            stop = closing
            if (stop - self._decoded) % 4:
                self.abort()
                return
        else:
            self._searched = end
            # Keep the last complete quad back: only the end may pad.
            stop = self._decoded + ((end - self._decoded) // 4 - 1) * 4
            if stop <= self._decoded:
                return
        try:
            while self._decoded < stop:
                # A slice at a time: a catch-up after the file opened late
                # holds one decoded slice, not all that arrived meanwhile.
                piece_stop = min(stop, self._decoded + TEXT_SLICE)
                ends = closing >= 0 and piece_stop == stop
                with buffer.view(self._decoded, piece_stop) as text:
                    if not ends and text[-1] == _PAD:
                        raise ValueError("padding before the end")
                    data = pybase64.b64decode(text, validate=True)
                    if ends and len(text) and noncanonical_tail(bytes(text[-4:]), data):
                        raise ValueError("non-canonical trailing bits")
                view = memoryview(data)
                while view:
                    view = view[os.write(self.fd, view) :]
                self.size += len(data)
                self._decoded = piece_stop
                del data, view
        except (binascii.Error, ValueError, OSError):
            self.abort()  # the whole-line path gives the answer
            return
        if closing >= 0:
            self._closing = closing

    def span(self) -> tuple[int, int] | None:
        if self._failed or self._closing < 0:
            return None
        return self.opening, self._closing

    def decoded(self) -> tuple[int, int] | None:
        """``(descriptor, size)`` of the complete decoded data, or None; read it on
        the pool, after the line ended (the descriptor stays this sink's)."""
        if self._failed or self._closing < 0:
            return None
        return self.fd, self.size

    def abort(self) -> None:
        self._failed = True
        if self._close is not None:
            self._close()

    def adopt(self, directory: str, keep_private: bool, temp: str) -> int | None:
        """Name the file ``temp`` in ``directory``; its descriptor, or None (then closed).

        None when ``directory`` is not the one the data went to or the link
        fails: the caller writes the file from the line instead. With
        ``keep_private`` the file is made ``0o600`` before it has a name.
        On the pool.
        """
        if self._failed or self._closing < 0 or directory != self.directory:
            self.abort()
            return None
        try:
            st = os.stat(directory)
            if (st.st_dev, st.st_ino) != self.directory_id:
                raise FileNotFoundError(directory)
            if keep_private:
                os.fchmod(self.fd, 0o600)
        except OSError:
            self.abort()
            return None
        try:
            name_unnamed(self.fd, temp)
        except OSError:
            _names_work[self.directory_id[0]] = False
            self.abort()
            return None
        _names_work[self.directory_id[0]] = True
        self._failed = True  # handed over: the caller closes it
        if self._close is not None:
            self._close.detach()
        return self.fd


def discard(streamed: StreamedWrite | None) -> None:
    """Close ``streamed``'s file if there is one (the request is handled from its line)."""
    if streamed is not None:
        with contextlib.suppress(OSError):
            streamed.abort()
