"""hypothesis on the bookkeeping every client shares (execserver.clientcore).

- Request ids: for any interleaving of calls, answers, errors, cancellations,
  late answers and a connection loss, ids are unique and every pending entry
  leaves the map exactly when its call ends -- for the asyncio client's
  ``AsyncRpc`` and the Twisted client's ``RpcClient`` alike.
- Resume replay: for any interleaving of live notifications and catch-up
  reads on the new connection after a drop (server-side production, read
  answers and deliveries in any order one connection allows), a handle
  delivers exactly the model sequence: what arrived before the drop, a
  GapEvent for what the server dropped, the rest in seq order, never twice,
  then the exit and the close in their places.
- The bounded output queue of both clients (Twisted ``OutputSubscription``,
  asyncio ``OutputStream``: one ``clientcore.process.OutputQueue``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from twisted.internet.defer import CancelledError, Deferred
from twisted.python.failure import Failure

from execserver import protocol as p
from execserver.aio.process import OutputStream
from execserver.aio.rpc import AsyncRpc
from execserver.client.process import OutputSubscription
from execserver.client.rpc import RpcClient
from execserver.clientcore.calls import PendingCalls, repeatable
from execserver.clientcore.errors import ConnectionClosed, OutputLagged, ServerError
from execserver.clientcore.ordering import SeqOrdering
from execserver.clientcore.types import GapEvent, OutputEvent
from tests.support.aio_harness import RecordingChannel, RecordingSink

# --- request ids ------------------------------------------------------------------------------

call_ops = st.lists(
    st.one_of(
        st.just(("call", 0)),
        st.tuples(
            st.sampled_from(["reply", "error", "cancel", "late", "garbage"]), st.integers(0, 99)
        ),
    ),
    max_size=40,
)


def reply(request_id: int) -> bytes:
    return json.dumps({"id": request_id, "result": {"processes": []}}).encode()


def error(request_id: int) -> bytes:
    return json.dumps({"id": request_id, "error": {"code": -32600, "message": "no"}}).encode()


async def _aio_ids(ops: list[tuple[str, int]], lose: bool) -> None:
    rpc = AsyncRpc()
    channel = RecordingChannel()
    rpc.channel = channel
    calls: dict[int, asyncio.Future[p.ListResponse]] = {}
    outstanding: list[int] = []
    ended: list[int] = []
    outcome: dict[int, str] = {}
    for op, n in ops:
        if op == "call":
            calls_before = len(channel.sent)
            call = asyncio.ensure_future(rpc.call(p.PROCESS_LIST, p.ListParams(), p.ListResponse))
            await asyncio.sleep(0)
            request_id = channel.sent[calls_before]["id"]
            assert request_id not in calls, "ids are never reused"
            calls[request_id] = call
            outstanding.append(request_id)
        elif op in ("reply", "error", "cancel") and outstanding:
            request_id = outstanding.pop(n % len(outstanding))
            ended.append(request_id)
            outcome[request_id] = op
            if op == "cancel":
                calls[request_id].cancel()
            else:
                rpc.message_received(reply(request_id) if op == "reply" else error(request_id))
        elif op == "late" and ended:
            rpc.message_received(reply(ended[n % len(ended)]))  # ignored
        elif op == "garbage":
            rpc.message_received(reply(10_000 + n))  # an id never sent: ignored
        await asyncio.sleep(0)
        assert rpc.pending_count == len(outstanding)
    if lose:
        rpc.connection_lost("gone")
    else:
        for request_id in outstanding:
            calls[request_id].cancel()
            outcome[request_id] = "cancel"
    await asyncio.sleep(0)
    assert rpc.pending_count == 0
    for request_id, task in calls.items():
        assert task.done()
        expected = outcome.get(request_id, "lost")
        if expected == "cancel":
            assert task.cancelled()
        elif expected == "reply":
            assert task.result() == p.ListResponse([])
        elif expected == "error":
            assert isinstance(task.exception(), ServerError)
        else:
            assert isinstance(task.exception(), ConnectionClosed)
    assert rpc.pending_count == 0


@given(ops=call_ops, lose=st.booleans())
def test_aio_request_ids_are_unique_and_every_entry_leaves(
    ops: list[tuple[str, int]], lose: bool
) -> None:
    asyncio.run(_aio_ids(ops, lose))


@given(ops=call_ops, lose=st.booleans())
def test_twisted_request_ids_are_unique_and_every_entry_leaves(
    ops: list[tuple[str, int]], lose: bool
) -> None:
    rpc = RpcClient()
    sink = RecordingSink()
    rpc.attach(sink)
    calls: dict[int, Deferred[p.ListResponse]] = {}
    results: dict[int, object] = {}
    outstanding: list[int] = []
    ended: list[int] = []
    outcome: dict[int, str] = {}

    def record(request_id: int) -> Any:
        def settle(result: object) -> None:
            results[request_id] = result.value if isinstance(result, Failure) else result

        return settle

    for op, n in ops:
        if op == "call":
            d = rpc.call(p.PROCESS_LIST, p.ListParams(), p.ListResponse)
            request_id = sink.sent[-1]["id"]
            assert request_id not in calls, "ids are never reused"
            calls[request_id] = d
            d.addBoth(record(request_id))
            outstanding.append(request_id)
        elif op in ("reply", "error", "cancel") and outstanding:
            request_id = outstanding.pop(n % len(outstanding))
            ended.append(request_id)
            outcome[request_id] = op
            if op == "cancel":
                calls[request_id].cancel()
            else:
                rpc.message_received(reply(request_id) if op == "reply" else error(request_id))
        elif op == "late" and ended:
            rpc.message_received(reply(ended[n % len(ended)]))
        elif op == "garbage":
            rpc.message_received(reply(10_000 + n))
        assert rpc.pending_count == len(outstanding)
    if lose:
        rpc.connection_lost("gone")
    else:
        for request_id in outstanding:
            calls[request_id].cancel()
            outcome[request_id] = "cancel"
    assert rpc.pending_count == 0
    for request_id in calls:
        expected = outcome.get(request_id, "lost")
        got = results[request_id]
        if expected == "cancel":
            assert isinstance(got, CancelledError)
        elif expected == "reply":
            assert got == p.ListResponse([])
        elif expected == "error":
            assert isinstance(got, ServerError)
        else:
            assert isinstance(got, ConnectionClosed)


@given(st.lists(st.sampled_from(["add", "pop", "discard", "take_all"]), max_size=50))
def test_pending_calls_model(ops: list[str]) -> None:
    calls: PendingCalls[str] = PendingCalls()
    model: list[int] = []
    issued: list[int] = []
    for op in ops:
        if op == "add":
            request_id = calls.add("m", object, "w")
            assert request_id not in issued
            issued.append(request_id)
            model.append(request_id)
        elif op == "pop" and model:
            assert calls.pop(model.pop(0)) is not None
        elif op == "discard" and model:
            calls.discard(model.pop())
        elif op == "take_all":
            assert len(calls.take_all()) == len(model)
            model = []
        assert len(calls) == len(model)
        assert all(i in calls for i in model)
    assert calls.pop(None) is None and calls.pop(1.5) is None


def test_repeatable_calls() -> None:
    assert repeatable(p.PROCESS_READ, None) and repeatable(p.FS_READ_FILE, None)
    assert not repeatable(p.PROCESS_START, None) and not repeatable(p.FS_WRITE_FILE, None)
    assert repeatable(p.PROCESS_WRITE, p.WriteParams("x", b"", write_id="w"))
    assert not repeatable(p.PROCESS_WRITE, p.WriteParams("x", b""))


# --- resume replay ordering -------------------------------------------------------------------


class _Recorder(SeqOrdering):
    def __init__(self) -> None:
        self.process_id = "p"
        self.has_exited = False
        self.is_closed = False
        self.delivered: list[tuple[Any, ...]] = []
        self._init_ordering()

    def deliver_output(self, event: OutputEvent) -> None:
        if isinstance(event, GapEvent):
            self.delivered.append(("gap", event.from_seq, event.to_seq))
        else:
            self.delivered.append(("out", event.seq, event.chunk))

    def mark_exited(
        self, exit_code: int | None, signal: str | None = None, timed_out: str | None = None
    ) -> None:
        self.has_exited = True
        self.delivered.append(("exit", exit_code))

    def mark_closed(self) -> None:
        self.is_closed = True
        self.delivered.append(("close",))


class _Server:
    """One process's seqs: output, one exit, the close last; the oldest
    ``first - 1`` seqs' output evicted while the client was away."""

    def __init__(self, kinds: list[str], first: int, produced: int) -> None:
        self.kinds = kinds
        self.first = first
        self.produced = produced

    def seq_of(self, kind: str) -> int:
        return self.kinds.index(kind) + 1

    def is_mark(self, seq: int) -> bool:
        return self.kinds[seq - 1] != "out"

    def read(self, after_seq: int, max_chunks: int) -> p.ReadResponse:
        start = after_seq + 1
        gap = None
        if start < self.first:
            low, high = start, self.first - 1
            while low <= high and self.is_mark(low):
                low += 1
            while high >= low and self.is_mark(high):
                high -= 1
            if low <= high:
                gap = p.SeqGap(low, high)
            start = self.first
        seqs = [s for s in range(start, self.produced + 1) if not self.is_mark(s)][:max_chunks]
        chunks = [p.ProcessOutputChunk(s, "stdout", b"%d" % s) for s in seqs]
        next_seq = seqs[-1] + 1 if seqs else self.produced + 1
        exit_seq, close_seq = self.seq_of("exit"), self.seq_of("close")
        response = p.ReadResponse(chunks, next_seq, exit_seq <= self.produced, None)
        if exit_seq <= self.produced:
            response.exit_code = 7
            response.exited_seq = exit_seq
        if close_seq <= self.produced:
            response.closed = True
            response.closed_seq = close_seq
        if gap is not None:
            response.gap = gap
        return response


