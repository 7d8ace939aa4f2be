"""The client's channels on their own: the local server's stdout pipe.

The spawned server's stdout is a pipe of the client's own, read through the
reactor's public ``addReader`` (``channels/process.py``); Twisted does not
know it, so the channel itself must hold the server's end back until that
pipe is drained, or output written just before the server exits is lost.
"""

from __future__ import annotations

import base64
import json
import sys
from typing import Any

import pytest_twisted
from twisted.internet.error import ProcessDone
from twisted.python.failure import Failure

from execserver.client import ConnectOptions, ExecServerClient, OutputEvent, RpcClient
from execserver.client.channels import ServerProcessProtocol
from tests.support.client_fakes import wait
from tests.support.harness import reactor


class _ProcessTransport:
    pid = 4242

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def writeSequence(self, data: list[bytes]) -> None:
        self.written.extend(data)


def _output(seq: int, data: bytes) -> bytes:
    params = {
        "processId": "p",
        "stream": "stdout",
        "chunk": base64.b64encode(data).decode(),
        "seq": seq,
    }
    return json.dumps({"method": "process/output", "params": params}).encode() + b"\n"


def test_the_end_is_reported_after_stdout_is_drained_not_at_exit() -> None:
    rpc = RpcClient(label="test")
    received: list[bytes] = []
    rpc.on_notification = lambda method, raw: received.append(bytes(raw or b""))
    proto = ServerProcessProtocol(rpc)
    proto.stdout_opened()
    proto.makeConnection(_ProcessTransport())
    burst = _output(1, b"a" * 1000) + _output(2, b"b" * 1000)
    proto.childDataReceived(1, burst[:700])
    # Reaped while the rest of its output is still in the pipe.
    proto.processEnded(Failure(ProcessDone(0)))
    assert not rpc.is_closed
    assert not proto.ended
    proto.childDataReceived(1, burst[700:])
    proto.stdout_closed()
    assert len(received) == 2
    assert rpc.closed_reason == "exec-server closed its stdout"
    assert proto.ended
    assert proto.exit_code == 0
    assert proto.when_ended().called


# Answers initialize, waits for initialized, floods output, exits at once.
_FLOODING_SERVER = r"""
import base64, json, os, sys
out = sys.stdout.buffer
request = json.loads(sys.stdin.readline())
result = {"protocolVersion": "exec-server.v0"}
out.write(json.dumps({"id": request["id"], "result": result}).encode() + b"\n")
out.flush()
sys.stdin.readline()
chunk = base64.b64encode(bytes(range(256)) * 1024).decode()
for seq in range(1, int(sys.argv[1]) + 1):
    params = {"processId": "p", "stream": "stdout", "chunk": chunk, "seq": seq}
    out.write(json.dumps({"method": "process/output", "params": params}).encode() + b"\n")
out.flush()
os._exit(0)
"""


@pytest_twisted.ensureDeferred
async def test_a_local_servers_last_output_before_it_exits_arrives_in_full() -> None:
    chunks = 48  # 12 MiB of payload through the 1 MiB pipe
    client: ExecServerClient = await wait(
        ExecServerClient.spawn_local(
            reactor,
            ConnectOptions("test-client", initialize_timeout=5.0),
            command=[sys.executable, "-c", _FLOODING_SERVER, str(chunks)],
            new_session=False,
        ),
        "the flooding server's handshake",
    )
    seqs: list[int] = []
    size = 0

    def count(event: Any) -> None:
        nonlocal size
        if isinstance(event, OutputEvent):
            assert event.seq is not None
            seqs.append(event.seq)
            size += len(event.chunk)

    client.add_event_listener(count)
    reason = await wait(client.when_disconnected(), "the server to exit")
    assert reason == "exec-server closed its stdout"
    assert seqs == list(range(1, chunks + 1))
    assert size == chunks * 256 * 1024
    await wait(client.close(), "close")
    assert client.local_server.ended
    assert client.local_server.exit_code == 0
