"""deploy/: the manifests against the Kubernetes API schemas, the shutdown a
fleet relies on, and the container image and ``podman kube play`` smoke test.

- Every manifest under ``deploy/kubernetes`` is validated offline with
  ``kubernetes-validate`` (the API's own OpenAPI schemas, shipped in the
  package) in strict mode: an unknown or misspelt field fails. The
  agent-sandbox custom resources cannot be known to it: their pod template
  is validated as the core ``PodTemplateSpec`` it is, and their own fields
  are checked against the CRD's (``agents.x-k8s.io``) field names below.
- SIGTERM while a session's process ignores SIGTERM: ``/readyz`` and new
  WebSocket connections get 503 until the sessions have ended (the
  listener stays open meanwhile), then the server exits 0 within
  ``--terminate-grace-ms`` + 2 s (the grace the manifests'
  ``terminationGracePeriodSeconds`` is derived from).
- Every HTTP connection accepted during the grace gets a whole answer (a
  request under way at the SIGTERM, one still coming when the grace ends),
  a second SIGTERM is logged and ignored, and after the exit connections are
  refused (both entry points: ``exec-server`` and ``twistd``).
- ``deploy/smoke-test`` on the real container runtime (podman + runc):
  see that script for what it asserts.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import pytest_twisted
import yaml
from kubernetes_validate import validate as k8s_validate
from twisted.internet import error
from twisted.internet.endpoints import TCP4ClientEndpoint, UNIXClientEndpoint, wrapClientTLS

from execserver.tls import ClientTls
from tests.support.harness import (
    DEFAULT_TIMEOUT,
    REPO_ROOT,
    descendants,
    observe,
    pid_alive,
    reactor,
    with_timeout,
)
from tests.support.polling import until
from tests.support.resume_handshake import initialize
from tests.support.tls import Pki, pki, start_wss
from tests.support.ws_harness import (
    RawHttp,
    WsClientProtocol,
    WsServerProcess,
    connect,
    get_request,
    http_get,
)

__all__ = ["pki"]  # a fixture, used by name

DEPLOY = REPO_ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"
#: The Kubernetes version whose API schemas the manifests must satisfy.
KUBE_VERSION = "1.33.0"

#: The server's own shutdown bound (docs/operations.md, "Signals and shutdown").
SHUTDOWN_SLACK_SECONDS = 2.0


def manifests() -> list[tuple[Path, int, dict[str, Any]]]:
    found = []
    for path in sorted(KUBE.rglob("*.yaml")):
        for index, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                found.append((path, index, doc))
    return found


def _id(item: tuple[Path, int, dict[str, Any]]) -> str:
    path, index, doc = item
    return f"{path.relative_to(KUBE)}#{index}:{doc.get('kind')}"


#: API groups the API server's schemas do not know: validated below by hand.
CUSTOM_GROUP = "extensions.agents.x-k8s.io"
KUSTOMIZE_GROUP = "kustomize.config.k8s.io"


def group_of(doc: dict[str, Any]) -> str:
    api_version: str = doc["apiVersion"]
    return api_version.split("/", maxsplit=1)[0] if "/" in api_version else ""


BUILTIN = [m for m in manifests() if group_of(m[2]) not in (CUSTOM_GROUP, KUSTOMIZE_GROUP)]
CUSTOM = [m for m in manifests() if group_of(m[2]) == CUSTOM_GROUP]
KUSTOMIZATIONS = [m for m in manifests() if group_of(m[2]) == KUSTOMIZE_GROUP]


@pytest.mark.parametrize("version", [KUBE_VERSION, "1.30.0"])
@pytest.mark.parametrize("item", BUILTIN, ids=_id)
def test_manifest_matches_the_kubernetes_api_schema(
    item: tuple[Path, int, dict[str, Any]], version: str
) -> None:
    # 1.30: the oldest release with securityContext.appArmorProfile.
    k8s_validate(item[2], version, strict=True)


def test_the_validator_refuses_a_misspelt_field() -> None:
    _path, _, doc = next(m for m in BUILTIN if m[2]["kind"] == "Deployment")
    broken = copy.deepcopy(doc)
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(Exception, match="readinesProbe"):
        k8s_validate(broken, KUBE_VERSION, strict=True)


def test_every_form_the_manifests_cover_is_there() -> None:
    kinds = sorted({doc["kind"] for _, _, doc in manifests()})
    assert kinds == [
        "Deployment",
        "Kustomization",
        "Namespace",
        "NetworkPolicy",
        "SandboxTemplate",
        "SandboxWarmPool",
        "Secret",
        "Service",
        "StatefulSet",
    ]


def test_each_kustomization_lists_every_manifest_beside_it() -> None:
    for path, _, doc in KUSTOMIZATIONS:
        beside = sorted(p.name for p in path.parent.glob("*.yaml") if p.name != path.name)
        assert sorted(doc["resources"]) == beside, path


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    if doc["kind"] == "SandboxTemplate":
        spec: dict[str, Any] = doc["spec"]["podTemplate"]["spec"]
    else:
        spec = doc["spec"]["template"]["spec"]
    return spec


def workloads() -> list[dict[str, Any]]:
    kinds = ("Deployment", "StatefulSet", "SandboxTemplate")
    return [doc for _, _, doc in manifests() if doc["kind"] in kinds]


def test_every_form_runs_the_same_pod() -> None:
    specs = [pod_spec(doc) for doc in workloads()]
    assert len(specs) == 3
    assert all(spec == specs[0] for spec in specs)


def test_the_pod_is_what_the_server_and_the_sandbox_need() -> None:
    spec = pod_spec(workloads()[0])
    container = spec["containers"][0]
    args = container["args"]
    # The token file the server reads is the Secret's key, copied 0400.
    token_file = args[args.index("--auth-token-file") + 1]
    assert "install -m 0400 /etc/exec-server/secret/tokens " + token_file in container["command"][2]
    assert container["command"][2].endswith('exec exec-server "$@"')
    secret = next(v for v in spec["volumes"] if "secret" in v)["secret"]
    names = {doc["metadata"]["name"] for _, _, doc in manifests() if doc["kind"] == "Secret"}
    assert secret["secretName"] in names
    assert args[args.index("--listen") + 1] == "ws://0.0.0.0:8765"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/readyz"
    # The kubelet's grace covers the server's: --terminate-grace-ms + 2 s.
    grace_ms = (
        int(args[args.index("--terminate-grace-ms") + 1])
        if "--terminate-grace-ms" in args
        else 2000
    )
    assert spec["terminationGracePeriodSeconds"] >= grace_ms / 1000 + SHUTDOWN_SLACK_SECONDS + 1
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "Unconfined"}
    # The API server refuses procMount Unmasked outside a pod user namespace
    # (a rule of its validation, not of the OpenAPI schema).
    assert container["securityContext"]["procMount"] == "Unmasked"
    assert spec["hostUsers"] is False
    assert container["resources"]["requests"] and container["resources"]["limits"]


#: The fields of agent-sandbox's CRDs (extensions.agents.x-k8s.io/v1beta1,
#: kubernetes-sigs/agent-sandbox k8s/crds/ at commit 2fd412d5, 2026-08-22)
#: that the examples use, with their types: the CRDs themselves are not
#: vendored here, so this is the part of their schema these files rely on.
SANDBOX_TEMPLATE_SPEC = {
    "podTemplate": dict,
    "service": bool,
    "networkPolicy": dict,
    "networkPolicyManagement": str,
    "envVarsInjectionPolicy": str,
    "volumeClaimTemplates": list,
    "volumeClaimTemplatesPolicy": str,
}
WARM_POOL_SPEC = {"replicas": int, "sandboxTemplateRef": dict, "updateStrategy": dict}


@pytest.mark.parametrize("item", CUSTOM, ids=_id)
def test_agent_sandbox_resources(item: tuple[Path, int, dict[str, Any]]) -> None:
    doc = item[2]
    assert doc["apiVersion"] == f"{CUSTOM_GROUP}/v1beta1"
    spec = doc["spec"]
    known = SANDBOX_TEMPLATE_SPEC if doc["kind"] == "SandboxTemplate" else WARM_POOL_SPEC
    assert set(spec) <= set(known), set(spec) - set(known)
    for key, value in spec.items():
        assert isinstance(value, known[key]), key
    if doc["kind"] == "SandboxTemplate":
        assert spec["networkPolicyManagement"] in ("Managed", "Unmanaged")
        assert set(spec["networkPolicy"]) <= {"ingress", "egress"}
        # Its pod template is a core PodTemplateSpec, and its policy rules
        # core NetworkPolicy rules: validated as such.
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
        template["template"] = spec["podTemplate"]
        k8s_validate(template, KUBE_VERSION, strict=True)
        policy = {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "p"},
            "spec": {"podSelector": {}, **spec["networkPolicy"]},
        }
        k8s_validate(policy, KUBE_VERSION, strict=True)
    else:
        assert spec["replicas"] >= 0
        templates = {d["metadata"]["name"] for _, _, d in CUSTOM if d["kind"] == "SandboxTemplate"}
        assert set(spec["sandboxTemplateRef"]) == {"name"}
        assert spec["sandboxTemplateRef"]["name"] in templates


# --- the shutdown a fleet relies on ------------------------------------------------


async def _start_tree_ignoring_term(client: WsClientProtocol) -> None:
    """``proc-1``: a tree that ignores SIGTERM (a shutdown waits the grace for its SIGKILL)."""
    await client.start_process(
        "proc-1", ["sh", "-c", "trap '' TERM; sleep 300 & echo started; wait"]
    )
    await client.wait_for(
        lambda m: b"started" in client.output_of("proc-1"), DEFAULT_TIMEOUT, "the tree"
    )


async def _readyz(server: WsServerProcess) -> tuple[int, bytes]:
    host, port = server.host_port
    status, _, body = await http_get(host, port, get_request("/readyz"), timeout=5)
    return status, body


@pytest_twisted.ensureDeferred
async def test_sigterm_answers_503_until_the_sessions_end_then_exits_0() -> None:
    # The window is the whole grace: long enough that a loaded machine (CI
    # runs the container build beside it) still polls within it.
    grace_ms = 6000
    server = await WsServerProcess.start("--terminate-grace-ms", str(grace_ms))
    try:
        client = await connect(server.url)
        await client.handshake()
        # The tree ignores SIGTERM: the shutdown waits the whole grace for
        # its SIGKILL, the window in which /readyz must say 503.
        await _start_tree_ignoring_term(client)
        assert server.pid is not None
        tree = descendants(server.pid)
        assert len(tree) >= 2
        assert await _readyz(server) == (200, b"ready\n")
        started = time.monotonic()
        server.signal("TERM")
        answer: list[tuple[int, bytes]] = []

        async def refusing() -> bool:
            answer[:] = [await _readyz(server)]
            return answer[0][0] == 503

        await until(refusing, "a 503 within the grace", timeout=grace_ms / 1000)
        [(status, body)] = answer
        assert body == b"exec-server is shutting down; connect again later\n"
        # An upgrade is refused the same way (a client retries elsewhere).
        host, port = server.host_port
        upgrade = get_request(
            "/",
            "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n",
        )
        status, headers, _ = await http_get(host, port, upgrade, timeout=5)
        assert (status, headers.get("retry-after")) == (503, "1")
        await with_timeout(
            observe(server.ended), grace_ms / 1000 + SHUTDOWN_SLACK_SECONDS + 3, "server exit"
        )
        assert server.exit_code == 0
        assert time.monotonic() - started < grace_ms / 1000 + SHUTDOWN_SLACK_SECONDS + 1
        assert not any(pid_alive(pid) for pid in tree)
        exited = await client.wait_notification("process/exited", "proc-1", timeout=1)
        assert exited["signal"] == "SIGKILL"
    finally:
        await server.stop()


SHUTTING_DOWN_503 = b"HTTP/1.1 503 Service Unavailable\r\n"
SHUTTING_DOWN_BODY = b"\r\n\r\nexec-server is shutting down; connect again later\n"


@pytest.mark.parametrize("twistd", [False, True], ids=["exec-server", "twistd"])
@pytest_twisted.ensureDeferred
async def test_no_connection_of_the_grace_is_closed_unanswered(twistd: bool) -> None:
    # Every HTTP connection the server accepted gets a whole answer, whether
    # its request was under way at the SIGTERM or still coming when the
    # grace ended; a second SIGTERM is logged, not a critical
    # ReactorNotRunning; after the exit a connection is refused.
    grace_ms = 3000
    server = await WsServerProcess.start("--terminate-grace-ms", str(grace_ms), twistd=twistd)
    try:
        client = await connect(server.url)
        await client.handshake()
        await _start_tree_ignoring_term(client)
        host, port = server.host_port
        early = await RawHttp.open(host, port)
        early.write(b"GET /readyz HTTP/1.1\r\n")
        # (The listener accepts in order: once a later connection is
        # answered, the server has this one, its request half read.)
        assert await _readyz(server) == (200, b"ready\n")
        started = time.monotonic()
        server.signal("TERM")
        await until(partial(_is_503, server), "a 503 within the grace", timeout=grace_ms / 1000)
        server.signal("TERM")
        early.write(b"Host: 127.0.0.1\r\n\r\n")
        answer = await early.answer(timeout=5)
        assert answer.startswith(SHUTTING_DOWN_503) and answer.endswith(SHUTTING_DOWN_BODY)
        # Half a request when the grace ends: answered before the exit.
        late = await RawHttp.open(host, port)
        late.write(b"GET /readyz HTTP/1.1\r\n")
        assert (await _readyz(server))[0] == 503
        answer = await late.answer(timeout=grace_ms / 1000 + SHUTDOWN_SLACK_SECONDS)
        assert answer.startswith(SHUTTING_DOWN_503) and answer.endswith(SHUTTING_DOWN_BODY)
        await with_timeout(
            observe(server.ended), grace_ms / 1000 + SHUTDOWN_SLACK_SECONDS, "server exit"
        )
        # (twistd ends by re-raising the signal that stopped its reactor.)
        assert server.exit_status() == ((None, signal.SIGTERM) if twistd else (0, None))
        assert time.monotonic() - started < grace_ms / 1000 + SHUTDOWN_SLACK_SECONDS
        log = server.stderr_bytes()  # (twistd -n logs to stdout)
        assert b"received SIGTERM again while shutting down: ignored" in log
        assert b"ReactorNotRunning" not in log
        with pytest.raises(error.ConnectionRefusedError):
            await RawHttp.open(host, port)
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_the_listener_stays_open_through_a_detached_sessions_grace() -> None:
    # The listener has no connection of its own left: it used to close at
    # once, and /readyz was refused for the rest of the grace.
    grace_ms = 6000
    server = await WsServerProcess.start("--terminate-grace-ms", str(grace_ms))
    try:
        client = await connect(server.url)
        await initialize(client, sessionTtlMs=60_000)
        await _start_tree_ignoring_term(client)
        assert server.pid is not None
        tree = descendants(server.pid)
        client.abort()
        await with_timeout(client.closed, DEFAULT_TIMEOUT, "the client's close")
        host, port = server.host_port

        async def detached() -> bool:
            _, _, text = await http_get(host, port, get_request("/metrics"), timeout=5)
            return b"\nexec_server_sessions_detached 1\n" in text

        await until(detached, "the session detached", timeout=DEFAULT_TIMEOUT)
        started = time.monotonic()
        server.signal("TERM")
        await until(partial(_is_503, server), "a 503 within the grace", timeout=grace_ms / 1000)
        # The tree still runs (it ignores SIGTERM): the grace is not over,
        # and the listener still answers.
        assert any(pid_alive(pid) for pid in tree)
        assert await _readyz(server) == (
            503,
            b"exec-server is shutting down; connect again later\n",
        )
        await with_timeout(
            observe(server.ended), grace_ms / 1000 + SHUTDOWN_SLACK_SECONDS, "server exit"
        )
        assert server.exit_code == 0
        assert time.monotonic() - started < grace_ms / 1000 + SHUTDOWN_SLACK_SECONDS
        assert not any(pid_alive(pid) for pid in tree)
    finally:
        await server.stop()


@pytest.mark.parametrize("scheme", ["ws", "wss", "unix"])
@pytest_twisted.ensureDeferred
async def test_a_request_at_the_last_moment_is_answered_then_connections_are_refused(
    scheme: str, pki: Pki, tmp_path: Path
) -> None:
    # No session: the shutdown closes the listener at once, and the
    # connections it had accepted are drained: one with half a request is
    # answered 503 (not dropped with the process), then a new one is refused.
    sock = tmp_path / "exec.sock"
    if scheme == "wss":
        server = await start_wss(pki)
    elif scheme == "unix":
        server = await WsServerProcess.start("--listen", f"unix://{sock}")
    else:
        server = await WsServerProcess.start()

    def endpoint() -> Any:
        if scheme == "unix":
            return UNIXClientEndpoint(reactor, str(sock), timeout=5)
        # (WsServerProcess.host_port assumes ws://.)
        bound = urlsplit(server.url)
        host, port = str(bound.hostname), int(bound.port or 0)
        plain = TCP4ClientEndpoint(reactor, host, port, timeout=5)
        return (
            wrapClientTLS(ClientTls(pki.ca_file).options(host), plain) if scheme == "wss" else plain
        )

    try:
        last = await RawHttp.open_on(endpoint())
        last.write(b"GET /readyz HTTP/1.1\r\n")
        # (Accepted in order: once a later connection is answered, the server has this one.)
        later = await RawHttp.open_on(endpoint())
        later.write(get_request("/readyz"))
        assert (await later.answer(timeout=5)).endswith(b"\r\n\r\nready\n")
        server.signal("TERM")
        answer = await last.answer(timeout=SHUTDOWN_SLACK_SECONDS)
        assert answer.startswith(SHUTTING_DOWN_503) and answer.endswith(SHUTTING_DOWN_BODY)
        await with_timeout(observe(server.ended), SHUTDOWN_SLACK_SECONDS, "server exit")
        assert server.exit_status() == (0, None)
        if scheme == "unix":
            # The socket file is removed with the listener.
            assert not sock.exists()
        else:
            with pytest.raises(error.ConnectionRefusedError):
                await RawHttp.open_on(endpoint())
    finally:
        await server.stop()


async def _is_503(server: WsServerProcess) -> bool:
    return (await _readyz(server))[0] == 503


# --- the image and the manifests on a real container runtime --------------------

#: What deploy/smoke-test asserts, one line per step (see deploy/smoke_test.py).
SMOKE_STEPS = [
    "ok: base image localhost/exec-server-base:",
    "ok: image localhost/exec-server:0.1.0 built from deploy/Containerfile in ",
    "ok: the entry point is the installed exec-server (/opt/exec-server), uid 10001, no checkout",
    "ok: without a token the server refuses 0.0.0.0 (exit 2)",
    "ok: bubblewrap runs in the image with /proc unmasked (in a user namespace too), not without",
    "ok: podman kube play of deployment.yaml and service.yaml: pod exec-server-pod-0",
    "ok: the Service's port published on 127.0.0.1:",
    "ok: a command ran in the pod (as exec)",
    "ok: a PTY session: input through the terminal, tty is /dev/pts/N",
    "ok: a 1 MiB file written, read back and hashed in the pod: the same bytes",
    "ok: /readyz 200; /metrics 200 with the token (3 processes started), 401 without",
    "ok: SIGTERM: /readyz 503 meanwhile, exit 0 after ",
    "ok: restarted: the resuming client says 'exec-server connection closed: session ",
    "ok: podman kube down: the pod and its ",
    "smoke test passed",
]


@pytest.mark.timeout(1500)
def test_smoke_test_builds_the_image_and_runs_the_manifests_on_podman() -> None:
    # Cold (no base image cached): about 2 min of mmdebstrap, 1 min of build,
    # 15 s of pod; the base is reused by name afterwards.
    done = subprocess.run(
        [str(DEPLOY / "smoke-test")],
        env=dict(os.environ, PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=1400,
        check=False,
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    assert [step for step in SMOKE_STEPS if not any(line.startswith(step) for line in lines)] == []