def _accept_live(handle: _Recorder, kind: str, seq: int) -> None:
    if kind == "out":
        handle.accept_output(OutputEvent("p", "stdout", b"%d" % seq, seq))
    elif kind == "exit":
        handle.accept_exit(seq, 7, None, None)
    else:
        handle.accept_close(seq)


@st.composite
def resume_scenarios(draw: st.DrawFn) -> tuple[list[str], int, int, int, int, list[str]]:
    outputs = draw(st.integers(0, 12))
    exit_after = draw(st.integers(0, outputs))
    kinds = ["out"] * exit_after + ["exit"] + ["out"] * (outputs - exit_after) + ["close"]
    total = len(kinds)
    delivered = draw(st.integers(0, total))  # arrived live before the drop
    attached = draw(st.integers(delivered, total))  # produced when the new connection attaches
    first = draw(st.integers(1, attached + 1))  # output below it was evicted meanwhile
    # (The exit is never among the evicted seqs here: a gap around it is
    # reported after the exit, by the gap's last seq.)
    assume(all(kinds[s - 1] == "out" for s in range(delivered + 1, first)))
    per_read = draw(st.integers(1, 4))
    steps = draw(st.lists(st.sampled_from(["produce", "respond", "deliver"]), max_size=60))
    return kinds, delivered, attached, first, per_read, steps


