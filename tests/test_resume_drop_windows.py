"""The windows in which a drop of a resumable session's connection could reach
the caller of a resuming client as a bare ``ConnectionClosed`` (issue 20's
CLI flake: ``exec-server-client run`` exited with "exec-server connection
closed: peer dropped the TCP connection ..." instead of resuming).

Each case drives one ordering deterministically: scripted servers
(:class:`tests.support.client_fakes.ScriptedServer`) on a fake clock, the drop
made where the case needs it, no sleeps.
"""

from __future__ import annotations

import base64
from typing import Any

import pytest
from twisted.internet.defer import Deferred

from execserver import protocol as p
from execserver.client import ExecServerClient, SessionLost
from execserver.client.process import RemoteProcess
from execserver.client.reconnect import ResumingClient
from execserver.client.types import OutputEvent
from tests.support.client_fakes import ScriptedServer

INIT = {
    "protocolVersion": "exec-server.v0",
    "sessionId": "s1",
    "sessionTtlMs": 30_000,
    "onDetachedFull": "pause",
    "retainedOutputBytes": 1 << 20,
}


#: What a server received after ``initialized`` in the same turn (not yet expected).
_early: dict[int, list[dict[str, Any]]] = {}


def expect(server: ScriptedServer, count: int) -> list[dict[str, Any]]:
    """The next ``count`` messages ``server`` received (and no more)."""
    messages = _early.pop(id(server), []) + server.received()
    assert len(messages) == count, messages
    return messages


def answer_handshake(server: ScriptedServer, result: dict[str, Any]) -> None:
    (init,) = expect(server, 1)
    assert init["method"] == "initialize"
    server.reply(init["id"], result)
    initialized, *early = server.received()
    assert initialized["method"] == "initialized"
    _early[id(server)] = early


def resumable(server: ScriptedServer, result: dict[str, Any] = INIT) -> ExecServerClient:
    d = server.connect()
    answer_handshake(server, result)
    clients: list[ExecServerClient] = []
    d.addCallback(clients.append)
    (client,) = clients
    return client


class Resuming:
    """A ResumingClient on a first scripted connection; each dial gets the
    next scripted server, whose handshake the test answers."""

    def __init__(self) -> None:
        self.first = ScriptedServer()
        self.servers: list[ScriptedServer] = []
        self.client = ResumingClient(self.first.clock, resumable(self.first), self._dial)

    def _dial(self, session_id: str) -> Deferred[ExecServerClient]:
        assert session_id == "s1"
        server = ScriptedServer()
        self.servers.append(server)
        return server.connect()

    def resumed(self, result: dict[str, Any] = INIT) -> ScriptedServer:
        """Answer the pending dial's handshake (the resume)."""
        server = self.servers[-1]
        answer_handshake(server, result)
        return server


def chunk(seq: int, data: bytes) -> dict[str, Any]:
    return {"seq": seq, "stream": "stdout", "chunk": base64.b64encode(data).decode()}


def read_answer(chunks: list[dict[str, Any]], next_seq: int, exit_code: int | None) -> Any:
    answer: dict[str, Any] = {
        "chunks": chunks,
        "nextSeq": next_seq,
        "exited": exit_code is not None,
        "exitCode": exit_code,
    }
    if exit_code is not None:
        answer.update({"exitedSeq": next_seq - 2, "closed": True, "closedSeq": next_seq - 1})
    return answer


def catch_up_read(server: ScriptedServer, after_seq: int) -> dict[str, Any]:
    (read,) = expect(server, 1)
    assert read["method"] == p.PROCESS_READ
    assert read["params"]["processId"] == "p1"
    assert read["params"]["afterSeq"] == after_seq
    return read


def finish_catch_up(server: ScriptedServer, after_seq: int = 0) -> None:
    """Answer the catch-up reads: the chunks after ``after_seq`` of "one two",
    then the exit (5) and the close."""
    chunks = [chunk(1, b"one "), chunk(2, b"two")][after_seq:]
    server.reply(catch_up_read(server, after_seq)["id"], read_answer(chunks, 3, None))
    server.reply(catch_up_read(server, 2)["id"], read_answer([], 5, 5))


