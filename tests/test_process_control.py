"""Process control beyond the reference (issue 5), through the real server over stdio.

Covers docs/process-control.md: ``pipeStdin``, ``size``, ``timeoutMs``,
``idleTimeoutMs``, ``process/signal``, ``process/closeStdin``,
``process/resize``, ``process/wait``, ``process/list``, ``graceMs``, the
``signal``/``timedOut`` exit fields and ``process/closed``; process trees are
checked in /proc after terminate, timeout, connection loss and server SIGTERM.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import pytest_twisted

from tests.support.harness import DEFAULT_TIMEOUT, RpcFailure, b64, descendants, pid_alive, unb64
from tests.support.polling import until
from tests.support.stdio_server import ServerProcess

GRACE_MS = 300
NEW_METHODS = [
    "process/signal",
    "process/closeStdin",
    "process/resize",
    "process/wait",
    "process/list",
]


@asynccontextmanager
async def running_server(*args: str) -> AsyncIterator[ServerProcess]:
    server = ServerProcess.start("--terminate-grace-ms", str(GRACE_MS), *args)
    try:
        await server.handshake()
        yield server
    finally:
        await server.stop()


async def wait_output(server: ServerProcess, process_id: str, needle: bytes) -> bytes:
    """Wait until the process's streamed output contains ``needle``."""

    def seen(message: dict[str, Any]) -> bool:
        return needle in server.output_of(process_id)

    await server.wait_for(seen, what=f"{needle!r} from {process_id}")
    return server.output_of(process_id)


async def process_tree(server: ServerProcess, process_id: str) -> list[int]:
    """The leader's pid and every live descendant of it."""
    listed = await server.call("process/list", {})
    (entry,) = [e for e in listed["processes"] if e["processId"] == process_id]
    leader: int = entry["pid"]
    return [leader, *descendants(leader)]


async def assert_tree_gone(pids: list[int]) -> None:
    await until(
        lambda: not any(pid_alive(pid) for pid in pids),
        f"{pids} to be gone",
        timeout=DEFAULT_TIMEOUT,
    )


def closed_output(server: ServerProcess, process_id: str) -> bytes:
    """The output that arrived before ``process/closed`` (raw wire order)."""
    out: list[bytes] = []
    for message in server.messages:
        params = message.get("params", {})
        if not isinstance(params, dict) or params.get("processId") != process_id:
            continue
        if message.get("method") == "process/closed":
            return b"".join(out)
        if message.get("method") == "process/output":
            out.append(unb64(params["chunk"]))
    raise AssertionError(f"no process/closed for {process_id}")


# A shell with two background grandchildren that hold its output pipe.
TREE = ["sh", "-c", "sleep 300 & sleep 300 & echo ready; wait"]
# A grandchild holding the output plus a member that ignores SIGTERM and no
# longer holds it; that member says "ready" (on fd 3) once SIGTERM is ignored.
STUBBORN_TREE = [
    "sh",
    "-c",
    "sleep 300 & (trap '' TERM; echo ready >&3; exec sleep 300 3>&-) 3>&1 >/dev/null 2>&1 & wait",
]

#: STUBBORN_TREE that names its three pids: "ready LEADER SLEEP STUBBORN". A
#: test then needs no /proc scan before a short timeout fires.
REPORTING_TREE = [
    "sh",
    "-c",
    "sleep 300 & s=$!; (trap '' TERM; read -r me _ < /proc/self/stat;"
    ' echo "ready $$ $s $me" >&3; exec sleep 300 3>&-) 3>&1 >/dev/null 2>&1 & wait',
]


async def reported_tree(server: ServerProcess, process_id: str) -> list[int]:
    """The pids REPORTING_TREE printed (available even after it was killed)."""
    output = await wait_output(server, process_id, b"\n")
    words = output.split()
    assert words[0] == b"ready", output
    return [int(w) for w in words[1:4]]


# --- handshake and baseline compatibility ------------------------------------


