"""Request round trips over stdio, as a ratio to a bare Twisted echo-RPC.

Two methods, each at 1 and 64 requests in flight:

- a cheap one: ``process/read`` of a process that has exited and closed (so
  every request is answered at once from memory);
- ``fs/getMetadata`` of a directory: the server ``stat``s it inline once
  the directory it is looked up in has been verified local on the fs pool
  (docs/filesystem.md, "Inline or pool"), else on the pool. Target at
  depth 64: 0.5 of the echo (issue 13).

Baseline: ``bench/echo_server.py``, a bare Twisted ``LineOnlyReceiver`` with
msgspec that, like the server, writes the replies to one read's requests in
one write; it echoes the params for the cheap method and answers
``fs/getMetadata`` with an inline ``os.stat`` of the path. Same pipes, same
client, same depths.

The client keeps ``depth`` requests outstanding: for each batch of answers it
reads, it writes as many new requests in one write.

    python bench/bench_rtt.py [--rounds 5] [--count 20000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import msgspec

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._client import (
    Ratio,
    Series,
    ServerError,
    StdioClient,
    print_header,
)

DEPTHS = (1, 64)
ECHO_SERVER = Path(__file__).resolve().parent / "echo_server.py"
#: (method, depth) -> the ratio promised: process/read's own target, and
#: issue 13's for fs/getMetadata (bench_fs.py prints the same figure).
TARGETS: dict[tuple[str, int], float] = {("process/read", 64): 0.35, ("fs/getMetadata", 64): 0.5}
#: method name -> request template (one ``%d`` for the id)
METHODS: dict[str, bytes] = {
    "process/read": b'{"id":%d,"method":"process/read","params":{"processId":"p"}}\n',
    "fs/getMetadata": b'{"id":%d,"method":"fs/getMetadata","params":{"path":"/tmp"}}\n',
}


def pipelined_rate(
    client: StdioClient, count: int, depth: int, template: bytes = METHODS["process/read"]
) -> float:
    """Requests per second with ``depth`` in flight; every answer is checked."""
    sent = 0
    answered = 0

    def requests(n: int) -> bytes:
        nonlocal sent
        first = sent
        sent += n
        return b"".join(template % i for i in range(first, sent))

    start = time.perf_counter()
    client.send_bytes(requests(min(depth, count)))
    while answered < count:
        got = 0
        for message in client.read_batch():
            if isinstance(message.error, msgspec.Raw):
                raise ServerError(bytes(message.error).decode())
            if message.id is not None:
                got += 1
        answered += got
        more = min(got, count - sent)
        if more > 0:
            client.send_bytes(requests(more))
    return count / (time.perf_counter() - start)


def server_rate(count: int, depth: int, method: str = "process/read") -> float:
    with StdioClient(["--exit-retention-ms", "3600000"]) as client:
        client.initialize()
        client.start("p", ["true"])
        for message in client.messages():
            if message.method == "process/closed":
                break
        # Warm up as echo_rate does (for fs/*: the thread pool starts).
        pipelined_rate(client, 100, 1, METHODS[method])
        return pipelined_rate(client, count, depth, METHODS[method])


def echo_rate(count: int, depth: int, method: str = "process/read") -> float:
    with StdioClient(argv=[sys.executable, str(ECHO_SERVER)]) as client:
        # Wait out the interpreter's start-up, as server_rate does.
        pipelined_rate(client, 100, 1, METHODS[method])
        return pipelined_rate(client, count, depth, METHODS[method])


def run(rounds: int = 5, count: int = 200000) -> list[Ratio]:
    keys = [(method, depth) for method in METHODS for depth in DEPTHS]
    server: dict[tuple[str, int], list[float]] = {k: [] for k in keys}
    echo: dict[tuple[str, int], list[float]] = {k: [] for k in keys}
    for _ in range(rounds):
        for method, depth in keys:
            n = count if depth > 1 else count // 10
            if method != "process/read":
                n //= 4  # a stat per request; keeps the run short
            echo[method, depth].append(echo_rate(n, depth, method))
            server[method, depth].append(server_rate(n, depth, method))
    return [
        Ratio(
            f"{method} round trips, depth {depth} (server / batching echo-RPC)",
            Series(f"server {method}, depth {depth}", "req/s", tuple(server[method, depth])),
            Series(f"echo-RPC {method}, depth {depth}", "req/s", tuple(echo[method, depth])),
            target=TARGETS.get((method, depth)),
        )
        for method, depth in keys
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count", type=int, default=200000)
    args = parser.parse_args()
    print_header("round trips")
    for ratio in run(args.rounds, args.count):
        print(ratio.value.describe())
        print(ratio.baseline.describe())
        print(ratio.describe(), flush=True)


if __name__ == "__main__":
    main()
