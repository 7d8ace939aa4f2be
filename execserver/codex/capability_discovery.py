"""``capabilities/discoverV2``: the Codex skills and plugins installed on the executor.

Codex (0.171, with executor capability discovery switched on) asks the
machine its commands run on which skills and plugins are installed *there*.
The server scans the reference's fixed locations, in this order:

1. installed plugins, ``CODEX_HOME/plugins/cache/MARKETPLACE/NAME/VERSION``
   (the active version: ``local`` if present, else the highest, semver
   order where both parse), each with its manifest and the MCP and app
   files it declares, and the skills below it, named ``PLUGIN:SKILL``;
2. standalone skills in ``CODEX_HOME/skills``, ``~/.agents/skills`` and
   ``/etc/codex/skills`` (``SKILL.md`` files up to 6 levels down).

Each ``SKILL.md`` is described by its YAML front matter (``name``,
``description``, ``metadata.short-description``); its sibling
``agents/openai.yaml`` adds ``dependencies`` and ``policy``. Missing
locations are normal (empty answer); a file that cannot be used becomes one
warning per location. The answer is bounded (4 MiB, 2048 capabilities, 64
warnings). All file work runs on the fs pool. docs/protocol.md,
"capabilities/discoverV2".
"""

from __future__ import annotations

import collections
import errno
import json
import os
import re
import stat
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

import attrs
import msgspec

from execserver import protocol as p
from execserver.codex import skill_yaml
from execserver.codex.environment_config import (
    ancestors,
    read_regular,
    request_codex_home,
    user_home,
)
from execserver.errors import RpcError
from execserver.fs.paths import FILE_URI_PREFIX, absolute_path, path_to_uri
from execserver.fs.pool import Runner

if TYPE_CHECKING:
    from execserver.sandbox.fsguard import Guard

CAPABILITIES_DISCOVER_V2: Final = "capabilities/discoverV2"
FAMILY: Final = "capability discovery"
SYSTEM_SKILLS: Final = "/etc/codex/skills"
PLUGINS_CACHE: Final = "plugins/cache"
DEFAULT_PLUGIN_VERSION: Final = "local"
REMOTE_INSTALL_METADATA: Final = ".codex-remote-plugin-install.json"
MANIFEST_PATHS: Final = (
    ".codex-plugin/plugin.json",
    ".claude-plugin/plugin.json",
    ".cursor-plugin/plugin.json",
)
SKILL_FILE: Final = "SKILL.md"
SKILL_METADATA: Final = "agents/openai.yaml"
DEFAULT_MCP_CONFIG: Final = ".mcp.json"

# Bounds, the reference's.
MAX_RESPONSE_BYTES: Final = 4 * 1024 * 1024
MAX_CAPABILITIES: Final = 2048
MAX_WARNINGS: Final = 64
MAX_LOCATIONS: Final = 512
MAX_SCAN_DEPTH: Final = 6
MAX_DIRECTORIES_PER_ROOT: Final = 2000
MAX_ENTRIES_PER_ROOT: Final = 20_000
MAX_FILE_BYTES: Final = 1024 * 1024
MAX_BUNDLE_BYTES_PER_ROOT: Final = 16 * 1024 * 1024
MAX_REMOTE_METADATA_BYTES: Final = 16 * 1024
MAX_NAME_LEN: Final = 64
MAX_QUALIFIED_NAME_LEN: Final = MAX_NAME_LEN * 2 + 1

METADATA_WARNING: Final = (
    "some capability metadata could not be loaded; discovery may be incomplete"
)
LOCATIONS_WARNING: Final = (
    "some capability locations could not be resolved; discovery may be incomplete"
)
SIZE_WARNING: Final = "capability discovery size limit reached"