@pytest_twisted.ensureDeferred
async def test_initialize_lists_the_new_methods() -> None:
    server = ServerProcess.start()
    try:
        init = await server.handshake()
        for method in NEW_METHODS:
            assert method in init["capabilities"]
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_baseline_client_sees_baseline_shapes() -> None:
    async with running_server() as server:
        await server.start_process("p", ["sh", "-c", "echo hi"])
        exited = await server.wait_notification("process/exited", "p")
        # `seq` (output 1, exit 2) is sent as the reference's current release does.
        assert exited == {"processId": "p", "exitCode": 0, "seq": 2}
        with pytest.raises(RpcFailure) as info:
            await server.call("process/write", {"processId": "p", "chunk": b64(b"x")})
        assert info.value.code == -32600
        assert info.value.message == "stdin is closed for process p"
        read = await server.call("process/read", {"processId": "p"})
        assert "timedOut" not in read and "signal" not in read
        # Terminate of an unknown id stays the baseline's {running: false}.
        assert await server.call("process/terminate", {"processId": "nope"}) == {"running": False}


# --- pipeStdin and closeStdin -------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_pipe_stdin_write_and_close_stdin_with_cat() -> None:
    async with running_server() as server:
        await server.start_process("cat", ["cat"], pipeStdin=True)
        data = b"line one\n" + bytes(range(256)) * 64
        await server.call("process/write", {"processId": "cat", "chunk": b64(data)})
        assert await server.call("process/closeStdin", {"processId": "cat"}) == {"closed": True}
        exited = await server.wait_notification("process/exited", "cat")
        assert exited["exitCode"] == 0
        await server.wait_closed("cat")
        assert closed_output(server, "cat") == data
        # Writing after closeStdin is refused like a baseline closed stdin.
        with pytest.raises(RpcFailure) as info:
            await server.call("process/write", {"processId": "cat", "chunk": b64(b"x")})
        assert info.value.code == -32600


@pytest_twisted.ensureDeferred
async def test_close_stdin_twice_and_without_pipe() -> None:
    async with running_server() as server:
        await server.start_process("c", ["sh", "-c", "cat; echo done; sleep 300"], pipeStdin=True)
        assert await server.call("process/closeStdin", {"processId": "c"}) == {"closed": True}
        assert await server.call("process/closeStdin", {"processId": "c"}) == {"closed": False}
        await wait_output(server, "c", b"done")
        await server.start_process("n", ["sleep", "300"])
        # Baseline stdin (no pipe): nothing to close.
        assert await server.call("process/closeStdin", {"processId": "n"}) == {"closed": False}
        for pid in ("c", "n"):
            await server.call("process/terminate", {"processId": pid, "graceMs": 0})
            await server.wait_closed(pid)


@pytest_twisted.ensureDeferred
async def test_close_stdin_on_a_pty_sends_the_terminals_eof_character() -> None:
    async with running_server() as server:
        await server.start_process("t", ["cat"], tty=True)
        await server.call("process/write", {"processId": "t", "chunk": b64(b"hello\n")})
        await wait_output(server, "t", b"hello\r\nhello\r\n")
        assert await server.call("process/closeStdin", {"processId": "t"}) == {"closed": True}
        exited = await server.wait_notification("process/exited", "t")
        assert exited["exitCode"] == 0
        # A program that changed its EOF character gets that one, read from termios.
        await server.start_process(
            "b", ["sh", "-c", "stty eof ^B; echo ready; cat; echo after-eof"], tty=True
        )
        await wait_output(server, "b", b"ready")
        assert await server.call("process/closeStdin", {"processId": "b"}) == {"closed": True}
        exited = await server.wait_notification("process/exited", "b")
        assert exited["exitCode"] == 0
        await server.wait_closed("b")
        assert b"after-eof" in closed_output(server, "b")


@pytest_twisted.ensureDeferred
async def test_pty_child_ending_on_eof_is_not_reported_as_hung_up() -> None:
    # Closing the master while the child is still exiting made the kernel
    # report SIGHUP for ~1 in 10 of these; the master now stays open until reap.
    async with running_server() as server:
        for n in range(40):
            process_id = f"eof{n}"
            await server.start_process(process_id, ["cat"], tty=True)
            await server.call("process/write", {"processId": process_id, "chunk": b64(b"x\n")})
            await wait_output(server, process_id, b"x\r\nx\r\n")
            await server.call("process/closeStdin", {"processId": process_id})
            exited = await server.wait_notification("process/exited", process_id)
            assert {k: v for k, v in exited.items() if k != "seq"} == {
                "processId": process_id,
                "exitCode": 0,
            }
            await server.wait_closed(process_id)


