"""WebSocket transport figures, each as a ratio to stdio measured in the same run.

- throughput: a child writes N bytes of ``/dev/zero`` (``head -c``); the
  client decodes every ``process/output`` (JSON and base64, typed msgspec)
  until ``process/closed``. WebSocket vs stdio, payload MB/s.
- connections: C concurrent WebSocket connections, each doing the handshake
  and starting one short process (``true``) and waiting for its
  ``process/closed``; total wall time and server RSS (idle, with every
  connection open, and the peak). Baseline: the same C processes started on
  one stdio session.
- round trips: ``process/terminate`` of an unknown id (pure dispatcher
  work) with 1 and with 64 requests in flight; requests/s, WebSocket vs
  stdio.

One client implementation for both transports: blocking Python reading 1 MiB
at a time into one buffer (the stdio pipe enlarged to 1 MiB), messages
sliced out by a newline or by a minimal RFC 6455 frame parser (masked frames
with a zero key, no fragmentation), every message decoded by the same typed
msgspec decoder. Figures are medians of ``--rounds``.

    python bench/bench_websocket.py [--rounds 3] [--mib 256] [--connections 200]
    python bench/bench_websocket.py --frames   # own frame path vs Autobahn's parser
    python bench/bench_websocket.py --edge-baseline DIR   # this checkout vs another tree

``--edge-baseline DIR`` compares this checkout's WebSocket edge with the
``execserver`` package of another tree (e.g. ``git archive OLD execserver |
tar -x -C DIR``), both servers running in the same run: upgrades/s
(sequential connect, upgrade, close), plain ``GET /readyz``/s, round
trips at depth 1 and 64 and output throughput, each as a ratio
this/baseline.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import os
import re
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import psutil

REPO = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024
CHILD_ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
#: A server that stops answering fails the run (socket.timeout) instead of hanging it.
SOCKET_TIMEOUT = 60.0


class OutputParams(msgspec.Struct):
    processId: str
    stream: str = ""
    chunk: bytes = b""


class Message(msgspec.Struct):
    id: int | None = None
    method: str | None = None
    params: OutputParams | None = None
    result: Any = None
    error: Any = None


decode_message = msgspec.json.Decoder(Message).decode
encode = msgspec.json.Encoder().encode


def start_params(process_id: str, argv: list[str]) -> dict[str, Any]:
    return {
        "processId": process_id,
        "argv": argv,
        "cwd": "/",
        "env": CHILD_ENV,
        "tty": False,
        "arg0": None,
    }


# --- servers ----------------------------------------------------------------------


class Server:
    def __init__(self, *args: str, tree: Path = REPO) -> None:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, PYTHONPATH=str(tree))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "execserver", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            cwd=str(tree),
        )

    def ws_address(self, timeout: float = 10.0) -> tuple[str, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.log.seek(0)
            found = re.search(rb"exec-server listening on ws://([\d.]+):(\d+)", self.log.read())
            if found:
                return found.group(1).decode(), int(found.group(2))
            if self.proc.poll() is not None:
                break
            time.sleep(0.01)
        raise RuntimeError("no listening banner")

    def rss(self) -> int:
        return int(psutil.Process(self.proc.pid).memory_info().rss)

    def peak_rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self.log.close()


# --- clients ----------------------------------------------------------------------


class _Reader:
    """What both clients share: 1 MiB reads into one buffer, messages sliced out of it.

    Only the framing differs (a newline vs a WebSocket frame header); every
    message is then decoded by the same :func:`decode_message`. Pipe and
    socket are read the same way, so a WebSocket/stdio ratio measures the
    server's transports, not two client implementations.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0

    def _recv(self) -> bytes:
        raise NotImplementedError

    def _fill(self) -> None:
        if self._pos > 1 << 20:
            del self._buf[: self._pos]
            self._pos = 0
        data = self._recv()
        if not data:
            raise EOFError("the server closed the connection")
        self._buf += data


class StdioClient(_Reader):
    def __init__(self, server: Server) -> None:
        super().__init__()
        assert server.proc.stdin is not None and server.proc.stdout is not None
        self._in = server.proc.stdin.fileno()
        self._out = server.proc.stdout.fileno()
        # As large as a loopback socket's buffer grows, so one read can
        # return as much as a recv() does.
        with contextlib.suppress(OSError):
            fcntl.fcntl(self._out, F_SETPIPE_SZ, 1 << 20)

    def _recv(self) -> bytes:
        return os.read(self._out, 1 << 20)

    def send(self, data: bytes) -> None:
        os.write(self._in, data + b"\n")

    def messages(self) -> Iterator[bytes]:
        while True:
            end = self._buf.find(b"\n", self._pos)
            if end < 0:
                self._fill()
                continue
            payload = bytes(self._buf[self._pos : end])
            self._pos = end + 1
            yield payload


