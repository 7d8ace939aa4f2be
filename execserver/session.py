"""A session: one client's process namespace and the process/* methods.

The session validates requests, starts processes through a
:class:`~execserver.spawn.Spawner`, keeps the id -> process registry (ids stay
reserved after exit for ``exit_retention_ms``), answers reads from retained
output (long-polling on output or exit), and emits ``process/output``,
``process/exited`` and ``process/closed`` through a ``send`` callable. It is
also the flow-control producer of its connection: when the transport's
outgoing buffer is full, every child's output pipe stops being read.

The process-control extensions (``docs/process-control.md``: signal, closeStdin,
resize, wait, list, timeouts, graceful terminate) are handled here too; the
timers and the escalation themselves live in :class:`ManagedProcess`.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import signal as _signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.logger import Logger
from zope.interface import implementer

from execserver import codec, fdlimit, limits, ptys
from execserver import protocol as p
from execserver.cgroups import Usage
from execserver.config import ServerConfig
from execserver.env_policy import build_env
from execserver.errors import RpcError
from execserver.fs.paths import uri_to_path
from execserver.processes import ManagedProcess
from execserver.reference_rules import (
    reference_path_error,
    reference_signal,
    reference_spawn_error,
)
from execserver.retained import RetainedChunk, RetainedTally
from execserver.sandbox import confine
from execserver.spawn import ProcessSpec, Spawner, SpawnError
from execserver.waiters import cancel_call

if TYPE_CHECKING:
    from execserver.dispatcher import Stats
    from execserver.registry import ResumableSession

log = Logger()

#: Recent writeIds remembered per process (a retry comes right after a drop).
WRITE_IDS_KEPT = 1024

Send = Callable[[object], None]


def _discard(message: object) -> None:
    """The sender of a released session."""


def _wire_limits(wire: p.ProcessLimits | None) -> limits.Limits | None:
    if wire is None:
        return None
    return limits.Limits(
        wire.memory_bytes, wire.max_processes, wire.cpu_percent, wire.file_size_bytes
    )


def _add_limit_fields(proc: ManagedProcess, entry: p.ListedProcess) -> p.ListedProcess:
    """``process/list``'s limits, usage and limitExceeded of one process."""
    if proc.limits:
        entry.limits = proc.limits.to_wire()
    if proc.limit_exceeded is not None:
        entry.limit_exceeded = proc.limit_exceeded[0]
    if proc.pid is not None and not proc.finished:
        usage = proc.tree.usage()
        wire = p.ProcessUsage()
        if usage.memory_bytes is not None:
            wire.memory_bytes = usage.memory_bytes
        if usage.memory_peak_bytes is not None:
            wire.memory_peak_bytes = usage.memory_peak_bytes
        if usage.cpu_usec is not None:
            wire.cpu_time_ms = usage.cpu_usec / 1000.0
        if usage.processes is not None:
            wire.processes = usage.processes
        if usage != Usage():
            entry.usage = wire
    return entry


def _timed_out(result: object, timeout: float) -> None:
    """A wait that timed out ends like one that was answered: with no value."""


def _validate_text(field: str, value: str) -> None:
    if "\0" in value:
        raise RpcError.invalid_params(f"{field} must not contain NUL characters")


_REALTIME_SIGNAL = re.compile(r"RT(MIN|MAX)(?:([+-])(\d+))?")


def parse_signal(value: int | str) -> int:
    """A signal number from a number, ``"9"``, ``"SIGKILL"``, ``"kill"`` or ``"SIGRTMIN+2"``.

    Raises ``-32602`` for unknown names and numbers outside ``1..NSIG-1``.
    """
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, int):
        if not 1 <= value < _signal.NSIG:
            raise RpcError.invalid_params(
                f"signal number {value} is out of range 1..{_signal.NSIG - 1}"
            )
        return value
    name = value.strip().upper()
    if name.startswith("SIG"):
        name = name[3:]
    member = _signal.Signals.__members__.get("SIG" + name)
    if member is not None and name not in ("RTMIN", "RTMAX"):
        return int(member)
    realtime = _REALTIME_SIGNAL.fullmatch(name)
    if realtime is not None:
        base = _signal.SIGRTMIN if realtime[1] == "MIN" else _signal.SIGRTMAX
        offset = int(realtime[3] or 0) * (-1 if realtime[2] == "-" else 1)
        number = int(base) + offset
        if _signal.SIGRTMIN <= number <= _signal.SIGRTMAX:
            return number
    raise RpcError.invalid_params(f"unknown signal `{value}`")


