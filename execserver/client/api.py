"""Typed methods for every protocol method, on top of one ``_call``.

:class:`ClientApi` is shared by :class:`~execserver.client.ExecServerClient`
(one connection) and :class:`~execserver.client.ReconnectingClient` (which
waits for a connection before each call), so both offer the same methods.
Each returns a Deferred of the shared wire type; ``await`` it from a
coroutine run under ``Deferred.fromCoroutine``.
"""

from __future__ import annotations

from typing import TypeVar

from twisted.internet.defer import Deferred

from execserver import protocol as p

T = TypeVar("T")


class ClientApi:
    """The protocol's methods; subclasses provide :meth:`_call`."""

    def _call(self, method: str, params: object, result_type: type[T]) -> Deferred[T]:
        raise NotImplementedError

    # --- process/* (baseline) ----------------------------------------------------------

    def exec(self, params: p.ExecParams) -> Deferred[p.ExecResponse]:
        """``process/start`` without a handle (see ``start_process`` for one)."""
        return self._call(p.PROCESS_START, params, p.ExecResponse)

    def read(
        self,
        process_id: str | p.ReadParams,
        after_seq: int | None = None,
        max_bytes: int | None = None,
        wait_ms: int | None = None,
    ) -> Deferred[p.ReadResponse]:
        """``process/read``: retained output after ``after_seq``, waiting up to ``wait_ms``."""
        params = (
            process_id
            if isinstance(process_id, p.ReadParams)
            else p.ReadParams(process_id, after_seq, max_bytes, wait_ms)
        )
        return self._call(p.PROCESS_READ, params, p.ReadResponse)

    def write(self, process_id: str, chunk: bytes) -> Deferred[p.WriteResponse]:
        """``process/write``: raw bytes to the process's stdin (PTY or ``pipeStdin``)."""
        return self._call(p.PROCESS_WRITE, p.WriteParams(process_id, bytes(chunk)), p.WriteResponse)

    def terminate(
        self, process_id: str, grace_ms: int | None = None
    ) -> Deferred[p.TerminateResponse]:
        """``process/terminate``; ``running`` says whether it was still running."""
        return self._call(
            p.PROCESS_TERMINATE, p.TerminateParams(process_id, grace_ms), p.TerminateResponse
        )

    # --- process control extensions ----------------------------------------------------

    def signal(self, process_id: str, signal: int | str) -> Deferred[p.SignalResponse]:
        """``process/signal``: a signal name (``"SIGINT"``, ``"INT"``) or number."""
        return self._call(p.PROCESS_SIGNAL, p.SignalParams(process_id, signal), p.SignalResponse)

    def close_stdin(self, process_id: str) -> Deferred[p.CloseStdinResponse]:
        return self._call(
            p.PROCESS_CLOSE_STDIN, p.CloseStdinParams(process_id), p.CloseStdinResponse
        )

    def resize(self, process_id: str, rows: int, cols: int) -> Deferred[p.Empty]:
        return self._call(p.PROCESS_RESIZE, p.ResizeParams(process_id, rows, cols), p.Empty)

    def wait(self, process_id: str, timeout_ms: int | None = None) -> Deferred[p.WaitResponse]:
        """``process/wait``: until exit, or ``timeout_ms`` (then ``exited: false``)."""
        return self._call(p.PROCESS_WAIT, p.WaitParams(process_id, timeout_ms), p.WaitResponse)

    def list_processes(self) -> Deferred[p.ListResponse]:
        return self._call(p.PROCESS_LIST, p.ListParams(), p.ListResponse)

    # --- fs/* ----------------------------------------------------------------------------

    def fs_read_file(self, path: str) -> Deferred[p.FsReadFileResponse]:
        """``fs/readFile``: the whole file (``data_base64`` holds the raw bytes)."""
        return self._call(p.FS_READ_FILE, p.FsReadFileParams(path), p.FsReadFileResponse)

    def fs_write_file(self, path: str, data: bytes) -> Deferred[p.Empty]:
        """``fs/writeFile``: create or replace ``path`` with ``data``."""
        return self._call(p.FS_WRITE_FILE, p.FsWriteFileParams(path, bytes(data)), p.Empty)

    def fs_create_directory(self, path: str, recursive: bool | None = None) -> Deferred[p.Empty]:
        return self._call(
            p.FS_CREATE_DIRECTORY, p.FsCreateDirectoryParams(path, recursive), p.Empty
        )

    def fs_get_metadata(self, path: str) -> Deferred[p.FsGetMetadataResponse]:
        return self._call(p.FS_GET_METADATA, p.FsGetMetadataParams(path), p.FsGetMetadataResponse)

    def fs_read_directory(self, path: str) -> Deferred[p.FsReadDirectoryResponse]:
        return self._call(
            p.FS_READ_DIRECTORY, p.FsReadDirectoryParams(path), p.FsReadDirectoryResponse
        )

    def fs_remove(
        self, path: str, recursive: bool | None = None, force: bool | None = None
    ) -> Deferred[p.Empty]:
        return self._call(p.FS_REMOVE, p.FsRemoveParams(path, recursive, force), p.Empty)

    def fs_copy(
        self, source_path: str, destination_path: str, recursive: bool = False
    ) -> Deferred[p.Empty]:
        return self._call(
            p.FS_COPY, p.FsCopyParams(source_path, destination_path, recursive), p.Empty
        )
