"""The real server over real WebSockets on 127.0.0.1 (issue 3).

Bounds stated by these tests: a client that disconnects, is killed, or
aborts TCP has its processes gone within ``REAP_BOUND`` seconds (the server
sends SIGTERM to the group at once; SIGKILL follows after
``--terminate-grace-ms``). A peer that stops answering pings is dropped after
``--ping-interval-ms`` + ``--ping-timeout-ms``.
"""

from __future__ import annotations

import base64
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from tests.support.bounds import REPLY_BACKLOG_RSS_GROWTH, STALL_RSS_GROWTH, MiB
from tests.support.harness import (
    DEFAULT_TIMEOUT,
    descendants,
    observe,
    peak_rss_bytes,
    pid_alive,
    reactor,
    reset_peak_rss,
    rss_bytes,
    with_timeout,
)
from tests.support.polling import until
from tests.support.ws_harness import (
    WsClientProtocol,
    WsServerProcess,
    connect,
    get_request,
    http_get,
)

#: Seconds within which a dead client's processes must be gone.
REAP_BOUND = 5.0

PING_INTERVAL_MS = 300
PING_TIMEOUT_MS = 3000

ECHO_SCRIPT = "printf 'ready\\n'; while IFS= read -r line; do printf 'echo:%s\\n' \"$line\"; done"


def children_of(server: WsServerProcess) -> list[int]:
    assert server.pid is not None
    return descendants(server.pid)


# --- the reference's websocket tests, ported ------------------------------------------