class WsClient(_Reader):
    """Minimal blocking RFC 6455 client."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__()
        self.sock = socket.create_connection((host, port), timeout=SOCKET_TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET / HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise EOFError("handshake refused")
            head += chunk
        status, _, rest = head.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 101"), status
        self._buf += rest

    def _recv(self) -> bytes:
        return self.sock.recv(1 << 20)

    def send(self, data: bytes) -> None:
        # Masked with a zero key: valid framing, no per-byte XOR in Python.
        n = len(data)
        if n < 126:
            head = struct.pack("!BB", 0x81, 0x80 | n)
        elif n < 1 << 16:
            head = struct.pack("!BBH", 0x81, 0x80 | 126, n)
        else:
            head = struct.pack("!BBQ", 0x81, 0x80 | 127, n)
        self.sock.sendall(head + b"\0\0\0\0" + data)

    def messages(self) -> Iterator[bytes]:
        while True:
            buf, pos = self._buf, self._pos
            if len(buf) - pos < 2:
                self._fill()
                continue
            opcode = buf[pos] & 0x0F
            n = buf[pos + 1] & 0x7F
            start = pos + 2
            if n == 126:
                if len(buf) - pos < 4:
                    self._fill()
                    continue
                n = struct.unpack_from("!H", buf, pos + 2)[0]
                start = pos + 4
            elif n == 127:
                if len(buf) - pos < 10:
                    self._fill()
                    continue
                n = struct.unpack_from("!Q", buf, pos + 2)[0]
                start = pos + 10
            if len(buf) < start + n:
                self._fill()
                continue
            payload = bytes(buf[start : start + n])
            self._pos = start + n
            if opcode == 9:
                self.sock.sendall(struct.pack("!BB", 0x8A, 0x80 | n) + b"\0\0\0\0" + payload)
            elif opcode in (1, 2):
                yield payload

    def close(self) -> None:
        self.sock.close()


Client = StdioClient | WsClient


def call(client: Client, request_id: int, method: str, params: Any) -> Message:
    client.send(encode({"id": request_id, "method": method, "params": params}))
    for raw in client.messages():
        message = decode_message(raw)
        if message.id == request_id:
            if message.error is not None:
                raise RuntimeError(message.error)
            return message
    raise EOFError


def handshake(client: Client) -> None:
    call(client, 0, "initialize", {"clientName": "bench"})
    client.send(b'{"method":"initialized","params":{}}')


# --- measurements -----------------------------------------------------------------


def stream_rate(client: Client, nbytes: int, process_id: str) -> float:
    """Payload MB/s of ``head -c nbytes /dev/zero`` decoded chunk by chunk."""
    start = time.perf_counter()
    client.send(
        encode(
            {
                "id": 1,
                "method": "process/start",
                "params": start_params(process_id, ["head", "-c", str(nbytes), "/dev/zero"]),
            }
        )
    )
    payload = 0
    for raw in client.messages():
        message = decode_message(raw)
        if message.method == "process/output":
            assert message.params is not None
            payload += len(message.params.chunk)
        elif message.method == "process/closed":
            break
    elapsed = time.perf_counter() - start
    assert payload == nbytes, (payload, nbytes)
    return nbytes / elapsed / 1e6


def throughput(nbytes: int) -> tuple[float, float]:
    stdio = Server()
    ws = Server("--listen", "ws://127.0.0.1:0")
    try:
        s_client = StdioClient(stdio)
        handshake(s_client)
        w_client = WsClient(*ws.ws_address())
        handshake(w_client)
        return stream_rate(w_client, nbytes, "t"), stream_rate(s_client, nbytes, "t")
    finally:
        stdio.stop()
        ws.stop()


def round_trips(client: Client, total: int, depth: int) -> float:
    """Requests/s with ``depth`` requests in flight."""
    template = b'{"id":%d,"method":"process/terminate","params":{"processId":"none"}}'
    next_id = 1
    for _ in range(min(depth, total)):
        client.send(template % next_id)
        next_id += 1
    answered = 0
    start = time.perf_counter()
    messages = client.messages()
    while answered < total:
        raw = next(messages)
        message = decode_message(raw)
        if message.id is None:
            continue
        answered += 1
        if next_id <= total:
            client.send(template % next_id)
            next_id += 1
    return total / (time.perf_counter() - start)


def paired_round_trips(a: Client, b: Client, depth: int, total: int) -> tuple[float, float]:
    """Round-trip rates of ``a`` and ``b``, each after a warm-up."""
    round_trips(a, min(total, 500), depth)
    round_trips(b, min(total, 500), depth)
    return round_trips(a, total, depth), round_trips(b, total, depth)


def rtt(depth: int, total: int) -> tuple[float, float]:
    stdio = Server()
    ws = Server("--listen", "ws://127.0.0.1:0")
    try:
        s_client = StdioClient(stdio)
        handshake(s_client)
        w_client = WsClient(*ws.ws_address())
        handshake(w_client)
        return paired_round_trips(w_client, s_client, depth, total)
    finally:
        stdio.stop()
        ws.stop()


def frame_paths(depth: int, total: int) -> tuple[float, float]:
    """Round trips with the server's own frame path, and with Autobahn's parser only."""
    fast = Server("--listen", "ws://127.0.0.1:0")
    public = Server("--listen", "ws://127.0.0.1:0", "--no-fast-frames")
    try:
        f_client = WsClient(*fast.ws_address())
        handshake(f_client)
        p_client = WsClient(*public.ws_address())
        handshake(p_client)
        return paired_round_trips(f_client, p_client, depth, total)
    finally:
        fast.stop()
        public.stop()


def upgrades(address: tuple[str, int], count: int) -> float:
    """Sequential WebSocket upgrades per second (connect, upgrade, close)."""
    start = time.perf_counter()
    for _ in range(count):
        WsClient(*address).close()
    return count / (time.perf_counter() - start)


def readyz(address: tuple[str, int], count: int) -> float:
    """Sequential plain ``GET /readyz`` requests per second (each on its own connection)."""
    host, port = address
    request = f"GET /readyz HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    start = time.perf_counter()
    for _ in range(count):
        with socket.create_connection(address, timeout=SOCKET_TIMEOUT) as sock:
            sock.sendall(request)
            reply = b""
            while True:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 200 "), reply[:40]
    return count / (time.perf_counter() - start)


def edge(baseline: Path, count: int, total: int) -> dict[str, float]:
    """This checkout's WebSocket edge against ``baseline``'s, both started now."""
    ours = Server("--listen", "ws://127.0.0.1:0")
    theirs = Server("--listen", "ws://127.0.0.1:0", tree=baseline)
    try:
        a, b = ours.ws_address(), theirs.ws_address()
        upgrades(a, 50)
        upgrades(b, 50)
        mine_up, base_up = upgrades(a, count), upgrades(b, count)
        mine_ready, base_ready = readyz(a, count), readyz(b, count)
        figures = {
            "upgrades": mine_up / base_up,
            "upgrades_abs": mine_up,
            "upgrades_base": base_up,
            "readyz": mine_ready / base_ready,
            "readyz_abs": mine_ready,
            "readyz_base": base_ready,
        }
        for depth in (1, 64):
            a_client = WsClient(*a)
            handshake(a_client)
            b_client = WsClient(*b)
            handshake(b_client)
            mine, base = paired_round_trips(a_client, b_client, depth, total)
            figures[f"rtt{depth}"] = mine / base
            a_client.close()
            b_client.close()
        a_client, b_client = WsClient(*a), WsClient(*b)
        handshake(a_client)
        handshake(b_client)
        # Both orders (the second stream of a pair tends to run slower here).
        mine = stream_rate(a_client, 128 * MiB, "t1")
        base = stream_rate(b_client, 128 * MiB, "t1") + stream_rate(b_client, 128 * MiB, "t2")
        mine += stream_rate(a_client, 128 * MiB, "t2")
        figures["throughput"] = mine / base
        return figures
    finally:
        ours.stop()
        theirs.stop()


def connections(count: int) -> dict[str, float]:
    ws = Server("--listen", "ws://127.0.0.1:0")
    stdio = Server()
    try:
        address = ws.ws_address()
        idle_rss = ws.rss()
        start = time.perf_counter()
        clients = [WsClient(*address) for _ in range(count)]
        for c in clients:
            c.send(b'{"id":0,"method":"initialize","params":{"clientName":"bench"}}')
        for c in clients:
            next(c.messages())
            c.send(b'{"method":"initialized","params":{}}')
            c.send(
                encode({"id": 1, "method": "process/start", "params": start_params("p", ["true"])})
            )
        for c in clients:
            for raw in c.messages():
                if decode_message(raw).method == "process/closed":
                    break
        ws_seconds = time.perf_counter() - start
        open_rss = ws.rss()
        peak = ws.peak_rss()
        for c in clients:
            c.close()

        s_client = StdioClient(stdio)
        handshake(s_client)
        start = time.perf_counter()
        for n in range(count):
            s_client.send(
                encode(
                    {
                        "id": n + 1,
                        "method": "process/start",
                        "params": start_params(f"p{n}", ["true"]),
                    }
                )
            )
        closed = 0
        for raw in s_client.messages():
            if decode_message(raw).method == "process/closed":
                closed += 1
                if closed == count:
                    break
        stdio_seconds = time.perf_counter() - start
        return {
            "ws_seconds": ws_seconds,
            "stdio_seconds": stdio_seconds,
            "idle_rss": idle_rss,
            "open_rss": open_rss,
            "peak_rss": peak,
        }
    finally:
        ws.stop()
        stdio.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--connections", type=int, default=200)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument(
        "--frames",
        action="store_true",
        help="only compare the fast frame path with --no-fast-frames (Autobahn's parser)",
    )
    parser.add_argument(
        "--edge-baseline",
        type=Path,
        metavar="DIR",
        help="only compare this checkout's WebSocket edge with the execserver package in DIR",
    )
    args = parser.parse_args()
    median = statistics.median
    if args.edge_baseline is not None:
        count = args.connections * 5
        print(
            f"WebSocket edge: this checkout / {args.edge_baseline} "
            f"({args.rounds} rounds, medians of same-run ratios)"
        )
        edge_runs = [
            edge(args.edge_baseline, count, args.requests // 4) for _ in range(args.rounds)
        ]
        for key, label in (
            ("upgrades", f"{count} sequential upgrades (connect, 101, close)"),
            ("readyz", f"{count} sequential GET /readyz"),
            ("rtt1", "round trips depth  1"),
            ("rtt64", "round trips depth 64"),
            ("throughput", "2 x 128 MiB output (both orders), client decodes every chunk"),
        ):
            line = f"{label}: ratio {median(r[key] for r in edge_runs):.2f}"
            if f"{key}_abs" in edge_runs[0]:
                line += (
                    f" ({median(r[key + '_abs'] for r in edge_runs):,.0f}/s vs "
                    f"{median(r[key + '_base'] for r in edge_runs):,.0f}/s)"
                )
            print(line)
        return
    if args.frames:
        print(f"WebSocket frame paths ({args.rounds} rounds, medians)")
        for depth in (1, 64):
            total = args.requests if depth > 1 else args.requests // 4
            runs = [frame_paths(depth, total) for _ in range(args.rounds)]
            print(
                f"round trips depth {depth:>2}: fast frames {median(r[0] for r in runs):,.0f} "
                f"req/s, Autobahn's parser {median(r[1] for r in runs):,.0f} req/s, "
                f"ratio fast/autobahn {median(r[0] / r[1] for r in runs):.2f}"
            )
        return

    print(f"exec-server WebSocket benchmarks ({args.rounds} rounds, medians)")
    runs = [throughput(args.mib * MiB) for _ in range(args.rounds)]
    ws_rate, stdio_rate = median(r[0] for r in runs), median(r[1] for r in runs)
    print(
        f"throughput {args.mib} MiB, client decodes every chunk: "
        f"ws {ws_rate:.0f} MB/s, stdio {stdio_rate:.0f} MB/s, "
        f"ratio ws/stdio {median(r[0] / r[1] for r in runs):.2f}"
    )
    for depth in (1, 64):
        total = args.requests if depth > 1 else args.requests // 4
        runs = [rtt(depth, total) for _ in range(args.rounds)]
        print(
            f"round trips depth {depth:>2}: ws {median(r[0] for r in runs):,.0f} req/s, "
            f"stdio {median(r[1] for r in runs):,.0f} req/s, "
            f"ratio ws/stdio {median(r[0] / r[1] for r in runs):.2f}"
        )
    conn_runs = [connections(args.connections) for _ in range(args.rounds)]

    def m(key: str) -> float:
        return median(r[key] for r in conn_runs)

    each_ms = m("ws_seconds") / args.connections * 1e3
    time_ratio = median(r["ws_seconds"] / r["stdio_seconds"] for r in conn_runs)
    rss_ratio = median(r["open_rss"] / r["idle_rss"] for r in conn_runs)
    print(
        f"{args.connections} concurrent connections x 1 short process: "
        f"ws {m('ws_seconds'):.2f} s total ({each_ms:.1f} ms each); "
        f"same starts on one stdio session {m('stdio_seconds'):.2f} s; ratio {time_ratio:.2f}"
    )
    print(
        f"server RSS: idle {m('idle_rss') / MiB:.0f} MiB, with {args.connections} connections "
        f"{m('open_rss') / MiB:.0f} MiB (ratio {rss_ratio:.2f}), "
        f"peak {m('peak_rss') / MiB:.0f} MiB; "
        f"{(m('open_rss') - m('idle_rss')) / args.connections / 1024:.0f} KiB per connection"
    )


if __name__ == "__main__":
    main()
