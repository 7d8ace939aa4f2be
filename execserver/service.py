"""Options and service composition: the ``twistd exec-server`` plugin and the CLI.

``makeService`` is the composition root: it is the only place (with
``cli.main``) that imports the global reactor.
"""

from __future__ import annotations

import ctypes
import os
import re
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
from twisted.application.service import IServiceCollection, MultiService, Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import (
    IReactorCore,
    IReactorProcess,
    IReactorTCP,
    IReactorThreads,
    IReactorTime,
)
from twisted.logger import Logger
from twisted.python import usage

from execserver import __version__, auth, fdlimit, metrics, ptys, tls, writebuffer
from execserver.app import build_dispatcher
from execserver.config import ServerConfig
from execserver.containment import MODES, Containment
from execserver.dispatcher import Dispatcher
from execserver.limits import NO_LIMITS
from execserver.limits import check_defaults as check_limit_defaults
from execserver.limits import parse_spec as parse_limits
from execserver.sandbox.engine import MECHANISM_CHOICES, SandboxEngine
from execserver.sandbox.floor import FLOOR_MODES, floor_policy
from execserver.sandbox.peers import ConfinedPeers
from execserver.shutdown_signals import RepeatSignals
from execserver.spawn import SPAWN_PATHS, PosixSpawner, SpawnPath, seal_inherited_fds
from execserver.transports.listen import (
    DEFAULT_SOCKET_MODE,
    STDIO_URL,
    ListenUrlError,
    StdioAddress,
    UnixAddress,
    WebSocketAddress,
    parse_listen_url,
)

if TYPE_CHECKING:
    from execserver.transports.websocket import WebSocketSettings

DEFAULT_LISTEN_URL = STDIO_URL
DEFAULT_PING_INTERVAL_MS = 20_000
DEFAULT_PING_TIMEOUT_MS = 20_000
#: Environment variable giving the default of ``--spawn-path`` (how CI runs
#: the process tests on both paths without changing each server's command).
SPAWN_PATH_ENV = "EXEC_SERVER_SPAWN_PATH"
log = Logger()
_ORIGIN_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#\s]+")