@pytest_twisted.ensureDeferred
async def test_exec_server_client_connects_over_websocket() -> None:
    server = await WsServerProcess.start()
    try:
        assert server.url.startswith("ws://127.0.0.1:")
        assert not server.url.endswith(":0")
        client = await connect(server.url)
        init = await client.handshake()
        assert init["protocolVersion"] == "exec-server.v0"
        started = await client.start_process("proc-1", ["bash", "-lc", ECHO_SCRIPT], tty=True)
        assert started == {"processId": "proc-1"}
        await client.wait_output_contains("proc-1", b"ready")
        assert {n["params"]["stream"] for n in client.notifications if "chunk" in n["params"]} == {
            "pty"
        }
        await client.call(
            "process/write",
            {"processId": "proc-1", "chunk": base64.b64encode(b"hello\n").decode()},
        )
        await client.wait_output_contains("proc-1", b"echo:hello")
        await client.call("process/terminate", {"processId": "proc-1"})
        await client.close()
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_websocket_disconnect_terminates_processes_for_that_connection(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "disconnected"
    server = await WsServerProcess.start()
    try:
        client = await connect(server.url)
        await client.handshake()
        await client.start_process(
            "proc-1", ["bash", "-lc", f"sleep 2; printf disconnected > {marker}"]
        )
        await until(
            lambda: len(children_of(server)) >= 2, "bash and sleep", timeout=DEFAULT_TIMEOUT
        )
        tree = children_of(server)
        await client.close()
        took = await until(
            lambda: not any(pid_alive(p) for p in tree),
            "the process tree to go",
            timeout=REAP_BOUND,
        )
        assert took < REAP_BOUND
        # The tree is gone, so the marker can never be written.
        assert not marker.exists()
    finally:
        assert await server.stop() == 0


# --- concurrency: sessions are per connection -------------------------------------------


async def _run_tagged(url: str, tag: str, process_ids: list[str]) -> WsClientProtocol:
    client = await connect(url)
    await client.handshake()
    for pid in process_ids:
        await client.start_process(
            pid, ["sh", "-c", f"for i in 1 2 3 4 5; do echo {tag}-{pid}; done"]
        )
    for pid in process_ids:
        await client.wait_notification("process/closed", pid, timeout=30)
    return client


def _assert_own_output(client: WsClientProtocol, tag: str, process_ids: list[str]) -> None:
    for pid in process_ids:
        assert client.output_of(pid) == f"{tag}-{pid}\n".encode() * 5
    for note in client.notifications:
        assert note["params"]["processId"] in process_ids


@pytest_twisted.ensureDeferred
async def test_two_clients_use_the_same_process_ids() -> None:
    server = await WsServerProcess.start()
    try:
        ids = ["proc-1", "proc-2"]
        a, b = await DeferredList(
            [
                Deferred.fromCoroutine(_run_tagged(server.url, "alpha", ids)),
                Deferred.fromCoroutine(_run_tagged(server.url, "beta", ids)),
            ],
            fireOnOneErrback=True,
            consumeErrors=True,
        )
        _assert_own_output(a[1], "alpha", ids)
        _assert_own_output(b[1], "beta", ids)
        # Each connection has its own session id.
        sessions = {
            m["result"]["sessionId"]
            for c in (a[1], b[1])
            for m in c.messages
            if "result" in m and "sessionId" in m["result"]
        }
        assert len(sessions) == 2
        await a[1].close()
        await b[1].close()
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_fifty_concurrent_clients_never_see_each_others_output() -> None:
    server = await WsServerProcess.start()
    try:
        ids = ["proc-1", "proc-2"]
        results = await with_timeout(
            DeferredList(
                [
                    Deferred.fromCoroutine(_run_tagged(server.url, f"client{n}", ids))
                    for n in range(50)
                ],
                fireOnOneErrback=True,
                consumeErrors=True,
            ),
            60,
            "fifty clients",
        )
        clients = [client for _, client in results]
        for n, client in enumerate(clients):
            _assert_own_output(client, f"client{n}", ids)
        await DeferredList([Deferred.fromCoroutine(c.close()) for c in clients])
    finally:
        assert await server.stop() == 0


# --- dead clients -------------------------------------------------------------------------

# A WebSocket client in a separate process, stdlib only: handshake, start a
# process that streams forever, print "started", then read slowly forever.
CLIENT_SCRIPT = r"""
import base64, json, os, socket, struct, sys
host, port, command = sys.argv[1], int(sys.argv[2]), sys.argv[3]
s = socket.create_connection((host, port))
key = base64.b64encode(os.urandom(16)).decode()
s.sendall((f"GET / HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
           "Sec-WebSocket-Version: 13\r\n\r\n").encode())
head = b""
while b"\r\n\r\n" not in head:
    head += s.recv(1)
assert head.startswith(b"HTTP/1.1 101"), head
def send(opcode, data):
    mask = os.urandom(4)
    n = len(data)
    hdr = bytes([0x80 | opcode]) + (
        bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n))
    s.sendall(hdr + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))
def exact(n):
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            sys.exit(0)
        out += chunk
    return out
def frame():
    b0, b1 = exact(2)
    n = b1 & 0x7F
    if n == 126:
        n = struct.unpack(">H", exact(2))[0]
    elif n == 127:
        n = struct.unpack(">Q", exact(8))[0]
    return b0 & 0x0F, exact(n)
send(1, json.dumps({"id": 1, "method": "initialize", "params": {"clientName": "doomed"}}).encode())
send(1, json.dumps({"method": "initialized", "params": {}}).encode())
send(1, json.dumps({"id": 2, "method": "process/start", "params": {
    "processId": "proc-1", "argv": ["sh", "-c", command], "cwd": "/",
    "env": {"PATH": os.environ["PATH"]}, "tty": False, "arg0": None}}).encode())
while True:
    opcode, payload = frame()
    if opcode == 9:
        send(10, payload)
    elif payload.startswith(b'{"id":2'):
        print("started", flush=True)
        if sys.argv[4:] == ["spam"]:
            # Ask for the retained output forever; never read a reply.
            request = json.dumps({"id": 3, "method": "process/read",
                                  "params": {"processId": "proc-1"}}).encode()
            while True:
                send(1, request)
"""


class _ClientScript(ProcessProtocol):
    def __init__(self) -> None:
        self.out = b""
        self.started: Deferred[None] = Deferred()
        self.ended: Deferred[None] = Deferred()

    def outReceived(self, data: bytes) -> None:
        self.out += data
        if b"started" in self.out and not self.started.called:
            self.started.callback(None)

    def processEnded(self, reason: Failure) -> None:
        if not self.started.called:
            self.started.errback(RuntimeError(f"client script ended early: {self.out!r}"))
        self.ended.callback(None)


async def _start_client_script(
    server: WsServerProcess, command: str, *mode: str
) -> tuple[_ClientScript, Any]:
    host, port = server.host_port
    proto = _ClientScript()
    transport = reactor.spawnProcess(
        proto,
        sys.executable,
        [sys.executable, "-c", CLIENT_SCRIPT, host, str(port), command, *mode],
        env={"PATH": os.environ["PATH"]},
        childFDs={0: "w", 1: "r", 2: 2},
    )
    await with_timeout(proto.started, DEFAULT_TIMEOUT, "the client script to start its process")
    return proto, transport


async def _kill_client_script(proto: _ClientScript, transport: Any) -> None:
    if not proto.ended.called:
        os.kill(transport.pid, signal.SIGKILL)
        await with_timeout(proto.ended, DEFAULT_TIMEOUT, "the client script to die")


@pytest_twisted.ensureDeferred
async def test_client_killed_mid_stream_has_its_processes_reaped() -> None:
    server = await WsServerProcess.start()
    try:
        bystander = await connect(server.url)
        await bystander.handshake()
        proto, transport = await _start_client_script(server, "sleep 300 & yes")
        try:
            await until(
                lambda: len(children_of(server)) >= 3, "sh, sleep, yes", timeout=DEFAULT_TIMEOUT
            )
            tree = children_of(server)
            os.kill(transport.pid, signal.SIGKILL)  # no close frame, no FIN from Python
            took = await until(
                lambda: not any(pid_alive(p) for p in tree),
                "the tree to be reaped",
                timeout=REAP_BOUND,
            )
            assert took < REAP_BOUND
        finally:
            await _kill_client_script(proto, transport)
        # The server keeps serving others.
        await bystander.start_process("p", ["echo", "still here"])
        await bystander.wait_notification("process/closed", "p")
        assert bystander.output_of("p") == b"still here\n"
        await bystander.close()
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_frozen_client_is_detected_by_ping_timeout() -> None:
    # The live client below is this test process, busy scanning /proc: its
    # pongs must beat the timeout even when a loaded machine starves it.
    server = await WsServerProcess.start(
        "--ping-interval-ms", str(PING_INTERVAL_MS), "--ping-timeout-ms", str(PING_TIMEOUT_MS)
    )
    try:
        # A live client answers pings (Autobahn does) and is never dropped.
        live = await connect(server.url)
        await live.handshake()
        proto, transport = await _start_client_script(server, "sleep 300 & sleep 300")
        try:
            await until(
                lambda: len(children_of(server)) >= 3, "sh, sleeps", timeout=DEFAULT_TIMEOUT
            )
            tree = children_of(server)
            os.kill(transport.pid, signal.SIGSTOP)  # TCP stays up; pongs stop
            detect = (PING_INTERVAL_MS + PING_TIMEOUT_MS) / 1000
            await until(
                lambda: not any(pid_alive(p) for p in tree),
                "the frozen client's tree to be reaped",
                timeout=detect + REAP_BOUND,
                interval=0.1,
            )
        finally:
            await _kill_client_script(proto, transport)
        assert not live.closed.called
        assert await live.call("process/terminate", {"processId": "nope"}, timeout=5) == {
            "running": False
        }
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_stalled_client_does_not_grow_server_memory_or_slow_others() -> None:
    server = await WsServerProcess.start()
    try:
        assert server.pid is not None
        idle = rss_bytes(server.pid)
        reset_peak_rss(server.pid)
        proto, transport = await _start_client_script(server, "yes")
        try:
            os.kill(transport.pid, signal.SIGSTOP)  # stops reading; TCP stays up
            # Meanwhile another client streams 64 MiB through the same server;
            # an unthrottled `yes` would produce gigabytes in that time.
            other = await connect(server.url)
            await other.handshake()
            await other.start_process("bulk", ["head", "-c", str(64 << 20), "/dev/zero"])
            await other.wait_notification("process/closed", "bulk", timeout=60)
            assert len(other.output_of("bulk")) == 64 << 20
            growth = peak_rss_bytes(server.pid) - idle
            print(f"\nstalled WebSocket client: server peak RSS {growth / MiB:.1f} MiB over idle")
            assert growth <= STALL_RSS_GROWTH, f"server RSS grew {growth / MiB:.1f} MiB over idle"
            await other.close()
        finally:
            await _kill_client_script(proto, transport)
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_client_sending_requests_without_reading_replies_is_throttled() -> None:
    server = await WsServerProcess.start()
    try:
        assert server.pid is not None
        idle = rss_bytes(server.pid)
        reset_peak_rss(server.pid)
        # Each process/read answers ~1.4 MiB (1 MiB retained, base64); the
        # client never reads them. The server stops reading its requests.
        proto, transport = await _start_client_script(server, "head -c 1048576 /dev/zero", "spam")
        try:
            other = await connect(server.url)
            await other.handshake()
            await other.start_process("bulk", ["head", "-c", str(64 << 20), "/dev/zero"])
            await other.wait_notification("process/closed", "bulk", timeout=60)
            growth = peak_rss_bytes(server.pid) - idle
            print(f"\nclient not reading replies: server peak RSS {growth / MiB:.1f} MiB over idle")
            assert growth <= REPLY_BACKLOG_RSS_GROWTH, f"RSS grew {growth / MiB:.1f} MiB over idle"
            await other.close()
        finally:
            await _kill_client_script(proto, transport)
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_tcp_abort_terminates_that_connections_processes_only() -> None:
    server = await WsServerProcess.start()
    try:
        doomed = await connect(server.url)
        other = await connect(server.url)
        for c in (doomed, other):
            await c.handshake()
            await c.start_process("proc-1", ["sleep", "300"])
        await until(lambda: len(children_of(server)) == 2, "two sleeps", timeout=DEFAULT_TIMEOUT)
        before = set(children_of(server))
        doomed.abort()
        await until(lambda: len(children_of(server)) == 1, "one sleep reaped", timeout=REAP_BOUND)
        assert set(children_of(server)) < before
        listed = await other.call("process/read", {"processId": "proc-1"})
        assert listed["exited"] is False
        await other.close()
        await until(lambda: not children_of(server), "the other sleep reaped", timeout=REAP_BOUND)
    finally:
        assert await server.stop() == 0


# --- limits and HTTP -------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_oversized_message_gets_an_error_and_the_connection_stays_usable() -> None:
    server = await WsServerProcess.start("--max-message-bytes", "4096")
    try:
        big = await connect(server.url)
        other = await connect(server.url)
        big.sendMessage(
            b'{"id":1,"method":"initialize","params":{"clientName":"' + b"x" * 8000 + b'"}}'
        )
        error = await big.wait_for(lambda m: "error" in m, DEFAULT_TIMEOUT, "the size error")
        assert error["id"] is None
        assert error["error"]["code"] == -32600
        assert "maximum size of 4096 bytes" in error["error"]["message"]
        # Same connection, still usable; the other client unaffected.
        assert (await big.handshake())["protocolVersion"] == "exec-server.v0"
        assert (await other.handshake())["protocolVersion"] == "exec-server.v0"
        await big.close()
        await other.close()
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_binary_frames_holding_json_are_accepted_and_replies_are_text() -> None:
    server = await WsServerProcess.start()
    try:
        client = await connect(server.url)
        response = await client.request("initialize", {"clientName": "bin"}, binary=True)
        assert response["result"]["protocolVersion"] == "exec-server.v0"
        assert client.binary_frames == 0
        await client.close()
    finally:
        assert await server.stop() == 0


def _upgrade_request(origin: str | None) -> bytes:
    extra = (
        "Upgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
    )
    if origin is not None:
        extra += f"Origin: {origin}\r\n"
    return get_request("/", extra)


@pytest_twisted.ensureDeferred
async def test_browser_origin_is_refused_unless_allowed() -> None:
    server = await WsServerProcess.start("--allow-origin", "http://localhost:3000")
    try:
        host, port = server.host_port
        status, _, body = await http_get(host, port, _upgrade_request("https://evil.example"))
        assert status == 403
        assert b"--allow-origin" in body
        # Listed origin: the upgrade succeeds (with a real client, too).
        client = await connect(server.url, headers={"Origin": "http://localhost:3000"})
        assert (await client.handshake())["protocolVersion"] == "exec-server.v0"
        await client.close()
        # No Origin (not a browser): allowed.
        plain = await connect(server.url)
        await plain.close()
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_every_browser_origin_is_refused_by_default() -> None:
    # No --allow-origin: even a loopback page or a sandboxed one ("null").
    server = await WsServerProcess.start()
    try:
        host, port = server.host_port
        for origin in ("http://localhost:3000", "http://127.0.0.1:8080", "null"):
            status, _, body = await http_get(host, port, _upgrade_request(origin))
            assert status == 403, origin
            assert b"--allow-origin" in body
        plain = await connect(server.url)
        assert (await plain.handshake())["protocolVersion"] == "exec-server.v0"
        await plain.close()
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_plain_http_endpoints() -> None:
    server = await WsServerProcess.start()
    try:
        host, port = server.host_port
        status, headers, body = await http_get(host, port, get_request("/readyz"))
        assert (status, body, headers["content-length"]) == (200, b"ready\n", "6")
        status, headers, body = await http_get(host, port, get_request("/metrics"))
        assert status == 200
        assert headers["content-type"].startswith("text/plain; version=0.0.4")
        assert b"exec_server_connections " in body
        status, headers, body = await http_get(host, port, get_request("/"))
        assert status == 426
        assert headers["upgrade"] == "websocket"
        assert b"WebSocket" in body
        status, _, _ = await http_get(host, port, get_request("/nothing-here"))
        assert status == 404
        status, headers, _ = await http_get(
            host, port, b"POST /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n"
        )
        assert (status, headers["allow"]) == (405, "GET, HEAD")
    finally:
        assert await server.stop() == 0


class _FloodCounter(WsClientProtocol):
    count_only = True


@pytest.mark.slow
@pytest_twisted.ensureDeferred
async def test_readyz_and_metrics_answer_during_a_one_gib_flood() -> None:
    server = await WsServerProcess.start()
    try:
        flood = await connect(server.url, protocol=_FloodCounter, utf8validateIncoming=False)
        await flood.handshake()
        await flood.start_process("flood", ["head", "-c", str(1 << 30), "/dev/zero"])
        await until(lambda: flood.bytes_received > 16 << 20, "the flood to start", timeout=30)
        host, port = server.host_port
        for _ in range(3):
            status, _, body = await http_get(host, port, get_request("/readyz"), timeout=5)
            assert status == 200
            status, _, body = await http_get(host, port, get_request("/metrics"), timeout=5)
            assert status == 200
            # Answered while the flood was still streaming.
            assert b"exec_server_processes_running 1\n" in body
        metrics = dict(
            line.rsplit(" ", 1)
            for line in body.decode().splitlines()
            if line and not line.startswith("#")
        )
        # Client bytes are base64 in JSON (4/3 larger): at least 8 MiB read from the child.
        assert int(metrics['exec_server_output_bytes_total{stream="stdout"}']) > 8 << 20
        await flood.wait_notification("process/closed", "flood", timeout=120)
        await flood.close()
    finally:
        assert await server.stop() == 0


# --- listeners and shutdown ------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_stdio_and_two_websocket_listeners_at_once() -> None:
    server = await WsServerProcess.start(
        "--listen",
        "stdio://",
        "--listen",
        "ws://127.0.0.1:0",
        "--listen",
        "ws://127.0.0.1:0",
        listeners=2,
    )
    try:
        assert len(set(server.urls)) == 2
        for url in server.urls:
            client = await connect(url)
            assert (await client.handshake())["protocolVersion"] == "exec-server.v0"
            await client.close()
    finally:
        await server.stop()


@pytest.mark.parametrize(
    ("sig", "twistd"),
    [("TERM", False), ("INT", False), ("TERM", True)],
    ids=["term", "int", "twistd"],
)
@pytest_twisted.ensureDeferred
async def test_shutdown_closes_connections_and_terminates_every_process(
    sig: str, twistd: bool
) -> None:
    server = await WsServerProcess.start(twistd=twistd)
    try:
        clients = [await connect(server.url) for _ in range(3)]
        for c in clients:
            await c.handshake()
            await c.start_process("proc-1", ["sh", "-c", "sleep 300 & sleep 300"])
        await until(lambda: len(children_of(server)) >= 9, "all sleeps", timeout=DEFAULT_TIMEOUT)
        tree = children_of(server)
        server.signal(sig)
        await with_timeout(observe(server.ended), REAP_BOUND + 5, "server exit")
        if twistd:
            # twistd re-raises the signal it stopped on, after a clean stop.
            assert (server.exit_code, server.exit_signal) in ((0, None), (None, signal.SIGTERM))
        else:
            assert server.exit_code == 0
        for c in clients:
            was_clean, code, reason = await with_timeout(c.closed, 5, "close")
            assert code == 1001, (was_clean, code, reason)
            exited = await c.wait_notification("process/exited", "proc-1", timeout=1)
            assert exited["signal"] == "SIGTERM"
        assert not any(pid_alive(p) for p in tree)
    finally:
        await server.stop()