_SEGMENT: Final = re.compile(r"^[A-Za-z0-9_-]+$")
_VERSION_SEGMENT: Final = re.compile(r"^[A-Za-z0-9_.+-]+$")
_SEMVER: Final = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?(?:\+[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?$"
)


#: Set on the thread of a scan confined to a profile that does not read
#: everything: there a path the profile may not read (the kernel's EACCES)
#: is treated as missing, as the reference's sandbox, which shows a command
#: only what it may read, has it.
_CONFINED = threading.local()


def _hidden(path: str) -> bool:
    """Whether the confining profile hides ``path`` (``deny``): then as if missing.

    Under Landlock, which cannot take reads away inside a readable tree, this
    check is what hides it (as for the fs calls); in a mount namespace the
    hidden path is an empty tmpfs already.
    """
    check = getattr(_CONFINED, "is_hidden", None)
    if check is None:
        return False
    return bool(check(os.path.abspath(path)) or check(os.path.realpath(path)))


def _denied(exc: OSError) -> bool:
    """Whether ``exc`` is the confinement's refusal (then: as if the path were missing)."""
    return bool(getattr(_CONFINED, "reads", False)) and exc.errno in (errno.EACCES, errno.EPERM)


class _OnTheWay:
    """An entry of a directory the confinement may not list, on the way to a readable path.

    The reference's sandbox shows such a directory with only the entries that
    lead to what the profile may read; Landlock refuses the listing, so it is
    made from the profile's roots (a stat is not refused).
    """

    __slots__ = ("name", "path")

    def __init__(self, directory: str, name: str) -> None:
        self.name = name
        self.path = os.path.join(directory, name)

    def _mode(self) -> int:
        try:
            return os.stat(self.path).st_mode
        except OSError:
            return 0

    def is_dir(self) -> bool:
        return stat.S_ISDIR(self._mode())

    def is_file(self) -> bool:
        return stat.S_ISREG(self._mode())


def _scandir(directory: str) -> list[os.DirEntry[str] | _OnTheWay]:
    """``os.scandir``'s entries; under a confinement that refuses it, the way to its roots."""
    try:
        return [e for e in os.scandir(directory) if not _hidden(e.path)]
    except OSError as exc:
        if not _denied(exc):
            raise
        prefix = directory.rstrip("/") + "/"
        roots: tuple[str, ...] = getattr(_CONFINED, "roots", ())
        names = sorted({r[len(prefix) :].split("/")[0] for r in roots if r.startswith(prefix)})
        if not names:
            raise
        return [_OnTheWay(directory, n) for n in names if not _hidden(os.path.join(directory, n))]


# --- wire types ---------------------------------------------------------------------


class DiscoverV2Params(msgspec.Struct, rename="camel"):
    cwd: str
    #: Codex's permission profile: the scan runs confined to it, as an fs
    #: call with that ``sandbox`` (``capabilityDiscoverySandbox``).
    sandbox: p.SandboxConfig | None = None


class CapabilityTextFile(msgspec.Struct):
    path: str
    contents: str


class DiscoveredPluginFiles(msgspec.Struct, rename="camel"):
    manifest: CapabilityTextFile
    mcp_config: CapabilityTextFile | None
    apps_config: CapabilityTextFile | None


class SkillToolDependency(msgspec.Struct, rename="camel"):
    type: str
    value: str
    description: str | None
    transport: str | None
    command: str | None
    url: str | None
    oauth_callback_port: int | None


class SkillDependencies(msgspec.Struct):
    tools: list[SkillToolDependency]


class SkillPolicy(msgspec.Struct, rename="camel"):
    allow_implicit_invocation: bool | None
    products: list[str]


class DiscoveryRoot(msgspec.Struct):
    id: str
    path: str


class PluginSkill(msgspec.Struct, rename="camel"):
    name: str
    description: str
    short_description: str | None
    path: str
    dependencies: SkillDependencies | None
    policy: SkillPolicy | None


class StandaloneSkill(msgspec.Struct, rename="camel"):
    name: str
    description: str
    short_description: str | None
    path: str
    discovery_root: DiscoveryRoot
    dependencies: SkillDependencies | None
    policy: SkillPolicy | None


class ExecutorPlugin(msgspec.Struct, rename="camel"):
    id: str
    display_name: str
    remote_plugin_id: str | None
    version: str
    root: str
    files: DiscoveredPluginFiles
    skills: list[PluginSkill]


class DiscoverV2Response(msgspec.Struct):
    plugins: list[ExecutorPlugin]
    skills: list[StandaloneSkill]
    warnings: list[str]


def _size(value: msgspec.Struct) -> int:
    return len(msgspec.json.encode(value))


# --- params -------------------------------------------------------------------------


def validate(params: DiscoverV2Params) -> str:
    """The native ``cwd`` (``-32602`` with the reference's texts where it has one)."""
    cwd = params.cwd
    data = {"kind": "relativePath", "field": "cwd", "path": cwd}
    scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*):", cwd)
    if scheme is not None and not cwd.startswith(FILE_URI_PREFIX):
        raise RpcError.invalid_params(f"unsupported path URI scheme `{scheme[1].lower()}`", data)
    if cwd.startswith(FILE_URI_PREFIX) and "?" in cwd:
        raise RpcError.invalid_params("query parameters are not allowed in path URIs", data)
    if scheme is None and not cwd.startswith("/"):
        raise RpcError.invalid_params("invalid URI: relative URL without a base", data)
    return absolute_path(cwd, "cwd")


# --- locations ----------------------------------------------------------------------


@attrs.frozen
class InstalledPlugin:
    id: str
    version: str
    remote_plugin_id: str | None


