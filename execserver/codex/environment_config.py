"""``environmentConfig/read``: the executor's own Codex configuration, by TOML key path.

Codex (0.171) asks the machine its commands run on for the parts of *that*
machine's Codex configuration it needs (today: ``mcp_servers``), because a
remote executor's files are out of its reach. The server reads the
configuration the way the reference's loader reads its "executor-local"
layers, keeps only the requested key paths, and answers with the layers as
TOML text, lowest precedence first; merging them is the client's job.

Config layers, in order (docs/protocol.md, "environmentConfig/read"):

1. system: ``/etc/codex/config.toml``;
2. user: ``$CODEX_HOME/config.toml`` (``CODEX_HOME``, else ``~/.codex``);
3. project: ``.codex/config.toml`` in each directory from the project root
   (nearest ancestor of ``cwd`` holding a ``project_root_markers`` entry,
   default ``.git``) down to ``cwd``, only for projects the system or user
   config marks ``trusted`` under ``[projects."PATH"]``; keys a project may
   not set (credentials' destinations, commands) are dropped;
4. legacy managed: ``/etc/codex/managed_config.toml``.

Requirements layers: ``/etc/codex/requirements.toml``, then the legacy
managed config read as requirements. A missing file is an empty layer;
layers left empty by the selection are dropped. All file work runs on the
fs pool, since it may block.
"""

from __future__ import annotations

import errno
import os
import pwd
import re
import socket
import stat
import tomllib
from collections.abc import Mapping
from typing import Any, Final

import attrs
import msgspec

from execserver import protocol as p
from execserver.codex import toml_depth
from execserver.codex.toml_writer import dumps
from execserver.errors import RpcError
from execserver.fs.paths import absolute_path, path_to_uri
from execserver.fs.pool import Runner
from execserver.spawn.lookup import os_error_text

ENVIRONMENT_CONFIG_READ: Final = "environmentConfig/read"
#: Handshake family named in "client must call initialize before using ... methods".
FAMILY: Final = "environment config"
SYSTEM_DIR: Final = "/etc/codex"
CONFIG_TOML: Final = "config.toml"
REQUIREMENTS_TOML: Final = "requirements.toml"
MANAGED_CONFIG_TOML: Final = "managed_config.toml"
DEFAULT_PROJECT_ROOT_MARKERS: Final = (".git",)
#: Keys a project's own config may not set: they choose where credentials
#: go or which local commands run (the reference's denylist).
PROJECT_DENYLIST: Final = (
    "openai_base_url",
    "chatgpt_base_url",
    "apps_mcp_product_sku",
    "model_provider",
    "model_providers",
    "notify",
    "profile",
    "profiles",
    "experimental_realtime_webrtc_call_base_url",
    "experimental_realtime_ws_base_url",
    "otel",
)

#: Bytes a configuration file may hold (larger ones are an error, unread).
MAX_CONFIG_BYTES: Final = 4 * 1024 * 1024

NO_SELECTORS: Final = "at least one config or requirements path is required"
EMPTY_SELECTOR: Final = "TOML paths must contain at least one key segment"


class EnvironmentConfigReadParams(msgspec.Struct, rename="camel"):
    cwd: str
    config_paths: list[list[str]]
    requirements_paths: list[list[str]]


class EnvironmentConfigLayer(msgspec.Struct, rename="camel"):
    #: Provenance for diagnostics (``user (/root/.codex/config.toml)``).
    source: str
    #: Directory relative paths in this layer are relative to (a URI).
    base_dir: str
    #: The selected part of the layer, as TOML.
    toml: str


class EnvironmentConfigLayerStack(msgspec.Struct, rename="camel"):
    layers: list[EnvironmentConfigLayer]
    #: Where the client inserts its cloud-provided layers.
    cloud_insertion_index: int


class EnvironmentConfigReadResponse(msgspec.Struct, rename="camel"):
    user_home_dir: str | None
    codex_home_dir: str
    hostname: str | None
    config: EnvironmentConfigLayerStack
    requirements: EnvironmentConfigLayerStack


class ConfigLoadError(Exception):
    """A configuration file could not be read or parsed (``-32603``)."""


@attrs.frozen
class Layer:
    source: str
    base_dir: str
    toml: dict[str, Any]


@attrs.frozen
class Stack:
    layers: list[Layer]
    cloud_insertion_index: int


