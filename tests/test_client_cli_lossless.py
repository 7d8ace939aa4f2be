"""``exec-server-client run`` through dropped connections: lossless, or loud (issue 20).

The issue's reproduction: a child writes far more than the server's
``--retained-output-bytes`` while the client is kept away from its session
by a connection-cutting proxy (:mod:`tests.support.cutting_proxy`, which holds the
client's new connections until the child has done what the test waits for).
With the default ``--on-detached-full pause`` the output must be byte-exact
and the exit status the child's; with ``--on-detached-full drop`` the client
must print the documented line naming the lost range and exit 125, never the
child's own status. Hypothesis chooses where the two cuts fall (the second
one lands in the reconnection's handshake or its catch-up).
"""

from __future__ import annotations

import hashlib
import random
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.protocol import Factory
from twisted.protocols.basic import LineOnlyReceiver

from execserver.client.cli.common import EXIT_OUTPUT_LOST
from tests.support.children import Collected
from tests.support.cutting_proxy import CuttingProxy
from tests.support.harness import (
    child_env,
    console_script,
    observe,
    reactor,
    server_env,
    with_timeout,
)
from tests.support.polling import until
from tests.support.tls import Pki
from tests.support.ws_harness import WsServerProcess

#: The server keeps this much output per process; the child writes 16 times it.
RETAINED = 256 * 1024
CHUNK = 65536
CHUNKS = 64
EXIT_CODE = 5
SEED = 7


def child_script(chunks: int) -> str:
    """The child: ``chunks`` pseudo-random 64 KiB writes, exit 5; its pid and
    its end are reported over a TCP connection to the test."""
    return (
        "import os, random, socket, sys\n"
        "s = socket.create_connection(('127.0.0.1', int(os.environ['REPORT_PORT'])))\n"
        "s.sendall(b'pid %d\\n' % os.getpid())\n"
        f"r = random.Random({SEED}); w = sys.stdout.buffer.write\n"
        f"for _ in range({chunks}): w(r.randbytes({CHUNK}))\n"
        "sys.stdout.flush()\n"
        "s.sendall(b'done\\n'); s.close()\n"
        f"sys.exit({EXIT_CODE})\n"
    )


CHILD = child_script(CHUNKS)
#: The line ``run`` prints for a gap (docs/client.md, "Exit status").
GAP_LINE = re.compile(
    rb"exec-server-client: output lost: the server dropped output seqs (\d+)-(\d+) of "
    rb"`[^`]+` before this client read them \(delivered before the gap: "
    rb"stdout (\d+) bytes, stderr (\d+) bytes\); exiting 125, not with the command's 5\n"
)


def expected(chunks: int = CHUNKS) -> bytes:
    r = random.Random(SEED)
    return b"".join(r.randbytes(CHUNK) for _ in range(chunks))


class Reports(LineOnlyReceiver):
    delimiter = b"\n"

    def __init__(self, box: ChildReports) -> None:
        self.box = box

    def lineReceived(self, line: bytes) -> None:
        word, _, rest = line.partition(b" ")
        if word == b"pid":
            self.box.pid = int(rest)
        elif word == b"done":
            self.box.done = True


