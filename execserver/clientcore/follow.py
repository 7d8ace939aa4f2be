"""Following a session's processes: the part every client shares, free of any event loop.

:class:`ProcessTable` is what the Twisted client (:mod:`execserver.client.client`)
and the asyncio client (:mod:`execserver.aio.client`) keep of the processes
they started, and the rules they follow them by; each client only supplies its
way to wait (a ``call`` returning an awaitable, a ``schedule`` for timers, a
``background`` runner) and its way to dial:

- **start registration**: a handle is registered under the requested id
  *before* ``process/start`` is sent (output may race the answer), dropped
  again if the start fails, and re-keyed under the id the server answers
  with (the one its notifications carry): :meth:`ProcessTable.claim`,
  :meth:`~ProcessTable.register`, :meth:`~ProcessTable.unregister`,
  :meth:`~ProcessTable.started`;
- **the start sequence** (:meth:`ProcessTable.start`): claim the id,
  register (or, sent again after a drop, adopt) the handle, ``process/start``
  (:func:`send_start`), re-key or unregister it, catch a resent one up;
- **close and linger**: a process that exited but whose output is not closed
  (a baseline server sends no ``process/closed``) is forgotten
  :data:`~execserver.clientcore.defaults.EXITED_LINGER_SECONDS` later; a
  closed one at once: :meth:`~ProcessTable.linger`, :meth:`~ProcessTable.forget`;
  a client's ``close()`` terminates every handle not started with
  ``detach=True`` that has not exited and waits for the exits, at most
  :data:`~execserver.clientcore.defaults.CLOSE_WAIT_SECONDS`
  (:func:`end_processes`);
- **acknowledgement** (``onDetachedFull: "pause"``): a ``process/read`` whose
  ``afterSeq`` tells the server what arrived, each time a quarter of its
  retention did: :meth:`~ProcessTable.acknowledge_if_due`
  (:meth:`~ProcessTable.ack_params`, :func:`acknowledge`);
- **catch-up after a resume, with gap reporting**: ``process/read`` from each
  handle's last delivered seq until it has all it missed, a
  :class:`~execserver.clientcore.types.GapEvent` where the server dropped
  some, then the live events held back meanwhile, then an acknowledgement of
  them: :meth:`~ProcessTable.catch_up`.

Which calls may be repeated on a resumed session is
:func:`execserver.clientcore.calls.repeatable`; when to stop resuming is
:class:`execserver.clientcore.resume.ResumeAttempts`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any, Generic, TypeVar

from pybase64 import b64decode

from execserver import protocol as p
from execserver.clientcore.defaults import CLOSE_WAIT_SECONDS, EXITED_LINGER_SECONDS
from execserver.clientcore.errors import ConnectionClosed, ExecServerError, ServerError
from execserver.clientcore.process import ProcessCore
from execserver.clientcore.start import already_started, next_process_id
from execserver.clientcore.transfer import Caller
from execserver.clientcore.types import (
    ClosedParams,
    ExitedParams,
    InitializeResult,
    OutputEvent,
    OutputParams,
)

H = TypeVar("H", bound=ProcessCore[Any])

#: ``schedule(seconds, fn)`` runs ``fn`` later and returns a canceller
#: (safe to call after ``fn`` ran).
Schedule = Callable[[float, Callable[[], None]], Callable[[], None]]
#: Runs a coroutine to its end without the caller waiting for it.
Background = Callable[[Coroutine[Any, Any, None]], object]


class ProcessTable(Generic[H]):
    """The processes one client follows, by the id their notifications carry."""

    def __init__(self, schedule: Schedule, linger_seconds: float = EXITED_LINGER_SECONDS) -> None:
        self._schedule = schedule
        self._linger_seconds = linger_seconds
        self.processes: dict[str, H] = {}
        self._lingering: dict[str, Callable[[], None]] = {}
        self._next_process = 1
        #: Handles whose ``process/start`` is not answered yet: the server
        #: may never have heard of them, so no resume catches them up.
        self.starting: set[H] = set()

    def get(self, process_id: str) -> H | None:
        return self.processes.get(process_id)

    def __len__(self) -> int:
        return len(self.processes)

    def __iter__(self) -> Iterator[H]:
        return iter(list(self.processes.values()))

    def take_all(self) -> list[H]:
        """Every handle, leaving the table empty (the connection or session ended)."""
        handles = list(self.processes.values())
        self.processes = {}
        return handles

    def settled(self) -> list[H]:
        """The handles whose start was answered (those a resume catches up)."""
        return [handle for handle in self.processes.values() if handle not in self.starting]

    # --- start registration ---------------------------------------------------------

    def new_process_id(self) -> str:
        """The next ``proc-N`` no handle of this table holds."""
        process_id, self._next_process = next_process_id(self._next_process, self.processes)
        return process_id

    def claim(self, requested: str) -> None:
        """Refuse an id a live handle of this client still holds."""
        existing = self.processes.get(requested)
        if existing is not None and not existing.is_closed:
            raise ExecServerError(f"process id {requested} is already in use by this client")

    def register(self, handle: H) -> None:
        """Before ``process/start`` is sent: output may race its answer."""
        self.processes[handle.process_id] = handle

    def unregister(self, requested: str, handle: H) -> None:
        """The start failed: the handle registered for it goes."""
        if self.processes.get(requested) is handle:
            del self.processes[requested]

    def started(self, requested: str, handle: H, response: p.ExecResponse) -> None:
        """The start's answer: the server's id is the one its notifications carry."""
        if response.process_id != requested:
            self.unregister(requested, handle)
            handle.process_id = response.process_id
            self.processes[response.process_id] = handle

    async def start(
        self,
        call: Caller,
        handle: H,
        params: p.ExecParams,
        again: bool,
        catch_up: Callable[[H], Awaitable[object]],
    ) -> None:
        """Send ``handle``'s ``process/start`` on one connection: what every
        client's start does, once per sending.

        The handle is registered under the requested id *before* the request
        (output may race the answer), re-keyed under the id the server
        answers with, dropped again if the start fails. ``again``: the start
        was in flight at a drop and is sent again, same ``processId``, on the
        resumed session: the handle is adopted (its live events wait), "process
        ID already exists" says the first one ran (:func:`send_start`), and
        either way it is caught up from its last seq (``catch_up``), so it
        sees the whole output once. While unanswered it is kept out of a
        resume's catch-up (:meth:`settled`).
        """
        requested = params.process_id
        self.claim(requested)
        if again:
            self.adopt([handle])
        else:
            self.register(handle)
        self.starting.add(handle)
        try:
            response = await send_start(call, params, again)
        except BaseException:
            self.unregister(requested, handle)
            if again:
                handle.abandon_catch_up()
            raise
        finally:
            self.starting.discard(handle)
        self.started(requested, handle, response)
        if again:
            await catch_up(handle)

    def after_start(self, handle: H, *, up: bool, following: bool, lost: Exception | None) -> bool:
        """A start was answered (or the start loop ended): a session that
        is ``lost`` fails the handle, a connection that dropped for good
        (neither ``up`` nor ``following`` the session) ends it; otherwise it
        is followed (a drop of a followed session keeps it for the resume):
        then True."""
        if lost is not None:
            handle.fail(lost)
        elif not up and not following:
            handle.connection_lost()
        else:
            return True
        return False

    # --- notifications ----------------------------------------------------------------

    def output(
        self,
        event: OutputEvent,
        call: Caller,
        result: InitializeResult | None,
        connected: bool,
        background: Background,
    ) -> bool:
        """A ``process/output``'s event (:func:`decode_output`): delivered to
        its handle in seq order, never twice (held back while it catches up),
        then acknowledged when due ("pause": :meth:`acknowledge_if_due`).
        False when it is not to be passed on (a duplicate, or held back)."""
        handle = self.processes.get(event.process_id)
        if handle is None:
            return True  # not followed here
        if not handle.accept_output(event):
            return False
        self.acknowledge_if_due(call, handle, len(event.chunk), result, connected, background)
        return True

    def exited(self, ex: ExitedParams) -> bool:
        """A ``process/exited``: False when it is not to be passed on (a
        duplicate, or held back while its handle catches up). A handle that
        exited lingers until its close (:meth:`linger`)."""
        handle = self.processes.get(ex.process_id)
        if handle is None:
            return True  # not followed here
        if not handle.accept_exit_report(ex):
            return False
        self.linger(handle)
        return True

    def closed(self, closed: ClosedParams) -> bool:
        """A ``process/closed``: False when it is not to be passed on; a
        closed handle is no longer followed."""
        handle = self.processes.get(closed.process_id)
        if handle is None:
            return True
        if not handle.accept_close(closed.seq):
            return False
        self.forget(handle)
        return True

    # --- close and linger -------------------------------------------------------------

    def linger(self, handle: H) -> None:
        """After an exit without a close: output may still follow for a
        while (a baseline server sends no ``process/closed``), then the
        handle ends."""
        process_id = handle.process_id
        if not handle.is_closed and process_id not in self._lingering:
            self._lingering[process_id] = self._schedule(
                self._linger_seconds, lambda: self.forget(handle, process_id)
            )

    def forget(self, handle: H, process_id: str | None = None) -> None:
        """The handle is closed and no longer followed."""
        process_id = handle.process_id if process_id is None else process_id
        cancel = self._lingering.pop(process_id, None)
        if cancel is not None:
            cancel()
        if self.processes.get(process_id) is handle:
            del self.processes[process_id]
        handle.mark_closed()

    def to_end(self) -> list[H]:
        """What ``close()`` terminates: every handle not started with
        ``detach=True`` whose process has not exited."""
        return [handle for handle in self if not handle.detach and not handle.has_exited]

    def cancel_lingers(self) -> None:
        """The connection dropped: no timer outlives it."""
        lingering, self._lingering = self._lingering, {}
        for cancel in lingering.values():
            cancel()

    # --- resume gating ----------------------------------------------------------------

    def dropped(self, following: bool) -> bool:
        """The connection dropped: no linger timer outlives it, and unless the
        client ``following`` the session waits for a resume, every handle
        ends (exited without an exit code, and closed). Returns ``following``:
        whether the handles wait for the next connection to adopt them."""
        self.cancel_lingers()
        if not following:
            for handle in self.take_all():
                handle.connection_lost()
        return following

    # --- acknowledgement ("pause") ------------------------------------------------------

    @staticmethod
    def ack_params(
        handle: H,
        size: int,
        result: InitializeResult | None,
        connected: bool,
        *,
        now: bool = False,
    ) -> p.ReadParams | None:
        """The ``process/read`` acknowledging ``handle``'s output, when one is due.

        With "pause" the server drops only acknowledged output and stops
        reading a child whose unacknowledged output fills its retention;
        acknowledging at a quarter of it (or ``now``) keeps the child running.
        ``size``: the payload bytes just delivered.
        """
        if result is None or result.on_detached_full != "pause" or handle.last_seq == 0:
            return None
        if not connected:
            return None
        if not handle.ack_due(size, result.retained_output_bytes or 0, now=now):
            return None
        return p.ReadParams(handle.process_id, handle.last_seq, 1, 0)

    def acknowledge_if_due(
        self,
        call: Caller,
        handle: H,
        size: int,
        result: InitializeResult | None,
        connected: bool,
        background: Background,
        *,
        now: bool = False,
    ) -> None:
        """Send the acknowledging read (:meth:`ack_params`) in the
        ``background`` when one is due: what every client does with it."""
        params = self.ack_params(handle, size, result, connected, now=now)
        if params is not None:
            background(acknowledge(call, handle, params))

    # --- catching up after a resume -----------------------------------------------------

    def adopt(self, handles: list[H]) -> None:
        """Follow ``handles`` (of a resumed session), holding their live events
        back until :meth:`catch_up`."""
        for handle in handles:
            handle.begin_catch_up()
            self.processes[handle.process_id] = handle

    async def catch_up(
        self,
        call: Caller,
        handle: H,
        result: InitializeResult | None,
        connected: Callable[[], bool],
        background: Background,
    ) -> Exception | None:
        """Deliver, in seq order and never twice, what ``handle`` missed: the
        output retained meanwhile (a gap where some was dropped), then its
        exit and close, then the live events held back; then acknowledge them.

        Returns None when caught up, or dropped again (the handle keeps
        waiting: the next resume catches up); the error that ended the handle
        otherwise (its id expired in the server, or a malformed reply: left
        in catch-up it would hold events back forever), for the client to log.
        """
        try:
            while handle.catch_up(
                await call(
                    p.PROCESS_READ, p.ReadParams(handle.process_id, handle.last_seq), p.ReadResponse
                )
            ):
                pass
        except ConnectionClosed:
            return None
        except Exception as exc:
            handle.fail(exc)
            self.forget(handle)
            return exc
        handle.end_catch_up()
        if handle.is_closed:
            self.forget(handle)
            return None
        # The live events held back meanwhile were delivered unacknowledged:
        # a "pause" server may be waiting for exactly them.
        self.acknowledge_if_due(call, handle, 0, result, connected(), background, now=True)
        return None


def decode_output(out: OutputParams) -> OutputEvent | None:
    """A ``process/output`` notification's event (None: its chunk is not valid
    base64; the client logs and drops it, the connection stays up)."""
    try:
        chunk = b64decode(out.chunk, validate=True)
    except ValueError:
        return None
    return OutputEvent(out.process_id, out.stream, chunk, out.seq)


async def send_start(call: Caller, params: p.ExecParams, again: bool) -> p.ExecResponse:
    """``process/start``; ``again``: it was in flight at a drop and is sent
    again, same ``processId``, on the resumed session, where "process ID
    already exists" says the first one was carried out (the handle then
    catches up from its last seq)."""
    try:
        result: p.ExecResponse = await call(p.PROCESS_START, params, p.ExecResponse)
    except ServerError as exc:
        if again and already_started(exc, params.process_id):
            return p.ExecResponse(params.process_id)
        raise
    return result


async def acknowledge(call: Caller, handle: ProcessCore[Any], params: p.ReadParams) -> None:
    """Send the acknowledging read; what it brings back is caught up (never twice)."""
    try:
        read = await call(p.PROCESS_READ, params, p.ReadResponse)
    except ExecServerError:
        return
    handle.catch_up(read)


#: ``within(jobs, seconds)``: run ``jobs`` together; True if all ended within ``seconds``.
Within = Callable[[Sequence[Awaitable[object]], float], Awaitable[bool]]


async def end_processes(
    handles: Sequence[H],
    terminate: Callable[[str], Awaitable[object]],
    exited: Callable[[H], Awaitable[object]],
    within: Within,
    *,
    also: Sequence[Awaitable[object]] = (),
    seconds: float = CLOSE_WAIT_SECONDS,
) -> bool:
    """What a client's ``close()`` does before it disconnects: terminate
    each of ``handles`` (:meth:`ProcessTable.to_end`) and wait for its exit,
    all at once, at most ``seconds``; ``also``: other endings to wait for
    meanwhile (the asyncio client's terminations of cancelled starts). A
    terminate that fails (the process is gone already, or the connection
    is) is not waited for. False when something was still running at the
    bound (the client logs it)."""

    async def end(handle: H) -> None:
        try:
            await terminate(handle.process_id)
        except ExecServerError:
            return  # gone already, or the connection is: nothing to wait for
        await exited(handle)

    jobs = [end(handle) for handle in handles]
    if not jobs and not also:
        return True
    return await within([*jobs, *also], seconds)