# --- params -----------------------------------------------------------------------


def validate(params: EnvironmentConfigReadParams) -> str:
    """The native ``cwd``, once the selectors are acceptable (``-32602`` otherwise)."""
    if not params.config_paths and not params.requirements_paths:
        raise RpcError.invalid_params(NO_SELECTORS)
    if any(not path for path in (*params.config_paths, *params.requirements_paths)):
        raise RpcError.invalid_params(EMPTY_SELECTOR)
    return absolute_path(params.cwd, "cwd")


# --- homes ------------------------------------------------------------------------


def _debug_str(text: str) -> str:
    """``text`` quoted as Rust's ``{:?}`` quotes a string (the reference's texts)."""
    out = []
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif char == "\n":
            out.append("\\n")
        elif char == "\r":
            out.append("\\r")
        elif char == "\t":
            out.append("\\t")
        elif char == "\0":
            out.append("\\0")
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{{{ord(char):x}}}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def _os_text(exc: OSError) -> str:
    return os_error_text(exc.errno) if exc.errno is not None else str(exc)


def user_home(environ: Mapping[str, str]) -> str | None:
    """``$HOME``, else the password database's, as the reference finds it."""
    home = environ.get("HOME")
    if home:
        return home
    try:
        return pwd.getpwuid(os.getuid()).pw_dir or None
    except KeyError:
        return None


def find_codex_home(environ: Mapping[str, str]) -> str:
    """``CODEX_HOME`` (must be a directory; canonicalised), else ``~/.codex``."""
    value = environ.get("CODEX_HOME")
    if value:
        quoted = _debug_str(value)
        try:
            info = os.stat(value)
        except FileNotFoundError:
            raise ConfigLoadError(
                f"CODEX_HOME points to {quoted}, but that path does not exist"
            ) from None
        except OSError as exc:
            raise ConfigLoadError(f"failed to read CODEX_HOME {quoted}: {_os_text(exc)}") from None
        if not stat.S_ISDIR(info.st_mode):
            raise ConfigLoadError(
                f"CODEX_HOME points to {quoted}, but that path is not a directory"
            )
        try:
            return os.path.realpath(value, strict=True)
        except OSError as exc:
            raise ConfigLoadError(
                f"failed to canonicalize CODEX_HOME {quoted}: {_os_text(exc)}"
            ) from None
    home = user_home(environ)
    if home is None:
        raise ConfigLoadError("Could not find home directory")
    return os.path.join(home, ".codex")


def request_codex_home(environ: Mapping[str, str]) -> str:
    """:func:`find_codex_home`, or the ``-32603`` both methods answer without one."""
    try:
        return find_codex_home(environ)
    except ConfigLoadError as exc:
        raise RpcError.internal(f"failed to find Codex home: {exc}") from None


# --- reading TOML files -----------------------------------------------------------

_TOML_POSITION: Final = re.compile(r"^(?P<msg>.*) \(at line (?P<line>\d+), column (?P<col>\d+)\)$")


def _parse_error(path: str, exc: tomllib.TOMLDecodeError) -> str:
    """``PATH:LINE:COL: MESSAGE``, the shape of the reference's config errors."""
    text = str(exc)
    found = _TOML_POSITION.match(text)
    if found is None:
        return f"{path}: {text}"
    return f"{path}:{found['line']}:{found['col']}: {found['msg']}"


def parse_toml(path: str, text: str) -> dict[str, Any]:
    """``text``'s table, or ``ValueError("PATH:LINE:COL: MESSAGE")``.

    Nesting deeper than the reference's parser allows (80 levels of tables
    and arrays) is refused with its message (``toml_depth``), where
    ``tomllib`` alone would raise ``RecursionError`` (or build what the
    walks after it cannot follow).
    """
    try:
        config: dict[str, Any] | None = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(_parse_error(path, exc)) from None
    except RecursionError:
        config = None
    if config is not None and not toml_depth.too_deep(config):
        return config
    found = toml_depth.first_too_deep(text)
    if found is None:
        raise ValueError(f"{path}: {toml_depth.TABLES_TOO_DEEP}")
    line, column, message = found
    raise ValueError(f"{path}:{line}:{column}: {message}")


