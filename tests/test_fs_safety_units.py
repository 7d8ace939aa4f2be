"""Units of the fs pool's bounds and the reply budget (issue 15, items 3, 4, 11).

- :class:`~execserver.fs.PoolRunner`: real threads, fake time. A
  queued request fails with ``busy`` after the wait timeout, is dropped when
  its connection closes, and the pool reports itself wedged (``/readyz``
  503 with the reason) once every thread has been busy longer than the
  stall threshold.
- :class:`~execserver.fs.ReplyBudget`: limits per connection and
  per server, the order of waiters, timeouts, cancellation, never-fits.
- The dispatcher charges an ``fs/readFile`` reply until the transport's
  unsent bytes show it has left, releases it at once when the connection
  closes (dropping what the closed transport still held) and drops a reply
  computed after the close.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from execserver import fs, metrics, writebuffer
from execserver.app import build_dispatcher, file_system
from execserver.config import ServerConfig
from execserver.dispatcher import SENT_POLL_SECONDS, Dispatcher
from execserver.errors import RpcError
from tests.support.fakes import FakeSpawner
from tests.support.harness import reactor, with_timeout

# --- the pool -------------------------------------------------------------------------


@pytest.fixture
def blocked_pool() -> Iterator[tuple[fs.PoolRunner, Clock, threading.Event]]:
    """Two threads, each busy until the event is set; time is a fake clock."""
    clock = Clock()
    runner = fs.PoolRunner(reactor, threads=2, wait_timeout=5.0, stall_after=3.0, clock=clock)
    release = threading.Event()
    try:
        yield runner, clock, release
    finally:
        release.set()
        runner.stop()


def _error_of(d: Deferred[Any]) -> RpcError:
    failures: list[Failure] = []
    d.addErrback(failures.append)
    assert failures, "expected the Deferred to have failed"
    error = failures[0].value
    assert isinstance(error, RpcError)
    return error


@pytest_twisted.ensureDeferred
async def test_a_wedged_pool_is_reported_and_queued_requests_time_out(
    blocked_pool: tuple[fs.PoolRunner, Clock, threading.Event],
) -> None:
    runner, clock, release = blocked_pool

    def block() -> str:
        assert release.wait(30)
        return "done"

    busy = [runner(block, owner="attacker") for _ in range(2)]
    mine = runner(lambda: "mine", owner="victim")
    theirs = runner(lambda: "theirs", owner="attacker")
    assert (runner.running, runner.queued) == (2, 2)
    assert runner.stall_reason() is None
    clock.advance(3.0)
    assert runner.stall_reason() is None  # "longer than", not "as long as"
    clock.advance(0.5)
    assert runner.stall_reason() == (
        "filesystem pool wedged: all 2 worker threads have been busy on one "
        "operation each for over 3 s; 2 request(s) waiting"
    )
    # The attacker disconnects: its queued request is dropped at once.
    runner.cancel_owner("attacker")
    assert _error_of(theirs).data == {"kind": "cancelled"}
    assert runner.queued == 1
    # The victim's waits at most the wait timeout, then gets a precise error.
    clock.advance(1.5)
    error = _error_of(mine)
    assert (error.code, error.data) == (-32600, {"kind": "busy"})
    assert error.message == (
        "filesystem busy: no worker thread became free within 5000 ms "
        "(all 2 are busy; --fs-wait-timeout-ms); retry later"
    )
    assert runner.queued == 0
    release.set()
    assert [await with_timeout(d, 10, "the blocked jobs") for d in busy] == ["done", "done"]
    assert (runner.running, runner.stall_reason()) == (0, None)


@pytest_twisted.ensureDeferred
async def test_queued_jobs_start_as_threads_free_up(
    blocked_pool: tuple[fs.PoolRunner, Clock, threading.Event],
) -> None:
    runner, clock, release = blocked_pool
    first = runner(lambda: release.wait(30))
    second = runner(lambda: release.wait(30))
    third = runner(lambda: "third")
    assert runner.queued == 1
    release.set()
    assert await with_timeout(third, 10, "the queued job") == "third"
    assert await with_timeout(first, 10, "first") and await with_timeout(second, 10, "second")
    clock.advance(60)  # its timeout was cancelled when it started
    assert (runner.running, runner.queued) == (0, 0)


@pytest_twisted.ensureDeferred
async def test_readyz_is_503_with_the_reason_while_the_pool_is_wedged(
    blocked_pool: tuple[fs.PoolRunner, Clock, threading.Event],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.support.ws_wire import http, make_factory

    runner, clock, release = blocked_pool
    factory = make_factory(clock)
    file_system(factory.dispatcher).pool = runner
    busy = [runner(lambda: release.wait(30)) for _ in range(2)]
    response, _ = http(factory, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert response.startswith(b"HTTP/1.1 200 OK\r\n")
    clock.advance(4)
    response, _ = http(factory, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert body.decode() == f"{runner.stall_reason()}\n"
    assert body.startswith(b"filesystem pool wedged: all 2 worker threads")
    text = metrics.render(factory.dispatcher).decode()
    assert "exec_server_fs_operations_running 2\n" in text
    assert "exec_server_fs_operations_queued 0\n" in text
    release.set()
    for d in busy:
        await with_timeout(d, 10, "the blocked jobs")
    response, _ = http(factory, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert response.startswith(b"HTTP/1.1 200 OK\r\n")


# --- the reply budget ------------------------------------------------------------------


def _budget(clock: Clock) -> fs.ReplyBudget:
    return fs.ReplyBudget(clock, limit=100, connection_limit=60, wait_timeout=5.0)


def _granted(d: Deferred[fs.Charge]) -> fs.Charge:
    got: list[fs.Charge] = []
    d.addCallback(got.append)
    assert got, "expected the reservation to be granted"
    return got[0]


def test_budget_limits_per_connection_and_per_server() -> None:
    clock = Clock()
    budget = _budget(clock)
    a1 = _granted(budget.reserve("a", 50))
    a2 = budget.reserve("a", 20)  # 70 > 60 for connection a: waits
    assert not a2.called
    b1 = _granted(budget.reserve("b", 40))  # other connections are not held back by a
    assert (budget.used, budget.owned("a"), budget.owned("b"), budget.waiting) == (90, 50, 40, 1)
    c1 = budget.reserve("c", 30)  # 120 > 100 server-wide: waits...
    b2 = budget.reserve("b", 5)  # ...and so does everything after it (first come, first served)
    assert not c1.called and not b2.called
    a1.release()
    assert a2.called and c1.called and b2.called
    assert (budget.used, budget.waiting) == (95, 0)
    for charge in (_granted(a2), b1, _granted(c1), _granted(b2)):
        charge.release()
        charge.release()  # idempotent
    assert (budget.used, budget.owned("a"), budget.waiting) == (0, 0, 0)


def test_budget_resize_true_up_and_release_serves_waiters() -> None:
    budget = _budget(Clock())
    charge = _granted(budget.reserve("a", 10))
    charge.resize(55)  # a file grew while read: charged what it took
    assert budget.used == 55
    waiting = budget.reserve("a", 10)
    assert not waiting.called
    charge.resize(30)
    assert waiting.called and budget.used == 40


def test_a_reply_that_can_never_fit_fails_at_once() -> None:
    budget = _budget(Clock())
    with pytest.raises(RpcError) as info:
        budget.reserve("a", 61)
    assert (info.value.code, info.value.data) == (-32600, {"kind": "replyTooLarge"})
    assert info.value.message == (
        "fs/readFile reply of 61 bytes exceeds the reply budget of 60 bytes "
        "(--connection-reply-budget-bytes)"
    )
    small_server = fs.ReplyBudget(Clock(), limit=50, connection_limit=60, wait_timeout=5.0)
    with pytest.raises(RpcError) as info:
        small_server.reserve("a", 51)
    assert info.value.message.endswith("of 50 bytes (--reply-budget-bytes)")


def test_budget_waits_time_out_and_are_cancelled_with_their_connection() -> None:
    clock = Clock()
    budget = _budget(clock)
    held = _granted(budget.reserve("a", 60))
    timed = budget.reserve("a", 10)
    clock.advance(1)
    gone = budget.reserve("a", 10)
    clock.advance(4)
    error = _error_of(timed)
    assert (error.code, error.data) == (-32600, {"kind": "busy"})
    assert error.message == (
        "fs/readFile could not get 10 bytes of reply budget within 5000 ms "
        "(--fs-wait-timeout-ms): replies being built or not yet sent hold 60 of 100 "
        "bytes on this server and 60 of 60 on this connection; retry later"
    )
    budget.cancel_owner("a")
    assert _error_of(gone).data == {"kind": "cancelled"}
    assert budget.waiting == 0
    clock.advance(10)  # no timer left behind
    held.release()
    assert budget.used == 0


def test_a_closed_connection_gets_none_of_its_waits_granted() -> None:
    # Dropping the first wait of a closed connection must not let its next
    # one fit in the room that made and be granted before it is dropped too.
    budget = _budget(Clock())
    held = _granted(budget.reserve("a", 40))
    large = budget.reserve("a", 30)  # 70 > 60 for connection a: waits
    small = budget.reserve("a", 10)  # behind it: waits
    budget.cancel_owner("a")
    assert _error_of(large).data == {"kind": "cancelled"}
    assert _error_of(small).data == {"kind": "cancelled"}
    assert (budget.used, budget.owned("a"), budget.waiting) == (40, 40, 0)
    held.release()
    assert budget.used == 0


class _QueueModel:
    """The reply budget's rule, written as plainly as possible: first come,
    first served, a wait held back by its connection holding back only that
    connection's later ones, one held back server-wide holding back all."""

    def __init__(self, limit: int, connection_limit: int) -> None:
        self.limit, self.connection_limit = limit, connection_limit
        self.used = 0
        self.owned: dict[str, int] = {}
        self.queue: list[tuple[int, str, int]] = []

    def serve(self) -> list[int]:
        granted, held = [], set()
        for entry in list(self.queue):
            ident, owner, size = entry
            if owner in held:
                continue
            if self.owned.get(owner, 0) + size > self.connection_limit:
                held.add(owner)
                continue
            if self.used + size > self.limit:
                break
            self.queue.remove(entry)
            self.used += size
            self.owned[owner] = self.owned.get(owner, 0) + size
            granted.append(ident)
        return granted


