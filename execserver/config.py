"""Server settings, with the defaults documented in docs/operations.md."""

from __future__ import annotations

from typing import Final

import attrs

from execserver.limits import NO_LIMITS, Limits

MiB: Final = 1024 * 1024


@attrs.frozen
class ServerConfig:
    #: Output kept per process for ``process/read`` (oldest chunks dropped first).
    retained_output_bytes: int = 1 * MiB
    #: How long an exited process id stays reserved and readable.
    exit_retention_ms: int = 30_000
    #: SIGTERM -> SIGKILL escalation delay for terminate, disconnect and shutdown.
    terminate_grace_ms: int = 2_000
    #: Running processes per session; a start beyond it is refused.
    max_processes: int = 1024
    #: Largest accepted line (stdio) or message (WebSocket).
    max_message_bytes: int = 128 * MiB
    #: Unsent output per connection above which child pipes stop being read.
    output_high_water_bytes: int = 2 * MiB
    #: Bytes of pending stdin per process above which ``process/write`` is refused.
    max_stdin_buffer_bytes: int = 16 * MiB
    #: Largest file ``fs/readFile`` returns (the reference's limit is 512 MiB).
    max_read_file_bytes: int = 512 * MiB
    #: How descendants of a process are tracked: "auto", "cgroup" or
    #: "subreaper" (docs/process-control.md, "Containment").
    process_containment: str = "auto"
    #: fs/readFile reply bytes being built or not yet sent, per server and per
    #: connection (the per-connection default fits the largest readable file).
    reply_budget_bytes: int = 1536 * MiB
    connection_reply_budget_bytes: int = 768 * MiB
    #: Longest an fs request waits for a pool thread or for reply budget.
    fs_wait_timeout_ms: int = 30_000
    #: /readyz fails once every fs pool thread is this long on one operation.
    fs_stall_ms: int = 10_000
    #: Longest a session may outlive its connection (0: sessions end with it).
    max_session_ttl_ms: int = 600_000
    #: Session lifetime after a disconnect for clients that do not ask.
    default_session_ttl_ms: int = 0
    #: Sessions (attached or detached) one identity may hold; a new one beyond
    #: it is refused at ``initialize`` (resuming one is always allowed).
    max_sessions_per_identity: int = 256
    #: Processes open at once over all sessions (the open-file limit may
    #: lower it further; docs/operations.md, "File descriptors").
    max_server_processes: int = 8192
    #: Output retained over all processes of the server; while it is reached
    #: new processes are refused (0: no limit beyond the per-process cap).
    max_total_retained_bytes: int = 2048 * MiB
    #: fs operations one connection may have on pool threads at once (of 4).
    max_fs_ops_per_session: int = 2
    #: PTYs (``tty: true`` processes not yet closed) per session and per
    #: server; the server's default is sized from the host (``ptys.py``).
    max_ptys_per_session: int = 64
    max_server_ptys: int = 1024
    #: Resource limits of a process that asks for none of a kind, and the
    #: most any process may have (--default-limits, --limit-ceiling).
    default_limits: Limits = NO_LIMITS
    limit_ceiling: Limits = NO_LIMITS