class ChildReports:
    """What the child tells the test: its pid, and that it wrote everything."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.done = False
        self.port: Any = None

    async def listen(self) -> ChildReports:
        endpoint = TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1")
        self.port = await endpoint.listen(Factory.forProtocol(lambda: Reports(self)))
        return self

    def reset(self) -> None:
        self.pid, self.done = None, False

    def waiting(self) -> bool:
        """The child is done, or waits in read(2)/write(2): on its full output
        (a paused child) or for input that only the absent client can send."""
        if self.done:
            return True
        if self.pid is None:
            return False
        try:
            with open(f"/proc/{self.pid}/syscall") as f:
                syscall = f.read().split()
        except OSError:
            return False
        return bool(syscall) and syscall[0] in ("0", "1")  # read, write (x86-64)


async def run_through_cuts(
    proxy: CuttingProxy,
    reports: ChildReports,
    first: int,
    second: int | None,
    mode: str | None,
    *,
    options: tuple[str, ...] = (),
    child: str = CHILD,
    stdin: bytes | None = None,
    url: str | None = None,
) -> Collected:
    """One ``run`` of ``child``; the client is held away after the first cut until
    the child finished writing (drop) or waits on its pipe (pause); the
    second cut (if any) falls that many bytes into the resumed connection.

    ``stdin``: written to the client's stdin, which is then closed (else it
    stays open and empty).
    """
    reports.reset()
    proto = Collected()
    argv = [console_script("exec-server-client"), "run", "--url", url or proxy.url, *options]
    if mode is not None:
        argv += ["--on-detached-full", mode]
    argv += ["-e", f"REPORT_PORT={reports.port.getHost().port}", "--"]
    argv += [sys.executable, "-c", child]
    env = server_env({"PATH": child_env()["PATH"]})
    cuts = proxy.cuts
    proxy.hold_after = proxy.accepted + 1  # the first connection goes through
    proxy.cut_after(first)
    reactor.spawnProcess(proto, argv[0], argv, env=env, path="/")
    if stdin is not None:
        assert proto.transport is not None
        proto.transport.write(stdin)
        proto.transport.closeStdin()
    try:
        await until(
            lambda: proxy.cuts > cuts or proto.ended.called,
            "the first cut or the end",
            timeout=30.0,
        )
        assert proxy.cuts > cuts, f"the CLI ended before the cut: {bytes(proto.err)!r}"
        if mode == "drop":
            await until(lambda: reports.done, "the child to finish writing", timeout=30.0)
        else:
            await until(reports.waiting, "the child to be paused", timeout=30.0)
        if second is not None:
            proxy.cut_after(second)
        proxy.release()
        await with_timeout(observe(proto.ended), 60.0, "the CLI to finish")
        return proto
    finally:
        # Shown with a failure (a timeout included): where the cuts fell and
        # how far the CLI got.
        print(f"cuts {proxy.cuts}, {proxy.s2c_bytes} bytes forwarded, {proxy.accepted} accepted")
        print(f"CLI: ended {proto.ended.called}, stdout {len(proto.out)} bytes, stderr:")
        print(bytes(proto.err)[-4000:].decode(errors="replace"))
        proxy.release()
        proxy.cut_at = None
        if not proto.ended.called:
            proto.transport.signalProcess("KILL")  # type: ignore[union-attr]


def chosen(max_first: int) -> list[tuple[int, int | None]]:
    """Cut points chosen by hypothesis (few: each example runs the real CLI)."""
    picked: list[tuple[int, int | None]] = []

    @settings(
        max_examples=min(4, settings().max_examples),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        first=st.integers(min_value=20_000, max_value=max_first),
        second=st.none() | st.integers(min_value=1, max_value=600_000),
    )
    def pick(first: int, second: int | None) -> None:
        picked.append((first, second))

    pick()
    return picked


async def started(*args: str) -> tuple[WsServerProcess, CuttingProxy, ChildReports]:
    server = await WsServerProcess.start("--retained-output-bytes", str(RETAINED), *args)
    proxy = await CuttingProxy(server.host_port).start()
    reports = await ChildReports().listen()
    return server, proxy, reports


async def stopped(server: WsServerProcess, proxy: CuttingProxy, reports: ChildReports) -> None:
    await proxy.stop()
    await reports.port.stopListening()
    await server.stop()


@pytest_twisted.ensureDeferred
async def test_the_issue_command_is_byte_exact_through_two_cuts_by_default() -> None:
    server, proxy, reports = await started()
    try:
        # The first cut: after the start, within the first 3 of 5.3 MiB (base64).
        for first, second in chosen(3 * 1024 * 1024):
            cli = await run_through_cuts(proxy, reports, first, second, mode=None)
            where = f"cuts {first}, {second}: {bytes(cli.err)!r}"
            assert bytes(cli.out) == expected(), where
            assert (cli.ended.result, bytes(cli.err)) == (EXIT_CODE, b""), where
    finally:
        await stopped(server, proxy, reports)


@pytest_twisted.ensureDeferred
async def test_the_issues_own_command_and_cuts_with_the_default_retention() -> None:
    # As reported: 256 writes of 64 KiB (16 MiB) and exit 5, the default
    # retention (1 MiB), a reset after 4 MB reached the client and one more
    # on the next connection; the client away while the child is paused.
    server = await WsServerProcess.start()
    proxy = await CuttingProxy(server.host_port).start()
    reports = await ChildReports().listen()
    try:
        cli = await run_through_cuts(
            proxy, reports, 4_000_000, 100_000, mode=None, child=child_script(256)
        )
        assert bytes(cli.out) == expected(256), bytes(cli.err)
        assert (cli.ended.result, bytes(cli.err)) == (EXIT_CODE, b"")
    finally:
        await stopped(server, proxy, reports)


@pytest_twisted.ensureDeferred
async def test_drop_mode_prints_the_lost_range_and_exits_125() -> None:
    server, proxy, reports = await started()
    try:
        # The cut falls within the first 2 MiB: more than the retention follows.
        for first, second in chosen(2 * 1024 * 1024)[:3]:
            cli = await run_through_cuts(proxy, reports, first, second, mode="drop")
            where = f"cuts {first}, {second}: {bytes(cli.err)!r}"
            assert cli.ended.result == EXIT_OUTPUT_LOST, where
            match = GAP_LINE.fullmatch(bytes(cli.err))
            assert match is not None, where
            from_seq, to_seq, before, stderr_bytes = (int(g) for g in match.groups())
            assert 1 <= from_seq <= to_seq and stderr_bytes == 0, where
            # What arrived: the stream up to the gap, then the end of it, no more
            # than the retention holds (none when the last chunk alone exceeds it).
            out, want = bytes(cli.out), expected()
            assert out[:before] == want[:before], where
            tail = out[before:]
            assert len(tail) <= RETAINED and want.endswith(tail), where
            assert before + len(tail) < len(want), where
    finally:
        await stopped(server, proxy, reports)


# --- pause holds under every drop: stdin, a PTY; WebSocket, Unix socket, TLS -----------

#: Reads its stdin in CHUNK pieces, writing CHUNK pseudo-random bytes for each,
#: then the SHA-256 of its input to stderr: stdin forwarded across the cuts.
STDIN_CHILD = (
    "import hashlib, os, random, socket, sys\n"
    "s = socket.create_connection(('127.0.0.1', int(os.environ['REPORT_PORT'])))\n"
    "s.sendall(b'pid %d\\n' % os.getpid())\n"
    f"h = hashlib.sha256(); r = random.Random({SEED}); w = sys.stdout.buffer.write\n"
    "while True:\n"
    f"    data = sys.stdin.buffer.read({CHUNK})\n"
    "    if not data: break\n"
    f"    h.update(data); w(r.randbytes({CHUNK}))\n"
    "sys.stdout.flush(); sys.stderr.write(h.hexdigest() + '\\n')\n"
    "s.sendall(b'done\\n'); s.close()\n"
    f"sys.exit({EXIT_CODE})\n"
)
STDIN_CHUNKS = 32
#: The plain child in a PTY put in raw mode (no newline translation, no echo).
PTY_CHILD = "import tty; tty.setraw(1)\n" + CHILD


def scenario(kind: str) -> tuple[dict[str, Any], bytes, bytes]:
    """(run_through_cuts arguments, expected stdout, expected stderr) of ``kind``."""
    if kind == "stdin":
        data = random.Random(11).randbytes(STDIN_CHUNKS * CHUNK)
        out = expected()[: STDIN_CHUNKS * CHUNK]
        digest = hashlib.sha256(data).hexdigest().encode() + b"\n"
        return {"child": STDIN_CHILD, "stdin": data, "options": ("-i",)}, out, digest
    if kind == "pty":
        return {"child": PTY_CHILD, "options": ("-t",)}, expected(), b""
    return {}, expected(), b""


async def transport_server(
    transport: str, root: Path
) -> tuple[WsServerProcess, CuttingProxy, str, tuple[str, ...]]:
    """(server, proxy, the URL the CLI dials, its extra options) over ``transport``."""
    retained = ("--retained-output-bytes", str(RETAINED))
    if transport == "unix":
        server = await WsServerProcess.start("--listen", f"unix://{root}/server.sock", *retained)
        proxy = await CuttingProxy(f"{root}/server.sock", listen_unix=f"{root}/proxy.sock").start()
        return server, proxy, proxy.url, ()
    if transport == "tls":
        pki = Pki(root)
        server = await WsServerProcess.start(
            *("--listen", "wss://127.0.0.1:0", "--tls-cert", pki.server_cert),
            *("--tls-key", pki.server_key, *retained),
        )
        proxy = await CuttingProxy(server.host_port).start()
        url = f"wss://127.0.0.1:{proxy.port.getHost().port}"
        return server, proxy, url, ("--ca-file", pki.ca_file)
    server = await WsServerProcess.start(*retained)
    proxy = await CuttingProxy(server.host_port).start()
    return server, proxy, proxy.url, ()


def handshake_and_catch_up_cuts() -> tuple[int, int, int]:
    """A first cut, and where a second one falls: in the resumed connection's
    handshake (its upgrade answer and initialize result are a few hundred
    bytes) or in its catch-up (the reads of the retained output)."""
    picked: list[tuple[int, int, int]] = []

    @settings(max_examples=1, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(
        first=st.integers(min_value=20_000, max_value=1024 * 1024),
        in_handshake=st.integers(min_value=1, max_value=300),
        in_catch_up=st.integers(min_value=2_000, max_value=RETAINED),
    )
    def pick(first: int, in_handshake: int, in_catch_up: int) -> None:
        picked.append((first, in_handshake, in_catch_up))

    pick()
    return picked[0]


KINDS = ["pipes", "stdin", "pty"]
TRANSPORTS = ["ws", "unix", "tls"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest_twisted.ensureDeferred
async def test_pause_is_byte_exact_through_cuts_in_the_handshake_and_the_catch_up(
    transport: str, kind: str
) -> None:
    root = Path(tempfile.mkdtemp(prefix="es-i20-"))  # short: Unix socket paths
    server, proxy, url, options = await transport_server(transport, root)
    reports = await ChildReports().listen()
    kwargs, out, err = scenario(kind)
    kwargs["options"] = (*options, *kwargs.get("options", ()))
    try:
        first, in_handshake, in_catch_up = handshake_and_catch_up_cuts()
        # The second cut alternates over the matrix: each transport and each
        # kind gets one in the handshake and one in the catch-up.
        odd = (TRANSPORTS.index(transport) + KINDS.index(kind)) % 2
        second = in_catch_up if odd else in_handshake
        cli = await run_through_cuts(proxy, reports, first, second, mode=None, url=url, **kwargs)
        where = f"{transport} {kind}, cuts {first}, {second}: {bytes(cli.err)[-300:]!r}"
        assert bytes(cli.out) == out, where
        assert (cli.ended.result, bytes(cli.err)) == (EXIT_CODE, err), where
        # Resumed at least once (twice unless the second cut fell before the
        # resumed connection reached the server).
        assert proxy.accepted >= 2
    finally:
        await stopped(server, proxy, reports)
        shutil.rmtree(root, ignore_errors=True)