@settings(max_examples=300)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["reserve", "release", "close"]),
            st.sampled_from("abc"),
            st.integers(1, 60),
        ),
        max_size=80,
    )
)
def test_the_reply_budget_grants_what_the_plain_rule_grants(
    ops: list[tuple[str, str, int]],
) -> None:
    budget = _budget(Clock())
    model = _QueueModel(budget.limit, budget.connection_limit)
    events: list[int] = []
    charges: list[tuple[int, str, fs.Charge]] = []
    expected: list[int] = []

    def granted(charge: fs.Charge, ident: int, owner: str) -> None:
        events.append(ident)
        charges.append((ident, owner, charge))

    for ident, (op, owner, size) in enumerate(ops):
        if op == "reserve":
            d = budget.reserve(owner, size)
            d.addCallbacks(granted, lambda _: None, callbackArgs=(ident, owner))
            model.queue.append((ident, owner, size))
            expected += model.serve()
        elif op == "release" and charges:
            _, held_by, charge = charges.pop(size % len(charges))
            model.used -= charge.size
            model.owned[held_by] -= charge.size
            charge.release()
            expected += model.serve()
        elif op == "close":
            budget.cancel_owner(owner)
            model.queue = [entry for entry in model.queue if entry[1] != owner]
            expected += model.serve()
        assert events == expected
        assert (budget.used, budget.waiting) == (model.used, len(model.queue))


