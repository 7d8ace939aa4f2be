"""Client-side cost of the asyncio client: can ``execserver.aio`` keep up?

- decode: a captured server stream (``head -c N /dev/zero`` in pipe mode,
  the server's real stdout reads) fed to the aio client's stdio path
  (``_ServerPipes.pipe_data_received`` -> NDJSON framing -> ``AsyncRpc``
  -> ``Client`` -> the process handle's output listener), no server
  running. Baselines in the same round: the server's own stdout rate
  (headroom: above 1 means the client is not what limits a stream; the
  same run is the lean client's end-to-end baseline below), the
  Twisted client library on the same reads, the lean msgspec decoder of
  the benchmarks' blocking client.
- end to end: ``aio.connect()`` (a spawned local server over stdio) +
  ``head -c N /dev/zero``, counting output in a listener until
  ``process/closed``, in a child interpreter; baseline: the same run with
  the lean blocking client.
- end to end over WebSocket: the same through ``aio.connect("ws://...")``
  (the ``websockets`` library) against one ``--listen ws://127.0.0.1:0``
  server; baseline: the Twisted client's ``connect_websocket`` (Autobahn)
  to the same server in the same round.

Rates are payload MB/s (10**6 bytes of child output per second); medians of
``--rounds``. Nothing is asserted.

    python bench/bench_aio_client.py [--rounds 5] [--mib 128]
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
    child_rate,
    client_bench_main,
    stream_round,
    twisted_end_to_end_rate,
)
from bench.bench_client import library_decode_rate
from bench.bench_throughput import client_decode_rate
from bench.bench_websocket import Server


class _NoChannel:
    """The decode benchmark sends nothing."""

    async def send(self, data: bytes) -> None:
        raise AssertionError("nothing is sent while decoding a captured stream")

    async def aclose(self) -> None:
        pass

    def abort(self) -> None:
        pass


def aio_decode_rate(reads: list[bytes]) -> float:
    """Payload MB/s of the aio client on a captured stream (in an event loop,
    as the client always runs)."""
    import asyncio

    async def measure() -> float:
        return _aio_decode_rate(reads)

    return asyncio.run(measure())


def _aio_decode_rate(reads: list[bytes]) -> float:
    from execserver.aio.channels import _ServerPipes
    from execserver.aio.client import Client, _Dialer
    from execserver.aio.process import Process
    from execserver.aio.rpc import AsyncRpc
    from execserver.clientcore.types import InitializeResult, OutputEvent

    rpc = AsyncRpc()
    pipes = _ServerPipes(rpc, None)
    dialer = _Dialer(
        url=None,
        server_command=None,
        token=None,
        ca_file=None,
        client_cert=None,
        client_key=None,
        connect_timeout=10.0,
        client_name="bench",
        session_ttl_ms=None,
        on_detached_full=None,
        env=None,
        stderr=None,
        shutdown_grace=5.0,
    )
    channel: object = _NoChannel()
    client = Client(
        dialer,
        rpc,
        channel,  # type: ignore[arg-type]
        InitializeResult("exec-server.v0"),
        request_timeout=None,
        resume=False,
    )
    handle = Process(client, "p")
    client._table.register(handle)  # as start() would register it
    received = 0

    def count(event: OutputEvent) -> None:
        nonlocal received
        received += len(event.chunk)

    handle.add_output_listener(count)
    start = time.perf_counter()
    for data in reads:
        pipes.pipe_data_received(1, data)
    seconds = time.perf_counter() - start
    assert handle.is_closed, "the captured stream ends with process/closed"
    return received / seconds / 1e6


_E2E = """
import asyncio, sys, time
from execserver import aio

async def main():
    total = int(sys.argv[1])
    async with aio.connect(sys.argv[2] if len(sys.argv) > 2 else None) as client:
        received = 0
        def count(event):
            nonlocal received
            received += len(event.chunk)
        start = time.perf_counter()
        proc = await client.start(["head", "-c", str(total), "/dev/zero"])
        proc.add_output_listener(count)
        await proc.closed()
        seconds = time.perf_counter() - start
    assert received == total, (received, total)
    print(total / seconds / 1e6)

asyncio.run(main())
"""


def aio_end_to_end_rate(total_bytes: int, url: str | None = None) -> float:
    """Payload MB/s through aio.connect() over stdio or ``url`` (own interpreter)."""
    return child_rate(_E2E, total_bytes, url)


def run(rounds: int = 5, mib: int = 128) -> list[Ratio | Series]:
    total = mib * MiB
    aio_rates: list[float] = []
    twisted_rates: list[float] = []
    lean: list[float] = []
    server: list[float] = []
    e2e: list[float] = []
    ws_aio: list[float] = []
    ws_twisted: list[float] = []
    ws = Server("--listen", "ws://127.0.0.1:0")
    host, port = ws.ws_address()
    url = f"ws://{host}:{port}"
    try:
        for _ in range(rounds):
            (aio_rate, twisted_rate, lean_rate), server_rate = stream_round(
                total, [aio_decode_rate, library_decode_rate, client_decode_rate]
            )
            aio_rates.append(aio_rate)
            twisted_rates.append(twisted_rate)
            lean.append(lean_rate)
            server.append(server_rate)
            e2e.append(aio_end_to_end_rate(total))
            ws_aio.append(aio_end_to_end_rate(total, url))
            ws_twisted.append(twisted_end_to_end_rate(total, url))
    finally:
        ws.stop()
    aio_series = Series("aio client decode", "MB/s", tuple(aio_rates))
    return [
        Ratio(
            "aio client headroom (aio decode / server stdout)",
            aio_series,
            Series("server stdout", "MB/s", tuple(server)),
        ),
        Ratio(
            f"aio client decode, {mib} MiB captured (aio / Twisted client library)",
            aio_series,
            Series("Twisted client library decode", "MB/s", tuple(twisted_rates)),
        ),
        Ratio(
            f"aio client decode, {mib} MiB captured (aio / lean msgspec decoder)",
            aio_series,
            Series("lean decoder", "MB/s", tuple(lean)),
        ),
        Ratio(
            f"end to end {mib} MiB (aio.connect() over stdio / lean blocking client)",
            Series("aio end to end", "MB/s", tuple(e2e)),
            Series("lean client end to end", "MB/s", tuple(server)),
        ),
        Ratio(
            f"end to end {mib} MiB over ws:// (aio with websockets / Twisted client)",
            Series("aio over ws://", "MB/s", tuple(ws_aio)),
            Series("Twisted client over ws://", "MB/s", tuple(ws_twisted)),
        ),
    ]


def main() -> None:
    client_bench_main(__doc__, "aio client", run)


if __name__ == "__main__":
    main()