@given(resume_scenarios())
def test_resume_replay_delivers_exactly_the_model_sequence(
    scenario: tuple[list[str], int, int, int, int, list[str]],
) -> None:
    kinds, delivered, attached, first, per_read, steps = scenario
    total = len(kinds)
    handle = _Recorder()
    for seq in range(1, delivered + 1):
        _accept_live(handle, kinds[seq - 1], seq)
    # The drop: live events wait from now on; the new connection's first
    # request is a read from the last seq delivered.
    handle.begin_catch_up()
    server = _Server(kinds, first, attached)
    channel: list[tuple[str, Any]] = []  # one connection: FIFO
    requested: int | None = handle.last_seq
    catching_up = True

    def step(kind: str) -> None:
        nonlocal requested, catching_up
        if kind == "produce" and server.produced < total:
            server.produced += 1
            channel.append(("live", server.produced))
        elif kind == "respond" and requested is not None:
            channel.append(("read", server.read(requested, per_read)))
            requested = None
        elif kind == "deliver" and channel:
            what, value = channel.pop(0)
            if what == "live":
                _accept_live(handle, kinds[value - 1], value)
            elif handle.catch_up(value):
                requested = handle.last_seq
            else:
                handle.end_catch_up()
                catching_up = False

    for kind in steps:
        step(kind)
    for _ in range(10 * total + 100):  # drain: everything produced and delivered
        if not (server.produced < total or channel or requested is not None or catching_up):
            break
        step("respond" if requested is not None else "produce")
        step("deliver")
    assert not catching_up and not channel

    expected: list[tuple[Any, ...]] = []
    for seq in range(1, total + 1):
        kind = kinds[seq - 1]
        if delivered < seq < first:
            if seq == first - 1:
                expected.append(("gap", delivered + 1, first - 1))
            continue
        if kind == "out":
            expected.append(("out", seq, b"%d" % seq))
        elif kind == "exit":
            expected.append(("exit", 7))
        else:
            expected.append(("close",))
    assert handle.delivered == expected
    assert handle.last_seq == total