# --- the dispatcher's accounting ---------------------------------------------------------


class Buffer:
    """Stands for a Twisted FileDescriptor: unsent bytes as the transports count them."""

    def __init__(self) -> None:
        self.dataBuffer = b""
        self.offset = 0
        self._tempDataBuffer: list[bytes] = []
        self._tempDataLen = 0
        self.connected = 1

    def send(self, count: int) -> None:
        self._tempDataLen -= count


class SlowOutbound:
    """An outbound whose transport keeps everything unsent until told otherwise."""

    def __init__(self) -> None:
        self.transport = Buffer()
        self.raw: list[bytes] = []

    def write_message(self, data: bytes) -> None:
        self.raw.append(data)
        self.transport._tempDataBuffer.append(data)
        self.transport._tempDataLen += len(data) + 1

    def close_connection(self) -> None:
        pass

    def unsent_bytes(self) -> int:
        return writebuffer.unsent_bytes(self.transport)

    def discard_unsent(self) -> None:
        writebuffer.discard_unsent(self.transport)

    def responses(self) -> dict[Any, dict[str, Any]]:
        return {m["id"]: m for m in map(json.loads, self.raw) if "id" in m}


def _connect(
    clock: Clock, **config: Any
) -> tuple[Dispatcher, SlowOutbound, Any]:  # Any: the dispatcher's Connection
    dispatcher = build_dispatcher(ServerConfig(**config), clock, FakeSpawner())
    outbound = SlowOutbound()
    conn = dispatcher.connect(outbound, "slow")
    conn.message_received(b'{"id":0,"method":"initialize","params":{"clientName":"t"}}')
    conn.message_received(b'{"method":"initialized","params":{}}')
    return dispatcher, outbound, conn


def _read_request(conn: Any, request_id: int, path: Path) -> None:
    message = {"id": request_id, "method": "fs/readFile", "params": {"path": str(path)}}
    conn.message_received(json.dumps(message).encode())


