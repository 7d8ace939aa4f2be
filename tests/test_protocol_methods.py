"""Each wire method declared once (``protocol.METHODS``), and used by server and clients.

The declaration names the method, its params and result types, its
handshake family and whether a call of it may be repeated after a resume.
These tests check that the server's routes carry the declared family (and,
for the process methods, the declared params type), that the clients'
resume rule is the declared one, and that every typed method of the three
clients goes through the one generic ``request`` path with the declared
result type.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from execserver import protocol as p
from execserver.aio.client import Client as AioClient
from execserver.app import build_dispatcher
from execserver.client.api import ClientApi
from execserver.clientcore.calls import REPEATABLE, repeatable
from execserver.config import ServerConfig
from tests.support.fakes import FakeSpawner

T = TypeVar("T")

#: Each typed method's call, with the declaration it must go through.
_CALLS: list[tuple[str, tuple[Any, ...], p.Method[Any, Any]]] = [
    ("read", ("p1", 3, 10, 0), p.ProcessRead),
    ("write", ("p1", b"x"), p.ProcessWrite),
    ("terminate", ("p1",), p.ProcessTerminate),
    ("signal", ("p1", "INT"), p.ProcessSignal),
    ("close_stdin", ("p1",), p.ProcessCloseStdin),
    ("resize", ("p1", 24, 80), p.ProcessResize),
    ("wait", ("p1", 5), p.ProcessWait),
    ("list_processes", (), p.ProcessList),
    ("fs_read_file", ("/f",), p.FsReadFile),
    ("fs_write_file", ("/f", b"d"), p.FsWriteFile),
    ("fs_create_directory", ("/d", True), p.FsCreateDirectory),
    ("fs_get_metadata", ("/f",), p.FsGetMetadata),
    ("fs_read_directory", ("/d",), p.FsReadDirectory),
    ("fs_remove", ("/f", True, True), p.FsRemove),
    ("fs_copy", ("/a", "/b", True), p.FsCopy),
]


def test_every_method_is_declared_once_with_its_wire_name() -> None:
    names = [method.name for method in p.METHODS]
    assert len(names) == len(set(names)) == 16
    assert {m.name for m in p.METHODS} >= {p.PROCESS_START, p.FS_COPY, p.PROCESS_LIST}
    assert {declared.name for _, _, declared in _CALLS} | {p.PROCESS_START} == set(names)


def test_the_server_routes_carry_the_declared_family_and_params() -> None:
    dispatcher = build_dispatcher(ServerConfig(), Clock(), FakeSpawner())
    for method in p.METHODS:
        route = dispatcher.routes[method.name]
        assert route.family == method.family, method.name
        if method.family == "exec":
            assert route.params_type is method.params, method.name


def test_the_resume_rule_is_the_declared_one() -> None:
    assert {
        p.PROCESS_READ,
        p.PROCESS_WAIT,
        p.PROCESS_LIST,
        p.FS_READ_FILE,
        p.FS_GET_METADATA,
        p.FS_READ_DIRECTORY,
    } == REPEATABLE
    for method in p.METHODS:
        if method is not p.ProcessWrite:
            assert repeatable(method.name, None) is method.repeatable
    assert repeatable(p.PROCESS_WRITE, p.WriteParams("p", b"", write_id="w"))
    assert not repeatable(p.PROCESS_WRITE, p.WriteParams("p", b""))


class _Recording(ClientApi):
    def __init__(self) -> None:
        self.sent: list[tuple[str, object, type[Any]]] = []

    def _call(self, method: str, params: object, result_type: type[T]) -> Deferred[T]:
        self.sent.append((method, params, result_type))
        return succeed(None)  # type: ignore[arg-type]


def _check(sent: list[tuple[str, object, type[Any]]]) -> None:
    assert len(sent) == len(_CALLS)
    for (method, params, result_type), (_, _, declared) in zip(sent, _CALLS, strict=True):
        assert method == declared.name
        assert isinstance(params, declared.params)
        assert result_type is declared.result


def test_the_twisted_typed_methods_go_through_the_declarations() -> None:
    client = _Recording()
    for name, args, _ in _CALLS:
        getattr(client, name)(*args)
    client.exec(p.ExecParams(process_id="p", argv=["true"], cwd="/", env={}, tty=False))
    _check(client.sent[:-1])
    assert client.sent[-1][0] == p.PROCESS_START and client.sent[-1][2] is p.ExecResponse


class _AioRecording(AioClient):
    def __init__(self) -> None:  # no connection: only the typed methods run
        self._request_timeout = None
        self._resume_enabled = False
        self.sent: list[tuple[str, object, type[Any]]] = []

    @property
    def resumable(self) -> bool:
        return False

    async def call(
        self, method: str, params: object, result_type: type[T], *, timeout: Any = None
    ) -> T:
        self.sent.append((method, params, result_type))
        return None  # type: ignore[return-value]


def test_the_asyncio_typed_methods_go_through_the_declarations() -> None:
    client = _AioRecording()

    async def every() -> None:
        for name, args, _ in _CALLS:
            await getattr(client, name)(*args)

    asyncio.run(every())
    _check(client.sent)


def test_the_twisted_client_offers_the_shared_names() -> None:
    import execserver.client as twisted_client
    from execserver.client.process import RemoteProcess
    from execserver.client.reconnect import ReconnectingClient, ResumingClient

    # The handle's pull queue under the asyncio/blocking name, the old one kept.
    assert RemoteProcess.output is RemoteProcess.subscribe
    # The reconnecting clients where the docs import them from.
    assert twisted_client.ReconnectingClient is ReconnectingClient
    assert twisted_client.ResumingClient is ResumingClient
    assert {"ReconnectingClient", "ResumingClient"} <= set(twisted_client.__all__)


def test_every_server_route_is_a_declared_method() -> None:
    """Issue 25 point 2: each route of the server is added from its one
    declaration (name, params type, family); the fs reads and writes decode
    with the server's own wire types, named at the route (``decode=``)."""
    from execserver.codex.capability_discovery import CapabilitiesDiscoverV2
    from execserver.codex.environment_config import EnvironmentConfigRead
    from execserver.fs.handlers import ReadFileWire, WriteFileWire
    from execserver.fs.handles import METHODS as BLOCK_READS

    declarations = (
        *p.METHODS,
        *p.DIALECT_METHODS,
        *BLOCK_READS,
        CapabilitiesDiscoverV2,
        EnvironmentConfigRead,
        p.HttpRequest,
    )
    declared = {method.name: method for method in declarations}
    assert len(declared) == len(declarations)  # each name declared once
    server_decode = {p.FS_READ_FILE: ReadFileWire, p.FS_WRITE_FILE: WriteFileWire}
    dispatcher = build_dispatcher(ServerConfig(), Clock(), FakeSpawner())
    # fs/watchMissing is routed only where inotify is available.
    assert set(declared) - {p.FS_WATCH_MISSING} <= set(dispatcher.routes) <= set(declared)
    for name, route in dispatcher.routes.items():
        method = declared[name]
        assert route.family == method.family, name
        assert route.params_type is server_decode.get(name, method.params), name
    for name, decode in server_decode.items():
        # The server's type decodes every field a client may send.
        client_fields = set(declared[name].params.__struct_fields__)
        assert client_fields <= set(decode.__struct_fields__), name