def read_regular(path: str, limit: int) -> bytes | None:
    """A regular file's bytes, at most ``limit``; None if it does not exist.

    Opened ``O_NONBLOCK`` and checked with ``fstat`` before reading (as
    ``fs/readFile`` does), so a FIFO or device never blocks a pool thread.
    Raises OSError (``EISDIR`` for a directory, as reading one would) or
    ValueError (not a regular file; more than ``limit`` bytes).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        return None
    with open(fd, "rb") as stream:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise OSError(errno.EISDIR, os.strerror(errno.EISDIR))
        if not stat.S_ISREG(mode):
            raise ValueError("not a regular file")
        raw = stream.read(limit + 1)
    if len(raw) > limit:
        raise ValueError(f"file exceeds the {limit}-byte limit")
    return raw


def _read_text(path: str) -> str | None:
    """The file's text; None if it does not exist. Other failures raise OSError/ValueError."""
    raw = read_regular(path, MAX_CONFIG_BYTES)
    if raw is None:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("stream did not contain valid UTF-8") from None


def _read_error(exc: OSError | ValueError) -> str:
    return _os_text(exc) if isinstance(exc, OSError) else str(exc)


def read_toml(path: str, what: str) -> dict[str, Any] | None:
    """A TOML file's table; None if missing (``Failed to read WHAT file PATH: ...``)."""
    try:
        text = _read_text(path)
    except (OSError, ValueError) as exc:
        raise ConfigLoadError(f"Failed to read {what} file {path}: {_read_error(exc)}") from None
    if text is None:
        return None
    try:
        return parse_toml(path, text)
    except ValueError as exc:
        raise ConfigLoadError(str(exc)) from None


def merge(base: dict[str, Any], overlay: Mapping[str, Any]) -> None:
    """Merge ``overlay`` into ``base``: tables recursively, anything else replaced."""
    for key, value in overlay.items():
        current = base.get(key)
        if isinstance(current, dict) and isinstance(value, Mapping):
            merge(current, value)
        else:
            base[key] = _copy(value)


def _copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


# --- projects and trust -----------------------------------------------------------


def _markers(config: Mapping[str, Any]) -> tuple[str, ...]:
    if "project_root_markers" not in config:
        return DEFAULT_PROJECT_ROOT_MARKERS
    markers = config["project_root_markers"]
    if not isinstance(markers, list) or not all(isinstance(m, str) for m in markers):
        raise ConfigLoadError("project_root_markers must be an array of strings")
    return tuple(markers)


def ancestors(path: str) -> list[str]:
    """``path`` and each of its parents, nearest first, ending with ``/``."""
    found = [path]
    while path != "/":
        path = os.path.dirname(path)
        found.append(path)
    return found


def _exists(path: str) -> bool:
    try:
        os.stat(path)
    except (OSError, ValueError):
        return False
    return True


def find_project_root(cwd: str, markers: tuple[str, ...]) -> str:
    """Nearest ancestor of ``cwd`` holding a marker; ``cwd`` if none (or no markers)."""
    if not markers:
        return cwd
    for ancestor in ancestors(cwd):
        if any(_exists(os.path.join(ancestor, marker)) for marker in markers):
            return ancestor
    return cwd


def find_repo_root(cwd: str) -> str | None:
    """The main checkout of the git repository ``cwd`` is in (worktrees resolve to it).

    Like ``git rev-parse --git-common-dir``'s parent, from the files alone.
    """
    base = cwd if os.path.isdir(cwd) else os.path.dirname(cwd)
    for ancestor in ancestors(base):
        dot_git = os.path.join(ancestor, ".git")
        if os.path.isdir(dot_git):
            return os.path.dirname(os.path.realpath(dot_git))
        if not os.path.isfile(dot_git):
            continue
        try:
            line = (_read_text(dot_git) or "").split("\n", 1)[0].strip()
        except (OSError, ValueError):
            return None
        if not line.startswith("gitdir:"):
            return None
        git_dir = os.path.join(ancestor, line[len("gitdir:") :].strip())
        try:
            relative = _read_text(os.path.join(git_dir, "commondir"))
        except (OSError, ValueError):
            relative = None
        common = git_dir if relative is None else os.path.join(git_dir, relative.strip())
        return os.path.dirname(os.path.realpath(common))
    return None


def _trust_keys(path: str) -> list[str]:
    canonical = os.path.realpath(path)
    return [canonical] if canonical == path else [canonical, path]


