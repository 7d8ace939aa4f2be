"""A sandboxed start and a sandboxed process's output, as ratios measured in one run.

- start: ``process/start`` -> ``process/exited`` of ``true``, one at a time,
  milliseconds (median of ``--count`` starts per round), with Codex's
  workspace-write profile (``sandbox`` on the start, network restricted)
  and without; ours over stdio, bwrap and Landlock, and the reference
  (``codex exec-server --listen ws://127.0.0.1:PORT``, Codex 0.171.0; its
  sandbox helper needs a ``CODEX_HOME`` outside ``TMPDIR``) over
  WebSocket, with the same profile. Goal: our sandboxed start at most half
  the reference's.
- throughput: payload MB/s of ``head -c 256MiB /dev/zero`` through our
  server, sandboxed (bwrap) / unsandboxed, in A B B A order each round.
  Goal: >= 0.95.

    python bench/bench_sandbox.py [--rounds 3] [--count 40] [--codex PATH]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec

from bench._client import MiB, Ratio, Series, StdioClient, child_env, print_header
from bench.bench_throughput import _drain_until_closed

CODEX = Path(
    "/root/.cache/exec-server-codex/0.171.0/package/vendor/x86_64-unknown-linux-musl/bin/codex"
)


def profile(work: Path, slash_tmp: bool = True) -> dict[str, Any]:
    """Codex 0.171.0's workspace-write profile for ``work``.

    ``slash_tmp=False`` (the Landlock rows) leaves /tmp out: Landlock refuses
    a profile whose carve-outs exist, and on a shared machine other programs
    leave /tmp/.agents or /tmp/.git behind.
    """

    def special(kind: str, sub: str | None = None) -> dict[str, Any]:
        value: dict[str, Any] = {"kind": kind}
        if sub is not None:
            value["subpath"] = sub
        return {"type": "special", "value": value}

    entries: list[dict[str, Any]] = [
        {"path": special("root"), "access": "read"},
        {"path": special("project_roots"), "access": "write"},
        *([{"path": special("slash_tmp"), "access": "write"}] if slash_tmp else []),
        {"path": special("tmpdir"), "access": "write"},
    ] + [
        {"path": special("project_roots", s), "access": "read", "missing_path_behavior": "skip"}
        for s in (".git", ".agents", ".codex", ".aws")
    ]
    return {
        "permissions": {
            "type": "managed",
            "file_system": {"type": "restricted", "entries": entries},
            "network": "restricted",
        },
        "cwd": f"file://{work}",
        "workspaceRoots": [f"file://{work}"],
        "windowsSandboxLevel": "disabled",
        "windowsSandboxProxySettingsMode": "reconcile",
        "useLegacyLandlock": False,
    }


def start_params(
    pid: str, argv: list[str], work: Path, sandboxed: bool, slash_tmp: bool = True
) -> dict[str, Any]:
    params: dict[str, Any] = {
        "processId": pid,
        "argv": argv,
        "cwd": f"file://{work}",
        "env": child_env(),
        "tty": False,
        "arg0": None,
    }
    if sandboxed:
        params["sandbox"] = profile(work, slash_tmp)
    return params


# --- ours, over stdio ---------------------------------------------------------------------


def ours_start_ms(work: Path, count: int, sandboxed: bool, mechanism: str = "auto") -> float:
    """Median milliseconds of start -> exited of ``true`` through our server."""
    times: list[float] = []
    with StdioClient(["--sandbox-mechanism", mechanism]) as client:
        client.initialize()
        for i in range(count + 3):
            pid = f"t{i}"
            request = {
                "id": client.new_id(),
                "method": "process/start",
                "params": start_params(pid, ["true"], work, sandboxed, mechanism != "landlock"),
            }
            began = time.perf_counter()
            client.send(request)
            done = False
            while not done:
                for message in client.read_batch():
                    if isinstance(message.error, msgspec.Raw):
                        raise RuntimeError(f"start refused: {bytes(message.error)!r}")
                    if message.method == "process/exited":
                        done = True
            if i >= 3:  # the first starts warm caches up
                times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def ours_throughput(work: Path, total: int, sandboxed: bool) -> float:
    with StdioClient() as client:
        client.initialize()
        began = time.perf_counter()
        client.send(
            {
                "id": client.new_id(),
                "method": "process/start",
                "params": start_params(
                    "p", ["head", "-c", str(total), "/dev/zero"], work, sandboxed
                ),
            }
        )
        payload = _drain_until_closed(client)
        seconds = time.perf_counter() - began
    if payload != total:
        raise AssertionError(f"received {payload} bytes, expected {total}")
    return total / seconds / 1e6


# --- the reference, over WebSocket ----------------------------------------------------------


class TinyWebSocket:
    """A blocking WebSocket client: enough JSON-RPC for the measurement."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        # Nagle + delayed ACKs would add ~40 ms to every small request.
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        self.buf = b""
        while b"\r\n\r\n" not in self.buf:
            self.buf += self._recv()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise RuntimeError(head.decode(errors="replace"))
        self.next_id = 1

    def _recv(self) -> bytes:
        data = self.sock.recv(1 << 20)
        # ACK at once: the reference's small writes (the start's answer, then
        # process/exited) would otherwise wait on Nagle for a delayed ACK.
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        if not data:
            raise RuntimeError("connection closed")
        return data

    def send(self, message: dict[str, Any]) -> None:
        payload = json.dumps(message).encode()
        mask = os.urandom(4)
        n = len(payload)
        if n < 126:
            header = bytes([0x81, 0x80 | n])
        elif n < 1 << 16:
            header = bytes([0x81, 0x80 | 126]) + n.to_bytes(2, "big")
        else:
            header = bytes([0x81, 0x80 | 127]) + n.to_bytes(8, "big")
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(header + mask + masked)

    def messages(self) -> Iterator[dict[str, Any]]:
        while True:
            while len(self.buf) < 2:
                self.buf += self._recv()
            n = self.buf[1] & 0x7F
            offset = 2
            if n == 126:
                while len(self.buf) < 4:
                    self.buf += self._recv()
                n, offset = int.from_bytes(self.buf[2:4], "big"), 4
            elif n == 127:
                while len(self.buf) < 10:
                    self.buf += self._recv()
                n, offset = int.from_bytes(self.buf[2:10], "big"), 10
            while len(self.buf) < offset + n:
                self.buf += self._recv()
            opcode = self.buf[0] & 0x0F
            payload, self.buf = self.buf[offset : offset + n], self.buf[offset + n :]
            if opcode == 1:
                yield json.loads(payload)

    def call(self, method: str, params: Any) -> dict[str, Any]:
        request_id = self.next_id
        self.next_id += 1
        self.send({"id": request_id, "method": method, "params": params})
        for message in self.messages():
            if message.get("id") == request_id:
                return message
        raise AssertionError("unreachable")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def reference_server(codex: Path, home: Path) -> Iterator[int]:
    port = _free_port()
    env = dict(os.environ, CODEX_HOME=str(home), TMPDIR=str(home.parent / "tmp"))
    Path(env["TMPDIR"]).mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [str(codex), "exec-server", "--listen", f"ws://127.0.0.1:{port}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def reference_start_ms(port: int, work: Path, count: int, sandboxed: bool) -> float:
    ws = TinyWebSocket(port)
    ws.call("initialize", {"clientName": "bench"})
    ws.send({"method": "initialized", "params": {}})
    times: list[float] = []
    for i in range(count + 3):
        pid = f"{'s' if sandboxed else 'u'}{i}"
        began = time.perf_counter()
        ws.send({"id": 10_000 + i, "method": "process/start",
                 "params": start_params(pid, ["true"], work, sandboxed)})  # fmt: skip
        for message in ws.messages():
            if "error" in message:
                raise RuntimeError(f"reference refused the start: {message['error']}")
            if message.get("method") == "process/exited":
                break
        if i >= 3:
            times.append((time.perf_counter() - began) * 1000)
    ws.sock.close()
    return statistics.median(times)


def run(rounds: int, count: int, codex: Path | None, mib: int) -> list[Ratio | Series]:
    base = Path(tempfile.mkdtemp(prefix="bench-sandbox-", dir="/var/tmp"))
    work = base / "work"
    work.mkdir()
    (work / ".git").mkdir()
    results: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        results.setdefault(name, []).append(value)

    try:
        for _ in range(rounds):
            add("ours", ours_start_ms(work, count, sandboxed=False))
            add("ours bwrap", ours_start_ms(work, count, sandboxed=True, mechanism="bwrap"))
            shutil.rmtree(work / ".git")  # Landlock refuses a carve-out that exists
            add("ours landlock", ours_start_ms(work, count, True, mechanism="landlock"))
            (work / ".git").mkdir()
            if codex is not None:
                home = base / "codex-home"
                home.mkdir(exist_ok=True)
                with reference_server(codex, home) as port:
                    add("reference", reference_start_ms(port, work, count, sandboxed=False))
                    add("reference sandboxed", reference_start_ms(port, work, count, True))
            # A B B A: drift of the machine's load within a round cancels out.
            a1 = ours_throughput(work, mib * MiB, sandboxed=False)
            b1 = ours_throughput(work, mib * MiB, sandboxed=True)
            b2 = ours_throughput(work, mib * MiB, sandboxed=True)
            a2 = ours_throughput(work, mib * MiB, sandboxed=False)
            add("throughput", (a1 + a2) / 2)
            add("throughput sandboxed", (b1 + b2) / 2)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    def series(name: str, unit: str = "ms") -> Series:
        return Series(name, unit, tuple(results[name]))

    figures: list[Ratio | Series] = [
        Ratio("sandboxed start (bwrap) / unsandboxed start", series("ours bwrap"), series("ours"),
              lower_is_better=True),
        Ratio("sandboxed start (landlock) / unsandboxed start", series("ours landlock"),
              series("ours"), lower_is_better=True),
    ]  # fmt: skip
    if codex is not None:
        figures += [
            Ratio("our sandboxed start (bwrap) / the reference's sandboxed start",
                  series("ours bwrap"), series("reference sandboxed"), target=0.5,
                  lower_is_better=True),
            Ratio("our sandboxed start (landlock) / the reference's sandboxed start",
                  series("ours landlock"), series("reference sandboxed"), target=0.5,
                  lower_is_better=True),
            Ratio("the reference: sandboxed / unsandboxed start", series("reference sandboxed"),
                  series("reference"), lower_is_better=True),
            Ratio("our unsandboxed start / the reference's", series("ours"), series("reference"),
                  lower_is_better=True),
        ]  # fmt: skip
    figures.append(
        Ratio(f"output {mib} MiB, sandboxed (bwrap) / unsandboxed",
              series("throughput sandboxed", "MB/s"), series("throughput", "MB/s"), target=0.95)
    )  # fmt: skip
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--count", type=int, default=40)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--codex", type=Path, default=CODEX if CODEX.exists() else None)
    args = parser.parse_args()
    print_header("sandboxed starts and output")
    for figure in run(args.rounds, args.count, args.codex, args.mib):
        if isinstance(figure, Ratio):
            print(figure.value.describe())
            print(figure.baseline.describe())
        print(figure.describe(), flush=True)


if __name__ == "__main__":
    main()
