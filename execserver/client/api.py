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
P = TypeVar("P")
R = TypeVar("R")


class ClientApi:
    """The protocol's methods; subclasses provide :meth:`_call`."""

    def _call(self, method: str, params: object, result_type: type[T]) -> Deferred[T]:
        raise NotImplementedError

    def request(self, method: p.Method[P, R], params: P) -> Deferred[R]:
        """Any declared protocol method (``p.ProcessRead``, ``p.FsCopy``, ...):
        the one path every typed method below takes."""
        return self._call(method.name, params, method.result)

    # --- process/* (baseline) ----------------------------------------------------------

    def exec(self, params: p.ExecParams) -> Deferred[p.ExecResponse]:
        """``process/start`` without a handle (see ``start_process`` for one)."""
        return self.request(p.ProcessStart, params)

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
        return self.request(p.ProcessRead, params)

    def write(self, process_id: str, chunk: bytes) -> Deferred[p.WriteResponse]:
        """``process/write``: raw bytes to the process's stdin (PTY or ``pipeStdin``)."""
        return self.request(p.ProcessWrite, p.WriteParams(process_id, bytes(chunk)))

    def terminate(
        self, process_id: str, grace_ms: int | None = None
    ) -> Deferred[p.TerminateResponse]:
        """``process/terminate``; ``running`` says whether it was still running."""
        return self.request(p.ProcessTerminate, p.TerminateParams(process_id, grace_ms))

    # --- process control extensions ----------------------------------------------------

    def signal(self, process_id: str, signal: int | str) -> Deferred[p.SignalResponse]:
        """``process/signal``: a signal name (``"SIGINT"``, ``"INT"``) or number."""
        return self.request(p.ProcessSignal, p.SignalParams(process_id, signal))

    def close_stdin(self, process_id: str) -> Deferred[p.CloseStdinResponse]:
        return self.request(p.ProcessCloseStdin, p.CloseStdinParams(process_id))

    def resize(self, process_id: str, rows: int, cols: int) -> Deferred[p.Empty]:
        return self.request(p.ProcessResize, p.ResizeParams(process_id, rows, cols))

    def wait(self, process_id: str, timeout_ms: int | None = None) -> Deferred[p.WaitResponse]:
        """``process/wait``: until exit, or ``timeout_ms`` (then ``exited: false``)."""
        return self.request(p.ProcessWait, p.WaitParams(process_id, timeout_ms))

    def list_processes(self) -> Deferred[p.ListResponse]:
        return self.request(p.ProcessList, p.ListParams())

    # --- fs/* ----------------------------------------------------------------------------

    def fs_read_file(self, path: str) -> Deferred[p.FsReadFileResponse]:
        """``fs/readFile``: the whole file (``data_base64`` holds the raw bytes)."""
        return self.request(p.FsReadFile, p.FsReadFileParams(path))

    def fs_write_file(self, path: str, data: bytes) -> Deferred[p.Empty]:
        """``fs/writeFile``: create or replace ``path`` with ``data``."""
        return self.request(p.FsWriteFile, p.FsWriteFileParams(path, bytes(data)))

    def fs_create_directory(self, path: str, recursive: bool | None = None) -> Deferred[p.Empty]:
        return self.request(p.FsCreateDirectory, p.FsCreateDirectoryParams(path, recursive))

    def fs_get_metadata(self, path: str) -> Deferred[p.FsGetMetadataResponse]:
        return self.request(p.FsGetMetadata, p.FsGetMetadataParams(path))

    def fs_read_directory(self, path: str) -> Deferred[p.FsReadDirectoryResponse]:
        return self.request(p.FsReadDirectory, p.FsReadDirectoryParams(path))

    def fs_remove(
        self, path: str, recursive: bool | None = None, force: bool | None = None
    ) -> Deferred[p.Empty]:
        return self.request(p.FsRemove, p.FsRemoveParams(path, recursive, force))

    def fs_copy(
        self, source_path: str, destination_path: str, recursive: bool = False
    ) -> Deferred[p.Empty]:
        return self.request(p.FsCopy, p.FsCopyParams(source_path, destination_path, recursive))