@implementer(IPushProducer)
class Session:
    """Process registry and process/* handlers of one client session."""

    def __init__(
        self,
        config: ServerConfig,
        clock: IReactorTime,
        spawner: Spawner,
        send: Send,
        session_id: str | None = None,
        stats: Stats | None = None,
        process_limit: Callable[[], int] = fdlimit.process_limit,
        retained: RetainedTally | None = None,
        sandbox: confine.SandboxEngine | None = None,
    ) -> None:
        self.config = config
        #: The server's sandbox (None: confined starts are refused).
        self.sandbox = sandbox
        #: Output retained by every session of the server (for
        #: ``--max-total-retained-bytes``), or None where unbounded.
        self._retained = retained
        self.session_id = session_id or secrets.token_urlsafe(24)
        self._clock = clock
        self._spawner = spawner
        self._send = send
        self.processes: dict[str, ManagedProcess] = {}
        self._expiry: dict[str, IDelayedCall] = {}
        #: Closed processes whose retention ran out while no connection was
        #: attached (released only after a new connection had its time).
        self._expired_detached: list[ManagedProcess] = []
        self._held: dict[ManagedProcess, list[object]] = {}
        self._paused = False
        self._closing = False
        #: Closed processes whose terminate still has a SIGKILL to send; kept
        #: here (not only in the registry, which may release them first) so
        #: shutdown waits for them.
        self._escalating: set[ManagedProcess] = set()
        #: Started and not exited (what --max-processes limits).
        self._running: set[ManagedProcess] = set()
        self.started_count = 0
        #: Server-wide counters (``dispatcher.Stats``) or None.
        self.stats = stats
        #: Server-wide limit on processes holding descriptors (with ``stats``).
        self._process_limit = process_limit
        #: Spawned and not yet closed: each holds descriptors in the server.
        self._holding_fds: set[ManagedProcess] = set()
        # --- resumption (docs/protocol.md, "Resumable sessions") ---
        #: How long the session outlives a disconnect, in ms (0: it does not).
        self.ttl_ms = 0
        #: "drop": the oldest output goes when the retained cap is reached;
        #: "pause": only output the client acknowledged (by a process/read's
        #: afterSeq) is dropped, and a child whose unacknowledged output
        #: fills the cap is not read until an acknowledgement frees room.
        self.on_detached_full: p.OnDetachedFull = "drop"
        #: Who created the session: only the same identity may resume it.
        self.owner: object = None
        #: True while a connection carries the session.
        self.attached = True
        #: The session whose pipes this one's flow control steers instead
        #: (set on the placeholder session of a connection that resumed).
        self._flow_target: ResumableSession | None = None
        #: Also paused and resumed with the transport (http/request's
        #: streamed bodies); each removes itself when it ends.
        self.flow_listeners: list[Any] = []
        #: The client speaks the reference's current dialect (docs/protocol.md,
        #: "Dialects"): results and notifications carry its fields.
        self.speaks_current_dialect = False
        #: The dialect whose process rules (terminate, PTY exit codes, the
        #: interrupt answer) the session follows: fixed when it starts its first
        #: process, so a resume does not change them midway. (Reads, nextSeq
        #: and long polls, follow the connection's dialect: resuming clients
        #: catch up with the current dialect's read rules.)
        self._reference_rules: bool | None = None

    # --- process/start ----------------------------------------------------------

    @property
    def reference_rules(self) -> bool:
        """Whether the reference's lifecycle rules apply (see ``_reference_rules``)."""
        return (
            self.speaks_current_dialect if self._reference_rules is None else self._reference_rules
        )

    def start(self, params: p.ExecParams) -> p.ExecResponse:
        if self._reference_rules is None:
            self._reference_rules = self.speaks_current_dialect
        if not params.argv:
            raise RpcError.invalid_params("argv must not be empty")
        if params.sandbox is not None and params.sandbox.mode == "hostDefault":
            raise RpcError.invalid_request(
                "sandbox mode `hostDefault` is not supported by exec-server yet"
            )
        if params.cwd.startswith("file://"):
            try:
                cwd = uri_to_path(params.cwd, "cwd")
            except RpcError:
                cwd = params.cwd
        else:
            cwd = params.cwd
        if not os.path.isabs(cwd):
            refused = self.speaks_current_dialect and reference_path_error(
                params.cwd, "cwd", process_cwd=True
            )
            raise refused or RpcError.invalid_params(
                f"cwd must be an absolute path, got `{params.cwd}`"
            )
        for arg in params.argv:
            _validate_text("argv", arg)
        _validate_text("cwd", cwd)
        env = build_env(params.env_policy, params.env)
        for key, value in env.items():
            _validate_text("env", key)
            _validate_text("env", value)
            if not key or "=" in key:
                raise RpcError.invalid_params(f"invalid environment variable name `{key}`")
        if params.arg0 is not None:
            _validate_text("arg0", params.arg0)
        effective = limits.resolve(
            _wire_limits(params.limits), self.config.default_limits, self.config.limit_ceiling
        )
        if self._closing:
            raise RpcError.invalid_request("session is shutting down")
        process_id = params.process_id
        if process_id in self.processes:
            raise RpcError.invalid_request(f"process {process_id} already exists")
        running = self.running_count()
        if running >= self.config.max_processes:
            raise RpcError.invalid_request(
                f"too many running processes: this session already runs {running}, "
                f"the limit set by --max-processes is {self.config.max_processes}"
            )
        if self.stats is not None:
            holding = self.stats.processes_open
            if holding >= self.config.max_server_processes:
                self.stats.refused["server_processes"] += 1
                raise RpcError.invalid_request(
                    f"too many running processes: the server already runs {holding}, "
                    f"the limit set by --max-server-processes is "
                    f"{self.config.max_server_processes}"
                )
            limit = self._process_limit()
            if holding >= limit:
                raise RpcError.invalid_request(
                    f"too many running processes: the server already runs {holding}, "
                    f"the limit derived from its open-file limit "
                    f"({fdlimit.soft_limit()} descriptors) is {limit}"
                )
        if params.tty:
            ptys.check_start(
                sum(1 for held in self._holding_fds if held.tty),
                self.stats,
                self.config.max_ptys_per_session,
                self.config.max_server_ptys,
            )
        cap = self.config.max_total_retained_bytes
        if cap and self._retained is not None:
            retained = self._retained.bytes
            if retained >= cap:
                if self.stats is not None:
                    self.stats.refused["retained_output"] += 1
                raise RpcError.invalid_request(
                    f"the server retains {retained} bytes of output, the limit set by "
                    f"--max-total-retained-bytes is {cap}: read, close or wait for "
                    "processes to be removed before starting more"
                )
        # pipeStdin only changes pipe processes (a PTY's input is always
        # open) and size only PTYs; each is ignored where it has no meaning.
        size = params.size
        spec = ProcessSpec(
            argv=tuple(params.argv),
            cwd=cwd,
            env=env,
            tty=params.tty,
            arg0=params.arg0,
            pipe_stdin=params.pipe_stdin and not params.tty,
            rows=size.rows if size is not None else 24,
            cols=size.cols if size is not None else 80,
            limits=effective,
        )
        spec, confined = confine.confine(self.sandbox, params.sandbox, spec)
        try:
            proc = self.spawn(
                process_id,
                spec,
                timeout_ms=params.timeout_ms or None,
                idle_timeout_ms=params.idle_timeout_ms or None,
                confined=confined,
            )
        except SpawnError as exc:
            if self.speaks_current_dialect:
                raise reference_spawn_error(exc) from None
            raise
        response = p.ExecResponse(proc.process_id)
        if self.speaks_current_dialect:
            response.sandbox_type = confine.SANDBOX_TYPE if confined else "none"
        if params.limits is not None:
            # Asked for: the effective limits (with defaults and ceilings).
            response.limits = effective.to_wire()
        return response

    def spawn(
        self,
        process_id: str,
        spec: ProcessSpec,
        timeout_ms: int | None = None,
        idle_timeout_ms: int | None = None,
        confined: bool = False,
    ) -> ManagedProcess:
        """Start a validated spec under ``process_id`` (raises SpawnError).

        ``timeout_ms``/``idle_timeout_ms`` (None: no limit) terminate the
        group with the server's grace when they expire. ``confined``: the
        spec runs under a sandbox (known before the spawn, which may already
        report the exit and its ``sandboxDenied``).
        """
        proc = ManagedProcess(
            process_id,
            spec.tty,
            self.config.retained_output_bytes,
            self,
            self._clock,
            argv=spec.argv,
            tally=self._retained,
        )
        proc.limits = spec.limits
        proc.confined = confined
        if self.on_detached_full == "pause":
            proc.output.protect()
        # Reserve the id before spawning: the spawn may deliver events at once.
        self.processes[process_id] = proc
        # Twisted reaps a child that already exited while constructing its
        # transport, so output and exit can be reported before spawn()
        # returns. Hold them until the start response is out (release_held),
        # so a client never hears of a process before it learns its id.
        self._held[proc] = []
        self._hold_fds(proc)
        try:
            self._spawner.spawn(proc, spec)
        except BaseException as exc:
            self._held.pop(proc, None)
            self._release_fds(proc)
            if self.processes.get(process_id) is proc:
                del self.processes[process_id]
            proc.leave_tally()
            code = getattr(exc, "errno", None)
            if isinstance(exc, OSError | SpawnError) and code in (errno.EMFILE, errno.ENFILE):
                raise RpcError.invalid_request(
                    f"too many open files: the server cannot start process {process_id} "
                    f"now ({os.strerror(code)}); retry once other processes have ended",
                    {"kind": "tooManyOpenFiles", "errno": code},
                ) from None
            raise
        if confined and self.sandbox is not None and proc.pid is not None:
            # The unix:// listeners refuse this tree's processes (sandbox/peers.py).
            self.sandbox.peers.add(proc.tree, proc.pid)
        if not self._held[proc]:
            del self._held[proc]
        else:
            # Normally the connection releases them right after the response;
            # this covers callers that start processes without one.
            self._clock.callLater(0, self.release_held)
        proc.stdin_open = (spec.tty or spec.pipe_stdin) and not proc.closed
        if timeout_ms is not None or idle_timeout_ms is not None:
            proc.start_timeouts(
                timeout_ms / 1000.0 if timeout_ms is not None else None,
                idle_timeout_ms / 1000.0 if idle_timeout_ms is not None else None,
                self.config.terminate_grace_ms / 1000.0,
            )
        self.started_count += 1
        if not proc.exited:
            self._running.add(proc)
        if self.stats is not None:
            self.stats.processes_started += 1
        if self._paused:
            proc.pause_reading()
        return proc

    def running_count(self) -> int:
        return len(self._running)

    def _hold_fds(self, proc: ManagedProcess) -> None:
        if proc not in self._holding_fds:
            self._holding_fds.add(proc)
            if self.stats is not None:
                self.stats.processes_open += 1
                self.stats.ptys_open += proc.tty

    def _release_fds(self, proc: ManagedProcess) -> None:
        if proc in self._holding_fds:
            self._holding_fds.discard(proc)
            if self.stats is not None:
                self.stats.processes_open -= 1
                self.stats.ptys_open -= proc.tty

    def lookup(self, process_id: str) -> ManagedProcess:
        proc = self.processes.get(process_id)
        if proc is None:
            raise RpcError.invalid_request(f"unknown process id {process_id}")
        return proc

    # --- process/read -----------------------------------------------------------

    def read(self, params: p.ReadParams) -> p.ReadResponse | Deferred[p.ReadResponse]:
        proc = self.lookup(params.process_id)
        if proc.output.protected and params.after_seq:
            # afterSeq acknowledges everything up to it ("pause" sessions).
            proc.acknowledge(params.after_seq)
            self._refill(proc)
        response = self._read_now(proc, params)
        wait_ms = params.wait_ms or 0
        if self._read_done(proc, response, params) or wait_ms <= 0:
            return response
        deadline = self._clock.seconds() + wait_ms / 1000.0
        return Deferred.fromCoroutine(self._long_poll(proc, params, deadline))

    async def _long_poll(
        self, proc: ManagedProcess, params: p.ReadParams, deadline: float
    ) -> p.ReadResponse:
        while (remaining := deadline - self._clock.seconds()) > 0:
            # Polls of a silent process time out again and again: the timeout
            # cancels the waiter, which takes it off the process's list.
            change = proc.wait_for_change()
            change.addTimeout(remaining, self._clock, onTimeoutCancel=_timed_out)
            await change
            response = self._read_now(proc, params)
            if self._read_done(proc, response, params):
                return response
        return self._read_now(proc, params)

    def _read_done(
        self, proc: ManagedProcess, response: p.ReadResponse, params: p.ReadParams
    ) -> bool:
        """Whether a long poll answers now: output, or an event the reader has not seen.

        Seed-era clients: output or the exit (the seeds' rule). Current-dialect
        clients (the reference's): output, the close, or an exit whose seq is
        past ``afterSeq``; a reader that saw the exit waits for the close (a
        background job may hold the output open for long).
        """
        if response.chunks:
            return True
        if not self.speaks_current_dialect:
            return proc.exited
        if proc.closed:
            return True
        return proc.exited and (params.after_seq or 0) < proc.output.next_seq - 1

    def _read_now(self, proc: ManagedProcess, params: p.ReadParams) -> p.ReadResponse:
        # afterSeq may be any u64; beyond the next seq nothing is readable
        # anyway, and clamping keeps the value within what islice() accepts.
        after_seq = min(params.after_seq or 0, proc.output.next_seq)
        read = proc.output.read(after_seq, params.max_bytes)
        next_seq = read.next_seq
        if not self.speaks_current_dialect:
            # The seeds' rule: one past the last output chunk, whether or not
            # the read returned it (the exit and close seqs never count).
            next_seq = min(next_seq, proc.output.last_output_seq + 1)
        elif read.chunks and not self._cut_by_max_bytes(proc, read.chunks, params.max_bytes):
            # The reference's: a read that returned everything answers the
            # process's next seq (past the exit and close), a read cut by
            # maxBytes one past its last chunk.
            next_seq = proc.output.next_seq
        response = p.ReadResponse(
            chunks=[p.ProcessOutputChunk(c.seq, c.stream, c.data) for c in read.chunks],
            next_seq=next_seq,
            exited=proc.exited,
            exit_code=self.exit_code_of(proc),
            closed=proc.closed,
        )
        if proc.signal is not None:
            response.signal = proc.signal
        if proc.timed_out is not None:
            response.timed_out = proc.timed_out
        if proc.exit_seq is not None:
            response.exited_seq = proc.exit_seq
        if proc.close_seq is not None:
            response.closed_seq = proc.close_seq
        if read.gap is not None:
            response.gap = p.SeqGap(*read.gap)
        if proc.limits and (exceeded := proc.limit_hit()) is not None:
            response.limit_exceeded, response.limit_value = exceeded
        if self.speaks_current_dialect:
            response.failure = None
            response.sandbox_denied = proc.exited and self._denied(proc)
        return response

    # --- process/write ----------------------------------------------------------

    def write(self, params: p.WriteParams) -> p.WriteResponse:
        write_id = params.write_id
        if write_id is not None and not write_id:
            raise RpcError.invalid_params("writeId must not be empty")
        if self.speaks_current_dialect and params.process_id not in self.processes:
            return p.WriteResponse(accepted=False, status="unknownProcess")
        proc = self.lookup(params.process_id)
        if write_id is not None and write_id in proc.write_ids:
            # A retry of a write whose answer was lost: written once already.
            return p.WriteResponse(accepted=True, status="accepted")
        if not proc.stdin_writable:
            if self.speaks_current_dialect:
                return p.WriteResponse(accepted=False, status="stdinClosed")
            if proc.tty:
                raise RpcError.internal(
                    f"failed to write to process stdin: process {params.process_id} has exited"
                )
            raise RpcError.invalid_request(f"stdin is closed for process {params.process_id}")
        pending = proc.stdin_unsent()
        if pending + len(params.chunk) > self.config.max_stdin_buffer_bytes:
            raise RpcError.invalid_request(
                f"stdin of process {params.process_id} is not being read: "
                f"{pending} bytes are already waiting "
                f"(limit {self.config.max_stdin_buffer_bytes}); retry later"
            )
        if params.chunk:
            proc.write_stdin(params.chunk)
        if write_id is None:
            if self.speaks_current_dialect:
                return p.WriteResponse(accepted=True, status="accepted")
            return p.WriteResponse(accepted=True)
        proc.write_ids[write_id] = None
        if len(proc.write_ids) > WRITE_IDS_KEPT:
            del proc.write_ids[next(iter(proc.write_ids))]
        return p.WriteResponse(accepted=True, status="accepted")

    # --- process/terminate ------------------------------------------------------

    def terminate(self, params: p.TerminateParams) -> p.TerminateResponse:
        proc = self.processes.get(params.process_id)
        if proc is None:
            return p.TerminateResponse(running=False)
        running = not proc.exited
        if not running and not params.descendants:
            # As the reference: a process that exited on its own is left
            # alone, and so are its background jobs (docs/process-control.md,
            # "Background descendants"); they end with the session.
            return p.TerminateResponse(running=False)
        if params.grace_ms is not None:
            grace_ms = params.grace_ms
        elif self.reference_rules:
            grace_ms = 0  # the reference SIGKILLs at once
        else:
            grace_ms = self.config.terminate_grace_ms
        # With ``descendants``, the group even after the leader exited:
        # members left behind may still hold its output open.
        proc.terminate(grace_ms / 1000.0)
        return p.TerminateResponse(running=running)

    # --- process/signal, closeStdin, resize -------------------------------------

    def signal(self, params: p.SignalParams) -> p.SignalResponse | p.Empty:
        if reference_signal(params.signal):
            # The reference's Ctrl-C: SIGINT to the group. Its answer is
            # ``{}``, for an unknown or exited process too.
            proc = self.processes.get(params.process_id)
            if self.reference_rules:
                if proc is not None:
                    proc.send_signal(_signal.SIGINT)
                return p.Empty()
            proc = self.lookup(params.process_id)
            return p.SignalResponse(delivered=proc.send_signal(_signal.SIGINT))
        proc = self.lookup(params.process_id)
        assert not isinstance(params.signal, dict)
        signum = parse_signal(params.signal)
        return p.SignalResponse(delivered=proc.send_signal(signum))

    def close_stdin(self, params: p.CloseStdinParams) -> p.CloseStdinResponse:
        proc = self.lookup(params.process_id)
        if proc.exited or proc.pid is None:
            raise RpcError.invalid_request(f"process {params.process_id} has exited")
        if proc.tty:
            # A terminal has no separate input to close: its line discipline
            # turns the EOF character into end-of-file for the reader. Sent on
            # every call, as a user pressing ^D again would.
            proc.send_eof()
            return p.CloseStdinResponse(closed=True)
        return p.CloseStdinResponse(closed=proc.close_stdin())

    def resize(self, params: p.ResizeParams) -> p.Empty:
        proc = self.lookup(params.process_id)
        if not proc.tty:
            raise RpcError.invalid_request(f"process {params.process_id} is not a tty")
        if proc.closed or proc.pid is None:
            raise RpcError.invalid_request(f"process {params.process_id} has exited")
        try:
            proc.resize(params.rows, params.cols)
        except OSError as exc:
            raise RpcError.internal(
                f"failed to resize the terminal of process {params.process_id}: {exc}"
            ) from None
        return p.Empty()

    # --- process/wait, process/list ---------------------------------------------

    def wait(self, params: p.WaitParams) -> p.WaitResponse | Deferred[p.WaitResponse]:
        proc = self.lookup(params.process_id)
        if proc.exited or params.timeout_ms == 0:
            return self._wait_response(proc)
        exited = proc.when_exited()
        if params.timeout_ms is not None:
            # The timeout cancels the exit waiter (taking it off the list):
            # the answer is the process's state then.
            exited.addTimeout(params.timeout_ms / 1000.0, self._clock, onTimeoutCancel=_timed_out)
        return exited.addCallback(lambda _: self._wait_response(proc))

    @staticmethod
    def _cut_by_max_bytes(
        proc: ManagedProcess, chunks: list[RetainedChunk], max_bytes: int | None
    ) -> bool:
        """Whether the reference's read loop stopped at ``maxBytes``: it reached
        the limit (even with the last chunk) or left a chunk out."""
        if max_bytes is None:
            return False
        if chunks[-1].seq != proc.output.last_output_seq:
            return True
        return sum(len(c.data) for c in chunks) >= max_bytes

    def exit_code_of(self, proc: ManagedProcess) -> int | None:
        """The exit code this client is told: the reference reports a PTY
        process that a signal ended with 1 (its PTY layer's code), pipes
        with 128+N; this server reports 128+N (and ``signal``) to seed-era
        clients for both."""
        if self.reference_rules and proc.tty and proc.signal is not None:
            return 1
        return proc.exit_code

    def _wait_response(self, proc: ManagedProcess) -> p.WaitResponse:
        response = p.WaitResponse(exited=proc.exited, exit_code=self.exit_code_of(proc))
        if proc.signal is not None:
            response.signal = proc.signal
        if proc.timed_out is not None:
            response.timed_out = proc.timed_out
        return response

    def list(self, params: p.ListParams) -> p.ListResponse:
        listed = [self._listed(proc) for proc in self.processes.values()]
        # Processes whose id was released while their background jobs run.
        listed.extend(
            self._listed(proc)
            for proc in self._escalating
            if self.processes.get(proc.process_id) is not proc and not proc.finished
        )
        return p.ListResponse(listed)

    def _listed(self, proc: ManagedProcess) -> p.ListedProcess:
        return _add_limit_fields(
            proc,
            p.ListedProcess(
                process_id=proc.process_id,
                pid=proc.pid,
                argv=list(proc.argv),
                tty=proc.tty,
                running=not proc.exited,
                exit_code=self.exit_code_of(proc),
                descendants=proc.descendant_pids() if proc.exited else [],
            ),
        )

    # --- notifications from ManagedProcess --------------------------------------

    def process_output(
        self, proc: ManagedProcess, stream: p.OutputStream, data: bytes, seq: int
    ) -> None:
        if self.stats is not None:
            self.stats.output_bytes[stream] += len(data)
        encoder = proc.output_encoder
        if encoder is None:
            encoder = proc.output_encoder = codec.OutputEncoder(proc.process_id)
        self._emit(proc, encoder.encode(stream, data, seq))
        if proc.retention_full and not proc.full_paused and proc.readable:
            proc.full_paused = True
            if not self._paused:
                proc.pause_reading()
            proc.when_retention_room(lambda: self._refill(proc))

    def _refill(self, proc: ManagedProcess) -> None:
        """Read a child again once acknowledged output made room (its own or the server's)."""
        if proc.full_paused and not proc.retention_full:
            proc.full_paused = False
            if not self._paused:
                proc.resume_reading()
        elif proc.full_paused:
            proc.when_retention_room(lambda: self._refill(proc))

    def process_exited(self, proc: ManagedProcess) -> None:
        self._running.discard(proc)
        if self.stats is not None:
            self.stats.processes_exited += 1
        code = self.exit_code_of(proc)
        params = p.ExitedNotification(proc.process_id, code if code is not None else -1)
        if proc.exit_seq is not None:
            params.seq = proc.exit_seq
        if proc.signal is not None:
            params.signal = proc.signal
        if proc.timed_out is not None:
            params.timed_out = proc.timed_out
        if self.speaks_current_dialect:
            params.sandbox_denied = self._denied(proc)
        if proc.limit_exceeded is not None:
            params.limit_exceeded, params.limit_value = proc.limit_exceeded
            if self.stats is not None:
                self.stats.limits_exceeded[proc.limit_exceeded[0]] += 1
        self._emit(proc, p.Notification(p.PROCESS_EXITED, params))

    def _denied(self, proc: ManagedProcess) -> bool:
        if not proc.confined:
            return False
        if proc.sandbox_denied is None:
            proc.sandbox_denied = confine.likely_denied(proc)
        return proc.sandbox_denied

    def process_closed(self, proc: ManagedProcess) -> None:
        self._release_fds(proc)
        if not proc.finished:
            self._escalating.add(proc)
            proc.when_finished().addCallback(lambda _: self._escalating.discard(proc))
        self._emit(
            proc,
            p.Notification(
                p.PROCESS_CLOSED,
                p.ClosedNotification(
                    proc.process_id,
                    proc.close_seq if proc.close_seq is not None else proc.output.next_seq - 1,
                ),
            ),
        )
        if self._closing:
            return
        delay = self.config.exit_retention_ms / 1000.0
        self._expiry[proc.process_id] = self._clock.callLater(delay, self._expire, proc)
        self._evict_retired_beyond_limit()

    def _emit(self, proc: ManagedProcess, message: object) -> None:
        held = self._held.get(proc)
        if held is None:
            self._send(message)
        else:
            held.append(message)

    def release_held(self) -> None:
        """Send the events of processes that reported them while being spawned."""
        if not self._held:
            return
        held, self._held = self._held, {}
        for messages in held.values():
            for message in messages:
                self._send(message)

    def _expire(self, proc: ManagedProcess) -> None:
        if not self.attached:
            # Not while the client is away: a resuming client that sends
            # its in-flight process/start again relies on "process ID
            # already exists" to know the first one ran, and a released id
            # would run the command twice. The entry stays (the per-session
            # cap still counts and evicts it); attach() restarts its time.
            self._expired_detached.append(proc)
            return
        self._expiry.pop(proc.process_id, None)
        if self.processes.get(proc.process_id) is proc:
            del self.processes[proc.process_id]
            proc.leave_tally()

    def _evict_retired_beyond_limit(self) -> None:
        # Closed processes waiting out their retention are capped at
        # max_processes per session so memory stays bounded under churn; the
        # oldest are released early.
        excess = len(self._expiry) - self.config.max_processes
        for process_id in list(self._expiry)[: max(0, excess)]:
            cancel_call(self._expiry.pop(process_id))
            proc = self.processes.pop(process_id, None)
            if proc is not None:
                proc.leave_tally()

    # --- flow control (IPushProducer) -------------------------------------------

    def pauseProducing(self) -> None:
        if self._flow_target is not None:
            self._flow_target.pauseProducing()
            return
        if self._paused:
            return
        self._paused = True
        for proc in self.processes.values():
            if not proc.full_paused:
                proc.pause_reading()
        for listener in list(self.flow_listeners):
            listener.pauseProducing()

    def resumeProducing(self) -> None:
        if self._flow_target is not None:
            self._flow_target.resumeProducing()
            return
        if not self._paused:
            return
        self._paused = False
        for proc in self.processes.values():
            if not proc.full_paused:
                proc.resume_reading()
        for listener in list(self.flow_listeners):
            listener.resumeProducing()

    def stopProducing(self) -> None:
        # A lost transport stops its producer; a session with a TTL is
        # detached by its connection instead (Connection.shutdown decides).
        if self._flow_target is None and self.ttl_ms == 0:
            self.shutdown()

    # --- resumption -------------------------------------------------------------

    def steer_flow_of(self, target: ResumableSession) -> None:
        """Let this (empty) session's transport flow control steer ``target``.

        A transport registers its connection's first session as its
        producer; after a resume the connection carries another one.
        """
        self._flow_target = target
        if self._paused:
            self._paused = False
            target.pauseProducing()

    def detach(self) -> None:
        """The connection is gone: keep running, retain output, send nothing."""
        self.attached = False
        self._send = _discard
        # Nothing throttles the output of a detached session but its cap.
        self.resumeProducing()

    def attach(self, send: Send) -> None:
        """A new connection took the session over."""
        self.attached = True
        self._send = send
        # The retention that ran out while detached starts again, whole, so
        # the client has it to catch up on those exits.
        due, self._expired_detached = self._expired_detached, []
        delay = self.config.exit_retention_ms / 1000.0
        for proc in due:
            if self.processes.get(proc.process_id) is proc and not self._closing:
                self._expiry[proc.process_id] = self._clock.callLater(delay, self._expire, proc)

    @property
    def paused(self) -> bool:
        return self._paused

    # --- shutdown ---------------------------------------------------------------

    def shutdown(self, grace_ms: int | None = None) -> Deferred[None]:
        """Terminate every process (whole groups) and fire when all are gone.

        Pending long-poll reads and waits are answered when their process
        exits. Output keeps being read (and sent while the transport is up)
        until each process is closed; the Deferred fires once every process is
        closed and every SIGKILL escalation under way has been sent, so a
        member that ignores SIGTERM cannot outlive the server.
        """
        grace = (self.config.terminate_grace_ms if grace_ms is None else grace_ms) / 1000.0
        self._closing = True
        # Flow control stays as the transport set it: a client that stopped
        # reading must not make the server buffer the output of the grace
        # period. Paused children die from the signals regardless, and a pipe
        # nobody reads is closed by the force-close after SIGKILL.
        waits = []
        for proc in {*self.processes.values(), *self._escalating}:
            # Closed ones too: members of its tree may outlive the output.
            if not proc.finished:
                proc.terminate(grace)
            if not proc.finished:
                waits.append(proc.when_finished())
        for timer in self._expiry.values():
            cancel_call(timer)
        self._expiry.clear()
        if not waits:
            self._leave_tally()
            return succeed(None)
        done: Deferred[None] = DeferredList(waits).addCallback(lambda _: self._leave_tally())
        return done

    def _leave_tally(self) -> None:
        # An ended session's output no longer counts against the server's
        # cap, even where its connection keeps it until release().
        for proc in self.processes.values():
            proc.leave_tally()

    def release(self) -> None:
        """After shutdown: drop the processes and the sender.

        Each process points back at this session and the sender at its
        connection; without this the whole session (retained output
        included) would wait for a full garbage collection.
        """
        self._leave_tally()
        self.processes.clear()
        self._held.clear()
        self._escalating.clear()
        self._running.clear()
        self._send = _discard


class _Carrier(Protocol):
    @property
    def session(self) -> object: ...


def session_of(carrier: _Carrier) -> Session:
    """The process session a connection carries (the composition root gives each one)."""
    session = carrier.session
    if not isinstance(session, Session):
        raise RpcError.internal("internal error: this connection carries no process session")
    return session
