"""What every integration test needs: paths, environments, bounded waits, /proc probes.

The installed console scripts (found next to ``sys.executable``; no path to
this checkout is passed on, so the code under test is what ``pip install``
shipped), the environments for our server and for the processes it starts,
``with_timeout`` / ``observe`` for Deferreds, and the JSON-RPC bookkeeping
(:class:`RpcTestClient`) the stdio and WebSocket test clients share. The
servers themselves: ``tests/support/stdio_server.py`` (``ServerProcess``),
``tests/support/ws_harness.py`` (``WsServerProcess``), both on
``tests/support/server_process.py``.
"""

from __future__ import annotations

import base64
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from twisted.internet import reactor as _reactor
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
reactor: Any = _reactor

DEFAULT_TIMEOUT = 10.0

#: The environment's scripts directory: ``exec-server``, ``exec-server-client``
#: and ``twistd`` as installed by ``pip install '.[test]'``.
BIN = Path(sys.executable).parent


#: A working directory outside the checkout for clients the tests run: an
#: ``exec-server-client --stdio`` starts ``python -m execserver``, which
#: would import a checkout in its working directory.
NEUTRAL_CWD = Path(tempfile.gettempdir())


def console_script(name: str) -> str:
    """The installed console script ``name`` (an error, not a skip, when missing)."""
    path = BIN / name
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: install the package under test (pip install '.[test]')"
        )
    return str(path)