def outcome(d: Deferred[Any]) -> list[Any]:
    got: list[Any] = []
    d.addBoth(got.append)
    return got


@pytest.mark.parametrize("server_got_it", [True, False])
def test_a_start_in_flight_at_the_drop_is_sent_again_on_the_resumed_session(
    server_got_it: bool,
) -> None:
    """Window 1: ``process/start`` sent, its answer lost with the connection.
    Before the fix the start failed with the drop's ConnectionClosed: the
    CLI's ``run`` printed "exec-server connection closed: ..." and exited 255."""
    r = Resuming()
    started = outcome(r.client.start_process(["child"], process_id="p1"))
    (start,) = expect(r.first, 1)
    assert start["method"] == p.PROCESS_START
    r.first.drop()
    assert started == [], started  # not failed: waiting for the resume
    second = r.resumed()
    (again,) = expect(second, 1)
    assert again["method"] == p.PROCESS_START
    assert again["params"] == start["params"]  # the same processId: sent once in effect
    if server_got_it:
        second.error(again["id"], -32600, "process p1 already exists")
    else:
        second.reply(again["id"], {"processId": "p1"})
    finish_catch_up(second)
    (handle,) = started
    assert isinstance(handle, RemoteProcess), handle
    seen: list[bytes] = []
    handle.add_output_listener(lambda event: seen.append(event.chunk))
    assert b"".join(seen) == b"one two"
    assert outcome(handle.exited()) == [5]
    # The handle's requests follow the session (not the dead first connection).
    assert handle._api is r.client


def test_a_start_dropped_twice_is_sent_again_on_each_resumed_connection() -> None:
    r = Resuming()
    started = outcome(r.client.start_process(["child"], process_id="p1"))
    expect(r.first, 1)
    r.first.drop()
    second = r.resumed()
    (again,) = expect(second, 1)
    assert again["method"] == p.PROCESS_START
    second.drop()  # the answer to the second sending is lost too
    assert started == [], started
    r.first.clock.advance(5)  # the resume's backoff
    third = r.resumed()
    (once_more,) = expect(third, 1)
    assert once_more["method"] == p.PROCESS_START
    third.error(once_more["id"], -32600, "process p1 already exists")
    finish_catch_up(third)
    (handle,) = started
    assert isinstance(handle, RemoteProcess), handle
    assert outcome(handle.exited()) == [5]


def test_a_start_refused_on_the_resumed_session_fails_with_the_servers_error() -> None:
    r = Resuming()
    started = outcome(r.client.start_process(["nope"], process_id="p1"))
    expect(r.first, 1)
    r.first.drop()
    second = r.resumed()
    (again,) = expect(second, 1)
    second.error(again["id"], -32600, "spawn failed", {"kind": "spawnNotFound"})
    (failure,) = started
    assert "spawn failed" in failure.getErrorMessage()
    assert expect(second, 0) == []  # no catch-up of a process that never ran
    assert r.client.client.tracked_process_count == 0


def test_a_start_in_flight_when_the_session_cannot_be_resumed_fails_with_session_lost() -> None:
    r = Resuming()
    started = outcome(r.client.start_process(["child"], process_id="p1"))
    expect(r.first, 1)
    r.first.drop()
    # The server answers the resume with another session: given up.
    r.resumed({**INIT, "sessionId": "s2"})
    (failure,) = started
    assert failure.check(SessionLost), failure


def test_output_of_a_start_whose_answer_was_lost_is_delivered_once() -> None:
    """Output that raced the lost answer (registered before the request) is
    not delivered twice by the catch-up of the start sent again."""
    r = Resuming()
    started = outcome(r.client.start_process(["child"], process_id="p1"))
    expect(r.first, 1)
    r.first.notify(p.PROCESS_OUTPUT, {**chunk(1, b"one "), "processId": "p1"})
    r.first.drop()
    second = r.resumed()
    (again,) = expect(second, 1)
    second.error(again["id"], -32600, "process p1 already exists")
    finish_catch_up(second, 1)
    (handle,) = started
    seen: list[OutputEvent] = []
    handle.add_output_listener(seen.append)
    assert [(e.seq, e.chunk) for e in seen] == [(1, b"one "), (2, b"two")]