def _projects_trust(config: Mapping[str, Any]) -> dict[str, str]:
    projects = config.get("projects")
    if projects is None:
        return {}
    if not isinstance(projects, dict):
        raise ConfigLoadError("invalid type for `projects`: expected a table")
    trust: dict[str, str] = {}
    for key, project in projects.items():
        if not isinstance(project, dict):
            raise ConfigLoadError(f"invalid type for `projects.{key}`: expected a table")
        level = project.get("trust_level")
        if level is None:
            continue
        if level not in ("trusted", "untrusted"):
            raise ConfigLoadError(f"unknown variant `{level}`, expected `trusted` or `untrusted`")
        trust[key] = level
    return trust


@attrs.frozen
class Trust:
    """Which project directories the executor's own config trusts."""

    projects: dict[str, str]
    project_root: str
    repo_root: str | None

    def trusted(self, directory: str) -> bool:
        """The first of ``directory``, the project root, the repository root with a level."""
        candidates = [directory, self.project_root]
        if self.repo_root is not None:
            candidates.append(self.repo_root)
        for candidate in candidates:
            for key in _trust_keys(candidate):
                if key in self.projects:
                    return self.projects[key] == "trusted"
        return False


def project_layers(cwd: str, trust: Trust, codex_home: str) -> list[Layer]:
    """Trusted ``.codex/config.toml`` layers from the project root down to ``cwd``."""
    directories = []
    for ancestor in ancestors(cwd):
        directories.append(ancestor)
        if ancestor == trust.project_root:
            break
    directories.reverse()
    home = os.path.realpath(codex_home)
    layers = []
    for directory in directories:
        dot_codex = os.path.join(directory, ".codex")
        if not os.path.isdir(dot_codex):
            continue
        if dot_codex == codex_home or os.path.realpath(dot_codex) == home:
            continue
        trusted = trust.trusted(directory)
        path = os.path.join(dot_codex, CONFIG_TOML)
        try:
            text = _read_text(path)
        except (OSError, ValueError) as exc:
            # Even for an untrusted project, as the reference does.
            raise ConfigLoadError(
                f"Failed to read project config file {path}: {_read_error(exc)}"
            ) from None
        if not trusted:
            continue
        config: dict[str, Any] = {}
        if text is not None:
            try:
                config = parse_toml(path, text)
            except ValueError as exc:
                raise ConfigLoadError(f"Error parsing project config file {path}: {exc}") from None
        for key in PROJECT_DENYLIST:
            config.pop(key, None)
        layers.append(Layer(f"project ({dot_codex}/{CONFIG_TOML})", dot_codex, config))
    return layers


# --- the layers ---------------------------------------------------------------------


def legacy_requirements(managed: Mapping[str, Any]) -> dict[str, Any]:
    """A legacy managed_config.toml read as requirements (one allowed value each)."""
    table: dict[str, Any] = {}
    if isinstance(managed.get("approval_policy"), str):
        table["allowed_approval_policies"] = [managed["approval_policy"]]
    reviewer = managed.get("approvals_reviewer")
    if isinstance(reviewer, str):
        table["allowed_approvals_reviewers"] = (
            [reviewer, "user"] if reviewer == "auto_review" else [reviewer]
        )
    mode = managed.get("sandbox_mode")
    if isinstance(mode, str):
        # Read-only must stay allowed for Codex to work at all.
        table["allowed_sandbox_modes"] = ["read-only"] + ([mode] if mode != "read-only" else [])
    return table


def load_layers(cwd: str, codex_home: str, system_dir: str = SYSTEM_DIR) -> tuple[Stack, Stack]:
    """The executor-local config and requirements layers (blocking: file reads)."""
    managed_file = os.path.join(system_dir, MANAGED_CONFIG_TOML)
    managed = read_toml(managed_file, "config")
    system_file = os.path.join(system_dir, CONFIG_TOML)
    system = read_toml(system_file, "config") or {}
    user_file = os.path.join(codex_home, CONFIG_TOML)
    user = read_toml(user_file, "config") or {}

    # The project's boundary and trust come from the executor's own
    # system, user and managed config, never from the project itself.
    discovery: dict[str, Any] = {}
    merge(discovery, system)
    merge(discovery, user)
    if managed is not None:
        merge(discovery, managed)
    markers = _markers(discovery)

    requirements_file = os.path.join(system_dir, REQUIREMENTS_TOML)
    system_requirements = read_toml(requirements_file, "requirements")
    requirement_layers = []
    if system_requirements is not None:
        requirement_layers.append(Layer(requirements_file, system_dir, system_requirements))
    if managed is not None:
        requirement_layers.append(Layer(managed_file, codex_home, legacy_requirements(managed)))
    requirements = Stack(requirement_layers, 1 if system_requirements is not None else 0)

    project_root = find_project_root(cwd, markers)
    trust = Trust(_projects_trust(discovery), project_root, find_repo_root(cwd))
    config_layers = [
        Layer(f"system ({system_file})", system_dir, system),
        Layer(f"user ({user_file})", codex_home, user),
        *project_layers(cwd, trust, codex_home),
    ]
    if managed is not None:
        config_layers.append(
            Layer(f"legacy managed_config.toml ({managed_file})", system_dir, managed)
        )
    # Cloud config follows the system layer.
    return Stack(config_layers, 1), requirements


