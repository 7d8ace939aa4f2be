"""The asyncio client's tokens and TLS against the real server (as the Twisted client's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytest_twisted

pytest.importorskip("OpenSSL", reason="wss:// needs twisted[tls] (pyOpenSSL)")

from execserver import aio
from tests.support.aio_harness import in_asyncio, on_reactor
from tests.support.auth import NEAR_MISS, OTHER, TOKEN, token_file, wait_stderr
from tests.support.cutting_proxy import CuttingProxy
from tests.support.tls import Pki, pki, start_wss
from tests.support.ws_harness import WsServerProcess

__all__ = ["pki"]  # the fixture, used by the tests below


@pytest_twisted.ensureDeferred
async def test_bearer_token(tmp_path: Path) -> None:
    server = await WsServerProcess.start("--auth-token-file", str(token_file(tmp_path, TOKEN)))
    secret = tmp_path / "client-token"
    secret.write_text(TOKEN + "\n")
    empty = tmp_path / "empty"
    empty.write_text("\n")

    async def scenario() -> None:
        async with aio.connect(server.url, token=TOKEN) as client:
            assert client.session_id
        async with aio.connect(server.url, token_file=str(secret)) as client:
            assert (await client.run(["echo", "authorised"])).stdout == b"authorised\n"
        for token in (NEAR_MISS, None):
            with pytest.raises(aio.AuthRefused) as refused:
                await aio.connect(server.url, token=token)
            assert refused.value.status == 401
            assert "authentication refused (HTTP 401" in str(refused.value)
            assert TOKEN not in str(refused.value)
        with pytest.raises(aio.ConnectFailed, match="is empty"):
            aio.connect(server.url, token_file=str(empty))
        with pytest.raises(aio.ConnectFailed, match="cannot read token file"):
            aio.connect(server.url, token_file=str(tmp_path / "missing"))

    try:
        await in_asyncio(scenario)
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_wss_with_a_ca_file_and_a_wrong_ca(pki: Pki) -> None:
    server = await start_wss(pki)

    async def scenario() -> None:
        async with aio.connect(server.url, ca_file=pki.ca_file) as client:
            assert (await client.run(["echo", "tls"])).stdout == b"tls\n"
        with pytest.raises(
            aio.ConnectFailed, match=r"TLS handshake failed: certificate verify failed.*ca_file"
        ):
            await aio.connect(server.url, ca_file=pki.other_ca_file)
        # The system store does not know the test CA either.
        with pytest.raises(aio.ConnectFailed, match="certificate verify failed"):
            await aio.connect(server.url)
        with pytest.raises(aio.ConnectFailed, match="cannot read"):
            await aio.connect(server.url, ca_file=str(Path(pki.ca_file).parent / "missing.pem"))

    try:
        await in_asyncio(scenario)
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_mutual_tls_requires_a_client_certificate(pki: Pki) -> None:
    server = await start_wss(pki, "--tls-client-ca", pki.client_ca_file)

    async def scenario() -> None:
        with pytest.raises(aio.ConnectFailed):
            await aio.connect(server.url, ca_file=pki.ca_file, connect_timeout=5)
        async with aio.connect(
            server.url,
            ca_file=pki.ca_file,
            client_cert=pki.client_cert,
            client_key=pki.client_key,
        ) as client:
            assert client.session_id

    try:
        await in_asyncio(scenario)
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_a_withdrawn_token_ends_the_session_at_the_next_resume(tmp_path: Path) -> None:
    path = token_file(tmp_path, TOKEN)
    server = await WsServerProcess.start("--auth-token-file", str(path), "--verbose")
    proxy = await CuttingProxy(server.host_port).start()

    async def scenario() -> None:
        async with aio.connect(proxy.url, token=TOKEN, session_ttl_ms=30_000) as client:
            proc = await client.start(["sleep", "30"])
            path.write_text(OTHER + "\n")
            await on_reactor(server._signal, "HUP")
            await on_reactor(wait_stderr, server, b"SIGHUP: 1 token(s) loaded")
            await on_reactor(proxy.cut)
            try:
                code = await proc.wait(timeout=20)
            except TimeoutError:
                task = client._resume_task
                state = (
                    "never started"
                    if task is None
                    else ("running" if not task.done() else repr(task.exception()))
                )
                raise AssertionError(
                    f"not ended within 20 s: resume task {state}; connected "
                    f"{client.is_connected}; lost {client.lost!r}; server stderr: "
                    f"{server.stderr[-3000:]!r}"
                ) from None
            assert code is None
            assert isinstance(proc.lost_reason, aio.SessionLost)
            # Given up at the refusal, not taken for a server that is gone.
            assert proc.lost_reason.cause.startswith("authentication refused (HTTP 401")
            assert client.resumes == 0 and client.lost is proc.lost_reason

    try:
        await in_asyncio(scenario)
    finally:
        await proxy.stop()
        assert await server.stop() == 0