# --- signals and terminate ----------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_sigint_to_sleep_by_name_short_name_and_number() -> None:
    async with running_server() as server:
        for process_id, sig in (("a", "SIGINT"), ("b", "INT"), ("c", 2)):
            await server.start_process(process_id, ["sleep", "300"])
            result = await server.call("process/signal", {"processId": process_id, "signal": sig})
            assert result == {"delivered": True}
            exited = await server.wait_notification("process/exited", process_id)
            assert exited["exitCode"] == 130
            assert exited["signal"] == "SIGINT"
            assert "timedOut" not in exited
        # Once exited, nothing is delivered.
        result = await server.call("process/signal", {"processId": "a", "signal": "TERM"})
        assert result == {"delivered": False}


@pytest_twisted.ensureDeferred
async def test_signal_reaches_the_whole_group() -> None:
    async with running_server() as server:
        await server.start_process("g", TREE)
        await wait_output(server, "g", b"ready")
        tree = await process_tree(server, "g")
        assert len(tree) == 3
        await server.call("process/signal", {"processId": "g", "signal": "SIGKILL"})
        exited = await server.wait_notification("process/exited", "g")
        assert exited["signal"] == "SIGKILL"
        assert exited["exitCode"] == 137
        await server.wait_closed("g")
        await assert_tree_gone(tree)


@pytest_twisted.ensureDeferred
async def test_term_ignoring_process_is_killed_after_grace() -> None:
    async with running_server() as server:
        script = "trap '' TERM; echo ready; while :; do sleep 1; done"
        await server.start_process("stubborn", ["sh", "-c", script])
        await wait_output(server, "stubborn", b"ready")
        tree = await process_tree(server, "stubborn")
        started = time.monotonic()
        result = await server.call("process/terminate", {"processId": "stubborn", "graceMs": 400})
        assert result == {"running": True}
        exited = await server.wait_notification("process/exited", "stubborn")
        elapsed = time.monotonic() - started
        assert exited["signal"] == "SIGKILL"
        assert exited["exitCode"] == 137
        assert 0.35 <= elapsed < 5.0
        await server.wait_closed("stubborn")
        await assert_tree_gone(tree)


@pytest_twisted.ensureDeferred
async def test_terminate_grace_zero_kills_at_once() -> None:
    async with running_server("--terminate-grace-ms", "60000") as server:
        await server.start_process("k", ["sh", "-c", "trap '' TERM; echo ready; sleep 300"])
        await wait_output(server, "k", b"ready")
        await server.call("process/terminate", {"processId": "k", "graceMs": 0})
        exited = await server.wait_notification("process/exited", "k")
        assert exited["signal"] == "SIGKILL"


@pytest_twisted.ensureDeferred
async def test_terminate_uses_sigterm_first() -> None:
    async with running_server() as server:
        await server.start_process("t", ["sleep", "300"])
        await server.call("process/terminate", {"processId": "t"})
        exited = await server.wait_notification("process/exited", "t")
        assert exited["signal"] == "SIGTERM"
        assert exited["exitCode"] == 143


# --- timeouts -----------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_wall_timeout_kills_the_tree_and_reports_timed_out() -> None:
    async with running_server() as server:
        # The tree reports itself before the limit even on a loaded machine.
        await server.start_process("w", REPORTING_TREE, timeoutMs=2000)
        tree = await reported_tree(server, "w")
        assert len(set(tree)) == 3
        exited = await server.wait_notification("process/exited", "w")
        assert exited["timedOut"] == "wall"
        assert exited["signal"] == "SIGTERM"
        await server.wait_closed("w")
        await assert_tree_gone(tree)
        read = await server.call("process/read", {"processId": "w"})
        assert read["timedOut"] == "wall"
        waited = await server.call("process/wait", {"processId": "w"})
        assert waited == {"exited": True, "exitCode": 143, "signal": "SIGTERM", "timedOut": "wall"}


