"""Request round trips over stdio, as a ratio to a bare Twisted echo-RPC.

- server: ``process/read`` of a process that has exited and closed (so every
  request is answered at once), at 1 and 64 requests in flight.
- baseline: ``bench/echo_server.py``, a bare Twisted ``LineOnlyReceiver``
  answering ``{"id", "result": params}`` with msgspec, over the same kind of
  pipes with the same client and the same depths.

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


def _read_request(request_id: int) -> bytes:
    return b'{"id":%d,"method":"process/read","params":{"processId":"p"}}\n' % request_id


def pipelined_rate(client: StdioClient, count: int, depth: int) -> float:
    """Requests per second with ``depth`` in flight; every answer is checked."""
    sent = 0
    answered = 0

    def requests(n: int) -> bytes:
        nonlocal sent
        first = sent
        sent += n
        return b"".join(_read_request(i) for i in range(first, sent))

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


def server_rate(count: int, depth: int) -> float:
    with StdioClient(["--exit-retention-ms", "3600000"]) as client:
        client.initialize()
        client.start("p", ["true"])
        for message in client.messages():
            if message.method == "process/closed":
                break
        return pipelined_rate(client, count, depth)


def echo_rate(count: int, depth: int) -> float:
    with StdioClient(argv=[sys.executable, str(ECHO_SERVER)]) as client:
        # Wait out the interpreter's start-up, as server_rate does.
        pipelined_rate(client, 100, 1)
        return pipelined_rate(client, count, depth)


def run(rounds: int = 5, count: int = 200000) -> list[Ratio]:
    server: dict[int, list[float]] = {d: [] for d in DEPTHS}
    echo: dict[int, list[float]] = {d: [] for d in DEPTHS}
    for _ in range(rounds):
        for depth in DEPTHS:
            n = count if depth > 1 else count // 10
            echo[depth].append(echo_rate(n, depth))
            server[depth].append(server_rate(n, depth))
    return [
        Ratio(
            f"process/read round trips, depth {depth} (server / bare LineOnlyReceiver echo)",
            Series(f"server, depth {depth}", "req/s", tuple(server[depth])),
            Series(f"echo-RPC, depth {depth}", "req/s", tuple(echo[depth])),
            target=0.35 if depth == 64 else None,
        )
        for depth in DEPTHS
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