def test_decoded_chunks_of_a_read_reach_the_handle_as_bytes() -> None:
    raw = msgspec.json.encode(
        p.ReadResponse([p.ProcessOutputChunk(1, "stderr", b"\x00\xff")], 2, False, None)
    )
    handle = _Recorder()
    handle.begin_catch_up()
    assert handle.catch_up(msgspec.json.decode(raw, type=p.ReadResponse))
    assert handle.delivered == [("out", 1, b"\x00\xff")]


# --- the asyncio client's bounded output stream -----------------------------------------------


@given(
    st.lists(st.one_of(st.integers(1, 3000), st.just(0)), max_size=60),
    st.integers(1, 8000),
)
def test_aio_output_stream_is_bounded_ordered_and_reports_where_to_read_from(
    steps: list[int], limit: int
) -> None:
    """Pushes (a size) and pulls (0) in any order: the buffer never exceeds
    ``limit`` (but for a single larger chunk), events come out in order, and
    after a lag the delivered events end exactly at ``OutputLagged.after_seq``."""

    async def scenario() -> None:
        stream = OutputStream("p", limit, lambda _: None)
        seq = 0
        delivered: list[int] = []
        lagged: OutputLagged | None = None
        for size in [*steps, *([0] * len(steps))]:
            if size:
                seq += 1
                stream.push(OutputEvent("p", "stdout", b"x" * size, seq))
                # Over the limit only with a single chunk larger than it.
                assert stream.buffered_bytes <= limit or len(stream._queue) == 1
            elif lagged is None:
                if stream.buffered_bytes == 0 and stream._error is None:
                    continue
                try:
                    event = await anext(stream)
                except OutputLagged as exc:
                    lagged = exc
                else:
                    assert event.seq is not None
                    delivered.append(event.seq)
        assert delivered == list(range(1, len(delivered) + 1)), "in order, none skipped"
        if lagged is not None:
            assert lagged.after_seq == (delivered[-1] if delivered else None)
        else:
            assert len(delivered) == seq

    asyncio.run(scenario())


# --- the bounded output queue (OutputQueue) of both clients ---------------------------------


def _drain(kind: str, queue: Any) -> list[object]:
    """Every outcome a reader gets: the events' seqs, then None (end) or the error."""
    got: list[object] = []
    if kind == "twisted":
        while True:
            outcome: list[object] = []
            reading = queue.next()
            reading.addErrback(lambda failure: failure.value)
            reading.addBoth(outcome.append)
            [item] = outcome
            got.append(item.seq if isinstance(item, OutputEvent) else item)
            if not isinstance(item, OutputEvent):
                return got

    async def read() -> None:
        try:
            async for event in queue:
                got.append(event.seq)
        except Exception as error:
            got.append(error)
        else:
            got.append(None)

    asyncio.run(read())
    return got


def _queue(kind: str, limit: int) -> Any:
    if kind == "twisted":
        return OutputSubscription("p", limit, lambda _: None)
    return OutputStream("p", limit, lambda _: None)


@pytest.mark.parametrize("kind", ["twisted", "aio"])
def test_one_event_larger_than_the_limit_is_queued_when_nothing_else_is(kind: str) -> None:
    queue = _queue(kind, limit=10)
    queue.push(OutputEvent("p", "stdout", b"x" * 25, 1))
    assert queue.buffered_bytes == 25
    queue.push(OutputEvent("p", "stdout", b"y", 2))  # now it is a lag
    queue.push(OutputEvent("p", "stdout", b"z", 3))  # ignored after it
    *seqs, lagged = _drain(kind, queue)
    assert seqs == [1]
    assert isinstance(lagged, OutputLagged) and lagged.after_seq == 1


@pytest.mark.parametrize("kind", ["twisted", "aio"])
def test_the_queue_ends_after_its_events_and_cancelling_ends_a_pending_read(kind: str) -> None:
    queue = _queue(kind, limit=10)
    queue.push(OutputEvent("p", "stdout", b"a", 1))
    queue.end()
    assert _drain(kind, queue) == [1, None]
    queue = _queue(kind, limit=10)
    if kind == "twisted":
        outcome: list[object] = []
        queue.next().addBoth(outcome.append)
        assert outcome == []
        queue.cancel()
        assert outcome == [None]
        return

    async def read_then_close() -> None:
        reading = asyncio.ensure_future(anext(queue))
        await asyncio.sleep(0)  # the read is waiting
        queue.close()
        with pytest.raises(StopAsyncIteration):
            await reading

    asyncio.run(read_then_close())