@pytest_twisted.ensureDeferred
async def test_idle_timeout_kills_a_silent_tree() -> None:
    async with running_server() as server:
        # Silent after its last line, which names the tree's pids (no /proc
        # scan has to beat the limit).
        script = 'echo a; sleep 0.1; sleep 300 & s=$!; sleep 300 & echo "b $$ $s $!"; wait'
        await server.start_process("i", ["sh", "-c", script], idleTimeoutMs=1500)
        exited = await server.wait_notification("process/exited", "i")
        assert exited["timedOut"] == "idle"
        await server.wait_closed("i")
        output = closed_output(server, "i")
        assert output.startswith(b"a\nb ") and output.endswith(b"\n"), output
        tree = [int(w) for w in output.split()[2:]]
        assert len(set(tree)) == 3
        await assert_tree_gone(tree)


@pytest_twisted.ensureDeferred
async def test_output_keeps_the_idle_timeout_away() -> None:
    async with running_server() as server:
        # Runs ~1.2 s, never silent for more than 0.1 s; the idle limit is 1 s.
        script = "for i in 1 2 3 4 5 6 7 8 9 10 11 12; do echo $i; sleep 0.1; done"
        await server.start_process("chatty", ["sh", "-c", script], idleTimeoutMs=1000)
        exited = await server.wait_notification("process/exited", "chatty")
        assert {k: v for k, v in exited.items() if k != "seq"} == {
            "processId": "chatty",
            "exitCode": 0,
        }


@pytest_twisted.ensureDeferred
async def test_zero_timeouts_mean_no_limit() -> None:
    async with running_server() as server:
        await server.start_process(
            "z", ["sh", "-c", "sleep 0.2; echo ok"], timeoutMs=0, idleTimeoutMs=0
        )
        exited = await server.wait_notification("process/exited", "z")
        assert {k: v for k, v in exited.items() if k != "seq"} == {"processId": "z", "exitCode": 0}


# --- resize -------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_size_and_resize_seen_by_stty() -> None:
    async with running_server() as server:
        script = "stty size; read x; stty size"
        await server.start_process(
            "r", ["sh", "-c", script], tty=True, size={"rows": 30, "cols": 100}
        )
        await wait_output(server, "r", b"30 100")
        assert (
            await server.call("process/resize", {"processId": "r", "rows": 40, "cols": 120}) == {}
        )
        await server.call("process/write", {"processId": "r", "chunk": b64(b"\n")})
        await wait_output(server, "r", b"40 120")
        await server.wait_notification("process/exited", "r")


@pytest_twisted.ensureDeferred
async def test_resize_sends_sigwinch() -> None:
    async with running_server() as server:
        script = "trap 'echo WINCH $(stty size)' WINCH; echo ready; while :; do sleep 0.05; done"
        await server.start_process("s", ["bash", "-c", script], tty=True)
        await wait_output(server, "s", b"ready")
        await server.call("process/resize", {"processId": "s", "rows": 33, "cols": 77})
        await wait_output(server, "s", b"WINCH 33 77")
        await server.call("process/terminate", {"processId": "s", "graceMs": 0})
        await server.wait_closed("s")


# --- wait and list --------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_wait_on_exit_and_on_timeout() -> None:
    async with running_server() as server:
        await server.start_process("short", ["sh", "-c", "sleep 0.2; exit 3"])
        waited = await server.call("process/wait", {"processId": "short"})
        assert waited == {"exited": True, "exitCode": 3}
        await server.start_process("long", ["sleep", "300"])
        started = time.monotonic()
        waited = await server.call("process/wait", {"processId": "long", "timeoutMs": 200})
        assert time.monotonic() - started >= 0.15
        assert waited == {"exited": False, "exitCode": None}
        assert await server.call("process/wait", {"processId": "long", "timeoutMs": 0}) == {
            "exited": False,
            "exitCode": None,
        }
        # A wait in flight is answered by the exit a terminate causes.
        pending = server.call("process/wait", {"processId": "long", "timeoutMs": 10000})
        await server.call("process/terminate", {"processId": "long"})
        assert await pending == {"exited": True, "exitCode": 143, "signal": "SIGTERM"}


@pytest_twisted.ensureDeferred
async def test_wait_on_a_timeout() -> None:
    async with running_server() as server:
        await server.start_process("t", ["sleep", "300"], timeoutMs=300)
        waited = await server.call("process/wait", {"processId": "t"})
        assert waited["exited"] is True
        assert waited["timedOut"] == "wall"


