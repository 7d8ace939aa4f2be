"""ResumingClient's decisions after a drop.

Against scripted servers on a fake clock, the dial is the test's: each
attempt gets the answer the case needs (a client of another session, a
refused upgrade, a refused connection). The CLI's own dial is checked
against a real WebSocket server on 127.0.0.1 for the typed errors those
decisions rest on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import pytest_twisted
from twisted.internet import error
from twisted.internet.defer import Deferred, fail, succeed

from execserver.client import AuthRefused, ConnectFailed, ExecServerClient, SessionLost
from execserver.client.cli import build_parser
from execserver.client.cli.common import connect
from execserver.client.reconnect import ResumingClient
from execserver.clientcore.resume import REFUSED_GIVE_UP_SECONDS
from tests.support.client_fakes import LocalWsServer, ScriptedServer
from tests.support.harness import reactor, refused_port

URL = "ws://127.0.0.1:1"


def resumable(server: ScriptedServer, session_id: str) -> ExecServerClient:
    """A client of ``server`` that was granted the resumable session ``session_id``."""
    d = server.connect()
    (init,) = server.expect(1)
    server.reply(
        init["id"],
        {"protocolVersion": "exec-server.v0", "sessionId": session_id, "sessionTtlMs": 30_000},
    )
    server.expect(1)  # initialized
    clients: list[ExecServerClient] = []
    d.addCallback(clients.append)
    (client,) = clients
    assert client.resumable
    return client


def dropped(
    answer: Callable[[], Deferred[ExecServerClient]],
) -> tuple[ResumingClient, list[str]]:
    """A ResumingClient whose first connection just dropped; each dial gets ``answer()``."""
    first_server = ScriptedServer()
    first = resumable(first_server, "s1")
    dialed: list[str] = []

    def dial(session_id: str) -> Deferred[ExecServerClient]:
        dialed.append(session_id)
        return answer()

    resuming = ResumingClient(first_server.clock, first, dial)
    first_server.drop()
    return resuming, dialed


def test_a_resume_answered_with_another_session_gives_up_and_closes_it() -> None:
    other_server = ScriptedServer()
    other = resumable(other_server, "s2")
    resuming, dialed = dropped(lambda: succeed(other))
    assert dialed == ["s1"]
    assert isinstance(resuming.lost, SessionLost)
    assert resuming.lost.session_id == "s1"
    assert "the server started a new session" in str(resuming.lost)
    # The handles are not adopted by the other session, and its connection is released.
    assert resuming.client is not other
    assert other_server.transport.disconnecting
    assert resuming.resumes == 0


def test_a_refused_token_gives_up_at_once_naming_it() -> None:
    refused = AuthRefused(URL, 401, "authentication refused (HTTP 401 Unauthorized)")
    resuming, dialed = dropped(lambda: fail(refused))
    assert dialed == ["s1"]
    assert isinstance(resuming.lost, SessionLost)
    assert "authentication refused (HTTP 401 Unauthorized)" in str(resuming.lost)
    assert "the server is gone" not in str(resuming.lost)


def test_refused_connections_give_up_after_the_refused_window() -> None:
    def refused() -> Deferred[ExecServerClient]:
        try:
            raise ConnectFailed(URL, "connection refused") from error.ConnectionRefusedError()
        except ConnectFailed:
            return fail()

    resuming, dialed = dropped(refused)
    clock = resuming._reactor
    while resuming.lost is None and clock.seconds() < 10 * REFUSED_GIVE_UP_SECONDS:
        clock.advance(0.05)
    assert isinstance(resuming.lost, SessionLost)
    assert "the server is gone" in str(resuming.lost)
    assert clock.seconds() >= REFUSED_GIVE_UP_SECONDS
    assert len(dialed) > 1


@pytest_twisted.ensureDeferred
async def test_the_cli_resume_dial_raises_the_typed_errors(tmp_path: Path) -> None:
    """The CLI's dial hands ResumingClient the typed error (not a CliError's
    text), so a revoked token and a vanished server are told apart."""
    server = LocalWsServer(token="right").start()
    token_file = tmp_path / "token"
    token_file.write_text("revoked\n")
    args = build_parser().parse_args(
        ["run", "--url", server.url, "--token-file", str(token_file), "--", "true"]
    )
    try:
        with pytest.raises(AuthRefused, match=r"authentication refused \(HTTP 401"):
            await connect(reactor, args, resume_session_id="s1")
    finally:
        await server.stop()
    with refused_port() as port:
        args.url = f"ws://127.0.0.1:{port}"
        with pytest.raises(ConnectFailed) as refused:
            await connect(reactor, args, resume_session_id="s1")
        assert isinstance(refused.value.__cause__, error.ConnectionRefusedError)