def _positive(name: str) -> Any:
    def convert(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise usage.UsageError(f"--{name} takes a whole number, got `{value}`") from None
        if number < 0:
            raise usage.UsageError(f"--{name} must not be negative, got `{value}`")
        return number

    return convert


_DEFAULTS = ServerConfig()


class Options(usage.Options):
    synopsis = "[--listen URL]... [options]"
    optFlags = [
        [
            "no-tune-malloc",
            None,
            "Leave glibc's allocator settings alone (by default buffers up to 4 MiB "
            "are served from the heap; see docs/operations.md).",
        ],
        [
            "no-raise-fd-limit",
            None,
            "Keep the soft open-file limit the server was started with "
            "(by default it is raised to the hard limit).",
        ],
        [
            "no-fast-frames",
            None,
            "WebSocket: let Autobahn's parser decode every frame (by default small "
            "complete frames are decoded by the server's own, faster, path).",
        ],
        [
            "allow-unauthenticated",
            None,
            "Allow a WebSocket listener on a non-loopback address without --auth-token-file "
            "(anyone who reaches it can run commands; a warning is logged on every start).",
        ],
        [
            "no-stdout-guard",
            None,
            "stdio://: leave fd 1 and sys.stdout as they are (by default stray writes "
            "to stdout are sent to stderr, away from the protocol stream).",
        ],
        [
            "floor-no-network",
            None,
            "--sandbox-floor: no network for any process, whatever the client asks.",
        ],
        [
            "check-sandbox",
            None,
            "Print which sandbox mechanisms work on this host (bubblewrap, user namespaces, "
            "Landlock, seccomp) and exit: 0 if confined processes can run, 1 if not.",
        ],
    ]
    longdesc = (
        "Serve the exec-server JSON-RPC protocol: start and steer processes and "
        "touch files for a client. --listen is repeatable; the default is stdio://."
    )
    optParameters = [
        [
            "auth-token-file",
            None,
            None,
            "WebSocket: file of accepted bearer tokens, one per line, mode 0600 or stricter "
            "(re-read on SIGHUP; default: $EXEC_SERVER_AUTH_TOKEN, else no authentication).",
        ],
        [
            "tls-cert",
            None,
            None,
            "wss:// listeners: PEM certificate (then any intermediates) the server presents.",
        ],
        ["tls-key", None, None, "wss:// listeners: PEM private key of --tls-cert."],
        [
            "bwrap",
            None,
            None,
            "The bubblewrap executable confined processes run under [default: bwrap on PATH].",
        ],
        [
            "tls-client-ca",
            None,
            None,
            "wss:// listeners: require a client certificate signed by a CA in this PEM file "
            "(mutual TLS).",
        ],
        [
            "retained-output-bytes",
            None,
            _DEFAULTS.retained_output_bytes,
            "Output retained per process for process/read (oldest dropped first).",
            _positive("retained-output-bytes"),
        ],
        [
            "exit-retention-ms",
            None,
            _DEFAULTS.exit_retention_ms,
            "How long an exited process id stays reserved and readable.",
            _positive("exit-retention-ms"),
        ],
        [
            "terminate-grace-ms",
            None,
            _DEFAULTS.terminate_grace_ms,
            "Delay between SIGTERM and SIGKILL when terminating a process group.",
            _positive("terminate-grace-ms"),
        ],
        [
            "max-processes",
            None,
            _DEFAULTS.max_processes,
            "Running processes allowed per session.",
            _positive("max-processes"),
        ],
        [
            "max-session-ttl-ms",
            None,
            _DEFAULTS.max_session_ttl_ms,
            "Longest a session outlives its connection when the client asks "
            "(initialize sessionTtlMs); 0 disables resumption.",
            _positive("max-session-ttl-ms"),
        ],
        [
            "default-session-ttl-ms",
            None,
            _DEFAULTS.default_session_ttl_ms,
            "Session lifetime after a disconnect for clients that do not ask "
            "(capped by --max-session-ttl-ms).",
            _positive("default-session-ttl-ms"),
        ],
        [
            "max-message-bytes",
            None,
            _DEFAULTS.max_message_bytes,
            "Largest accepted JSON-RPC line or WebSocket message.",
            _positive("max-message-bytes"),
        ],
        [
            "max-read-file-bytes",
            None,
            _DEFAULTS.max_read_file_bytes,
            "Largest file fs/readFile returns; a larger one is refused with an error.",
            _positive("max-read-file-bytes"),
        ],
        [
            "reply-budget-bytes",
            None,
            _DEFAULTS.reply_budget_bytes,
            "fs/readFile reply bytes being built or not yet sent, over all connections; "
            "further reads wait (up to --fs-wait-timeout-ms).",
            _positive("reply-budget-bytes"),
        ],
        [
            "connection-reply-budget-bytes",
            None,
            _DEFAULTS.connection_reply_budget_bytes,
            "The same budget per connection; a reply larger than either budget is refused.",
            _positive("connection-reply-budget-bytes"),
        ],
        [
            "fs-wait-timeout-ms",
            None,
            _DEFAULTS.fs_wait_timeout_ms,
            "Longest an fs request waits for a free fs thread or reply budget before failing.",
            _positive("fs-wait-timeout-ms"),
        ],
        [
            "max-fs-ops-per-session",
            None,
            _DEFAULTS.max_fs_ops_per_session,
            "fs operations one connection may have on the 4 fs threads at once; its "
            "further ones wait (up to --fs-wait-timeout-ms) while others' run.",
            _positive("max-fs-ops-per-session"),
        ],
        [
            "fs-stall-ms",
            None,
            _DEFAULTS.fs_stall_ms,
            "/readyz answers 503 once every fs thread has been this long on one operation.",
            _positive("fs-stall-ms"),
        ],
        [
            "max-partial-message-bytes",
            None,
            256 * 1024 * 1024,
            "WebSocket: bytes of incomplete messages held over all connections; a "
            "connection that would exceed it is closed with code 1013 (try again later).",
            _positive("max-partial-message-bytes"),
        ],
        [
            "max-connections",
            None,
            4096,
            "WebSocket: connections open at once over all listeners (upgraded or not); "
            "more get HTTP 503.",
            _positive("max-connections"),
        ],
        [
            "handshake-timeout-ms",
            None,
            5000,
            "WebSocket: a connection that has not completed its HTTP request or upgrade "
            "within this is dropped (slow headers).",
            _positive("handshake-timeout-ms"),
        ],
        [
            "max-request-head-bytes",
            None,
            16 * 1024,
            "WebSocket: largest HTTP request line and headers; larger gets 431.",
            _positive("max-request-head-bytes"),
        ],
        [
            "max-sessions-per-identity",
            None,
            _DEFAULTS.max_sessions_per_identity,
            "Sessions (attached or detached) one identity may hold; a new one beyond it "
            "is refused at initialize.",
            _positive("max-sessions-per-identity"),
        ],
        [
            "max-server-processes",
            None,
            _DEFAULTS.max_server_processes,
            "Processes open at once over all sessions.",
            _positive("max-server-processes"),
        ],
        [
            "max-ptys-per-session",
            None,
            _DEFAULTS.max_ptys_per_session,
            "PTYs (tty processes not yet closed) one session may hold; a tty start beyond "
            "it is refused.",
            _positive("max-ptys-per-session"),
        ],
        [
            "max-server-ptys",
            None,
            None,
            "PTYs the server may hold over all sessions (default: a quarter of the host's "
            "/proc/sys/kernel/pty/max, 1024 without it).",
            _positive("max-server-ptys"),
        ],
        [
            "max-total-retained-bytes",
            None,
            _DEFAULTS.max_total_retained_bytes,
            "Output retained over all processes; while reached, new processes are refused "
            "(0: no server-wide limit).",
            _positive("max-total-retained-bytes"),
        ],
        [
            "ping-interval-ms",
            None,
            DEFAULT_PING_INTERVAL_MS,
            "WebSocket: ping every client this often; 0 disables pings (and dead-peer detection).",
            _positive("ping-interval-ms"),
        ],
        [
            "ping-timeout-ms",
            None,
            DEFAULT_PING_TIMEOUT_MS,
            "WebSocket: drop a client (terminating its processes) whose pong is this late.",
            _positive("ping-timeout-ms"),
        ],
    ]

    def __init__(self) -> None:
        super().__init__()
        self["listen"] = []
        self["allow-origin"] = []
        self["process-containment"] = "auto"
        self["default-limits"] = NO_LIMITS
        self["limit-ceiling"] = NO_LIMITS
        self["socket-mode"] = DEFAULT_SOCKET_MODE
        self["spawn-path"] = os.environ.get(SPAWN_PATH_ENV) or "fast"
        self["sandbox-mechanism"] = "auto"
        self["sandbox-floor"] = None
        self["floor-writable-root"] = []

    def opt_allow_origin(self, origin: str) -> None:
        """WebSocket: admit pages from this browser Origin, e.g. http://localhost:3000 (repeatable; any other Origin gets 403)."""  # noqa: E501
        if origin != "null" and not _ORIGIN_RE.fullmatch(origin.rstrip("/")):
            raise usage.UsageError(
                f"--allow-origin takes an origin like `https://example.com:8443` "
                f"(scheme://host[:port]) or `null`, got `{origin}`"
            )
        self["allow-origin"].append(origin)

    def opt_process_containment(self, mode: str) -> None:
        """How every descendant of a process is tracked and killed with it: auto (cgroup v2 where writable, else subreaper), cgroup, subreaper, or none (process group only; for measurement) [default: auto]."""  # noqa: E501
        if mode not in MODES:
            raise usage.UsageError(f"--process-containment takes {', '.join(MODES)}, got `{mode}`")
        self["process-containment"] = mode

    def opt_default_limits(self, spec: str) -> None:
        """Resource limits of a process that sets none of a kind, e.g. memoryBytes=2G,maxProcesses=512 (memoryBytes, maxProcesses, cpuPercent, fileSizeBytes; K/M/G/T suffixes) [default: none]."""  # noqa: E501
        try:
            self["default-limits"] = parse_limits(spec, "--default-limits")
        except ValueError as exc:
            raise usage.UsageError(str(exc)) from None

    def opt_limit_ceiling(self, spec: str) -> None:
        """Highest resource limits any process may have (same form as --default-limits); a start asking for more is refused, one asking for none gets the ceiling [default: none]."""  # noqa: E501
        try:
            self["limit-ceiling"] = parse_limits(spec, "--limit-ceiling")
        except ValueError as exc:
            raise usage.UsageError(str(exc)) from None

    def opt_spawn_path(self, path: str) -> None:
        """How children are created: fast (posix_spawn through Twisted's private hooks, checked at startup) or stock (public reactor.spawnProcess through setsid) [default: fast, or $EXEC_SERVER_SPAWN_PATH]."""  # noqa: E501
        if path not in SPAWN_PATHS:
            raise usage.UsageError(f"--spawn-path takes {', '.join(SPAWN_PATHS)}, got `{path}`")
        self["spawn-path"] = path

    def opt_socket_mode(self, mode: str) -> None:
        """unix:// listeners: permissions of the socket file, in octal [default: 0600]."""
        try:
            value = int(mode, 8)
        except ValueError:
            value = -1
        if not 0 <= value <= 0o777:
            raise usage.UsageError(f"--socket-mode takes octal permissions like 0660, got `{mode}`")
        self["socket-mode"] = value

    def opt_sandbox_mechanism(self, mechanism: str) -> None:
        """How confined processes are confined: auto (bubblewrap, else Landlock), bwrap or landlock; a confined start that the chosen mechanism cannot serve is refused [default: auto]."""  # noqa: E501
        if mechanism not in MECHANISM_CHOICES:
            raise usage.UsageError(
                f"--sandbox-mechanism takes {', '.join(MECHANISM_CHOICES)}, got `{mechanism}`"
            )
        self["sandbox-mechanism"] = mechanism

    def opt_sandbox_floor(self, mode: str) -> None:
        """Confine every process and fs call at least to this: read-only or workspace-write (with --floor-writable-root); full-access requests are then refused."""  # noqa: E501
        if mode not in FLOOR_MODES:
            raise usage.UsageError(f"--sandbox-floor takes {', '.join(FLOOR_MODES)}, got `{mode}`")
        self["sandbox-floor"] = mode

    def opt_floor_writable_root(self, path: str) -> None:
        """--sandbox-floor workspace-write: a directory writable under the floor (repeatable; absolute)."""  # noqa: E501
        if not os.path.isabs(path):
            raise usage.UsageError(f"--floor-writable-root takes an absolute path, got `{path}`")
        self["floor-writable-root"].append(path)

    def opt_listen(self, url: str) -> None:
        """Listen on URL: stdio://, ws://IP:PORT, wss://IP:PORT or unix:///PATH (repeatable)."""
        try:
            address = parse_listen_url(url)
        except ListenUrlError as exc:
            raise usage.UsageError(str(exc)) from None
        self["listen"].append(address)

    def opt_version(self) -> None:
        """Print the version and exit."""
        print(f"exec-server {__version__}")
        raise SystemExit(0)

    def postOptions(self) -> None:
        if self["floor-writable-root"] and self["sandbox-floor"] != "workspace-write":
            raise usage.UsageError("--floor-writable-root needs --sandbox-floor workspace-write")
        if self["floor-no-network"] and self["sandbox-floor"] is None:
            raise usage.UsageError("--floor-no-network needs --sandbox-floor")
        if self["spawn-path"] not in SPAWN_PATHS:
            raise usage.UsageError(
                f"${SPAWN_PATH_ENV} takes {', '.join(SPAWN_PATHS)}, got `{self['spawn-path']}`"
            )
        try:
            check_limit_defaults(self["default-limits"], self["limit-ceiling"])
        except ValueError as exc:
            raise usage.UsageError(str(exc)) from None
        if not self["listen"]:
            self["listen"] = [StdioAddress()]
        stdio = [a for a in self["listen"] if isinstance(a, StdioAddress)]
        if len(stdio) > 1:
            raise usage.UsageError("stdio:// can be listened on only once")
        if self["max-message-bytes"] < 1024:
            raise usage.UsageError("--max-message-bytes must be at least 1024")
        if self["max-partial-message-bytes"] < 1024:
            raise usage.UsageError("--max-partial-message-bytes must be at least 1024")
        if self["max-processes"] < 1:
            raise usage.UsageError("--max-processes must be at least 1")
        if self["ping-interval-ms"] and not self["ping-timeout-ms"]:
            raise usage.UsageError("--ping-timeout-ms must be positive while pings are enabled")
        for name in (
            "max-connections",
            "handshake-timeout-ms",
            "max-sessions-per-identity",
            "max-server-processes",
            "max-fs-ops-per-session",
            "max-ptys-per-session",
        ):
            if self[name] < 1:
                raise usage.UsageError(f"--{name} must be at least 1")
        if self["max-server-ptys"] is None:
            self["max-server-ptys"] = ptys.default_server_ptys()
        elif self["max-server-ptys"] < 1:
            raise usage.UsageError("--max-server-ptys must be at least 1")
        if self["max-request-head-bytes"] < 1024:
            raise usage.UsageError("--max-request-head-bytes must be at least 1024")
        self._check_tls()
        self._check_auth()

    def _check_tls(self) -> None:
        secure = [a for a in self["listen"] if isinstance(a, WebSocketAddress) and a.secure]
        given = [f for f in ("tls-cert", "tls-key", "tls-client-ca") if self[f] is not None]
        self["tls-options"] = None
        if not secure:
            if given:
                raise usage.UsageError(
                    f"--{given[0]} is given but no wss:// address is listened on"
                )
            return
        if self["tls-cert"] is None or self["tls-key"] is None:
            raise usage.UsageError(f"{secure[0]} needs --tls-cert and --tls-key")
        server_tls = tls.ServerTls(self["tls-cert"], self["tls-key"], self["tls-client-ca"])
        try:
            self["tls-options"] = server_tls.options()
        except tls.TlsConfigError as exc:
            raise usage.UsageError(str(exc)) from None

    def _check_auth(self) -> None:
        # The variable is removed from this process's environment whatever
        # is configured, so that no child can inherit it.
        from_env = auth.TokenStore.from_environment(os.environ)
        try:
            if self["auth-token-file"] is not None:
                self["auth"] = auth.TokenStore.from_file(self["auth-token-file"])
            else:
                self["auth"] = from_env
        except auth.AuthConfigError as exc:
            raise usage.UsageError(str(exc)) from None
        if self["auth"] is not None or self["allow-unauthenticated"]:
            return
        for address in self["listen"]:
            if not isinstance(address, WebSocketAddress) or address.is_loopback:
                continue
            # A required client certificate authenticates too.
            if not (address.secure and self["tls-client-ca"] is not None):
                raise usage.UsageError(
                    f"refusing to listen on {address} without authentication: anyone who "
                    "can reach it could run any command as this user. Give "
                    f"--auth-token-file (or ${auth.TOKEN_ENV}), listen on a loopback "
                    "address, or pass --allow-unauthenticated to accept the risk"
                )

    def websocket_settings(self) -> WebSocketSettings:
        from execserver.transports.websocket import WebSocketSettings

        return WebSocketSettings(
            max_message_bytes=self["max-message-bytes"],
            ping_interval=self["ping-interval-ms"] / 1000.0,
            ping_timeout=self["ping-timeout-ms"] / 1000.0,
            allowed_origins=frozenset(self["allow-origin"]),
            max_partial_message_bytes=self["max-partial-message-bytes"],
            fast_frames=not self["no-fast-frames"],
            auth=self.get("auth"),
            socket_mode=self["socket-mode"],
            tls_options=self.get("tls-options"),
            max_connections=self["max-connections"],
            open_handshake_timeout=self["handshake-timeout-ms"] / 1000.0,
            max_request_head_bytes=self["max-request-head-bytes"],
        )

    def sandbox(self) -> SandboxEngine:
        """The server's sandbox (probed when the service starts), with the operator's floor."""
        floor = None
        if self["sandbox-floor"] is not None:
            floor = floor_policy(
                self["sandbox-floor"], self["floor-writable-root"], not self["floor-no-network"]
            )
        masked = tuple(a.path for a in self["listen"] if isinstance(a, UnixAddress))
        if self["auth-token-file"] is not None:
            # The tokens that guard the listeners: no sandboxed command reads them.
            masked += (os.path.abspath(self["auth-token-file"]),)
        return SandboxEngine(self["sandbox-mechanism"], self["bwrap"], floor, masked)

    def config(self) -> ServerConfig:
        return ServerConfig(
            retained_output_bytes=self["retained-output-bytes"],
            exit_retention_ms=self["exit-retention-ms"],
            terminate_grace_ms=self["terminate-grace-ms"],
            max_processes=self["max-processes"],
            max_message_bytes=self["max-message-bytes"],
            max_read_file_bytes=self["max-read-file-bytes"],
            reply_budget_bytes=self["reply-budget-bytes"],
            connection_reply_budget_bytes=self["connection-reply-budget-bytes"],
            fs_wait_timeout_ms=self["fs-wait-timeout-ms"],
            fs_stall_ms=self["fs-stall-ms"],
            process_containment=self["process-containment"],
            max_session_ttl_ms=self["max-session-ttl-ms"],
            default_session_ttl_ms=self["default-session-ttl-ms"],
            max_sessions_per_identity=self["max-sessions-per-identity"],
            max_server_processes=self["max-server-processes"],
            max_total_retained_bytes=self["max-total-retained-bytes"],
            max_fs_ops_per_session=self["max-fs-ops-per-session"],
            max_ptys_per_session=self["max-ptys-per-session"],
            max_server_ptys=self["max-server-ptys"],
            default_limits=self["default-limits"],
            limit_ceiling=self["limit-ceiling"],
        )


@attrs.frozen
class ProcessWide:
    """The process-wide settings a starting server makes, each of which can be skipped."""

    #: Mark inherited descriptors close-on-exec (no child inherits them).
    seal_fds: bool = True
    #: glibc ``mallopt`` (:func:`tune_allocator`).
    tune_malloc: bool = True
    #: Soft RLIMIT_NOFILE up to the hard limit (:func:`raise_fd_limit`).
    raise_fd_limit: bool = True


class ExecServerService(MultiService):
    """Owns the dispatcher; stopping it terminates every session's processes.

    Building it changes nothing outside it; :meth:`startService` makes the
    process-wide settings (``ProcessWide``), starts containment (prctl,
    cgroups) and checks the spawn path, then starts the listeners.
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        containment: Containment | None = None,
        spawner: PosixSpawner | None = None,
        process_wide: ProcessWide | None = None,
        sandbox: SandboxEngine | None = None,
    ) -> None:
        super().__init__()
        self.dispatcher = dispatcher
        #: Probed (and its choice logged) when the service starts.
        self.sandbox = sandbox
        self.containment = containment
        self.spawner = spawner
        self.process_wide = process_wide if process_wide is not None else ProcessWide()
        #: A second SIGTERM/SIGINT during the shutdown is logged, not a second
        #: ``reactor.stop`` (set by the composition root of a real server).
        self.repeat_signals: RepeatSignals | None = None

    def startService(self) -> None:
        wide = self.process_wide
        if wide.seal_fds:
            seal_inherited_fds()
        if wide.tune_malloc:
            tune_allocator()
        if wide.raise_fd_limit:
            # A higher soft limit before the first process starts.
            raise_fd_limit(self.dispatcher.config.max_processes)
        if self.containment is not None:
            # A ContainmentError (--process-containment cgroup on a host
            # without a writable cgroup v2) stops the start.
            self.containment.start()
        try:
            self._start_rest()
        except BaseException:
            # A spawn path or listener that fails must not leave the cgroups
            # behind (stopService is never called for a failed start).
            if self.containment is not None:
                self.containment.stop()
            raise

    def _start_rest(self) -> None:
        if writebuffer.PROBLEM is not None:
            log.warn(
                "flow control: Twisted's write buffer changed ({problem}); unsent bytes "
                "read as 0, so the stdin bound and the fs reply budget do not hold",
                problem=writebuffer.PROBLEM,
            )
        if writebuffer.HIGH_WATER_PROBLEM is not None:
            log.warn(
                "flow control: Twisted's producer pause changed ({problem}); the high-water "
                "mark is set as bufferSize, which socket reads then grow to",
                problem=writebuffer.HIGH_WATER_PROBLEM,
            )
        if self.spawner is not None:
            # A child that would not lead its own group could not be
            # terminated with its tree: fall back, or refuse to start.
            self.spawner.check()
            log.info("spawn path: {path}", path=self.spawner.path)
        if self.sandbox is not None:
            self.sandbox.start()
        super().startService()

    def stopService(self) -> Deferred[None]:
        d: Deferred[Any] = Deferred.fromCoroutine(self._stop())
        return d

    async def _stop(self) -> None:
        # No new sessions (a new WebSocket connection, /readyz included, is
        # answered 503 while the listeners wait for their sessions to end,
        # so a load balancer stops routing here), then end every session,
        # then whatever escaped every session.
        if self.repeat_signals is not None:
            self.repeat_signals.shutting_down()
        self.dispatcher.begin_stopping()
        await super().stopService()
        await self.dispatcher.shutdown()
        if self.containment is not None:
            await self.containment.stop()
        if self.sandbox is not None:
            self.sandbox.stop()


def tune_allocator() -> None:
    """Keep glibc from mmap-ing and unmapping every large buffer.

    By default each buffer over 128 KiB (a 256 KiB pipe read, its base64, the
    notification around it) gets fresh pages from the kernel and gives them
    back on free: one page fault per 4 KiB, every time. Measured here that
    costs 20x the work of the base64 itself. Serving such buffers from the
    heap, and keeping up to 16 MiB of freed heap, removes it; memory stays
    bounded (buffers over 4 MiB, e.g. fs/readFile data, are still mapped).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 4 * 1024 * 1024)
    mallopt(m_trim_threshold, 16 * 1024 * 1024)