@attrs.frozen
class Location:
    root: str
    #: The installed plugin at ``root``; None for a standalone skills root.
    plugin: InstalledPlugin | None = None
    #: ``discoveryRoot.id`` of a standalone skills root.
    root_id: str = ""


def _semver_key(version: str) -> tuple[Any, ...] | None:
    found = _SEMVER.match(version)
    if found is None:
        return None
    pre = found[4]
    pre_key: tuple[Any, ...] = (1,)
    if pre is not None:
        pre_key = (
            0,
            *((0, int(p), "") if p.isdigit() else (1, 0, p) for p in pre.split(".")),
        )
    return (int(found[1]), int(found[2]), int(found[3]), pre_key)


def _version_order(left: str, right: str) -> int:
    lkey, rkey = _semver_key(left), _semver_key(right)
    if lkey is not None and rkey is not None:
        return (lkey > rkey) - (lkey < rkey)
    return (left > right) - (left < right)


def active_plugin_version(package: str) -> str | None:
    """``local`` if installed, else the highest version directory (semver where both parse)."""
    try:
        entries = [e for e in _scandir(package) if e.is_dir()]
    except OSError:
        return None
    versions = [
        e.name for e in entries if _VERSION_SEGMENT.match(e.name) and e.name not in (".", "..")
    ]
    if not versions:
        return None
    if DEFAULT_PLUGIN_VERSION in versions:
        return DEFAULT_PLUGIN_VERSION
    best = versions[0]
    for version in versions[1:]:
        if _version_order(version, best) > 0:
            best = version
    return best


def _read_remote_plugin_id(path: str) -> str | None:
    """The remote identity a remote install recorded; None without one. Raises ValueError."""
    try:
        raw = read_regular(path, MAX_REMOTE_METADATA_BYTES)
    except OSError as exc:
        raise ValueError(exc.strerror) from None
    if raw is None:
        return None
    try:
        metadata = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"failed to parse remote plugin install metadata: {exc}") from None
    if not isinstance(metadata, dict) or metadata.get("schema_version") != 1:
        raise ValueError("unsupported remote plugin install metadata")
    remote = metadata.get("remote_plugin_id")
    if not isinstance(remote, str) or not remote.strip():
        raise ValueError("remote plugin id must not be blank")
    if len(remote.strip().encode()) > 1024:
        raise ValueError("remote plugin ID exceeds its byte limit")
    return remote.strip()


def plugin_locations(codex_home: str) -> tuple[list[Location], list[str]]:
    """Installed plugins' active roots, by id; location warnings."""
    cache = os.path.join(codex_home, PLUGINS_CACHE)
    packages: dict[str, str] = {}
    warnings: list[str] = []
    try:
        marketplaces = sorted(e.name for e in _scandir(cache) if e.is_dir())
    except FileNotFoundError:
        return [], []
    except OSError as exc:
        if _denied(exc):
            return [], []
        return [], [f"failed to scan plugin cache path {cache}: {exc.strerror}"]
    for marketplace in marketplaces:
        try:
            names = [e.name for e in _scandir(os.path.join(cache, marketplace)) if e.is_dir()]
        except OSError as exc:
            if not _denied(exc):
                warnings.append(f"failed to scan plugin cache path {cache}: {exc.strerror}")
            continue
        for name in names:
            if _SEGMENT.match(name) and _SEGMENT.match(marketplace):
                packages[f"{name}@{marketplace}"] = os.path.join(cache, marketplace, name)
    locations: list[Location] = []
    for plugin_id in sorted(packages):
        package = packages[plugin_id]
        version = active_plugin_version(package)
        if version is None:
            continue
        if len(locations) == MAX_LOCATIONS:
            warnings.append(f"plugin cache reached its {MAX_LOCATIONS}-location limit")
            break
        try:
            remote = _read_remote_plugin_id(os.path.join(package, REMOTE_INSTALL_METADATA))
        except ValueError as exc:
            warnings.append(f"could not read remote installation metadata for {plugin_id}: {exc}")
            remote = None
        locations.append(
            Location(os.path.join(package, version), InstalledPlugin(plugin_id, version, remote))
        )
    return locations, warnings


def locations(
    environ: Mapping[str, str], system_skills: str = SYSTEM_SKILLS
) -> tuple[list[Location], list[str]]:
    """Every location to scan, plugins first; resolving warnings (``-32603`` without a home)."""
    codex_home = request_codex_home(environ)
    found, warnings = plugin_locations(codex_home)
    found.append(Location(os.path.join(codex_home, "skills"), root_id="codex-home-skills"))
    home = user_home(environ)
    if home is not None:
        found.append(Location(os.path.join(home, ".agents", "skills"), root_id="user-agent-skills"))
    found.append(Location(system_skills, root_id="system-skills"))
    return found, warnings


