"""Prometheus text exposition (format 0.0.4) of a dispatcher's state.

Rendered on demand from :class:`~execserver.dispatcher.Stats` counters and a
walk over the live sessions, so nothing is kept twice. The format is small
enough that a client library (and its global registry) would cost more than
these few lines; label values are escaped as the format requires.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from execserver import __version__, fdlimit
from execserver.app import file_system, process_sessions, sandbox_of
from execserver.sandbox.peers import REFUSAL_REASONS

if TYPE_CHECKING:
    from execserver.dispatcher import Dispatcher

Sample = tuple[dict[str, str], float | int]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _family(name: str, kind: str, help_text: str, samples: Iterable[Sample]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        if labels:
            rendered = ",".join(f'{key}="{_escape(val)}"' for key, val in sorted(labels.items()))
            lines.append(f"{name}{{{rendered}}} {value}")
        else:
            lines.append(f"{name} {value}")
    return lines


def render(dispatcher: Dispatcher) -> bytes:
    """The current metrics of ``dispatcher`` as a Prometheus text page."""
    stats = dispatcher.stats
    running = 0
    registered = 0
    retained = 0
    # Detached (resumable) sessions' processes run and retain output too.
    for session in process_sessions(dispatcher):
        for proc in session.processes.values():
            registered += 1
            if not proc.exited:
                running += 1
            retained += proc.output.retained_bytes

    lines: list[str] = []
    lines += _family(
        "exec_server_info",
        "gauge",
        "Server version.",
        [({"version": __version__}, 1)],
    )
    engine = sandbox_of(dispatcher)
    lines += _family(
        "exec_server_sandbox_mechanism",
        "gauge",
        "How confined processes are confined (bwrap, landlock, none: confined starts refused).",
        [({"mechanism": engine.describe() if engine is not None else "none"}, 1)],
    )
    refused_peers = (
        engine.peers.refused_counts if engine is not None else dict.fromkeys(REFUSAL_REASONS, 0)
    )
    lines += _family(
        "exec_server_sandbox_peer_refused_total",
        "counter",
        "Connections on unix:// listeners refused by the peer check, by reason "
        "(confined: a sandboxed command of this server or its tree; exited: the peer "
        "exited before it could be checked).",
        [({"reason": reason}, count) for reason, count in sorted(refused_peers.items())],
    )
    lines += _family(
        "exec_server_auth_refused_total",
        "counter",
        "Requests refused with 401 for a missing or wrong bearer token.",
        [({}, stats.auth_refused)],
    )
    lines += _family(
        "exec_server_refused_total",
        "counter",
        "Connections, handshakes, sessions and processes refused by a limit, by limit.",
        [({"limit": name}, count) for name, count in sorted(stats.refused.items())],
    )
    lines += _family(
        "exec_server_websocket_sockets",
        "gauge",
        "TCP and Unix connections open on WebSocket listeners, before or after the upgrade.",
        [({}, stats.sockets_open)],
    )
    lines += _family(
        "exec_server_connections_opened_total",
        "counter",
        "Client connections accepted (stdio and WebSocket).",
        [({}, stats.connections_opened)],
    )
    lines += _family(
        "exec_server_connections",
        "gauge",
        "Client connections currently open.",
        [({}, stats.connections_active)],
    )
    registry = dispatcher.sessions
    lines += _family(
        "exec_server_sessions",
        "gauge",
        "Sessions alive, attached or detached (including ones still terminating their processes).",
        [({}, len(dispatcher.connections) + registry.detached_count + registry.ending_count)],
    )
    lines += _family(
        "exec_server_ptys_open",
        "gauge",
        "PTYs held (tty processes started and not yet closed), all sessions.",
        [({}, stats.ptys_open)],
    )
    lines += _family(
        "exec_server_sessions_detached",
        "gauge",
        "Sessions waiting to be resumed (their connection is gone, their TTL runs).",
        [({}, registry.detached_count)],
    )
    lines += _family(
        "exec_server_sessions_evicted_total",
        "counter",
        "Detached anonymous sessions ended to make room (--max-sessions-per-identity).",
        [({}, stats.sessions_evicted)],
    )
    lines += _family(
        "exec_server_processes_running",
        "gauge",
        "Processes started and not yet exited.",
        [({}, running)],
    )
    lines += _family(
        "exec_server_processes_registered",
        "gauge",
        "Process ids held by sessions (running, or exited and still retained).",
        [({}, registered)],
    )
    lines += _family(
        "exec_server_processes_started_total",
        "counter",
        "Processes started.",
        [({}, stats.processes_started)],
    )
    lines += _family(
        "exec_server_processes_exited_total",
        "counter",
        "Processes whose exit was reported.",
        [({}, stats.processes_exited)],
    )
    lines += _family(
        "exec_server_retained_output_bytes",
        "gauge",
        "Output bytes retained for process/read across all sessions.",
        [({}, retained)],
    )
    fs = file_system(dispatcher)
    lines += _family(
        "exec_server_fs_operations_running",
        "gauge",
        "Filesystem operations running on the fs pool's threads.",
        [({}, fs.running)],
    )
    lines += _family(
        "exec_server_fs_operations_queued",
        "gauge",
        "Filesystem operations waiting for a free fs pool thread.",
        [({}, fs.queued)],
    )
    lines += _family(
        "exec_server_reply_bytes_queued",
        "gauge",
        "Bytes of fs/readFile replies being built or not yet sent (the reply budget in use).",
        [({}, fs.budget.used)],
    )
    lines += _family(
        "exec_server_reply_budget_waiting",
        "gauge",
        "fs/readFile requests waiting for reply budget.",
        [({}, fs.budget.waiting)],
    )
    streams = dict.fromkeys(("stdout", "stderr", "pty"), 0)
    streams.update(stats.output_bytes)
    lines += _family(
        "exec_server_output_bytes_total",
        "counter",
        "Process output bytes read, by stream.",
        [({"stream": stream}, count) for stream, count in sorted(streams.items())],
    )
    lines += _family(
        "exec_server_requests_total",
        "counter",
        "Requests answered, by method and outcome (ok or error). Unparseable "
        "messages count as <invalid>, unknown methods as <unknown>.",
        [
            ({"method": method, "outcome": outcome}, count)
            for (method, outcome), count in sorted(stats.requests.items())
        ],
    )
    lines += _family(
        "exec_server_websocket_partial_message_bytes",
        "gauge",
        "Bytes of incomplete WebSocket messages held, over all connections "
        "(capped by --max-partial-message-bytes).",
        [({}, stats.partial_message_bytes)],
    )
    fds = fdlimit.fds_in_use()
    if fds is not None:
        lines += _family(
            "exec_server_open_fds",
            "gauge",
            "File descriptors the server has open.",
            [({}, fds)],
        )
    lines += _family(
        "exec_server_max_fds",
        "gauge",
        "The server's soft RLIMIT_NOFILE (raised to the hard limit at start).",
        [({}, fdlimit.soft_limit())],
    )
    lines += _family(
        "exec_server_processes_open",
        "gauge",
        "Processes started and not yet closed (each holds descriptors in the server).",
        [({}, stats.processes_open)],
    )
    lines += _family(
        "exec_server_process_limit",
        "gauge",
        "Processes that may be open at once, server-wide, derived from the "
        "descriptor limit; a start beyond it is refused with -32600.",
        [({}, fdlimit.process_limit())],
    )
    lines += _usage_families(dispatcher)
    return ("\n".join(lines) + "\n").encode()


def _usage_families(dispatcher: Dispatcher) -> list[str]:
    """What running processes' trees use (from their cgroups), and the limits they hit."""
    memory = cpu_usec = tasks = 0
    for session in process_sessions(dispatcher):
        for proc in session.processes.values():
            if proc.pid is None or proc.finished:
                continue
            usage = proc.tree.usage()
            memory += usage.memory_bytes or 0
            cpu_usec += usage.cpu_usec or 0
            tasks += usage.processes or 0
    lines = _family(
        "exec_server_process_memory_bytes",
        "gauge",
        "Memory charged to the cgroups of running processes (where measured: "
        "processes with a memory controller).",
        [({}, memory)],
    )
    lines += _family(
        "exec_server_process_cpu_seconds",
        "gauge",
        "CPU time used so far by the trees of processes that have not finished.",
        [({}, round(cpu_usec / 1e6, 6))],
    )
    lines += _family(
        "exec_server_process_tasks",
        "gauge",
        "Processes (v1 pids: tasks) in the trees of processes that have not finished.",
        [({}, tasks)],
    )
    lines += _family(
        "exec_server_limit_exceeded_total",
        "counter",
        "Processes a resource limit ended or crippled, by limitExceeded.",
        [
            ({"limit": name}, count)
            for name, count in sorted(dispatcher.stats.limits_exceeded.items())
        ],
    )
    return lines