def raise_fd_limit(max_processes: int) -> None:
    """Use the hard RLIMIT_NOFILE and log the process limit it implies.

    Every process costs the server descriptors (``execserver.fdlimit``); the
    limit derived from them is logged as a warning when it is below
    ``--max-processes``, where it is the one a session meets first.
    """
    before, after = fdlimit.raise_soft_limit()
    limit = fdlimit.process_limit(after)
    emit = log.warn if limit < max_processes else log.info
    emit(
        "open-file limit {after} descriptors{raised}: at most {limit} processes "
        "server-wide ({per} descriptors each, {reserved} kept for connections and files)",
        after=after,
        raised=f" (raised from {before})" if after != before else "",
        limit=limit,
        per=fdlimit.FDS_PER_PROCESS,
        reserved=fdlimit.reserved_fds(after),
    )


def build_service(
    options: Options, reactor: IReactorCore, *, repeat_signals: bool = False
) -> ExecServerService:
    """Compose the service; ``reactor`` must also provide time, processes and TCP.

    ``repeat_signals``: the process's server (``reactor.run`` installs its
    signal handlers): a second SIGTERM/SIGINT during the shutdown is logged
    and ignored (``execserver.shutdown_signals``).
    """
    from execserver.transports.stdio import StdioService

    # Adapting checks that the reactor provides each interface used (zope
    # returns the reactor itself), so each part is typed by what it uses.
    clock = IReactorTime(reactor)
    processes = IReactorProcess(reactor)
    config = options.config()
    containment = Containment(config.process_containment, clock)
    spawn_path: SpawnPath = options["spawn-path"]
    spawner = PosixSpawner(processes, containment, spawn_path)
    sandbox = options.sandbox()
    # The unix:// listeners refuse the confined processes' trees (sandbox/peers.py).
    sandbox.peers = ConfinedPeers(clock, containment)
    dispatcher = build_dispatcher(config, clock, spawner, sandbox=sandbox)
    process_wide = ProcessWide(
        tune_malloc=not options["no-tune-malloc"],
        raise_fd_limit=not options["no-raise-fd-limit"],
    )
    root = ExecServerService(dispatcher, containment, spawner, process_wide, sandbox)
    if repeat_signals:
        signals = RepeatSignals(IReactorThreads(reactor).callFromThread)
        # (After the reactor's own handlers are in place: "during startup".)
        reactor.callWhenRunning(signals.install)
        root.repeat_signals = signals
    for address in options["listen"]:
        child: Service
        if isinstance(address, StdioAddress):
            child = StdioService(dispatcher, reactor, guard_stdout=not options["no-stdout-guard"])
        else:
            from execserver.transports.websocket import WebSocketService

            child = WebSocketService(
                dispatcher,
                IReactorTCP(reactor),
                address,
                attrs.evolve(options.websocket_settings(), peer_check=sandbox.peers.refused),
                metrics=partial(metrics.render, dispatcher),
            )
        child.setServiceParent(root)
    store = options.get("auth")
    if store is not None and store.path is not None:
        auth.TokenReloadService(store, IReactorThreads(reactor)).setServiceParent(root)
    return root


def makeService(options: Options) -> IServiceCollection:
    from twisted.internet import reactor

    if not options["no-stdout-guard"] and any(
        isinstance(address, StdioAddress) for address in options["listen"]
    ):
        from execserver.transports.stdio import guard_stdout

        # twistd logs to stdout before any service starts: take fd 1 for the
        # protocol now (twistd's composition root), not in startService.
        guard_stdout()

    return build_service(options, reactor, repeat_signals=True)
