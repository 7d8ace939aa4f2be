"""Build exec-server's image and run deploy/kubernetes on podman: the smoke test.

Run as root on a Linux host with podman, runc and mmdebstrap (Debian's
packages), from a Python environment where exec-server is installed (its
client connects from outside the pod)::

    deploy/smoke-test                # or: python deploy/smoke_test.py

What it does, each step asserted (a failure exits 1 naming the step):

1. The base image: no image registry is needed. A minimal Debian with
   python3, its venv module, bubblewrap and libseccomp is made with
   mmdebstrap and imported (``podman import``) as
   ``localhost/exec-server-base:KEY``, KEY a hash of what goes in; an
   image of that name already there is reused.
2. The project image: ``deploy/Containerfile`` with that base as its
   ``BASE`` build argument, tagged with the name the manifests use. pip in
   the build reaches PyPI; the host's CA bundle is handed to it as a build
   secret (for a TLS-intercepting proxy).
3. The image: its entry point is the installed ``exec-server`` of
   ``/opt/exec-server`` (the checkout is not in the image), it runs as
   uid 10001, it refuses to listen on 0.0.0.0 without a token, and
   bubblewrap runs in it given an unmasked /proc (``procMount: Unmasked``)
   and not without.
4. ``podman kube play`` of deployment.yaml and service.yaml as written,
   the Secret of secret.yaml handed to podman first (podman 4.3 passes a
   Secret's ``data`` to the volume undecoded, so the script decodes it).
   podman ignores Services: the script publishes the Service's port on
   127.0.0.1 with a TCP forwarder to the pod's targetPort, as kube-proxy
   would.
5. Through that port, with the Secret's token: a command, a PTY session, a
   file round trip, ``/readyz`` (200) and ``/metrics`` (200 with the token,
   401 without).
6. SIGTERM, as the kubelet sends it (``podman stop`` with the pod's
   ``terminationGracePeriodSeconds``), while a session runs a process tree
   that ignores SIGTERM: ``/readyz`` answers 503 meanwhile, the server
   exits 0 within the grace, and every process of the container has ended.
7. The container started again (the kubelet restarting it): the client
   that was resuming its session is told ``unknown session id`` and says
   so (``SessionLost``).
8. ``podman kube down``: the pod is gone and every process it had has
   ended.

Figures (seconds for each stage, the image's size) are printed at the end.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import hashlib
import http.client
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from execserver import sync
from execserver.clientcore.errors import SessionLost

DEPLOY = Path(__file__).resolve().parent
REPO = DEPLOY.parent
KUBE = DEPLOY / "kubernetes"
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = ("python3", "python3-venv", "bubblewrap", "libseccomp2", "ca-certificates")
#: bwrap as the sandbox's startup probe runs it.
BWRAP_PROBE = (
    "bwrap --die-with-parent --unshare-user --unshare-pid --unshare-net "
    "--ro-bind / / --proc /proc --dev /dev -- /bin/true"
)
#: The pod's writable home (an emptyDir): where every command runs.
HOME = "/home/exec"
REFUSAL = "refusing to listen on ws://0.0.0.0:8765 without authentication"


class Failed(Exception):
    """A step's assertion failed."""


def check(condition: bool, what: str) -> None:
    if not condition:
        raise Failed(what)


def say(line: str) -> None:
    print(line, flush=True)


def ok(line: str) -> None:
    say(f"ok: {line}")


