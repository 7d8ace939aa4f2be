"""Fakes for unit tests: an outbound that records messages, a spawner whose
processes are driven by the test, and a signal sender that kills nothing.

Fake processes deliver events in the order Twisted does for a real child:
output, ``childConnectionLost`` per stream, ``processExited``, then
``processEnded`` (reaped and every pipe closed).
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet import error
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from execserver.app import build_dispatcher
from execserver.config import ServerConfig
from execserver.dispatcher import Connection
from execserver.processes import ManagedProcess
from execserver.session import Session, session_of
from execserver.spawn import ProcessSpec, SpawnError

# Above Linux's largest pid_max (2**22): a fake pid never names a real process,
# so even a signal that escaped the fake kill function could reach nothing.
FAKE_PID_BASE = 5_000_000


class FakeOutbound:
    """Collects what the dispatcher writes to a transport."""

    def __init__(self) -> None:
        self.raw: list[bytes] = []
        self.closed = False

    def write_message(self, data: bytes) -> None:
        assert b"\n" not in data, "a message must fit on one NDJSON line"
        self.raw.append(data)

    def close_connection(self) -> None:
        self.closed = True

    def unsent_bytes(self) -> int:
        return 0  # (everything is "sent" as written)

    def discard_unsent(self) -> None:
        pass

    @property
    def messages(self) -> list[dict[str, Any]]:
        return [json.loads(m) for m in self.raw]

    def take(self) -> list[dict[str, Any]]:
        """Messages written since the last take()."""
        out = self.messages
        self.raw.clear()
        return out

    def responses(self) -> dict[Any, dict[str, Any]]:
        return {m["id"]: m for m in self.messages if "id" in m}

    def notifications(self, method: str | None = None) -> list[dict[str, Any]]:
        return [
            m["params"]
            for m in self.messages
            if "method" in m and (method is None or m["method"] == method)
        ]


class FakeKill:
    """Stands in for ``os.killpg``: records signals; a group lives until killed."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int]] = []
        self.dead: set[int] = set()

    def __call__(self, pid: int, sig: int) -> bool:
        alive = pid not in self.dead
        if sig != 0:
            self.sent.append((pid, sig))
        if sig == 9:
            self.dead.add(pid)
        return alive

    def signals_to(self, pid: int) -> list[int]:
        return [sig for p, sig in self.sent if p == pid]


class FakeStdin:
    """The stdin pipe of a fake process, with Twisted's buffer attributes."""

    def __init__(self) -> None:
        self.written = b""
        self.dataBuffer = b""
        self.offset = 0
        self._tempDataLen = 0

    def write(self, data: bytes) -> None:
        self.written += data


class FakeProcessTransport:
    """The transport a fake spawner hands a ManagedProcess."""

    def __init__(self, proto: ManagedProcess, spec: ProcessSpec, pid: int) -> None:
        self.proto = proto
        self.spec = spec
        self.pid = pid
        self.paused = False
        self.pause_calls = 0
        self.resume_calls = 0
        self.written = b""
        self.lost = False
        self.pipes: dict[int, Any] = {0: FakeStdin()} if spec.pipe_stdin else {}
        # A PTYProcess is itself a FileDescriptor with a write buffer.
        self.dataBuffer = b""
        self.offset = 0
        self._tempDataLen = 0

    # --- what the session calls -----------------------------------------------------

    def pauseProducing(self) -> None:
        self.paused = True
        self.pause_calls += 1

    def resumeProducing(self) -> None:
        self.paused = False
        self.resume_calls += 1

    def write(self, data: bytes) -> None:
        self.written += data

    def loseConnection(self) -> None:
        self.lost = True

    def closeStdin(self) -> None:
        pass

    # --- what the test drives ---------------------------------------------------------

    def output(self, data: bytes, fd: int = 1) -> None:
        self.proto.childDataReceived(fd, data)

    def exit(self, code: int = 0, signal: int | None = None) -> None:
        """The child died: streams close, then exit, then the end."""
        if signal is not None:
            reason = Failure(error.ProcessTerminated(None, signal, None))
        elif code == 0:
            reason = Failure(error.ProcessDone(0))
        else:
            reason = Failure(error.ProcessTerminated(code, None, None))
        self._group_gone()
        self.proto.processExited(reason)
        self.proto.processEnded(reason)

    def exit_leaving_group(self, code: int = 0) -> Failure:
        """The leader exited but a group member still holds the output open."""
        reason = Failure(error.ProcessDone(0) if code == 0 else error.ProcessTerminated(code))
        self.proto.processExited(reason)
        return reason

    def end(self, reason: Failure) -> None:
        self._group_gone()
        self.proto.processEnded(reason)

    def _group_gone(self) -> None:
        """The whole group is gone (nothing holds the output any more): streams close."""
        kill = self.proto._kill
        if isinstance(kill, FakeKill):
            kill.dead.add(self.pid)
        for fd in (1, 2) if not self.spec.tty else (1,):
            self.proto.childConnectionLost(fd)


