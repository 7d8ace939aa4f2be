"""Wire types of the exec-server protocol, declared once for server and client.

Every request's params, every result and every notification is a msgspec
``Struct`` whose field names are rendered in camelCase, matching the
reference implementation (``codex-exec-server``) byte for byte. ``bytes``
fields travel as standard base64 strings, which msgspec encodes and decodes
in C.

Baseline fields come first, in the reference's order; fields this server
adds (see ``docs/protocol.md``) follow and are omitted when unset, so a
baseline client sees exactly the baseline shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar

import msgspec

PROTOCOL_VERSION = "exec-server.v0"
SERVER_NAME = "exec-server"

# Method names.
INITIALIZE = "initialize"
INITIALIZED = "initialized"
PROCESS_START = "process/start"
PROCESS_READ = "process/read"
PROCESS_WRITE = "process/write"
PROCESS_TERMINATE = "process/terminate"
PROCESS_OUTPUT = "process/output"
PROCESS_EXITED = "process/exited"
PROCESS_CLOSED = "process/closed"
PROCESS_SIGNAL = "process/signal"
PROCESS_CLOSE_STDIN = "process/closeStdin"
PROCESS_RESIZE = "process/resize"
PROCESS_WAIT = "process/wait"
PROCESS_LIST = "process/list"
FS_READ_FILE = "fs/readFile"
FS_WRITE_FILE = "fs/writeFile"
FS_CREATE_DIRECTORY = "fs/createDirectory"
FS_GET_METADATA = "fs/getMetadata"
FS_READ_DIRECTORY = "fs/readDirectory"
FS_REMOVE = "fs/remove"
FS_COPY = "fs/copy"

#: Listed in ``initialize``'s ``capabilities`` by a server whose fs/readFile
#: and fs/writeFile take ranges (a client must not send ranged writes to a
#: server without them: it would ignore ``offset`` and replace the whole
#: file each time).
RANGE_CAPABILITIES = (f"{FS_READ_FILE}:range", f"{FS_WRITE_FILE}:range")

# JSON-RPC error codes used by the reference.
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603

#: Largest accepted count or duration of our extensions (timeouts, grace):
#: the largest signed 64-bit integer (2^63 - 1). msgspec range-checks
#: integers within int64, so anything outside ``0..I64_MAX`` is ``-32602``
#: naming the field, e.g. ``Expected `int` >= 0 - at `$.timeoutMs```.
I64_MAX = (1 << 63) - 1
NonNegative = Annotated[int, msgspec.Meta(ge=0, le=I64_MAX)]
#: The reference declares ``process/read``'s ``afterSeq``, ``maxBytes`` and
#: ``waitMs`` as ``u64`` and accepts all of ``0..U64_MAX``; so do we. msgspec
#: cannot bound an integer beyond int64, so the upper bound is checked after
#: decoding (:func:`_check_u64`), with the same message shape.
U64_MAX = (1 << 64) - 1
U64 = Annotated[int, msgspec.Meta(ge=0)]


def _check_u64(params: msgspec.Struct, fields: tuple[str, ...]) -> None:
    for name in fields:
        value = getattr(params, name)
        if value is not None and value > U64_MAX:
            wire = name.split("_")[0] + "".join(w.title() for w in name.split("_")[1:])
            # msgspec turns a ValueError raised here into a ValidationError
            # (-32602) with exactly this text.
            raise ValueError(f"Expected `int` <= {U64_MAX} - at `$.{wire}`")


#: A terminal dimension: TIOCSWINSZ stores rows and columns as unsigned shorts.
WindowDimension = Annotated[int, msgspec.Meta(ge=1, le=65535)]
TimedOut = Literal["wall", "idle"]
RequestId = int | str
OutputStream = Literal["stdout", "stderr", "pty"]


class _Wire(msgspec.Struct, rename="camel"):
    """Base for request params: camelCase on the wire, unknown fields ignored."""


class _Out(msgspec.Struct, rename="camel", omit_defaults=True):
    """Base for results and notifications whose extension fields are omitted when unset."""


# --- initialize -------------------------------------------------------------


OnDetachedFull = Literal["drop", "pause"]


class InitializeParams(_Wire):
    client_name: str
    # Resumable sessions (docs/protocol.md, "Resumable sessions"). UNSET
    # (absent) vs None (``null``) tells the dialects apart: the current
    # reference client always sends the key (docs/protocol.md, "Dialects").
    resume_session_id: str | msgspec.UnsetType | None = msgspec.UNSET
    session_ttl_ms: NonNegative | None = None
    on_detached_full: OnDetachedFull | None = None


class ServerInfo(_Out):
    name: str
    version: str


class InitializeResponse(msgspec.Struct, rename="camel"):
    protocol_version: str
    session_id: str
    server_info: ServerInfo
    capabilities: list[str]
    # Resumable sessions: sent to clients that asked (or got a server default
    # TTL), so a baseline client's result is unchanged.
    #: The granted session lifetime after a disconnect (0: none).
    session_ttl_ms: int | msgspec.UnsetType = msgspec.UNSET
    on_detached_full: OnDetachedFull | msgspec.UnsetType = msgspec.UNSET
    #: Per-process retention cap (what a "pause" client must acknowledge within).
    retained_output_bytes: int | msgspec.UnsetType = msgspec.UNSET
    #: Current dialect only: the machine the client's commands run on.
    environment_info: EnvironmentInfo | msgspec.UnsetType = msgspec.UNSET


class ShellInfo(msgspec.Struct):
    name: str
    path: str


class EnvironmentInfo(msgspec.Struct, rename="camel"):
    """``environment/info`` (and ``initialize``'s ``environmentInfo``), current dialect.

    Directories are ``file://`` URIs; ``capabilities`` names the optional
    methods this server implements, each ``true`` (see docs/protocol.md).
    """

    shell: ShellInfo
    executor_version: str
    cwd: str
    user_home_dir: str
    platform_os: str
    prepend_path_dirs: list[str]
    temporary_directories: list[str]
    temp_dir: str
    capabilities: dict[str, bool]
    #: Additive: how confined processes are confined here ("bwrap",
    #: "landlock", or "none": confined starts are refused).
    sandbox: str | msgspec.UnsetType = msgspec.UNSET


class EnvironmentInfoParams(msgspec.Struct):
    """``environment/info`` takes no params (``null``, absent or ``{}``)."""


# --- process/start ----------------------------------------------------------


# The ``sandbox`` of process/start and of every fs/* call. Two dialects share
# the field: the seed's ``{"mode": ...}`` (with our additive ``readOnly`` and
# ``workspaceWrite`` modes) and the current reference's permission profile
# ``{"permissions": {...}, "cwd": ..., "workspaceRoots": [...], ...}``. The
# profile's own field names are snake_case, as the reference spells them.
# Resolution (what a profile allows) is execserver.sandbox.policy's job.


class SpecialRoot(msgspec.Struct, tag_field="kind", tag="root"):
    pass


class SpecialMinimal(msgspec.Struct, tag_field="kind", tag="minimal"):
    pass


class SpecialCurrentWorkingDirectory(
    msgspec.Struct, tag_field="kind", tag="current_working_directory"
):
    pass


class SpecialProjectRoots(msgspec.Struct, tag_field="kind", tag="project_roots"):
    subpath: str | None = None


class SpecialTmpdir(msgspec.Struct, tag_field="kind", tag="tmpdir"):
    pass


class SpecialSlashTmp(msgspec.Struct, tag_field="kind", tag="slash_tmp"):
    pass


class SpecialUnknown(msgspec.Struct, tag_field="kind", tag="unknown"):
    """A special path from a newer client: the reference ignores it, and so do we."""

    path: str
    subpath: str | None = None


SpecialPath = (
    SpecialRoot
    | SpecialMinimal
    | SpecialCurrentWorkingDirectory
    | SpecialProjectRoots
    | SpecialTmpdir
    | SpecialSlashTmp
    | SpecialUnknown
)


class PathTarget(msgspec.Struct, tag_field="type", tag="path"):
    #: A ``file://`` URI (the reference's form) or an absolute path.
    path: str


class SpecialTarget(msgspec.Struct, tag_field="type", tag="special"):
    value: SpecialPath


class GlobTarget(msgspec.Struct, tag_field="type", tag="glob_pattern"):
    pattern: str


class FileSystemSandboxEntry(msgspec.Struct):
    path: PathTarget | SpecialTarget | GlobTarget
    access: Literal["read", "write", "deny", "none"]
    missing_path_behavior: Literal["skip"] | None = None


class RestrictedFileSystem(msgspec.Struct, tag_field="type", tag="restricted"):
    entries: list[FileSystemSandboxEntry]
    #: The reference's usize (glob patterns, which are refused here).
    glob_scan_max_depth: NonNegative | None = None


class UnrestrictedFileSystem(msgspec.Struct, tag_field="type", tag="unrestricted"):
    pass


NetworkSandboxPolicy = Literal["restricted", "enabled"]


class ManagedPermissions(msgspec.Struct, tag_field="type", tag="managed"):
    file_system: RestrictedFileSystem | UnrestrictedFileSystem
    network: NetworkSandboxPolicy


class DisabledPermissions(msgspec.Struct, tag_field="type", tag="disabled"):
    pass


class ExternalPermissions(msgspec.Struct, tag_field="type", tag="external"):
    network: NetworkSandboxPolicy


PermissionProfile = ManagedPermissions | DisabledPermissions | ExternalPermissions

#: The seed's modes and ours (additive): readOnly and workspaceWrite.
SandboxMode = Literal["none", "hostDefault", "readOnly", "workspaceWrite"]


class SandboxConfig(_Wire):
    """``sandbox``: the seed's ``mode`` form or the current dialect's profile.

    A seed client's ``{"mode": "none"}`` decodes exactly as before; an
    object with neither ``mode`` nor ``permissions`` is the seed's error
    (``Object missing required field `mode` - at `$.sandbox```).
    """

    mode: SandboxMode | msgspec.UnsetType = msgspec.UNSET
    #: workspaceWrite (ours): absolute paths (or file URIs); absent: the cwd.
    writable_roots: list[str] | msgspec.UnsetType = msgspec.UNSET
    #: readOnly / workspaceWrite (ours): network allowed (default false).
    network: bool | msgspec.UnsetType = msgspec.UNSET
    # Current dialect (the reference's FileSystemSandboxContext).
    permissions: PermissionProfile | msgspec.UnsetType = msgspec.UNSET
    cwd: str | None = None
    workspace_roots: list[str] | None = None
    windows_sandbox_level: Any = None
    windows_sandbox_private_desktop: bool = False
    windows_sandbox_proxy_settings_mode: Any = None
    use_legacy_landlock: bool = False

    def __post_init__(self) -> None:
        # msgspec turns these ValueErrors into -32602 "... - at `$.sandbox`".
        if self.permissions is msgspec.UNSET:
            if self.mode is msgspec.UNSET:
                raise ValueError("Object missing required field `mode`")
            if self.writable_roots is not msgspec.UNSET and self.mode != "workspaceWrite":
                raise ValueError("`writableRoots` is taken only with mode `workspaceWrite`")
            if self.network is not msgspec.UNSET and self.mode not in (
                "readOnly",
                "workspaceWrite",
            ):
                raise ValueError(
                    "`network` is taken only with modes `readOnly` and `workspaceWrite`"
                )
        elif self.mode is not msgspec.UNSET:
            raise ValueError("sandbox takes either `mode` or `permissions`, not both")


class TerminalSize(_Wire):
    rows: WindowDimension
    cols: WindowDimension


class EnvPolicy(_Wire):
    """How the child's environment is built from the server's (current dialect).

    As the reference's shell environment policy: start from ``inherit``
    ("all", "core" or "none" of the server's variables), drop the default
    excludes (names matching ``*KEY*``, ``*SECRET*``, ``*TOKEN*``) unless
    ``ignoreDefaultExcludes``, drop names matching ``exclude``, add ``set``,
    keep only names matching ``includeOnly`` (when not empty); ``env`` is
    applied on top. Patterns are case-insensitive shell wildcards.
    """

    inherit: Literal["all", "core", "none"] = "all"
    ignore_default_excludes: bool = False
    exclude: list[str] = msgspec.field(default_factory=list)
    set: dict[str, str] = msgspec.field(default_factory=dict)
    include_only: list[str] = msgspec.field(default_factory=list)


#: ``limits`` values: below 2**62 (what a cgroup file or an rlimit takes).
LimitValue = Annotated[int, msgspec.Meta(ge=1, le=(1 << 62) - 1)]


class ProcessLimits(_Wire):
    """``process/start``'s ``limits`` (docs/process-control.md, "Resource limits")."""

    #: At least 1 MiB: below a few pages not even ``exec`` fits.
    memory_bytes: Annotated[int, msgspec.Meta(ge=1 << 20, le=(1 << 62) - 1)] | None = None
    max_processes: LimitValue | None = None
    #: Percent of one CPU; the CFS quota's floor is 1 ms per 100 ms period.
    cpu_percent: Annotated[int, msgspec.Meta(ge=1, le=409_600)] | None = None
    file_size_bytes: LimitValue | None = None


LimitExceeded = Literal["memory", "processes", "cpu", "fileSize"]


class ProcessUsage(_Out):
    """What a process's tree uses now, from its cgroup (absent: not measured here)."""

    memory_bytes: int | msgspec.UnsetType = msgspec.UNSET
    memory_peak_bytes: int | msgspec.UnsetType = msgspec.UNSET
    cpu_time_ms: float | msgspec.UnsetType = msgspec.UNSET
    processes: int | msgspec.UnsetType = msgspec.UNSET


class ExecParams(_Wire):
    process_id: str
    argv: list[str]
    cwd: str
    env: dict[str, str]
    tty: bool
    arg0: str | None = None
    sandbox: SandboxConfig | None = None
    # Extensions (docs/process-control.md); each default is the baseline behaviour.
    pipe_stdin: bool = False
    size: TerminalSize | None = None
    #: 0 or absent: no limit.
    timeout_ms: NonNegative | None = None
    idle_timeout_ms: NonNegative | None = None
    # Current dialect: without it, ``env`` is the whole environment.
    env_policy: EnvPolicy | None = None
    limits: ProcessLimits | None = None


class ExecResponse(_Wire):
    process_id: str
    #: Current dialect: the sandbox the process runs in (always "none").
    sandbox_type: str | msgspec.UnsetType = msgspec.UNSET
    #: Sent when the request had ``limits``: the effective ones.
    limits: dict[str, int] | msgspec.UnsetType = msgspec.UNSET


# --- process/read -----------------------------------------------------------


class ReadParams(_Wire):
    process_id: str
    after_seq: U64 | None = None
    max_bytes: U64 | None = None
    wait_ms: U64 | None = None

    #: The ``u64`` fields whose upper bound is checked after decoding.
    U64_FIELDS: ClassVar[tuple[str, ...]] = ("after_seq", "max_bytes", "wait_ms")

    def __post_init__(self) -> None:
        _check_u64(self, self.U64_FIELDS)


class SeqGap(msgspec.Struct, rename="camel"):
    from_seq: int
    to_seq: int


class ProcessOutputChunk(msgspec.Struct, rename="camel"):
    seq: int
    stream: OutputStream
    chunk: bytes


class ReadResponse(msgspec.Struct, rename="camel"):
    chunks: list[ProcessOutputChunk]
    next_seq: int
    exited: bool
    exit_code: int | None
    # Extensions: msgspec never encodes UNSET fields, so baseline clients see
    # exactly the reference's four fields (including ``"exitCode": null``).
    closed: bool | msgspec.UnsetType = msgspec.UNSET
    signal: str | msgspec.UnsetType = msgspec.UNSET
    timed_out: TimedOut | msgspec.UnsetType = msgspec.UNSET
    #: Where the exit and the close fall in the process's seq order.
    exited_seq: int | msgspec.UnsetType = msgspec.UNSET
    closed_seq: int | msgspec.UnsetType = msgspec.UNSET
    #: Output seqs of the requested range that are no longer retained.
    gap: SeqGap | msgspec.UnsetType = msgspec.UNSET
    #: Current dialect: a start failure's text (never: a failed start is an
    #: error answer here) and whether a sandbox denied the process.
    failure: str | msgspec.UnsetType | None = msgspec.UNSET
    sandbox_denied: bool | msgspec.UnsetType = msgspec.UNSET
    #: The resource limit that ended or crippled the process, and its figure.
    limit_exceeded: LimitExceeded | msgspec.UnsetType = msgspec.UNSET
    limit_value: int | msgspec.UnsetType = msgspec.UNSET


# --- process/write, process/terminate ---------------------------------------


class WriteParams(_Wire):
    process_id: str
    chunk: bytes
    #: A retried write with the same id is acknowledged, not written again.
    write_id: str | None = None


class WriteResponse(_Wire):
    accepted: bool
    #: The reference's current dialect (whose clients always send a
    #: ``writeId``) reports the outcome as ``status``; sent with a writeId.
    status: str | msgspec.UnsetType = msgspec.UNSET


class TerminateParams(_Wire):
    process_id: str
    #: SIGTERM -> SIGKILL delay; absent: --terminate-grace-ms (seed dialect)
    #: or 0 (current dialect, as the reference); 0: SIGKILL at once.
    grace_ms: NonNegative | None = None
    #: Also end what is left of the tree of a process that already exited
    #: (background jobs, daemons); without it those live until the session ends.
    descendants: bool = False


class TerminateResponse(_Wire):
    running: bool


# --- notifications ----------------------------------------------------------


class OutputNotification(msgspec.Struct, rename="camel"):
    process_id: str
    stream: OutputStream
    chunk: bytes
    seq: int


class ExitedNotification(msgspec.Struct, rename="camel"):
    process_id: str
    exit_code: int
    signal: str | msgspec.UnsetType = msgspec.UNSET
    seq: int | msgspec.UnsetType = msgspec.UNSET
    timed_out: TimedOut | msgspec.UnsetType = msgspec.UNSET
    #: Current dialect: whether a sandbox denial ended the process (never here).
    sandbox_denied: bool | msgspec.UnsetType = msgspec.UNSET
    limit_exceeded: LimitExceeded | msgspec.UnsetType = msgspec.UNSET
    limit_value: int | msgspec.UnsetType = msgspec.UNSET


class ClosedNotification(msgspec.Struct, rename="camel"):
    process_id: str
    seq: int


# --- process control extensions (docs/process-control.md) -----------------


class SignalParams(_Wire):
    process_id: str
    #: A name ("SIGINT" or "INT"), a number, or the reference's
    #: ``"interrupt"`` (also as ``{"interrupt": null}``).
    signal: int | str | dict[str, None]


class SignalResponse(_Wire):
    delivered: bool


class CloseStdinParams(_Wire):
    process_id: str


class CloseStdinResponse(_Wire):
    closed: bool


class ResizeParams(_Wire):
    process_id: str
    rows: WindowDimension
    cols: WindowDimension


class WaitParams(_Wire):
    process_id: str
    #: Absent: wait until the process exits; 0: answer at once.
    timeout_ms: NonNegative | None = None


class WaitResponse(msgspec.Struct, rename="camel"):
    exited: bool
    exit_code: int | None
    signal: str | msgspec.UnsetType = msgspec.UNSET
    timed_out: TimedOut | msgspec.UnsetType = msgspec.UNSET


class ListParams(_Wire):
    pass


class ListedProcess(msgspec.Struct, rename="camel", omit_defaults=True):
    process_id: str
    pid: int | None
    argv: list[str]
    tty: bool
    running: bool
    exit_code: int | None
    #: Pids of the tree still running besides the leader (omitted when none):
    #: background jobs of a process that exited live until the session ends.
    descendants: list[int] = msgspec.field(default_factory=list)
    #: The process's effective resource limits and its tree's usage.
    limits: dict[str, int] | msgspec.UnsetType = msgspec.UNSET
    usage: ProcessUsage | msgspec.UnsetType = msgspec.UNSET
    limit_exceeded: LimitExceeded | msgspec.UnsetType = msgspec.UNSET


class ListResponse(msgspec.Struct, rename="camel"):
    processes: list[ListedProcess]


# --- JSON-RPC envelopes -----------------------------------------------------


class ErrorObject(msgspec.Struct, omit_defaults=True):
    code: int
    message: str
    data: Any = None


class Request(msgspec.Struct, omit_defaults=True):
    id: RequestId
    method: str
    params: Any = None


class Notification(msgspec.Struct, omit_defaults=True):
    method: str
    params: Any = None


class Response(msgspec.Struct):
    id: RequestId
    result: Any


class ErrorResponse(msgspec.Struct):
    id: RequestId | None
    error: ErrorObject


class Empty(msgspec.Struct):
    """An empty JSON object, ``{}``."""


# --- fs/* (filesystem methods) ----------------------------------------------
# Baseline shapes of the reference's Fs* params and responses. Paths are
# native absolute path strings. ``bytes`` fields travel as standard base64.


class FsReadFileParams(_Wire):
    path: str
    sandbox: SandboxConfig | None = None


class FsReadFileResponse(msgspec.Struct, rename="camel"):
    data_base64: bytes


class FsWriteFileParams(_Wire):
    path: str
    data_base64: bytes
    sandbox: SandboxConfig | None = None


class FsCreateDirectoryParams(_Wire):
    path: str
    recursive: bool | None = None
    sandbox: SandboxConfig | None = None


class FsGetMetadataParams(_Wire):
    path: str
    sandbox: SandboxConfig | None = None


class FsGetMetadataResponse(msgspec.Struct, rename="camel"):
    is_directory: bool
    is_file: bool
    created_at_ms: int
    modified_at_ms: int
    # Extensions (omitted when unset): lstat says the path itself is a
    # symlink; byte size of what the path resolves to.
    is_symlink: bool | msgspec.UnsetType = msgspec.UNSET
    size: int | msgspec.UnsetType = msgspec.UNSET


class FsReadDirectoryParams(_Wire):
    path: str
    sandbox: SandboxConfig | None = None


class FsReadDirectoryEntry(msgspec.Struct, rename="camel"):
    file_name: str
    is_directory: bool
    is_file: bool
    # Extension: the entry itself is a symlink (its other flags describe the target).
    is_symlink: bool | msgspec.UnsetType = msgspec.UNSET


class FsReadDirectoryResponse(msgspec.Struct, rename="camel"):
    entries: list[FsReadDirectoryEntry]


class FsRemoveParams(_Wire):
    path: str
    recursive: bool | None = None
    force: bool | None = None
    sandbox: SandboxConfig | None = None


class FsWatchMissingParams(_Wire):
    """``fs/watchMissing`` (current dialect): paths as URIs or absolute paths."""

    watch_id: U64 | str
    missing: list[str]
    #: The reference's shape is one URI (or null); a list is accepted too.
    present: list[str] | str | None = None

    U64_FIELDS: ClassVar[tuple[str, ...]] = ("watch_id",)

    def __post_init__(self) -> None:
        if isinstance(self.watch_id, int):
            _check_u64(self, self.U64_FIELDS)


class FsWatchMissingResponse(msgspec.Struct):
    watching: bool


class FsMissingChangedNotification(msgspec.Struct, rename="camel"):
    watch_id: int | str


class FsCopyParams(_Wire):
    source_path: str
    destination_path: str
    recursive: bool = False
    sandbox: SandboxConfig | None = None


# --- fs/canonicalize, fs/walk (the current dialect) --------------------------------------

FS_CANONICALIZE = "fs/canonicalize"
FS_WALK = "fs/walk"

WalkKind = Literal["directory", "file"]


class FsCanonicalizeParams(msgspec.Struct, rename="camel"):
    path: str


class FsCanonicalizeResponse(msgspec.Struct, rename="camel"):
    path: str


class WalkOptions(msgspec.Struct, rename="camel"):
    # The reference's usize: a negative value is -32602 naming the field
    # (values past the maxima of fs/walk.py are the reference's -32600).
    max_depth: NonNegative
    max_directories: NonNegative
    max_entries: NonNegative
    follow_directory_symlinks: bool


class FsWalkParams(msgspec.Struct, rename="camel"):
    path: str
    options: WalkOptions


class WalkEntry(msgspec.Struct, rename="camel"):
    path: str
    kind: WalkKind


class WalkError(msgspec.Struct, rename="camel"):
    path: str
    message: str


class FsWalkResponse(msgspec.Struct, rename="camel"):
    entries: list[WalkEntry] = msgspec.field(default_factory=list)
    errors: list[WalkError] = msgspec.field(default_factory=list)
    truncated: bool = False


# --- the methods, each declared once ---------------------------------------------------

P = TypeVar("P")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Method(Generic[P, R]):
    """One request method, as AMP's ``Command`` declares one: its name, the
    type of its params and of its result, the handshake family whose routes
    it belongs to (what a connection must have done first; ``None``: no
    handshake needed), and whether a call of it in flight at a dropped
    connection may be sent again on the resumed session (repeating it
    changes nothing).

    The server's routes are added from these (``app``), and every client
    calls through one generic path taking one (``request``); the typed
    convenience methods only build the params.
    """

    name: str
    params: type[P]
    result: type[R]
    family: str | None = "exec"
    repeatable: bool = False


ProcessStart = Method(PROCESS_START, ExecParams, ExecResponse)
ProcessRead = Method(PROCESS_READ, ReadParams, ReadResponse, repeatable=True)
#: Repeatable only with a ``writeId`` (see :func:`execserver.clientcore.calls.repeatable`).
ProcessWrite = Method(PROCESS_WRITE, WriteParams, WriteResponse)
ProcessTerminate = Method(PROCESS_TERMINATE, TerminateParams, TerminateResponse)
ProcessSignal = Method(PROCESS_SIGNAL, SignalParams, SignalResponse)
ProcessCloseStdin = Method(PROCESS_CLOSE_STDIN, CloseStdinParams, CloseStdinResponse)
ProcessResize = Method(PROCESS_RESIZE, ResizeParams, Empty)
ProcessWait = Method(PROCESS_WAIT, WaitParams, WaitResponse, repeatable=True)
ProcessList = Method(PROCESS_LIST, ListParams, ListResponse, repeatable=True)
FsReadFile = Method(
    FS_READ_FILE, FsReadFileParams, FsReadFileResponse, "filesystem", repeatable=True
)
FsWriteFile = Method(FS_WRITE_FILE, FsWriteFileParams, Empty, "filesystem")
FsCreateDirectory = Method(FS_CREATE_DIRECTORY, FsCreateDirectoryParams, Empty, "filesystem")
FsGetMetadata = Method(
    FS_GET_METADATA, FsGetMetadataParams, FsGetMetadataResponse, "filesystem", repeatable=True
)
FsReadDirectory = Method(
    FS_READ_DIRECTORY,
    FsReadDirectoryParams,
    FsReadDirectoryResponse,
    "filesystem",
    repeatable=True,
)
FsRemove = Method(FS_REMOVE, FsRemoveParams, Empty, "filesystem")
FsCopy = Method(FS_COPY, FsCopyParams, Empty, "filesystem")

#: Every request method of the baseline and of its process-control and fs
#: extensions (``initialize`` aside: its result is read leniently by clients).
METHODS: tuple[Method[Any, Any], ...] = (
    ProcessStart,
    ProcessRead,
    ProcessWrite,
    ProcessTerminate,
    ProcessSignal,
    ProcessCloseStdin,
    ProcessResize,
    ProcessWait,
    ProcessList,
    FsReadFile,
    FsWriteFile,
    FsCreateDirectory,
    FsGetMetadata,
    FsReadDirectory,
    FsRemove,
    FsCopy,
)


# --- the handshake's and the current dialect's methods, each declared once ---------------

ENVIRONMENT_INFO = "environment/info"
FS_WATCH_MISSING = "fs/watchMissing"

#: No family: a connection calls it first. Clients read its result
#: leniently (``clientcore.types.InitializeResult``).
Initialize = Method(INITIALIZE, InitializeParams, InitializeResponse, None)
#: Current dialect; its params are null (any value is accepted). Gated on
#: the handshake as the reference gates it ("... environment info methods").
EnvironmentInfoMethod = Method(ENVIRONMENT_INFO, object, EnvironmentInfo, "environment info")


class EnvironmentStatusResponse(msgspec.Struct):
    """``environment/status``: the reference's ``{"status": "ready"}``."""

    status: Literal["ready"] = "ready"


ENVIRONMENT_STATUS = "environment/status"
#: Current dialect; params ``null``, absent or ``{}`` (the reference's unit).
EnvironmentStatusMethod = Method(
    ENVIRONMENT_STATUS, object, EnvironmentStatusResponse, "environment status"
)
FsWatchMissing = Method(
    FS_WATCH_MISSING, FsWatchMissingParams, FsWatchMissingResponse, "filesystem"
)
FsCanonicalize = Method(FS_CANONICALIZE, FsCanonicalizeParams, FsCanonicalizeResponse, "filesystem")
FsWalk = Method(FS_WALK, FsWalkParams, FsWalkResponse, "filesystem")

#: The handshake and the current dialect's methods of the server's own
#: rooms (the Codex-only ones are declared beside their types in
#: ``execserver.codex``). Not in :data:`METHODS`: no client repeats them.
DIALECT_METHODS: tuple[Method[Any, Any], ...] = (
    Initialize,
    EnvironmentInfoMethod,
    EnvironmentStatusMethod,
    FsWatchMissing,
    FsCanonicalize,
    FsWalk,
)


# --- http/request: HTTP made by the executor (remote MCP servers), declared once ------------

HTTP_REQUEST = "http/request"
HTTP_REQUEST_BODY_DELTA = "http/request/bodyDelta"


class HttpHeader(msgspec.Struct, rename="camel"):
    """One header; repeated names are repeated items, in order."""

    name: str
    #: The value; with ``valueEnvVar``, the prefix of it (``"Bearer "``).
    value: str
    #: An environment variable of the server whose value is appended to
    #: ``value`` (credentials stay on the executor; ``httpHeaderEnvVars``).
    value_env_var: str | msgspec.UnsetType | None = msgspec.UNSET


class HttpRequestParams(msgspec.Struct, rename="camel"):
    #: An HTTP token (``GET``, ``POST``, ...; case kept).
    method: str
    #: An absolute ``http://`` or ``https://`` URL.
    url: str
    #: Names this request's ``http/request/bodyDelta`` notifications; required
    #: even when the body is buffered (as the reference).
    request_id: str
    headers: list[HttpHeader] = msgspec.field(default_factory=list)
    #: The request body (base64 on the wire); absent: none.
    body_base64: bytes | None = None
    #: The whole request's deadline; absent or null: none (as codex 0.171.0).
    timeout_ms: NonNegative | None = None
    #: Answer at the response headers and send the body as notifications.
    stream_response: bool = False
    #: ``follow`` (up to 10 redirects, the default) or ``stop`` (a 3xx is the
    #: answer); serde's map form (``{"stop": null}``) too. Checked by the
    #: route, with the reference's texts.
    redirect_policy: str | dict[str, None] = "follow"


class HttpRequestResponse(msgspec.Struct, rename="camel"):
    status: int
    headers: list[HttpHeader]
    #: The whole body when buffered; empty with ``streamResponse``.
    body_base64: bytes


class HttpRequestBodyDeltaNotification(msgspec.Struct, rename="camel"):
    request_id: str
    #: 1, 2, ... per request; the last one has ``done`` true.
    seq: int
    delta_base64: bytes
    done: bool = False
    #: Why the body ended early; set only on the last one.
    error: str | None = None


#: Gated on the handshake as the reference gates it ("... using http methods").
HttpRequest = Method(HTTP_REQUEST, HttpRequestParams, HttpRequestResponse, "http")