class Podman:
    """``podman --runtime runc`` with a containers.conf that sets no rlimits."""

    def __init__(self, work: Path) -> None:
        conf = work / "containers.conf"
        # Rootful podman here cannot set the default rlimits; crun refuses
        # this hybrid-cgroup host, runc does not.
        conf.write_text("[containers]\ndefault_ulimits = []\n")
        self.env = dict(os.environ, CONTAINERS_CONF=str(conf))

    def run(
        self, *args: str, check_rc: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        argv = ["podman", "--runtime", "runc", *args]
        done = subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check_rc and done.returncode != 0:
            raise Failed(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def out(self, *args: str, timeout: float = 120) -> str:
        return self.run(*args, timeout=timeout).stdout.strip()


def load(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((KUBE / name).read_text()) if d]


# --- 1, 2: the images ------------------------------------------------------------


def base_image(podman: Podman, work: Path) -> tuple[str, float]:
    mmdebstrap = [
        "mmdebstrap",
        "--mode=root",
        "--variant=minbase",
        f"--include={','.join(BASE_PACKAGES)}",
        "--dpkgopt=path-exclude=/usr/share/doc/*",
        "--dpkgopt=path-exclude=/usr/share/man/*",
        "--dpkgopt=path-exclude=/usr/share/locale/*",
        "--aptopt=Acquire::Languages none",
        SUITE,
    ]
    key = hashlib.sha256(json.dumps(mmdebstrap).encode()).hexdigest()[:12]
    name = f"localhost/exec-server-base:{SUITE}-{key}"
    if podman.run("image", "exists", name, check_rc=False).returncode == 0:
        ok(f"base image {name} (cached)")
        return name, 0.0
    started = time.monotonic()
    tar = work / "base.tar"
    done = subprocess.run(
        [*mmdebstrap, str(tar), MIRROR], capture_output=True, text=True, timeout=1200, check=False
    )
    check(done.returncode == 0, f"mmdebstrap failed: {done.stderr[-2000:]}")
    podman.run("import", "--change", 'CMD ["/bin/sh"]', str(tar), name, timeout=600)
    tar.unlink()
    seconds = time.monotonic() - started
    ok(f"base image {name} made with mmdebstrap in {seconds:.0f} s")
    return name, seconds


def image_name() -> str:
    """The image the Deployment runs, as podman stores a short name."""
    (deployment,) = load("deployment.yaml")
    image: str = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    return image if "/" in image else f"localhost/{image}"


def ca_bundle() -> str | None:
    for candidate in (
        os.environ.get("PIP_CERT"),
        os.environ.get("SSL_CERT_FILE"),
        "/etc/ssl/certs/ca-certificates.crt",
    ):
        if candidate and os.path.isfile(candidate):
            return candidate
    return None


def build_image(podman: Podman, base: str, image: str) -> float:
    started = time.monotonic()
    args = ["build", "--format", "docker", "--build-arg", f"BASE={base}"]
    bundle = ca_bundle()
    if bundle is not None:
        args += ["--secret", f"id=pip-ca,src={bundle}"]
    args += ["-f", str(DEPLOY / "Containerfile"), "-t", image, str(REPO)]
    podman.run(*args, timeout=1200)
    # The wheel-building stage is not needed once the image is built.
    podman.run("image", "prune", "--force", check_rc=False)
    seconds = time.monotonic() - started
    ok(f"image {image} built from deploy/Containerfile in {seconds:.0f} s")
    return seconds


# --- 3: the image on its own -----------------------------------------------------


def check_image(podman: Podman, image: str) -> int:
    inspected = json.loads(podman.out("image", "inspect", image))[0]
    config = inspected["Config"]
    check(config.get("Entrypoint") == ["exec-server"], f"entry point {config.get('Entrypoint')}")
    check(config.get("User") == "10001:10001", f"user {config.get('User')}")
    check(config.get("StopSignal") == "SIGTERM", f"stop signal {config.get('StopSignal')}")
    healthcheck = json.dumps(inspected.get("Healthcheck"))
    check("EXEC_SERVER_READYZ_URL" in healthcheck, f"the HEALTHCHECK: {healthcheck}")
    check("/readyz" in " ".join(config.get("Env", [])), "the HEALTHCHECK's URL is /readyz")
    script = (
        "set -e; command -v exec-server; id -u; "
        "python3 -c 'import execserver; print(execserver.__file__)'; "
        'head -1 "$(command -v exec-server)"; '
        "test ! -e /src && test ! -e /tmp/wheels && echo no-checkout"
    )
    lines = podman.out(
        "run", "--rm", "--no-healthcheck", "--entrypoint", "sh", image, "-c", script
    ).splitlines()
    check(
        lines
        == [
            "/opt/exec-server/bin/exec-server",
            "10001",
            "/opt/exec-server/lib/python3.11/site-packages/execserver/__init__.py",
            "#!/opt/exec-server/bin/python3",
            "no-checkout",
        ],
        f"the installed exec-server: {lines}",
    )
    ok("the entry point is the installed exec-server (/opt/exec-server), uid 10001, no checkout")
    refused = podman.run(
        "run",
        "--rm",
        "--no-healthcheck",
        image,
        "--listen",
        "ws://0.0.0.0:8765",
        check_rc=False,
    )
    check(refused.returncode == 2, f"exit status {refused.returncode} without a token")
    check(REFUSAL in refused.stderr, f"the refusal: {refused.stderr.strip()}")
    ok("without a token the server refuses 0.0.0.0 (exit 2)")
    probe = ["run", "--rm", "--no-healthcheck", "--entrypoint", "sh"]
    masked = podman.run(*probe, image, "-c", BWRAP_PROBE, check_rc=False)
    check(
        masked.returncode != 0 and "Can't mount proc" in masked.stderr,
        f"bwrap under a masked /proc: {masked.returncode} {masked.stderr.strip()}",
    )
    podman.run(*probe, "--security-opt", "unmask=ALL", image, "-c", BWRAP_PROBE)
    # In a user namespace of its own, as a hostUsers: false pod runs.
    userns = ["--uidmap", "0:200000:65536", "--gidmap", "0:200000:65536"]
    masked = podman.run(*probe, *userns, image, "-c", BWRAP_PROBE, check_rc=False)
    check(masked.returncode != 0, "bwrap in a user namespace under a masked /proc")
    podman.run(*probe, *userns, "--security-opt", "unmask=ALL", image, "-c", BWRAP_PROBE)
    ok("bubblewrap runs in the image with /proc unmasked (in a user namespace too), not without")
    size = int(json.loads(podman.out("image", "inspect", image))[0]["Size"])
    return size


# --- 4: the pod, and the Service's port ------------------------------------------


class Forwarder:
    """127.0.0.1:PORT -> the pod's IP and targetPort, resolved per connection.

    podman kube play ignores Services; this stands in for kube-proxy. A
    connection that cannot reach the pod is closed (as a proxy answers when
    no endpoint is ready), so a client retries rather than giving up.
    """

    def __init__(self, target: Callable[[], tuple[str, int] | None]) -> None:
        self._target = target
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._server.getsockname()[1]
        self._stopped = False
        #: (when, the pod's address) per connection, for a failure's report.
        self.targets: list[tuple[float, tuple[str, int] | None]] = []
        self._threads: list[threading.Thread] = []
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(client,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, client: socket.socket) -> None:
        target = self._target()
        with self._lock:
            self.targets.append((round(time.monotonic(), 2), target))
        upstream: socket.socket | None = None
        try:
            if target is not None:
                with contextlib.suppress(OSError):
                    upstream = socket.create_connection(target, timeout=5)
            if upstream is None:
                return
            upstream.settimeout(None)
            with self._lock:
                self._sockets.update((client, upstream))
            back = threading.Thread(target=self._pump, args=(upstream, client), daemon=True)
            back.start()
            self._pump(client, upstream)
            back.join(timeout=30)
        finally:
            for s in (client, upstream):
                if s is not None:
                    with self._lock:
                        self._sockets.discard(s)
                    s.close()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def stop(self) -> None:
        self._stopped = True
        self._server.close()
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
        for thread in [self._accepting, *self._threads]:
            thread.join(timeout=10)


class Pod:
    """The Deployment's one pod as podman kube play makes it."""

    def __init__(self, podman: Podman, work: Path) -> None:
        self.podman = podman
        (self.deployment,) = load("deployment.yaml")
        (self.secret,) = load("secret.yaml")
        (self.service,) = load("service.yaml")
        spec = self.deployment["spec"]["template"]["spec"]
        self.container_spec = spec["containers"][0]
        self.grace: int = spec["terminationGracePeriodSeconds"]
        self.pod_name = f"{self.deployment['metadata']['name']}-pod-0"
        self.container = f"{self.pod_name}-{self.container_spec['name']}"
        # podman kube play reads one file: the two manifests, byte for byte.
        self.played = work / "deployment+service.yaml"
        self.played.write_text(
            (KUBE / "deployment.yaml").read_text() + "---\n" + (KUBE / "service.yaml").read_text()
        )
        self._secret_file = work / "podman-secret.yaml"
        port = self.service["spec"]["ports"][0]
        target = port["targetPort"]
        named = {p["name"]: p["containerPort"] for p in self.container_spec["ports"]}
        self.target_port: int = named.get(target, target)
        self.token = self.secret_data("tokens").decode().splitlines()[0].strip()

    def secret_data(self, key: str) -> bytes:
        return base64.b64decode(self.secret["data"][key])

    def _clean(self) -> None:
        name = self.secret["metadata"]["name"]
        self.podman.run("kube", "down", str(self.played), check_rc=False)
        self.podman.run("pod", "rm", "--force", self.pod_name, check_rc=False)
        self.podman.run("secret", "rm", name, check_rc=False)
        # podman keeps a Secret volume's files in a volume of its name.
        self.podman.run("volume", "rm", "--force", name, check_rc=False)

    def play(self) -> None:
        self._clean()
        decoded = dict(self.secret)
        decoded["data"] = {k: self.secret_data(k).decode() for k in self.secret["data"]}
        self._secret_file.write_text(yaml.safe_dump(decoded))
        self.podman.run("secret", "create", self.secret["metadata"]["name"], str(self._secret_file))
        args = ["kube", "play", str(self.played)]
        userns = self.deployment["spec"]["template"]["spec"].get("hostUsers") is False
        if userns and not subordinate_ids("containers"):
            # podman runs hostUsers: false as --userns=auto, which takes its
            # ids from the `containers` user's ranges in /etc/subuid and
            # /etc/subgid; without them the pod runs in the host's (the
            # image checks above ran the same container in a user namespace).
            args += ["--userns", "host"]
            say(
                "note: no subordinate ids for `containers`: the pod runs without its user namespace"
            )
        self.podman.run(*args, timeout=300)
        ok(f"podman kube play of deployment.yaml and service.yaml: pod {self.pod_name}")

    def down(self) -> None:
        self.podman.run("kube", "down", str(self.played), timeout=120)

    def cleanup(self) -> None:
        self._clean()
        # emptyDir volumes outlive the pod in podman 4.3.
        for volume in ("tmp", "home", "token"):
            self.podman.run("volume", "rm", "--force", volume, check_rc=False)

    def ip(self) -> str | None:
        done = self.podman.run(
            "inspect", "--format", "{{.NetworkSettings.IPAddress}}", self.container, check_rc=False
        )
        address = done.stdout.strip()
        if done.returncode != 0 or not address:
            infra = self.podman.run(
                "pod", "inspect", "--format", "{{.InfraContainerID}}", self.pod_name, check_rc=False
            ).stdout.strip()
            if not infra:
                return None
            networks = self.podman.run(
                "inspect", "--format", "{{json .NetworkSettings.Networks}}", infra, check_rc=False
            ).stdout.strip()
            found = [n.get("IPAddress") for n in json.loads(networks or "{}").values()]
            address = next((a for a in found if a), "")
        return address or None

    def target(self) -> tuple[str, int] | None:
        address = self.ip()
        return None if address is None else (address, self.target_port)

    def host_pids(self) -> list[int]:
        """Host pids of every process in the pod's containers."""
        pids = []
        for line in self.podman.out("pod", "top", self.pod_name, "hpid").splitlines()[1:]:
            if line.strip().isdigit():
                pids.append(int(line))
        return pids

    def state(self) -> tuple[str, int]:
        status, code = self.podman.out(
            "inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", self.container
        ).split()
        return status, int(code)


def subordinate_ids(user: str) -> bool:
    """Whether ``user`` has ranges in both /etc/subuid and /etc/subgid."""
    for path in ("/etc/subuid", "/etc/subgid"):
        try:
            entries = Path(path).read_text().splitlines()
        except OSError:
            return False
        if not any(line.split(":")[0] == user for line in entries):
            return False
    return True


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def get(port: int, path: str, token: str | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def poll(what: str, timeout: float, probe: Callable[[], bool], interval: float = 0.05) -> float:
    started = time.monotonic()
    while True:
        with contextlib.suppress(OSError, http.client.HTTPException):
            if probe():
                return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise Failed(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


# --- 5 to 8 ----------------------------------------------------------------------


def exercise(url: str, port: int, token: str) -> None:
    with sync.connect(url, token=token, resume=False, call_timeout=60) as client:
        result = client.run(
            ["sh", "-c", "echo hello from $(id -un); uname -s"], cwd=HOME, timeout=60
        )
        check(
            (result.stdout, result.exit_code) == (b"hello from exec\nLinux\n", 0),
            f"a command: {result}",
        )
        ok("a command ran in the pod (as exec)")
        pty = client.run(
            ["sh", "-c", "read line; echo got:$line; tty"],
            tty=True,
            input=b"ping\n",
            cwd=HOME,
            timeout=60,
        )
        check(b"got:ping" in pty.stdout and b"/dev/pts/" in pty.stdout, f"a PTY: {pty}")
        ok("a PTY session: input through the terminal, tty is /dev/pts/N")
        data = secrets.token_bytes(1024 * 1024)
        client.fs_write_file("/home/exec/round-trip.bin", data)
        back = client.fs_read_file("/home/exec/round-trip.bin")
        check(back.data_base64 == data, "the file read back differs")
        listed = client.run(["sha256sum", "round-trip.bin"], cwd=HOME, timeout=60)
        check(listed.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest(), "sha256")
        ok("a 1 MiB file written, read back and hashed in the pod: the same bytes")
    check(get(port, "/readyz") == (200, b"ready\n"), "/readyz")
    status, metrics = get(port, "/metrics", token)
    check(status == 200 and b'exec_server_info{version="0.1.0"} 1' in metrics, "/metrics")
    started = next(
        line
        for line in metrics.decode().splitlines()
        if line.startswith("exec_server_processes_started_total")
    )
    check(float(started.split()[-1]) >= 3, f"processes started: {started}")
    check(get(port, "/metrics")[0] == 401, "/metrics without the token")
    ok("/readyz 200; /metrics 200 with the token (3 processes started), 401 without")


def shutdown_and_restart(pod: Pod, url: str, port: int) -> None:
    client = sync.connect(url, token=pod.token, session_ttl_ms=60000, call_timeout=60)
    try:
        session = client.session_id
        tree = "trap '' TERM; sleep 300 & sleep 300 & echo started; wait"
        proc = client.start(["sh", "-c", tree], cwd=HOME)
        seen = b""
        for event in proc.output(timeout=30):
            seen += event.chunk
            if b"started" in seen:
                break
        pids = pod.host_pids()
        check(len(pids) >= 4, f"the server and the tree in the pod: {pids}")
        stopped: dict[str, float] = {}

        def stop() -> None:
            began = time.monotonic()
            pod.podman.run("stop", "--time", str(pod.grace), pod.container, timeout=pod.grace + 60)
            stopped["seconds"] = time.monotonic() - began

        stopper = threading.Thread(target=stop)
        stopper.start()
        saw_503: list[bytes] = []

        def not_ready() -> bool:
            status, body = get(port, "/readyz")
            if status == 503:
                saw_503.append(body)
            return status == 503

        poll("/readyz 503 during the shutdown", pod.grace, not_ready, interval=0.02)
        stopper.join(timeout=pod.grace + 90)
        check(saw_503[0].startswith(b"exec-server is shutting down"), f"503 body {saw_503}")
        status, code = pod.state()
        check((status, code) == ("exited", 0), f"the server's exit: {status} {code}")
        check(stopped["seconds"] < pod.grace, f"stopped in {stopped['seconds']:.1f} s")
        left = [pid for pid in pids if alive(pid)]
        check(not left, f"processes left after SIGTERM: {left}")
        check(proc.wait(timeout=5) is not None or proc.signal is not None, "the tree's exit")
        ok(
            f"SIGTERM: /readyz 503 meanwhile, exit 0 after {stopped['seconds']:.1f} s "
            f"(grace {pod.grace} s), the tree (SIGTERM ignored) killed, no process left"
        )
        pod.podman.run("start", pod.container)
        poll("the restarted server", 60, lambda: get(port, "/readyz")[0] == 200)

        def lost() -> bool:
            return client.aio.lost is not None

        poll("the client to give the session up", 60, lost, interval=0.1)
        error = client.aio.lost
        assert error is not None
        expected = f"session {session} could not be resumed: unknown session id {session}"
        check(
            isinstance(error, SessionLost)
            and error.cause == f"unknown session id {session}"
            and str(error).endswith(expected),
            f"the client: {error}",
        )
        ok(f"restarted: the resuming client says {str(error)!r}")
    finally:
        with contextlib.suppress(Exception):
            client.close()


def down(pod: Pod) -> None:
    pids = pod.host_pids()
    check(len(pids) >= 1, "processes in the pod before kube down")
    pod.down()
    gone = pod.podman.run("pod", "exists", pod.pod_name, check_rc=False).returncode != 0
    check(gone, "the pod is gone after kube down")
    left = [pid for pid in pids if alive(pid)]
    check(not left, f"processes left after kube down: {left}")
    ok(f"podman kube down: the pod and its {len(pids)} processes are gone")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--keep-image", action="store_true", help="keep the project image afterwards"
    )
    args = parser.parse_args(argv)
    for tool in ("podman", "runc", "mmdebstrap"):
        if shutil.which(tool) is None:
            say(f"FAILED: {tool} is not installed (apt-get install podman runc mmdebstrap)")
            return 1
    # The pod, Secret and image names are the manifests': one run at a time.
    lock = open(os.path.join(tempfile.gettempdir(), "exec-server-smoke-test.lock"), "w")  # noqa: SIM115
    fcntl.flock(lock, fcntl.LOCK_EX)
    figures: dict[str, float] = {}
    work = Path(tempfile.mkdtemp(prefix="exec-server-smoke."))
    podman = Podman(work)
    image = image_name()
    pod = Pod(podman, work)
    forwarder: Forwarder | None = None
    started = time.monotonic()
    try:
        base, figures["base image (s)"] = base_image(podman, work)
        figures["image build (s)"] = build_image(podman, base, image)
        figures["image size (MB)"] = check_image(podman, image) / 1e6
        run_started = time.monotonic()
        pod.play()
        forwarder = Forwarder(pod.target)
        url = f"ws://127.0.0.1:{forwarder.port}"
        ready = poll("/readyz 200", 60, lambda: get(forwarder.port, "/readyz")[0] == 200)
        ok(f"the Service's port published on 127.0.0.1:{forwarder.port}; ready in {ready:.1f} s")
        exercise(url, forwarder.port, pod.token)
        shutdown_and_restart(pod, url, forwarder.port)
        down(pod)
        figures["pod run (s)"] = time.monotonic() - run_started
    except Failed as exc:
        say(f"FAILED: {exc}")
        if forwarder is not None:
            say(f"the forwarder's targets (last 20): {forwarder.targets[-20:]}")
        logs = podman.run("logs", "--tail", "40", pod.container, check_rc=False)
        if logs.returncode == 0:
            say(f"the server's last lines:\n{logs.stdout}{logs.stderr}")
        return 1
    finally:
        if forwarder is not None:
            forwarder.stop()
        pod.cleanup()
        if not args.keep_image:
            podman.run("rmi", "--force", image, check_rc=False)
        shutil.rmtree(work, ignore_errors=True)
        lock.close()
    figures["total (s)"] = time.monotonic() - started
    say("figures: " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()))
    say("smoke test passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
