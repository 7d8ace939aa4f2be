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
  listener until ``process/closed``. Baseline: the lean blocking client's
  run of the same round (``bench_throughput.server_run``; the same run is
  the server stdout rate of the headroom figure).

Rates are payload MB/s (10**6 bytes of child output per second); medians of
``--rounds``. Nothing is asserted.

    python bench/bench_client.py [--rounds 5] [--mib 128]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._client import (
    MiB,
    Ratio,
    Series,
    client_bench_main,
    stream_round,
    twisted_end_to_end_rate,
)
from bench.bench_throughput import client_decode_rate


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
    client._table.register(handle)  # as start_process would register it
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


def run(rounds: int = 5, mib: int = 128) -> list[Ratio | Series]:
    total = mib * MiB
    library: list[float] = []
    lean: list[float] = []
    server: list[float] = []
    e2e: list[float] = []
    for _ in range(rounds):
        (library_rate, lean_rate), server_rate = stream_round(
            total, [library_decode_rate, client_decode_rate]
        )
        library.append(library_rate)
        lean.append(lean_rate)
        server.append(server_rate)
        e2e.append(twisted_end_to_end_rate(total))
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
            Series("lean client end to end", "MB/s", tuple(server)),
        ),
    ]


def main() -> None:
    client_bench_main(__doc__, "client", run)


if __name__ == "__main__":
    main()
