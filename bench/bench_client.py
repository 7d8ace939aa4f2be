"""Client-side cost: how fast ``execserver.client`` consumes an output flood.

- decode: a captured server stream (``head -c N /dev/zero`` in pipe mode,
  the server's real stdout reads) fed to the client library's NDJSON channel
  (``NdjsonProtocol`` -> ``RpcClient`` -> ``ExecServerClient`` -> the process
  handle's output listener), no server running. Baseline in the same round:
  the lean typed decoder of the benchmarks' blocking client
  (``bench/_client.LineDecoder``) on the same reads.
- headroom: the library's decode rate / the server's stdout rate (measured
  with the lean client): above 1 means the library is not the bottleneck.
- end to end: ``ExecServerClient.spawn_local`` + ``head -c N /dev/zero`` on
  the Twisted reactor (in a child interpreter), counting output in a
  listener until ``process/closed``. Baseline: the same run with the lean
  blocking client (``bench_throughput.server_run``).

Rates are payload MB/s (10**6 bytes of child output per second); medians of
``--rounds``. Nothing is asserted.

    python bench/bench_client.py [--rounds 5] [--mib 128]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._client import MiB, Ratio, Series, print_header, server_env
from bench.bench_throughput import capture_stream, client_decode_rate, server_run


def library_decode_rate(reads: list[bytes]) -> float:
    """Payload MB/s of the client library on a captured stream."""
    from twisted.internet import task
    from twisted.internet.testing import StringTransport

    from execserver.client import ExecServerClient, RpcClient
    from execserver.client.channels import NdjsonProtocol
    from execserver.client.process import RemoteProcess
    from execserver.client.types import OutputEvent

    rpc = RpcClient()
    proto = NdjsonProtocol(rpc)
    proto.makeConnection(StringTransport())
    client = ExecServerClient(rpc, task.Clock())
    handle = RemoteProcess(client, "p")
    client._processes["p"] = handle  # as start_process would register it
    received = 0

    def count(event: OutputEvent) -> None:
        nonlocal received
        received += len(event.chunk)

    handle.add_output_listener(count)
    start = time.perf_counter()
    for data in reads:
        proto.dataReceived(data)
    seconds = time.perf_counter() - start
    assert handle.is_closed, "the captured stream ends with process/closed"
    return received / seconds / 1e6


_E2E = """
import sys, time
from twisted.internet import defer, task
from execserver.client import ExecServerClient

async def main(reactor):
    total = int(sys.argv[1])
    client = await ExecServerClient.spawn_local(reactor)
    received = 0
    def count(event):
        nonlocal received
        received += len(event.chunk)
    start = time.perf_counter()
    proc = await client.start_process(["head", "-c", str(total), "/dev/zero"])
    proc.add_output_listener(count)
    await proc.closed()
    seconds = time.perf_counter() - start
    await client.close()
    assert received == total, (received, total)
    print(total / seconds / 1e6)

task.react(lambda r: defer.Deferred.fromCoroutine(main(r)))
"""


def library_end_to_end_rate(total_bytes: int) -> float:
    """Payload MB/s through spawn_local on the Twisted reactor (own interpreter)."""
    out = subprocess.run(
        [sys.executable, "-c", _E2E, str(total_bytes)],
        env=server_env(),
        cwd=str(Path(__file__).resolve().parent.parent),
        check=True,
        capture_output=True,
        text=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def run(rounds: int = 5, mib: int = 128) -> list[Ratio | Series]:
    total = mib * MiB
    library: list[float] = []
    lean: list[float] = []
    server: list[float] = []
    e2e: list[float] = []
    e2e_lean: list[float] = []
    for _ in range(rounds):
        reads = capture_stream(total)
        library.append(library_decode_rate(reads))
        lean.append(client_decode_rate(reads))
        del reads
        server.append(server_run(total, tty=False)[0])
        e2e.append(library_end_to_end_rate(total))
        e2e_lean.append(server_run(total, tty=False)[0])
    library_series = Series("client library decode", "MB/s", tuple(library))
    return [
        Ratio(
            f"client library decode, {mib} MiB captured (library / lean msgspec decoder)",
            library_series,
            Series("lean decoder", "MB/s", tuple(lean)),
        ),
        Ratio(
            "client library headroom (library decode / server stdout)",
            library_series,
            Series("server stdout", "MB/s", tuple(server)),
        ),
        Ratio(
            f"end to end {mib} MiB (spawn_local + library / lean blocking client)",
            Series("library end to end", "MB/s", tuple(e2e)),
            Series("lean client end to end", "MB/s", tuple(e2e_lean)),
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args()
    print_header(f"client ({os.cpu_count()} CPUs)")
    results = run(args.rounds, args.mib)
    for result in results:
        print(result.describe(), flush=True)
    if args.json:
        print(
            json.dumps({r.name: (r.ratio if isinstance(r, Ratio) else r.median) for r in results})
        )


if __name__ == "__main__":
    main()