@pytest_twisted.ensureDeferred
async def test_list_shows_running_and_exited_processes() -> None:
    async with running_server() as server:
        assert await server.call("process/list", {}) == {"processes": []}
        await server.start_process("run", ["sleep", "300"])
        await server.start_process("done", ["sh", "-c", "exit 7"], tty=True)
        await server.wait_notification("process/exited", "done")
        listed = {e["processId"]: e for e in (await server.call("process/list", {}))["processes"]}
        assert set(listed) == {"run", "done"}
        assert listed["run"]["running"] is True
        assert listed["run"]["exitCode"] is None
        assert listed["run"]["argv"] == ["sleep", "300"]
        assert listed["run"]["tty"] is False
        assert pid_alive(listed["run"]["pid"])
        assert listed["done"]["running"] is False
        assert listed["done"]["exitCode"] == 7
        assert listed["done"]["tty"] is True
        await server.call("process/terminate", {"processId": "run", "graceMs": 0})
        await server.wait_closed("run")


# --- exit and close ordering ------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_pty_tail_of_one_mib_arrives_before_closed() -> None:
    async with running_server() as server:
        script = "printf '%1048576s' ''; printf END"
        await server.start_process("tail", ["sh", "-c", script], tty=True)
        exited = await server.wait_notification("process/exited", "tail", timeout=30)
        assert exited["exitCode"] == 0
        await server.wait_closed("tail", timeout=30)
        output = closed_output(server, "tail")
        assert len(output) == 1048576 + 3
        assert output.endswith(b" END")
        read = await server.call("process/read", {"processId": "tail", "afterSeq": 0})
        assert read["closed"] is True


@pytest_twisted.ensureDeferred
async def test_pipe_tail_arrives_before_exited() -> None:
    async with running_server() as server:
        await server.start_process("p", ["sh", "-c", "head -c 3000000 /dev/zero; echo END"])
        await server.wait_notification("process/exited", "p", timeout=30)
        before_exit = []
        for message in server.messages:
            if message.get("method") == "process/exited":
                break
            if message.get("method") == "process/output":
                before_exit.append(unb64(message["params"]["chunk"]))
        data = b"".join(before_exit)
        assert len(data) == 3000004
        assert data.endswith(b"END\n")


@pytest_twisted.ensureDeferred
async def test_grandchild_holding_the_pipe_delays_closed_not_exited() -> None:
    async with running_server() as server:
        await server.start_process("h", ["sh", "-c", "sleep 300 & echo started"])
        exited = await server.wait_notification("process/exited", "h")
        assert exited["exitCode"] == 0
        # The grandchild was reparented away from the server: find it by its group.
        listed = await server.call("process/list", {})
        leader = listed["processes"][0]["pid"]
        assert _group_alive(leader)
        read = await server.call("process/read", {"processId": "h", "waitMs": 300})
        assert read["exited"] is True
        assert read["closed"] is False
        assert not any(m.get("method") == "process/closed" for m in server.messages)
        # A plain terminate leaves the background job alone (it ends with the
        # session); asked for, it ends.
        result = await server.call("process/terminate", {"processId": "h"})
        assert result == {"running": False}
        assert _group_alive(leader)
        [listed_h] = (await server.call("process/list", {}))["processes"]
        assert len(listed_h["descendants"]) == 1
        terminate = {"processId": "h", "descendants": True}
        assert await server.call("process/terminate", terminate) == {"running": False}
        await server.wait_closed("h")
        read = await server.call("process/read", {"processId": "h"})
        assert read["closed"] is True
        await until(
            lambda: not _group_alive(leader), "the group to be gone", timeout=DEFAULT_TIMEOUT
        )


