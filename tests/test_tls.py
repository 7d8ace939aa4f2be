"""``wss://`` through the real server: verification, a wrong CA, mutual TLS, bad files.

The certificates are made with the ``cryptography`` package (``tests/support/tls.py``): a CA, a
server certificate for 127.0.0.1 signed by it, a client certificate signed
by a second CA, and an unrelated CA the client must not accept.
"""

from __future__ import annotations

from typing import Any

import pytest
import pytest_twisted
from twisted.internet import reactor

pytest.importorskip("OpenSSL", reason="wss:// needs twisted[tls] (pyOpenSSL)")
pytest.importorskip("service_identity", reason="wss:// needs twisted[tls] (service_identity)")

from execserver.client import connect_websocket
from execserver.client.errors import ConnectFailed
from execserver.tls import ClientTls
from tests.support.harness import DEFAULT_TIMEOUT, run_script, with_timeout
from tests.support.tls import Pki, pki, start_wss

__all__ = ["pki"]  # fixtures, used by name


async def dial(url: str, tls: ClientTls) -> object:
    return await with_timeout(
        connect_websocket(reactor, url, tls=tls), DEFAULT_TIMEOUT, f"connect to {url}"
    )


@pytest_twisted.ensureDeferred
async def test_client_verifies_the_server_with_a_ca_file(pki: Pki) -> None:
    server = await start_wss(pki)
    try:
        assert server.url.startswith("wss://127.0.0.1:")
        client = await with_timeout(
            connect_websocket(reactor, server.url, tls=ClientTls(pki.ca_file)),
            DEFAULT_TIMEOUT,
            "wss connect",
        )
        assert client.session_id
        await client.close()
        # The same through the CLI.
        done = run_script(
            "exec-server-client",
            *("run", "--url", server.url, "--ca-file", pki.ca_file, "--", "echo", "tls"),
        )
        assert (done.returncode, done.stdout) == (0, b"tls\n"), done.stderr
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_a_wrong_ca_fails_with_a_clear_error(pki: Pki) -> None:
    server = await start_wss(pki)
    try:
        with pytest.raises(
            ConnectFailed, match=r"TLS handshake failed: certificate verify failed.*--ca-file"
        ):
            await dial(server.url, ClientTls(pki.other_ca_file))
        # The system store does not know the test CA either.
        with pytest.raises(ConnectFailed, match="certificate verify failed"):
            await dial(server.url, ClientTls())
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_mutual_tls_requires_a_client_certificate(pki: Pki) -> None:
    server = await start_wss(pki, "--tls-client-ca", pki.client_ca_file)
    try:
        with pytest.raises(ConnectFailed):
            await dial(server.url, ClientTls(pki.ca_file))
        client = await with_timeout(
            connect_websocket(
                reactor,
                server.url,
                tls=ClientTls(pki.ca_file, pki.client_cert, pki.client_key),
            ),
            DEFAULT_TIMEOUT,
            "mutual TLS connect",
        )
        assert client.session_id
        await client.close()
    finally:
        assert await server.stop() == 0


def run_refused(*args: str) -> str:
    done = run_script("exec-server", *args, text=True)
    assert done.returncode != 0, done.stderr
    assert "Traceback" not in done.stderr
    return str(done.stderr)


def test_bad_tls_configuration_is_refused_at_start(pki: Pki) -> None:
    wss = ("--listen", "wss://127.0.0.1:0")
    assert "needs --tls-cert and --tls-key" in run_refused(*wss)
    assert "no wss:// address" in run_refused("--tls-cert", pki.server_cert)
    assert "does not belong to the certificate" in run_refused(
        *wss, "--tls-cert", pki.server_cert, "--tls-key", pki.client_key
    )
    assert "holds no PEM certificate" in run_refused(
        *wss, "--tls-cert", pki.server_key, "--tls-key", pki.server_key
    )
    assert "cannot read --tls-key /nonexistent" in run_refused(
        *wss, "--tls-cert", pki.server_cert, "--tls-key", "/nonexistent"
    )


def test_mutual_tls_counts_as_authentication_on_a_network_address(pki: Pki) -> None:
    from twisted.python import usage

    from execserver.service import Options

    tls_args = ["--tls-cert", pki.server_cert, "--tls-key", pki.server_key]
    options = Options()
    options.parseOptions(
        ["--listen", "wss://0.0.0.0:0", *tls_args, "--tls-client-ca", pki.client_ca_file]
    )
    assert options.websocket_settings().tls_options is not None
    with pytest.raises(usage.UsageError, match="without authentication"):
        Options().parseOptions(["--listen", "wss://0.0.0.0:0", *tls_args])


@pytest_twisted.ensureDeferred
async def test_a_client_certificate_owns_the_sessions_it_creates(pki: Pki) -> None:
    from execserver.client import ConnectOptions
    from execserver.client.errors import ServerError

    server = await start_wss(pki, "--tls-client-ca", pki.client_ca_file)
    first = ClientTls(pki.ca_file, pki.client_cert, pki.client_key)
    second = ClientTls(pki.ca_file, pki.second_cert, pki.second_key)

    async def dial_as(tls: ClientTls, options: ConnectOptions) -> Any:
        return await with_timeout(
            connect_websocket(reactor, server.url, options, tls=tls), DEFAULT_TIMEOUT, "connect"
        )

    try:
        owner = await dial_as(first, ConnectOptions(session_ttl_ms=60_000))
        session_id = owner.session_id
        await owner.close()
        with pytest.raises(ServerError):
            await dial_as(second, ConnectOptions(resume_session_id=session_id))
        back = await dial_as(first, ConnectOptions(resume_session_id=session_id))
        assert back.session_id == session_id
        await back.close()
    finally:
        assert await server.stop() == 0
