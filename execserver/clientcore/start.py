"""``process/start`` params as every client builds them from keyword arguments."""

from __future__ import annotations

import os
from collections.abc import Callable, Container, Mapping, Sequence

from execserver import protocol as p
from execserver.clientcore.defaults import DEFAULT_PATH
from execserver.clientcore.errors import ServerError

#: The JSON-RPC code of the server's "process ID already exists".
_INVALID_REQUEST = -32600


def already_started(error: Exception, process_id: str) -> bool:
    """Whether ``error`` answers a ``process/start`` sent again on a resumed
    session (its first sending was in flight at a drop) by saying the first one
    was carried out: "process PROCESS_ID already exists". The id is this
    client's own for the session, so nothing else can hold it.
    """
    return (
        isinstance(error, ServerError)
        and error.code == _INVALID_REQUEST
        and error.message == f"process {process_id} already exists"
    )


def next_process_id(counter: int, in_use: Container[str]) -> tuple[str, int]:
    """The first ``proc-N`` from ``counter`` on not in ``in_use``, and the next counter."""
    while True:
        candidate = f"proc-{counter}"
        counter += 1
        if candidate not in in_use:
            return candidate, counter


def exec_params(
    argv: Sequence[str] | p.ExecParams,
    new_process_id: Callable[[], str],
    *,
    process_id: str | None = None,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    tty: bool = False,
    arg0: str | None = None,
    pipe_stdin: bool = False,
    size: tuple[int, int] | None = None,
    timeout_ms: int | None = None,
    idle_timeout_ms: int | None = None,
    sandbox: p.SandboxConfig | None = None,
) -> p.ExecParams:
    """``argv`` as given when it is complete ``ExecParams``; otherwise the defaults:
    a generated ``process_id`` (``new_process_id()``), this process's working
    directory, ``env={"PATH": DEFAULT_PATH}``; ``size`` is ``(rows, cols)``;
    ``sandbox`` (see :func:`sandbox_config`) confines the process."""
    if isinstance(argv, p.ExecParams):
        return argv
    return p.ExecParams(
        process_id=process_id or new_process_id(),
        argv=list(argv),
        cwd=cwd if cwd is not None else os.getcwd(),
        env=dict(env) if env is not None else {"PATH": DEFAULT_PATH},
        tty=tty,
        arg0=arg0,
        pipe_stdin=pipe_stdin,
        size=p.TerminalSize(*size) if size is not None else None,
        timeout_ms=timeout_ms,
        idle_timeout_ms=idle_timeout_ms,
        sandbox=sandbox,
    )


#: ``--sandbox`` of ``exec-server-client run/shell`` (Codex's names).
SANDBOX_MODES = ("read-only", "workspace-write", "danger-full-access")


def sandbox_config(
    mode: str, writable_roots: Sequence[str] = (), network: bool = True
) -> p.SandboxConfig:
    """The ``sandbox`` of a start for ``mode`` (one of :data:`SANDBOX_MODES`).

    ``read-only`` and ``workspace-write`` are exec-server's additive mode
    form (``writable_roots`` empty: the process's cwd); ``danger-full-access``
    is the reference's ``disabled`` profile, refused by a server with a floor.
    """
    if mode == "read-only":
        return p.SandboxConfig(mode="readOnly", network=network)
    if mode == "workspace-write":
        if writable_roots:
            return p.SandboxConfig(
                mode="workspaceWrite", writable_roots=list(writable_roots), network=network
            )
        return p.SandboxConfig(mode="workspaceWrite", network=network)
    if mode == "danger-full-access":
        return p.SandboxConfig(permissions=p.DisabledPermissions())
    raise ValueError(f"sandbox mode must be one of {', '.join(SANDBOX_MODES)}, got `{mode}`")