class FakeSpawner:
    """A Spawner whose children exist only as FakeProcessTransports."""

    def __init__(self, kill: FakeKill | None = None) -> None:
        self.kill = kill or FakeKill()
        self.spawned: list[FakeProcessTransport] = []
        self.fail_with: SpawnError | None = None

    def spawn(self, proto: Any, spec: ProcessSpec) -> FakeProcessTransport:
        if self.fail_with is not None:
            raise self.fail_with
        assert isinstance(proto, ManagedProcess)
        # The session builds its ManagedProcess with the real killpg; route
        # every signal of this fake child to the recording fake instead.
        proto._kill = self.kill
        transport = FakeProcessTransport(proto, spec, FAKE_PID_BASE + len(self.spawned))
        self.spawned.append(transport)
        proto.makeConnection(transport)
        return transport

    def by_id(self, process_id: str) -> FakeProcessTransport:
        matches = [t for t in self.spawned if t.proto.process_id == process_id]
        assert matches, f"no process {process_id} was spawned"
        return matches[-1]


class Harness:
    """One dispatcher connection over fakes, driven by JSON lines."""

    def __init__(
        self, config: ServerConfig | None = None, spawner: FakeSpawner | None = None
    ) -> None:
        self.clock = Clock()
        self.spawner = spawner or FakeSpawner()
        self.dispatcher = build_dispatcher(config or ServerConfig(), self.clock, self.spawner)
        self.outbound = FakeOutbound()
        self.conn: Connection = self.dispatcher.connect(self.outbound, "test")
        self._next_id = 1

    @property
    def session(self) -> Session:
        """The process session the connection carries now."""
        return session_of(self.conn)

    def send(self, message: dict[str, Any]) -> None:
        self.conn.message_received(json.dumps(message).encode())

    def request(self, method: str, params: Any = None, request_id: Any = None) -> Any:
        """Send a request; returns its id."""
        if request_id is None:
            request_id = self._next_id
            self._next_id += 1
        message: dict[str, Any] = {"id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        self.send(message)
        return request_id

    def response(self, request_id: Any) -> dict[str, Any] | None:
        return self.outbound.responses().get(request_id)

    def call(self, method: str, params: Any = None) -> dict[str, Any]:
        """A request that must be answered at once; returns the whole response."""
        request_id = self.request(method, params)
        response = self.response(request_id)
        assert response is not None, f"{method} was not answered synchronously"
        return response

    def result(self, method: str, params: Any = None) -> Any:
        response = self.call(method, params)
        assert "error" not in response, response
        return response["result"]

    def error(self, method: str, params: Any = None) -> dict[str, Any]:
        response = self.call(method, params)
        assert "error" in response, response
        error: dict[str, Any] = response["error"]
        return error

    def handshake(self) -> dict[str, Any]:
        result: dict[str, Any] = self.result("initialize", {"clientName": "test"})
        self.send({"method": "initialized", "params": {}})
        return result

    def start(self, process_id: str = "proc-1", tty: bool = False, **extra: Any) -> Any:
        params: dict[str, Any] = {
            "processId": process_id,
            "argv": ["bash", "-lc", "sleep 30"],
            "cwd": "/",
            "env": {},
            "tty": tty,
            "arg0": None,
        }
        params.update(extra)
        return self.result("process/start", params)

    def process(self, process_id: str = "proc-1") -> FakeProcessTransport:
        return self.spawner.by_id(process_id)


def exec_params(process_id: str = "proc-1", **extra: Any) -> dict[str, Any]:
    params: dict[str, Any] = {
        "processId": process_id,
        "argv": ["bash", "-lc", "true"],
        "cwd": "/",
        "env": {},
        "tty": False,
        "arg0": None,
    }
    params.update(extra)
    return params


# --- a second connection to a harness's dispatcher ---------------------------------------


class Second:
    """Another connection to the harness's dispatcher."""

    def __init__(self, h: Harness, identity: object = None) -> None:
        self.outbound = FakeOutbound()
        if identity is not None:
            self.outbound.identity = identity  # type: ignore[attr-defined]
        self.conn = h.dispatcher.connect(self.outbound, "second")
        self._id = 1000

    def call(self, method: str, params: Any) -> dict[str, Any]:
        import json

        self._id += 1
        self.conn.message_received(
            json.dumps({"id": self._id, "method": method, "params": params}).encode()
        )
        response: dict[str, Any] = self.outbound.responses()[self._id]
        return response


def drop(h: Harness) -> None:
    """What a transport does when its connection is lost."""
    h.conn.transport_closed()
    h.conn.shutdown()


def ready(config: ServerConfig | None = None) -> Harness:
    """A :class:`Harness` past the handshake."""
    h = Harness(config)
    h.handshake()
    return h