# --- one root -----------------------------------------------------------------------


@attrs.define
class _Root:
    """The files one root yields (the reference's V1 root discovery)."""

    path: str
    warnings: list[str] = attrs.Factory(list)
    budget: int = 0
    manifest: CapabilityTextFile | None = None
    plugin_files: DiscoveredPluginFiles | None = None
    plugin_invalid: bool = False
    namespace_manifests: list[tuple[str, str]] = attrs.Factory(list)
    skills: list[tuple[str, str, str | None]] = attrs.Factory(list)

    def read(self, path: str) -> str | None:
        """A bounded UTF-8 file's text; None if missing or unusable (with a warning)."""
        if _hidden(path):
            return None
        try:
            info = os.stat(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if not _denied(exc):
                self.warnings.append(f"failed to inspect capability file {path}: {exc.strerror}")
            return None
        if not stat.S_ISREG(info.st_mode):
            return None
        if info.st_size > MAX_FILE_BYTES:
            self.warnings.append(f"capability file {path} exceeds the {MAX_FILE_BYTES}-byte limit")
            return None
        if self.budget + info.st_size > MAX_BUNDLE_BYTES_PER_ROOT:
            self.warnings.append(
                f"capability root bundle exceeds the {MAX_BUNDLE_BYTES_PER_ROOT}-byte limit"
            )
            return None
        try:
            raw = read_regular(path, MAX_FILE_BYTES)
        except (OSError, ValueError) as exc:
            if isinstance(exc, OSError) and _denied(exc):
                return None
            reason = exc.strerror if isinstance(exc, OSError) else exc
            self.warnings.append(f"failed to read capability file {path}: {reason}")
            return None
        if raw is None:
            return None
        if self.budget + len(raw) > MAX_BUNDLE_BYTES_PER_ROOT:
            self.warnings.append(f"capability file {path} exceeded its read limit")
            return None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            self.warnings.append(f"capability file {path} is not UTF-8: {exc}")
            return None
        self.budget += len(raw)
        return text


def _walk(root: str, warnings: list[str]) -> list[str]:
    """Files below ``root``, breadth first in name order, within the walk limits.

    Symlinked directories are followed (each real directory once); the root
    counts as one of the directories.
    """
    files: list[str] = []
    directories = 1
    entries = 0
    seen: set[str] = {os.path.realpath(root)}
    pending: collections.deque[tuple[str, int]] = collections.deque([(root, 0)])
    truncated = False
    while pending:
        directory, depth = pending.popleft()
        try:
            listing = sorted(_scandir(directory), key=lambda e: e.name)
        except OSError as exc:
            if not _denied(exc):
                uri = path_to_uri(directory)
                warnings.append(f"failed to scan capability path {uri}: {exc.strerror}")
            continue
        for entry in listing:
            if entries == MAX_ENTRIES_PER_ROOT:
                truncated = True
                break
            entries += 1
            try:
                if entry.is_dir():
                    real = os.path.realpath(entry.path)
                    if depth + 1 > MAX_SCAN_DEPTH or real in seen:
                        continue
                    if directories == MAX_DIRECTORIES_PER_ROOT:
                        truncated = True
                        continue
                    directories += 1
                    seen.add(real)
                    pending.append((entry.path, depth + 1))
                elif entry.is_file():
                    files.append(entry.path)
            except OSError:
                continue
        if entries == MAX_ENTRIES_PER_ROOT and truncated:
            break
    if truncated:
        warnings.append(f"capability scan reached its traversal limit (root: {path_to_uri(root)})")
    return files


def _manifest_priority(path: str) -> int | None:
    if os.path.basename(path) != "plugin.json":
        return None
    parent = os.path.basename(os.path.dirname(path))
    for index, relative in enumerate(MANIFEST_PATHS):
        if relative.split("/")[0] == parent:
            return index
    return None


def _first_manifest(found: _Root, directory: str) -> CapabilityTextFile | None:
    for relative in MANIFEST_PATHS:
        path = os.path.join(directory, relative)
        text = found.read(path)
        if text is not None:
            return CapabilityTextFile(path, text)
    return None


def _declared(root: str, field: str, value: Any, manifest: str, warnings: list[str]) -> str | None:
    if not isinstance(value, str):
        return None
    if not value.startswith("./"):
        warnings.append(f"ignoring {field} in {path_to_uri(manifest)}: path must start with `./`")
        return None
    relative = value[2:]
    if not relative or ".." in re.split(r"[/\\]", relative):
        warnings.append(
            f"ignoring {field} in {path_to_uri(manifest)}: "
            "path must remain below the capability root"
        )
        return None
    return os.path.normpath(os.path.join(root, relative))


def _plugin_files(found: _Root, manifest: CapabilityTextFile) -> DiscoveredPluginFiles | None:
    """The manifest's MCP and app files; None if the manifest is unusable."""
    try:
        declarations = json.loads(manifest.contents)
    except json.JSONDecodeError:
        return None
    if not isinstance(declarations, dict):
        return None
    mcp = declarations.get("mcpServers")
    apps = declarations.get("apps")
    name = declarations.get("name")
    if (apps is not None and not isinstance(apps, str)) or (
        name is not None and not isinstance(name, str)
    ):
        return None
    mcp_config: CapabilityTextFile | None = None
    if isinstance(mcp, dict):
        # Inline servers: their JSON, as written, under the manifest's path.
        mcp_config = CapabilityTextFile(
            manifest.path, json.dumps(mcp, separators=(",", ":"), ensure_ascii=False)
        )
    else:
        path = _declared(found.path, "mcpServers", mcp, manifest.path, found.warnings)
        path = path or os.path.join(found.path, DEFAULT_MCP_CONFIG)
        text = found.read(path)
        mcp_config = CapabilityTextFile(path, text) if text is not None else None
    apps_config: CapabilityTextFile | None = None
    apps_path = _declared(found.path, "apps", apps, manifest.path, found.warnings)
    if apps_path is not None:
        text = found.read(apps_path)
        apps_config = CapabilityTextFile(apps_path, text) if text is not None else None
    return DiscoveredPluginFiles(manifest, mcp_config, apps_config)


def discover_root(root: str) -> _Root:
    """Read what one existing root directory holds (blocking)."""
    found = _Root(root)
    files = _walk(root, found.warnings)
    skill_paths = sorted((p for p in files if os.path.basename(p) == SKILL_FILE), key=path_to_uri)
    manifest_paths = [p for p in files if _manifest_priority(p) is not None]
    manifest_paths.sort(
        key=lambda p: (path_to_uri(os.path.dirname(os.path.dirname(p))), _manifest_priority(p))
    )
    found.manifest = _first_manifest(found, root)
    inherited = found.manifest
    for ancestor in ancestors(root)[1:]:
        if inherited is not None:
            break
        inherited = _first_manifest(found, ancestor)
    seen: set[str] = set()
    if inherited is not None:
        seen.add(os.path.dirname(os.path.dirname(inherited.path)))
        found.namespace_manifests.append((inherited.path, inherited.contents))
    for path in manifest_paths:
        plugin_root = os.path.dirname(os.path.dirname(path))
        if plugin_root in seen:
            continue
        seen.add(plugin_root)
        text = found.read(path)
        if text is not None:
            found.namespace_manifests.append((path, text))
    if found.manifest is not None:
        found.plugin_files = _plugin_files(found, found.manifest)
        found.plugin_invalid = found.plugin_files is None
    for path in skill_paths:
        text = found.read(path)
        if text is None:
            continue
        found.skills.append(
            (path, text, found.read(os.path.join(os.path.dirname(path), SKILL_METADATA)))
        )
    return found


# --- skill metadata -----------------------------------------------------------------


class SkillParseError(ValueError):
    pass


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _frontmatter(contents: str) -> str | None:
    lines = contents.splitlines()
    if not lines or lines[0].strip() != "---":
        return None
    body: list[str] = []
    for line in lines[1:]:
        if line.strip() == "---":
            return "\n".join(body) if body else None
        body.append(line)
    return None


def _repair(frontmatter: str) -> str | None:
    """Quote ``key: value`` scalars that hold ``: `` (prose the reference tolerates)."""
    changed = False
    block_indent: int | None = None
    out: list[str] = []
    for line in frontmatter.split("\n"):
        indent = len(line) - len(line.lstrip(" "))
        if block_indent is not None:
            if not line.strip() or indent > block_indent:
                out.append(line)
                continue
            block_indent = None
        key, colon, value = line.partition(":")
        if not colon or not key.strip() or (value and not value[0].isspace()):
            out.append(line)
            continue
        stripped = value.lstrip()
        lead = value[: len(value) - len(stripped)]
        scalar, comment = stripped, ""
        for index, char in enumerate(stripped):
            if char == "#" and (index == 0 or stripped[index - 1].isspace()):
                cut = len(stripped[:index].rstrip())
                scalar, comment = stripped[:cut], stripped[cut:]
                break
        scalar = scalar.rstrip()
        if not scalar:
            out.append(line)
            continue
        if scalar[0] in "|>":
            block_indent = indent
            out.append(line)
            continue
        if scalar[0] in "'\"":
            out.append(line)
            continue
        separator = re.search(r":\s", scalar) is not None
        flow_like = False
        if scalar[0] in "[{@`":
            try:
                skill_yaml.loads(scalar)
            except skill_yaml.YamlError:
                flow_like = True
        if not separator and not flow_like:
            out.append(line)
            continue
        quoted = "'" + scalar.replace("'", "''") + "'"
        out.append(f"{key}:{lead}{quoted}{comment}")
        changed = True
    return "\n".join(out) if changed else None


def _text_field(table: Mapping[str, Any], key: str) -> str | None:
    value = table.get(key)
    if value is None or isinstance(value, str):
        return value
    raise SkillParseError(f"invalid type for `{key}`")


def _fields(frontmatter: str) -> tuple[str | None, str | None, str | None]:
    """``name``, ``description``, ``metadata.short-description`` as typed fields.

    Raises YamlError for text that is not YAML or fields of the wrong type
    (both are the reference's deserialisation errors).
    """
    table = skill_yaml.loads(frontmatter)
    if not isinstance(table, dict):
        raise skill_yaml.YamlError("expected a mapping")
    metadata = table.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise skill_yaml.YamlError("invalid type for `metadata`")
    try:
        return (
            _text_field(table, "name"),
            _text_field(table, "description"),
            _text_field(metadata, "short-description"),
        )
    except SkillParseError as exc:
        raise skill_yaml.YamlError(str(exc)) from None


def parse_skill(contents: str, directory_name: str) -> tuple[str, str, str | None]:
    """``(name, description, short description)`` of a ``SKILL.md``, as the reference validates."""
    frontmatter = _frontmatter(contents)
    if frontmatter is None:
        raise SkillParseError("missing YAML frontmatter delimited by ---")
    try:
        raw_name, raw_description, raw_short = _fields(frontmatter)
    except skill_yaml.YamlError as original:
        repaired = _repair(frontmatter)
        if repaired is None:
            raise SkillParseError(f"invalid YAML: {original}") from None
        try:
            raw_name, raw_description, raw_short = _fields(repaired)
        except skill_yaml.YamlError:
            raise SkillParseError(f"invalid YAML: {original}") from None
    name = _one_line(raw_name or "") or _one_line(directory_name) or "skill"
    description = _one_line(raw_description or "")
    short = _one_line(raw_short or "") or None
    if len(name) > MAX_NAME_LEN:
        raise SkillParseError(f"invalid name: exceeds maximum length of {MAX_NAME_LEN} characters")
    if not description:
        raise SkillParseError("missing field `description`")
    return name, description, short


#: ``policy.products`` values (lower case or all upper case in the file).
PRODUCTS: Final = ("codex", "chatgpt", "atlas")
_TOOL_FIELDS: Final = ("type", "value", "description", "transport", "command", "url")


class _InvalidMetadata(ValueError):
    """``agents/openai.yaml`` does not have the reference's shape: both parts are null."""


def _optional_text(table: Mapping[str, Any], key: str) -> str | None:
    value = table.get(key)
    if value is None or isinstance(value, str):
        return value
    raise _InvalidMetadata(key)


def _dependencies(raw: Any) -> SkillDependencies | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise _InvalidMetadata("dependencies")
    entries = raw.get("tools")
    if entries is None:
        return None
    if not isinstance(entries, list):
        raise _InvalidMetadata("tools")
    tools = []
    for entry in entries:
        if not isinstance(entry, dict):
            raise _InvalidMetadata("tool")
        kind, value, description, transport, command, url = (
            _optional_text(entry, key) for key in _TOOL_FIELDS
        )
        if kind is not None and value is not None:
            # The OAuth callback port is not read from the file (always null).
            tools.append(
                SkillToolDependency(kind, value, description, transport, command, url, None)
            )
    return SkillDependencies(tools) if tools else None


def _policy(raw: Any) -> SkillPolicy | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise _InvalidMetadata("policy")
    allow = raw.get("allow_implicit_invocation")
    allowed: bool | None = None
    if allow is not None:
        # YAML 1.2 booleans, unquoted.
        if isinstance(allow, skill_yaml.Quoted) or allow not in skill_yaml.BOOLEANS:
            raise _InvalidMetadata("allow_implicit_invocation")
        allowed = skill_yaml.BOOLEANS[allow]
    products = raw.get("products")
    if products is None:
        products = []
    if not isinstance(products, list):
        raise _InvalidMetadata("products")
    names = []
    for product in products:
        if not isinstance(product, str) or (
            product not in PRODUCTS and product.lower() not in PRODUCTS
        ):
            raise _InvalidMetadata("products")
        if product != product.lower() and product != product.upper():
            raise _InvalidMetadata("products")
        names.append(product.lower())
    return SkillPolicy(allowed, names)


def skill_extras(text: str | None) -> tuple[SkillDependencies | None, SkillPolicy | None]:
    """``dependencies`` and ``policy`` from a skill's ``agents/openai.yaml``.

    A file that does not read, or whose parts have the wrong shape, gives
    ``null`` for both, without a warning (as the reference).
    """
    if text is None:
        return None, None
    try:
        table = skill_yaml.loads(text)
        if table is None:
            return None, None
        if not isinstance(table, dict) or not isinstance(table.get("interface", {}), dict | None):
            raise _InvalidMetadata("interface")
        return _dependencies(table.get("dependencies")), _policy(table.get("policy"))
    except (skill_yaml.YamlError, _InvalidMetadata):
        return None, None


# --- assembling the answer ----------------------------------------------------------


@attrs.define
class _Discovery:
    plugin: ExecutorPlugin | None = None
    skills: list[StandaloneSkill] = attrs.Factory(list)
    warnings: list[str] = attrs.Factory(list)


def _load(location: Location) -> _Discovery:
    if _hidden(location.root):
        return _Discovery()
    try:
        info = os.stat(location.root)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return _Discovery()
    except OSError as exc:
        text = f"could not inspect capability root {path_to_uri(location.root)}: {exc.strerror}"
        return _Discovery(warnings=[text])
    if not stat.S_ISDIR(info.st_mode):
        return _Discovery()
    found = discover_root(location.root)
    warnings = list(found.warnings)
    if location.plugin is not None and (found.manifest is None or found.plugin_invalid):
        warnings.append(
            f"installed plugin at {path_to_uri(location.root)} has no readable manifest"
        )
        return _Discovery(warnings=warnings)
    namespaces: dict[str, str] = {}
    for path, contents in found.namespace_manifests:
        plugin_root = os.path.dirname(os.path.dirname(path))
        try:
            manifest = json.loads(contents)
        except json.JSONDecodeError:
            continue
        name = manifest.get("name") if isinstance(manifest, dict) else None
        if name is not None and not isinstance(name, str):
            continue
        if not name or not name.strip():
            name = os.path.basename(plugin_root)
            if not name:
                continue
        namespaces.setdefault(plugin_root, name)
    plugin_skills: list[PluginSkill] = []
    standalone: list[StandaloneSkill] = []
    for path, contents, metadata in found.skills:
        directory = os.path.dirname(path)
        try:
            name, description, short = parse_skill(contents, os.path.basename(directory))
        except SkillParseError:
            warnings.append(f"invalid skill metadata at {path_to_uri(path)}")
            continue
        # The nearest plugin root holding the skill names it.
        owners = (namespaces.get(ancestor) for ancestor in ancestors(directory))
        namespace = next((owner for owner in owners if owner is not None), None)
        if namespace is not None:
            if len(namespace) + 1 + len(name) > MAX_QUALIFIED_NAME_LEN:
                warnings.append(
                    f"invalid skill metadata at {path_to_uri(path)}: qualified name "
                    f"exceeds {MAX_QUALIFIED_NAME_LEN} characters"
                )
                name = ""
            else:
                name = f"{namespace}:{name}"
        if not name:
            continue
        dependencies, policy = skill_extras(metadata)
        if location.plugin is not None:
            plugin_skills.append(
                PluginSkill(name, description, short, path_to_uri(path), dependencies, policy)
            )
        else:
            root = DiscoveryRoot(location.root_id, path_to_uri(location.root))
            standalone.append(
                StandaloneSkill(
                    name, description, short, path_to_uri(path), root, dependencies, policy
                )
            )
    if location.plugin is None or found.manifest is None or found.plugin_files is None:
        return _Discovery(skills=standalone, warnings=warnings)
    manifest = json.loads(found.manifest.contents)
    interface = manifest.get("interface")
    display = interface.get("displayName") if isinstance(interface, dict) else None
    name = manifest.get("name")
    if not isinstance(display, str) or not display.strip():
        display = name if isinstance(name, str) and name.strip() else None
    files = found.plugin_files
    plugin = ExecutorPlugin(
        id=location.plugin.id,
        display_name=display or os.path.basename(location.root),
        remote_plugin_id=location.plugin.remote_plugin_id,
        version=location.plugin.version,
        root=path_to_uri(location.root),
        files=DiscoveredPluginFiles(
            CapabilityTextFile(path_to_uri(files.manifest.path), files.manifest.contents),
            _wire_file(files.mcp_config),
            _wire_file(files.apps_config),
        ),
        skills=plugin_skills,
    )
    return _Discovery(plugin=plugin, warnings=warnings)


def _wire_file(file: CapabilityTextFile | None) -> CapabilityTextFile | None:
    return None if file is None else CapabilityTextFile(path_to_uri(file.path), file.contents)


@attrs.define
class _Budget:
    capabilities: int = 0
    bytes: int = 0
    truncated: bool = False

    def admit(self, capabilities: int, size: int) -> bool:
        if (
            self.capabilities + capabilities > MAX_CAPABILITIES
            or self.bytes + size > MAX_RESPONSE_BYTES
        ):
            self.truncated = True
            return False
        self.capabilities += capabilities
        self.bytes += size
        return True


def _append(response: DiscoverV2Response, found: _Discovery, budget: _Budget) -> None:
    room = MAX_WARNINGS - len(response.warnings)
    response.warnings.extend(found.warnings[: max(room, 0)])
    if found.plugin is not None:
        remaining = MAX_CAPABILITIES - budget.capabilities
        if remaining == 0:
            budget.truncated = True
            return
        plugin = found.plugin
        if len(plugin.skills) > remaining - 1:
            budget.truncated = True
            del plugin.skills[remaining - 1 :]  # the plugin itself counts too
        if budget.admit(1 + len(plugin.skills), _size(plugin)):
            response.plugins.append(plugin)
        return
    for skill in found.skills:
        if budget.capabilities == MAX_CAPABILITIES:
            budget.truncated = True
            break
        if budget.admit(1, _size(skill)):
            response.skills.append(skill)


def _finish(response: DiscoverV2Response, truncated: bool) -> DiscoverV2Response:
    response.plugins.sort(key=lambda plugin: (plugin.id, plugin.root))
    del response.warnings[MAX_WARNINGS:]
    if truncated or _size(response) > MAX_RESPONSE_BYTES:
        del response.warnings[MAX_WARNINGS - 1 :]
        response.warnings.insert(0, SIZE_WARNING)
        while _size(response) > MAX_RESPONSE_BYTES:
            # Extra warnings go first; the limit warning stays.
            if len(response.warnings) > 1:
                del response.warnings[1:]
            elif response.skills:
                response.skills.pop()
            elif response.plugins:
                response.plugins.pop()
            else:
                break
    return response


def discover(
    environ: Mapping[str, str] | None = None, system_skills: str = SYSTEM_SKILLS
) -> DiscoverV2Response:
    """Answer one request (blocking; run off the reactor)."""
    env = os.environ if environ is None else environ
    found, location_warnings = locations(env, system_skills)
    response = DiscoverV2Response([], [], [LOCATIONS_WARNING] if location_warnings else [])
    budget = _Budget()
    for index, location in enumerate(found):
        discovery = _load(location)
        if discovery.warnings:
            discovery.warnings = [METADATA_WARNING]
        _append(response, discovery, budget)
        full = budget.capabilities == MAX_CAPABILITIES or budget.bytes == MAX_RESPONSE_BYTES
        if full and index + 1 < len(found):
            budget.truncated = True
            break
    return _finish(response, budget.truncated)


def discover_confined(
    confined_reads: bool,
    roots: tuple[str, ...] = (),
    is_hidden: Callable[[str], bool] | None = None,
    environ: Mapping[str, str] | None = None,
) -> DiscoverV2Response:
    """:func:`discover` on a thread confined to a profile (``confined_reads``: not all readable)."""
    _CONFINED.reads, _CONFINED.roots, _CONFINED.is_hidden = confined_reads, roots, is_hidden
    try:
        return discover(environ)
    finally:
        _CONFINED.reads, _CONFINED.roots, _CONFINED.is_hidden = False, (), None


def register(router: Any, run: Runner, guard: Guard | None = None) -> None:
    """Add ``capabilities/discoverV2`` to ``router``; its file work runs on ``run`` (fs pool).

    With ``guard`` (the fs calls'), a request whose ``sandbox`` restricts
    reads (or any request, under an operator's floor) is scanned on a thread
    confined to that profile, as an fs call with it: what the profile may not
    read is not found.
    """

    def handle(conn: Any, params: DiscoverV2Params) -> Any:
        validate(params)
        if guard is not None and guard.applies(params.sandbox):
            policy = guard.policy(params.sandbox)
            # The paths it may read (or write): the directories above them
            # are listed as the way there.
            roots = tuple(r.path for r in policy.rules if r.access != "none")
            reads = not policy.full_read
            return run(
                guard.run,
                params.sandbox,
                (),
                (),
                discover_confined,
                reads,
                roots,
                policy.is_hidden if policy.hidden() else None,
                owner=conn,
            )
        return run(discover, owner=conn)

    router.add_method(CapabilitiesDiscoverV2, handle)


#: ``capabilities/discoverV2``, declared once (beside its types: the protocol
#: module imports nothing of ``codex/``).
CapabilitiesDiscoverV2 = p.Method(
    CAPABILITIES_DISCOVER_V2, DiscoverV2Params, DiscoverV2Response, FAMILY
)