def started_process(r: Resuming) -> RemoteProcess:
    """p1, started on the first connection (and still running)."""
    started = outcome(r.client.start_process(["child"], process_id="p1"))
    (start,) = expect(r.first, 1)
    r.first.reply(start["id"], {"processId": "p1"})
    (handle,) = started
    assert isinstance(handle, RemoteProcess), handle
    return handle


def test_a_call_waiting_for_the_resume_is_not_handed_a_connection_that_dropped_again() -> None:
    """Window 2: a call made while the session is suspended waits for the
    resume; the resumed connection drops during its catch-up. Before the fix
    the waiting call was handed that dead connection, so a terminate that was
    never sent failed with OutcomeUnknown ("may or may not have been carried
    out") instead of going out on the next connection."""
    r = Resuming()
    handle = started_process(r)
    r.first.drop()
    terminated = outcome(handle.terminate())
    second = r.resumed()
    catch_up_read(second, 0)
    second.drop()  # before the catch-up read is answered
    assert terminated == [], terminated
    third = r.resumed()
    finish_catch_up(third)
    (terminate,) = expect(third, 1)
    assert terminate["method"] == p.PROCESS_TERMINATE
    third.reply(terminate["id"], {"running": False})
    assert len(terminated) == 1 and not isinstance(terminated[0], Exception), terminated


class _Proc:
    """What the CLI's stdin forwarder uses of a handle: closeStdin answers scripted."""

    def __init__(self, answers: list[Deferred[Any]]) -> None:
        self.answers = answers
        self.closes = 0
        self.has_exited = False

    def close_stdin(self) -> Deferred[Any]:
        self.closes += 1
        return self.answers.pop(0)


class _Client:
    def supports(self, method: str) -> bool:
        return True


@pytest.mark.parametrize("tty", [False, True])
def test_the_cli_sends_the_end_of_input_again_when_a_drop_made_its_outcome_unknown(
    tty: bool,
) -> None:
    """Window 3 (``run -i``): the ``process/closeStdin`` at the end of the
    input was in flight at a drop, so the resuming client failed it with
    OutcomeUnknown. Before the fix the CLI ignored that: the command never
    saw the end of its input and the run hung. A pipe's close is sent again
    (closing twice changes nothing); a PTY's is not (each is one more ^D)."""
    from execserver.client.cli.run import _StdinForwarder
    from execserver.client.errors import OutcomeUnknown

    lost: Deferred[Any] = Deferred()
    proc = _Proc([lost, Deferred()])
    forwarder = _StdinForwarder(None, proc, _Client(), tty)  # type: ignore[arg-type]
    forwarder._end_of_input()
    assert proc.closes == 1
    lost.errback(OutcomeUnknown(p.PROCESS_CLOSE_STDIN, "peer dropped the TCP connection"))
    assert proc.closes == (1 if tty else 2)


def test_a_start_sent_again_whose_catch_up_is_cut_waits_for_the_next_resume() -> None:
    """A start in flight at a drop is sent again ("already exists") and the
    connection drops again during its catch-up read. The handle must wait
    for the next resume (and be caught up there), not end as if the session
    were gone: the Twisted Deferred of the cut read resumes the start before
    the connection's own lost listener has judged the drop. Before the fix
    the handle exited without a code and the CLI's ``run`` said "connection
    lost while ... was running" (exit 255) with nothing printed: the flake
    of test_cli_run_over_websocket_survives_cuts_byte_exact."""
    r = Resuming()
    started = outcome(r.client.start_process(["child"], process_id="p1"))
    expect(r.first, 1)
    r.first.drop()
    second = r.resumed()
    (again,) = expect(second, 1)
    assert again["method"] == p.PROCESS_START
    second.error(again["id"], -32600, "process p1 already exists")
    catch_up_read(second, 0)
    second.drop()  # the catch-up read's answer is lost with the connection
    (handle,) = started
    assert isinstance(handle, RemoteProcess), handle
    assert not handle.has_exited, "ended by a drop of a session that is resumed"
    seen: list[bytes] = []
    handle.add_output_listener(lambda event: seen.append(event.chunk))
    r.first.clock.advance(5)  # the resume's backoff
    third = r.resumed()
    finish_catch_up(third)
    assert b"".join(seen) == b"one two"
    assert outcome(handle.exited()) == [5]
    assert outcome(handle.closed()) == [None]


