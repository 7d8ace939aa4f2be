"""``http/request`` throughput: a streamed body through the server, as ratios.

Each round fetches the same body from a local HTTP server (127.0.0.1,
threaded ``http.server``) three ways, in turn: directly with ``urllib``
(the baseline), through this server (``python -m execserver --listen
stdio://``, ``streamResponse``, every ``http/request/bodyDelta`` decoded),
and through the reference (``codex exec-server --listen stdio``, when
``--codex PATH`` is given). Prints MiB/s per way, medians and the ratios
to the baseline measured in the same round. Nothing is asserted.

    python bench/bench_http_request.py [--rounds 5] [--mib 64] [--codex PATH]
"""

from __future__ import annotations

import argparse
import base64
import http.server
import json
import os
import socketserver
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

CHUNK = 64 * 1024


def serve(total: int) -> tuple[socketserver.ThreadingTCPServer, str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(total))
            self.end_headers()
            block = b"x" * CHUNK
            for _ in range(total // CHUNK):
                self.wfile.write(block)

        def log_message(self, *args: object) -> None:
            pass

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def direct(url: str, total: int) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(url) as response:
        got = 0
        while block := response.read(1 << 20):
            got += len(block)
    assert got == total
    return time.perf_counter() - started


def through(argv: list[str], env: dict[str, str], url: str, total: int) -> float:
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
    )
    assert proc.stdin is not None and proc.stdout is not None

    def send(message: dict[str, object]) -> None:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(message).encode() + b"\n")
        proc.stdin.flush()

    try:
        send({"id": 1, "method": "initialize", "params": {"clientName": "bench"}})
        proc.stdout.readline()
        send({"method": "initialized", "params": {}})
        params = {"method": "GET", "url": url, "requestId": "b", "streamResponse": True}
        started = time.perf_counter()
        send({"id": 2, "method": "http/request", "params": params})
        got = 0
        while True:
            message = json.loads(proc.stdout.readline())
            note = message.get("params") if message.get("method") else None
            if note is None:
                continue
            got += len(base64.b64decode(note["deltaBase64"]))
            if note["done"]:
                assert note["error"] is None and got == total, (note, got)
                return time.perf_counter() - started
    finally:
        proc.stdin.close()
        proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--codex", type=Path, default=None)
    args = parser.parse_args()
    total = args.mib * 1024 * 1024
    server, url = serve(total)
    tmp = Path(tempfile.mkdtemp(prefix="bench-http-"))
    (tmp / "home").mkdir()
    (tmp / "tmp").mkdir()
    env = dict(os.environ, CODEX_HOME=str(tmp / "home"), TMPDIR=str(tmp / "tmp"))
    ways = {"direct (urllib)": lambda: direct(url, total)}
    ours = [sys.executable, "-m", "execserver", "--listen", "stdio://"]
    ways["exec-server"] = lambda: through(ours, env, url, total)
    if args.codex is not None:
        reference = [str(args.codex), "exec-server", "--listen", "stdio"]
        ways["reference"] = lambda: through(reference, env, url, total)
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            seconds[name].append(way())
    server.shutdown()
    base = statistics.median(seconds["direct (urllib)"])
    print(f"{args.mib} MiB streamed, {args.rounds} rounds")
    for name, runs in seconds.items():
        median = statistics.median(runs)
        rates = ", ".join(f"{args.mib / s:.0f}" for s in runs)
        print(
            f"{name:16} {args.mib / median:7.0f} MiB/s  ratio to direct {base / median:.2f}"
            f"  (runs: {rates})"
        )


if __name__ == "__main__":
    main()