# --- selecting key paths ------------------------------------------------------------


@attrs.define
class Selector:
    """A trie of requested key paths; ``terminal`` selects the whole value."""

    terminal: bool = False
    children: dict[str, Selector] = attrs.Factory(dict)

    @classmethod
    def of(cls, paths: list[list[str]]) -> Selector:
        root = cls()
        for path in paths:
            node = root
            for segment in path:
                if node.terminal:
                    break
                node = node.children.setdefault(segment, cls())
            else:
                node.terminal = True
                node.children.clear()
        return root


def _select(value: Any, selector: Selector) -> Any:
    if selector.terminal or not isinstance(value, dict):
        # A non-table where a table was asked for still overrides lower layers.
        return value
    return {
        key: _select(child, selector.children[key])
        for key, child in value.items()
        if key in selector.children
    }


def project(stack: Stack, paths: list[list[str]]) -> Stack:
    """Keep only ``paths`` of each layer, drop layers left empty, move the cloud index."""
    selector = Selector.of(paths)
    kept = []
    cloud = 0
    for index, layer in enumerate(stack.layers):
        selected = _select(layer.toml, selector)
        if not selector.terminal and not selected:
            continue
        if index < stack.cloud_insertion_index:
            cloud += 1
        kept.append(Layer(layer.source, layer.base_dir, selected))
    return Stack(kept, cloud)


def _wire(stack: Stack) -> EnvironmentConfigLayerStack:
    return EnvironmentConfigLayerStack(
        [
            EnvironmentConfigLayer(layer.source, path_to_uri(layer.base_dir), dumps(layer.toml))
            for layer in stack.layers
        ],
        stack.cloud_insertion_index,
    )


def read_environment_config(
    params: EnvironmentConfigReadParams,
    cwd: str,
    environ: Mapping[str, str] | None = None,
    system_dir: str = SYSTEM_DIR,
) -> EnvironmentConfigReadResponse:
    """Answer one request (blocking; run off the reactor). Errors are ``-32603``."""
    env = os.environ if environ is None else environ
    codex_home = request_codex_home(env)
    try:
        config, requirements = load_layers(cwd, codex_home, system_dir)
    except ConfigLoadError as exc:
        raise RpcError.internal(f"failed to load executor-local config: {exc}") from None
    home = user_home(env)
    return EnvironmentConfigReadResponse(
        user_home_dir=path_to_uri(home) if home and home.startswith("/") else None,
        codex_home_dir=path_to_uri(codex_home),
        hostname=socket.gethostname() or None,
        config=_wire(project(config, params.config_paths)),
        requirements=_wire(project(requirements, params.requirements_paths)),
    )


def register(router: Any, run: Runner) -> None:
    """Add ``environmentConfig/read`` to ``router``; its file work runs on ``run``.

    Reading files may block (a slow or hung file system), so ``run`` is the
    fs pool's runner: bounded per connection like any fs call.
    """

    def handle(conn: Any, params: EnvironmentConfigReadParams) -> Any:
        cwd = validate(params)
        return run(read_environment_config, params, cwd, owner=conn)

    router.add_method(EnvironmentConfigRead, handle)


#: ``environmentConfig/read``, declared once (beside its types: the protocol
#: module imports nothing of ``codex/``).
EnvironmentConfigRead = p.Method(
    ENVIRONMENT_CONFIG_READ, EnvironmentConfigReadParams, EnvironmentConfigReadResponse, FAMILY
)