def _group_alive(pgid: int) -> bool:
    """True while a live process is in group ``pgid`` (found in /proc)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


# --- cleanup when the session or the server ends ---------------------------------


@pytest_twisted.ensureDeferred
async def test_terminate_leaves_no_process_of_the_tree() -> None:
    async with running_server() as server:
        await server.start_process("t", STUBBORN_TREE)
        await wait_output(server, "t", b"ready")
        tree = await process_tree(server, "t")
        assert len(tree) == 3
        await server.call("process/terminate", {"processId": "t"})
        await server.wait_closed("t")
        await assert_tree_gone(tree)


@pytest_twisted.ensureDeferred
async def test_connection_loss_leaves_no_process_behind() -> None:
    server = ServerProcess.start("--terminate-grace-ms", str(GRACE_MS))
    try:
        await server.handshake()
        await server.start_process("a", STUBBORN_TREE)
        await server.start_process("b", TREE, tty=True)
        await wait_output(server, "a", b"ready")
        await wait_output(server, "b", b"ready")
        trees = await process_tree(server, "a") + await process_tree(server, "b")
        assert len(trees) == 6
    finally:
        code = await server.stop()
    assert code == 0
    await assert_tree_gone(trees)


@pytest_twisted.ensureDeferred
async def test_server_sigterm_leaves_no_process_behind() -> None:
    server = ServerProcess.start("--terminate-grace-ms", str(GRACE_MS))
    try:
        await server.handshake()
        await server.start_process("a", STUBBORN_TREE)
        await server.start_process("b", TREE, tty=True)
        await wait_output(server, "a", b"ready")
        await wait_output(server, "b", b"ready")
        trees = await process_tree(server, "a") + await process_tree(server, "b")
        server.kill("TERM")
        await server.wait_notification("process/closed", "a")
        await server.wait_notification("process/closed", "b")
    finally:
        await server.stop()
    await assert_tree_gone(trees)


# --- invalid input ----------------------------------------------------------------


async def expect_error(
    server: ServerProcess, method: str, params: dict[str, Any], code: int, message: str | None
) -> RpcFailure:
    with pytest.raises(RpcFailure) as info:
        await server.call(method, params)
    assert info.value.code == code, info.value.message
    if message is not None:
        assert info.value.message == message
    return info.value


@pytest_twisted.ensureDeferred
async def test_invalid_inputs_get_precise_errors() -> None:
    async with running_server() as server:
        await server.start_process("pipe", ["sleep", "300"])
        await server.start_process("tty", ["sleep", "300"], tty=True)
        await server.start_process("gone", ["true"])
        await server.wait_notification("process/exited", "gone")

        await expect_error(
            server,
            "process/signal",
            {"processId": "pipe", "signal": "SIGFOO"},
            -32602,
            "unknown signal `SIGFOO`",
        )
        await expect_error(
            server, "process/signal", {"processId": "pipe", "signal": 0}, -32602, None
        )
        await expect_error(
            server, "process/signal", {"processId": "pipe", "signal": 1000}, -32602, None
        )
        await expect_error(
            server, "process/signal", {"processId": "pipe", "signal": True}, -32602, None
        )
        for rows, cols in ((0, 80), (24, -1), (65536, 80), (24, 0)):
            await expect_error(
                server,
                "process/resize",
                {"processId": "tty", "rows": rows, "cols": cols},
                -32602,
                None,
            )
        await expect_error(
            server,
            "process/resize",
            {"processId": "pipe", "rows": 24, "cols": 80},
            -32600,
            "process pipe is not a tty",
        )
        await expect_error(
            server, "process/closeStdin", {"processId": "gone"}, -32600, "process gone has exited"
        )
        await expect_error(
            server, "process/terminate", {"processId": "pipe", "graceMs": -1}, -32602, None
        )
        await expect_error(
            server, "process/wait", {"processId": "pipe", "timeoutMs": -5}, -32602, None
        )
        for method, extra in (
            ("process/signal", {"signal": "INT"}),
            ("process/closeStdin", {}),
            ("process/resize", {"rows": 24, "cols": 80}),
            ("process/wait", {}),
        ):
            await expect_error(
                server, method, {"processId": "nope", **extra}, -32600, "unknown process id nope"
            )
        start = {
            "processId": "bad",
            "argv": ["true"],
            "cwd": "/",
            "env": {},
            "tty": True,
            "arg0": None,
        }
        await expect_error(
            server, "process/start", {**start, "size": {"rows": 0, "cols": 80}}, -32602, None
        )
        await expect_error(server, "process/start", {**start, "timeoutMs": -1}, -32602, None)
        await expect_error(server, "process/start", {**start, "idleTimeoutMs": "x"}, -32602, None)
        # None of the rejected starts took the id.
        await server.call("process/start", {**start, "tty": False})
        for pid in ("pipe", "tty"):
            await server.call("process/terminate", {"processId": pid, "graceMs": 0})
            await server.wait_closed(pid)