def test_run_waits_for_the_close_through_a_resume_slower_than_its_bound() -> None:
    """A drop between ``process/exited`` and ``process/closed``, and a resume
    slower than the 2 s ``run`` gives the rest of the output after the exit
    (a loaded machine): ``run`` must wait for the resume's catch-up, which
    brings the output written after the exit (a descendant's) and the close.
    Before the fix ``run`` stopped waiting at 2 s and exited with the
    command's code, that output lost without a word."""
    from execserver.client.cli.run import CLOSED_AFTER_EXIT_SECONDS, rest_of_output

    r = Resuming()
    started = outcome(r.client.start_process(["child"], process_id="p1"))
    (start,) = expect(r.first, 1)
    r.first.reply(start["id"], {"processId": "p1"})
    (handle,) = started
    assert isinstance(handle, RemoteProcess), handle
    seen: list[bytes] = []
    handle.add_output_listener(lambda event: seen.append(event.chunk))
    r.first.send({"method": p.PROCESS_OUTPUT, "params": {"processId": "p1", **chunk(1, b"one ")}})
    r.first.send(
        {"method": p.PROCESS_EXITED, "params": {"processId": "p1", "exitCode": 5, "seq": 2}}
    )
    assert outcome(handle.exited()) == [5]
    done = outcome(Deferred.fromCoroutine(rest_of_output(handle, r.client, r.first.clock)))
    r.first.drop()  # process/closed (and the output after the exit) lost with it
    r.first.clock.advance(CLOSED_AFTER_EXIT_SECONDS + 1)  # the resume is slow
    assert done == [], "run gave up on the rest of the output during the resume"
    second = r.resumed()
    read = catch_up_read(second, 2)
    answer = read_answer([chunk(3, b"late")], 5, 5)
    answer.update({"exitedSeq": 2, "closedSeq": 4})
    second.reply(read["id"], answer)
    second.reply(catch_up_read(second, 4)["id"], {**answer, "chunks": []})
    assert done == [True]
    assert b"".join(seen) == b"one late"


def test_run_sends_the_terminate_of_a_gone_reader_again_after_a_drop() -> None:
    """``run``'s reader went away (EPIPE) and the terminate it sent was in
    flight at a drop (outcome unknown): it is sent again on the resumed
    session. Before the fix it was dropped, the command (``yes``) ran on
    with nobody reading and ``run`` waited for its exit forever."""
    from execserver.client.cli.run import terminate_through_drops

    r = Resuming()
    started = outcome(r.client.start_process(["yes"], process_id="p1"))
    (start,) = expect(r.first, 1)
    r.first.reply(start["id"], {"processId": "p1"})
    (handle,) = started
    assert isinstance(handle, RemoteProcess), handle
    terminate_through_drops(handle)
    (term,) = expect(r.first, 1)
    assert term["method"] == p.PROCESS_TERMINATE
    r.first.drop()  # the terminate's outcome is unknown
    second = r.resumed()
    read = catch_up_read(second, 0)
    second.reply(read["id"], read_answer([], 1, None))
    (again,) = expect(second, 1)
    assert again["method"] == p.PROCESS_TERMINATE
    assert again["params"]["processId"] == "p1"
    second.reply(again["id"], {"running": True})
    second.send(
        {"method": p.PROCESS_EXITED, "params": {"processId": "p1", "exitCode": 143, "seq": 1}}
    )
    assert outcome(handle.exited()) == [143]
    assert expect(second, 0) == []  # sent again once, not more
