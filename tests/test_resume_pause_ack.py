"""After a catch-up in "pause" mode, both clients acknowledge what it delivered.

A "pause" server stops reading a child whose unacknowledged output fills its
retention; a client acknowledges with a ``process/read`` whose ``afterSeq``
is its last seq. Live events that arrive on the new connection before a
catch-up read's answer are held back and delivered when the catch-up ends,
outside the live path that counts what needs acknowledging: the client must
acknowledge them then, or a server waiting for exactly them keeps the child
paused forever (seen as a stall of tests/test_aio_resume.py's pause test).

Scripted, no server: the connection drops, the session is resumed, live
output 1..3 arrives, then the catch-up read's answer carrying only seq 1.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import attrs
from twisted.internet import task

from execserver.aio.client import Client
from execserver.aio.rpc import AsyncRpc
from execserver.client.client import ExecServerClient
from execserver.client.process import RemoteProcess
from execserver.client.rpc import RpcClient
from execserver.clientcore.types import InitializeResult
from tests.support.aio_harness import RecordingChannel, RecordingSink

RESULT = InitializeResult(
    "exec-server.v0",
    session_id="S",
    session_ttl_ms=30_000,
    on_detached_full="pause",
    retained_output_bytes=3 * (4096 + 96),
)


def output(seq: int) -> bytes:
    params = {"processId": "proc-1", "stream": "stdout", "chunk": "eA==", "seq": seq}
    return json.dumps({"method": "process/output", "params": params}).encode()


def answer(request_id: int, result: Any) -> bytes:
    return json.dumps({"id": request_id, "result": result}).encode()


CATCH_UP_ANSWER = {
    "chunks": [{"seq": 1, "stream": "stdout", "chunk": "eA=="}],
    "nextSeq": 2,
    "exited": False,
    "exitCode": None,
}


def acknowledged(sent: list[dict[str, Any]], after_seq: int) -> bool:
    return any(
        m.get("method") == "process/read" and m["params"].get("afterSeq") == after_seq for m in sent
    )


# --- asyncio ------------------------------------------------------------------------------


@attrs.define
class _Dialer:
    """Hands out the second connection (already "initialized") on a resume."""

    rpc: AsyncRpc
    channel: RecordingChannel
    url: str = "ws://127.0.0.1:1"

    async def open(self, resume_session_id: str | None) -> tuple[AsyncRpc, RecordingChannel, Any]:
        assert resume_session_id == "S"
        return self.rpc, self.channel, RESULT


async def _aio_scenario() -> list[dict[str, Any]]:
    first, second = AsyncRpc(), AsyncRpc()
    first_channel, second_channel = RecordingChannel(), RecordingChannel()
    first.channel, second.channel = first_channel, second_channel
    dialer = _Dialer(second, second_channel)
    client = Client(
        dialer,  # type: ignore[arg-type]
        first,
        first_channel,  # type: ignore[arg-type]
        RESULT,
        request_timeout=None,
        resume=True,
    )
    starting = asyncio.ensure_future(client.start(["x"], cwd="/"))
    await asyncio.sleep(0)
    first.message_received(answer(first_channel.sent[0]["id"], {"processId": "proc-1"}))
    proc = await starting
    first.connection_lost("cut")
    for _ in range(10):
        await asyncio.sleep(0)
        if second_channel.sent:
            break
    [catch_up] = second_channel.sent
    assert (catch_up["method"], catch_up["params"]["afterSeq"]) == ("process/read", 0)
    for seq in (1, 2, 3):
        second.message_received(output(seq))
    second.message_received(answer(catch_up["id"], CATCH_UP_ANSWER))
    for _ in range(10):
        await asyncio.sleep(0)
    assert proc.last_seq == 3 and not proc.catching_up
    return second_channel.sent


def test_aio_acknowledges_the_events_a_catch_up_held_back() -> None:
    sent = asyncio.run(_aio_scenario())
    assert acknowledged(sent, 3), sent


# --- Twisted ------------------------------------------------------------------------------


def test_twisted_acknowledges_the_events_a_catch_up_held_back() -> None:
    clock = task.Clock()
    first, second = RpcClient(), RpcClient()
    first_sink, second_sink = RecordingSink(), RecordingSink()
    first.attach(first_sink)
    second.attach(second_sink)
    old = ExecServerClient(first, clock)
    old.initialize_result = RESULT
    handles: list[RemoteProcess] = []
    old.start_process(["x"], cwd="/").addCallback(handles.append)
    first.message_received(answer(first_sink.sent[0]["id"], {"processId": "proc-1"}))
    [proc] = handles
    first.connection_lost("cut")
    new = ExecServerClient(second, clock)
    new.initialize_result = RESULT
    new.adopt(old)
    [catch_up] = second_sink.sent
    assert (catch_up["method"], catch_up["params"]["afterSeq"]) == ("process/read", 0)
    for seq in (1, 2, 3):
        second.message_received(output(seq))
    second.message_received(answer(catch_up["id"], CATCH_UP_ANSWER))
    assert proc.last_seq == 3
    assert acknowledged(second_sink.sent, 3), second_sink.sent