def test_a_reply_is_charged_until_the_transport_has_sent_it(tmp_path: Path) -> None:
    clock = Clock()
    size = 300_000
    (tmp_path / "f").write_bytes(b"x" * size)
    reply = fs.encoded_result_size(size)
    dispatcher, outbound, conn = _connect(clock)
    budget = file_system(dispatcher).budget
    _read_request(conn, 1, tmp_path / "f")
    assert base64.b64decode(outbound.responses()[1]["result"]["dataBase64"]) == b"x" * size
    assert budget.used == reply
    _read_request(conn, 2, tmp_path / "f")
    _read_request(conn, 3, tmp_path / "f")
    assert budget.used == 3 * reply
    assert len(clock.getDelayedCalls()) == 1  # one check timer per connection, not per reply
    outbound.transport.send(reply // 2)
    clock.advance(SENT_POLL_SECONDS)
    assert budget.used == 3 * reply
    outbound.transport.send(reply)
    clock.advance(SENT_POLL_SECONDS)
    assert budget.used == 2 * reply
    assert len(clock.getDelayedCalls()) == 1
    text = metrics.render(dispatcher).decode()
    assert f"exec_server_reply_bytes_queued {2 * reply}\n" in text
    outbound.transport.send(outbound.transport._tempDataLen)
    clock.advance(SENT_POLL_SECONDS)
    assert budget.used == 0
    assert "exec_server_reply_bytes_queued 0\n" in metrics.render(dispatcher).decode()
    assert clock.getDelayedCalls() == []


def test_a_small_file_is_read_at_once_and_charged_what_its_reply_took(tmp_path: Path) -> None:
    clock = Clock()
    (tmp_path / "small").write_bytes(b"s" * 1000)
    (tmp_path / "big").write_bytes(b"b" * 300_000)
    big = fs.encoded_result_size(300_000)
    dispatcher, outbound, conn = _connect(clock, connection_reply_budget_bytes=big)
    budget = file_system(dispatcher).budget
    _read_request(conn, 1, tmp_path / "small")
    assert budget.used == fs.encoded_result_size(1000)
    # A small read beyond the budget waits like any other.
    _read_request(conn, 2, tmp_path / "big")
    _read_request(conn, 3, tmp_path / "small")
    assert sorted(outbound.responses()) == [0, 1]
    assert budget.waiting == 2
    outbound.transport.send(outbound.transport._tempDataLen)
    clock.advance(SENT_POLL_SECONDS)
    assert sorted(outbound.responses()) == [0, 1, 2]
    outbound.transport.send(outbound.transport._tempDataLen)
    clock.advance(SENT_POLL_SECONDS)
    assert sorted(outbound.responses()) == [0, 1, 2, 3]
    assert base64.b64decode(outbound.responses()[3]["result"]["dataBase64"]) == b"s" * 1000


def test_requests_beyond_the_connection_budget_wait_for_it(tmp_path: Path) -> None:
    clock = Clock()
    size = 300_000
    (tmp_path / "f").write_bytes(b"y" * size)
    reply = fs.encoded_result_size(size)
    dispatcher, outbound, conn = _connect(clock, connection_reply_budget_bytes=reply * 2)
    for request_id in (1, 2, 3):
        _read_request(conn, request_id, tmp_path / "f")
    assert sorted(outbound.responses()) == [0, 1, 2]  # the third waits, holding nothing
    assert file_system(dispatcher).budget.waiting == 1
    outbound.transport.send(outbound.transport._tempDataLen)
    clock.advance(SENT_POLL_SECONDS)
    assert sorted(outbound.responses()) == [0, 1, 2, 3]
    assert file_system(dispatcher).budget.used == reply


def test_closing_releases_the_budget_and_drops_what_the_transport_held(tmp_path: Path) -> None:
    clock = Clock()
    (tmp_path / "f").write_bytes(b"z" * 200_000)
    dispatcher, outbound, conn = _connect(clock)
    budget = file_system(dispatcher).budget
    _read_request(conn, 1, tmp_path / "f")
    assert budget.used > 0
    transport = outbound.transport
    transport.connected = 0  # as Twisted leaves it when the connection is lost
    conn.transport_closed()
    assert budget.used == 0
    assert (transport._tempDataBuffer, transport._tempDataLen, transport.dataBuffer) == ([], 0, b"")
    clock.advance(1)


def test_a_reply_computed_after_the_close_is_dropped(tmp_path: Path) -> None:
    clock = Clock()
    (tmp_path / "f").write_bytes(b"w" * 200_000)
    dispatcher, outbound, conn = _connect(clock)
    pending: list[tuple[Deferred[Any], Any, tuple[Any, ...]]] = []

    def manual(func: Any, *args: Any, owner: object = None) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        pending.append((d, func, args))
        return d

    file_system(dispatcher).run = manual
    _read_request(conn, 1, tmp_path / "f")
    d, func, args = pending.pop()
    d.callback(func(*args))  # sized: the reply's bytes are reserved
    assert file_system(dispatcher).budget.used == fs.encoded_result_size(200_000)
    d, func, args = pending.pop()  # now being built
    outbound.transport.connected = 0
    conn.transport_closed()
    assert file_system(dispatcher).budget.used > 0  # still being built: still charged
    d.callback(func(*args))
    assert file_system(dispatcher).budget.used == 0
    assert sorted(outbound.responses()) == [0]