def run_script(name: str, *args: str, text: bool = False) -> subprocess.CompletedProcess[Any]:
    """Run console script ``name`` to its end (no stdin, output captured, 60 s)."""
    return subprocess.run(
        [console_script(name), *args],
        env=server_env(),
        capture_output=True,
        text=text,
        timeout=60,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test's environment minus any ``PYTHONPATH`` entry inside this checkout."""
    env = dict(os.environ)
    kept = [
        entry
        for entry in env.pop("PYTHONPATH", "").split(os.pathsep)
        if entry and not Path(entry).resolve().is_relative_to(REPO_ROOT)
    ]
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    env.pop("COVERAGE_PROCESS_START", None)
    if extra:
        env.update(extra)
    return env


def child_env() -> dict[str, str]:
    """An environment for processes the server starts."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


class RpcFailure(Exception):
    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(f"{error.get('code')}: {error.get('message')}")
        self.code: int = error["code"]
        self.message: str = error["message"]
        self.data: Any = error.get("data")


def with_timeout(d: Deferred[Any], seconds: float, what: str) -> Deferred[Any]:
    def on_timeout(result: Any, timeout: float) -> Any:
        if isinstance(result, Failure):
            result.trap(Exception)
        raise TimeoutError(f"timed out after {timeout}s waiting for {what}")

    return d.addTimeout(seconds, reactor, onTimeoutCancel=on_timeout)


def observe(source: Deferred[Any]) -> Deferred[Any]:
    """A Deferred that fires with ``source``'s result without consuming it."""
    d: Deferred[Any] = Deferred()

    def forward(outcome: Any) -> Any:
        if not d.called:
            d.callback(outcome if not isinstance(outcome, Failure) else None)
        return outcome

    source.addBoth(forward)
    return d


class RpcTestClient:
    """JSON-RPC bookkeeping shared by the stdio and WebSocket test clients.

    Subclasses call :meth:`_init_rpc` in ``__init__``, implement :meth:`send`,
    and hand every decoded incoming message to :meth:`_received`.
    """

    client_name = "test"

    def _init_rpc(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.notifications: list[dict[str, Any]] = []
        self.pending: dict[Any, Deferred[dict[str, Any]]] = {}
        self.watchers: list[tuple[Callable[[dict[str, Any]], bool], Deferred[Any]]] = []
        self.next_id = 1

    def send(self, message: dict[str, Any], binary: bool = False) -> None:
        raise NotImplementedError

    def _received(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        self._dispatch(message)

    def _dispatch(self, message: dict[str, Any]) -> None:
        if "id" in message and ("result" in message or "error" in message):
            d = self.pending.pop(message["id"], None)
            if d is not None:
                d.callback(message)
        else:
            self.notifications.append(message)
        for watcher in list(self.watchers):
            predicate, d = watcher
            if not d.called and predicate(message):
                self.watchers.remove(watcher)
                d.callback(message)

    def _fail_pending(self, reason: str) -> None:
        for d in list(self.pending.values()):
            if not d.called:
                d.errback(ConnectionError(reason))
        self.pending.clear()

    def notify(self, method: str, params: Any = None) -> None:
        message: dict[str, Any] = {"method": method}
        if params is not None:
            message["params"] = params
        self.send(message)

    async def request(
        self,
        method: str,
        params: Any = None,
        timeout: float = DEFAULT_TIMEOUT,
        binary: bool = False,
    ) -> dict[str, Any]:
        """Send a request and return the whole response message."""
        request_id = self.next_id
        self.next_id += 1
        d: Deferred[dict[str, Any]] = Deferred()
        self.pending[request_id] = d
        message: dict[str, Any] = {"id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        self.send(message, binary)
        result: dict[str, Any] = await with_timeout(d, timeout, f"response to {method}")
        return result

    async def call(self, method: str, params: Any = None, timeout: float = DEFAULT_TIMEOUT) -> Any:
        """Send a request and return its result, raising RpcFailure on an error."""
        response = await self.request(method, params, timeout)
        if "error" in response:
            raise RpcFailure(response["error"])
        return response["result"]

    async def handshake(self) -> dict[str, Any]:
        result: dict[str, Any] = await self.call("initialize", {"clientName": self.client_name})
        self.notify("initialized", {})
        return result

    async def wait_for(
        self,
        predicate: Callable[[dict[str, Any]], bool],
        timeout: float = DEFAULT_TIMEOUT,
        what: str = "a message",
        include_past: bool = True,
    ) -> dict[str, Any]:
        if include_past:
            for message in self.messages:
                if predicate(message):
                    return message
        d: Deferred[dict[str, Any]] = Deferred()
        self.watchers.append((predicate, d))
        result: dict[str, Any] = await with_timeout(d, timeout, what)
        return result

    async def wait_notification(
        self, method: str, process_id: str | None = None, timeout: float = DEFAULT_TIMEOUT
    ) -> dict[str, Any]:
        def match(m: dict[str, Any]) -> bool:
            return m.get("method") == method and (
                process_id is None or m.get("params", {}).get("processId") == process_id
            )

        message = await self.wait_for(match, timeout, f"{method} for {process_id}")
        params: dict[str, Any] = message["params"]
        return params

    async def start_process(
        self,
        process_id: str,
        argv: list[str],
        tty: bool = False,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        **extra: Any,
    ) -> Any:
        params: dict[str, Any] = {
            "processId": process_id,
            "argv": argv,
            "cwd": cwd or str(REPO_ROOT),
            "env": child_env() if env is None else env,
            "tty": tty,
            "arg0": None,
        }
        params.update(extra)
        return await self.call("process/start", params)

    def output_of(self, process_id: str, stream: str | None = None) -> bytes:
        """Concatenated process/output bytes received so far, in seq order."""
        chunks = [
            m["params"]
            for m in self.notifications
            if m.get("method") == "process/output"
            and m["params"]["processId"] == process_id
            and (stream is None or m["params"]["stream"] == stream)
        ]
        chunks.sort(key=lambda c: c["seq"])
        return b"".join(unb64(c["chunk"]) for c in chunks)

    async def wait_closed(self, process_id: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        await self.wait_notification("process/closed", process_id, timeout)


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A 127.0.0.1 port that refuses connections for as long as the block runs.

    The socket stays bound but never listens: connecting gets ECONNREFUSED,
    and no other process (a parallel test's server) can take the port
    meanwhile, as it could once a probe socket were closed.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def status_bytes(pid: int, field: str = "VmRSS") -> int:
    """A size field (``VmRSS``, ``VmHWM``, ...) of ``/proc/PID/status``, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(f"no {field} for {pid}")


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` now."""
    return status_bytes(pid, "VmRSS")


def reset_peak_rss(pid: int) -> None:
    """Restart ``pid``'s peak-RSS count (``VmHWM``) from its current RSS."""
    # clear_refs "5" (Linux >= 4.0); without permission the peak simply
    # keeps counting from the start, which only makes the check stricter.
    with contextlib.suppress(OSError), open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes(pid: int) -> int:
    """Highest RSS of ``pid`` since it started or since :func:`reset_peak_rss`."""
    return status_bytes(pid, "VmHWM")


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (via /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found
