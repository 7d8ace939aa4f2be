"""``capabilities/discoverV2``: the executor's Codex skills and plugins, as the reference.

The expected answers are what the reference server (``codex exec-server``
0.171.0) answered for the same trees. The method runs through the real
server over stdio, with ``HOME`` and ``CODEX_HOME`` set for it; the
front-matter parser is also tested directly. docs/protocol.md,
"capabilities/discoverV2".
"""

from __future__ import annotations

import json
import os
from contextlib import AbstractAsyncContextManager, suppress
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_twisted
from hypothesis import given
from hypothesis import strategies as st

import execserver
from execserver.codex import capability_discovery as cd
from execserver.codex import environment_info, skill_yaml
from execserver.errors import RpcError
from execserver.fs.paths import path_to_uri
from tests.codex import fetch_codex
from tests.codex.fetch_codex import FetchError, fetch
from tests.support import codex_session
from tests.support.codex_config import write_file
from tests.support.stdio_server import ServerProcess

CODEX_INIT = codex_session.CODEX_INIT
METADATA_WARNING = "some capability metadata could not be loaded; discovery may be incomplete"


def _skill(directory: Path, front: str) -> Path:
    return write_file(directory / "SKILL.md", f"---\n{front}---\nbody\n")


def serving(tmp_path: Path, init: Any = CODEX_INIT) -> AbstractAsyncContextManager[ServerProcess]:
    (tmp_path / "codex-home").mkdir(exist_ok=True)
    env = {"HOME": str(tmp_path / "home"), "CODEX_HOME": str(tmp_path / "codex-home")}
    return codex_session.serving(init, env)


async def discover(tmp_path: Path) -> Any:
    async with serving(tmp_path) as server:
        init = server.last_init  # type: ignore[attr-defined]
        assert init["environmentInfo"]["capabilities"]["capabilityDiscoveryV2"] is True
        # The reference release whose protocol is spoken (Codex gates the
        # method on it); this package's own version stays in serverInfo.
        assert init["environmentInfo"]["executorVersion"] == "0.171.0"
        assert init["serverInfo"]["version"] == execserver.__version__
        return await server.call("capabilities/discoverV2", {"cwd": path_to_uri(str(tmp_path))})


def _standalone(path: Path, root: Path, root_id: str, name: str, description: str) -> Any:
    return {
        "name": name,
        "description": description,
        "shortDescription": None,
        "path": path_to_uri(str(path)),
        "discoveryRoot": {"id": root_id, "path": path_to_uri(str(root))},
        "dependencies": None,
        "policy": None,
    }


@pytest_twisted.ensureDeferred
async def test_user_skills_plugins_and_warnings_as_the_reference(tmp_path: Path) -> None:
    home, codex_home = tmp_path / "home", tmp_path / "codex-home"
    skills, agents = codex_home / "skills", home / ".agents" / "skills"
    alpha = _skill(skills / "alpha", "name: alpha\ndescription: Alpha skill does things\n")
    write_file(skills / "bad" / "SKILL.md", "no frontmatter here\n")  # invalid: one warning
    spaced = _skill(skills / "my  dir", "description: spaced\n")  # name from the directory
    beta = _skill(
        agents / "beta",
        'description: "quoted: desc"\nmetadata:\n  short-description: short beta\n',
    )
    deps = _skill(skills / "deps", "name: deps\ndescription: with deps\n")
    write_file(
        skills / "deps" / "agents" / "openai.yaml",
        "interface:\n  display_name: D\ndependencies:\n  tools:\n    - type: mcp\n"
        "      value: github\n      description: gh\npolicy:\n  allow_implicit_invocation: false\n",
    )
    # A plugin nested in a skills root namespaces the skills below it.
    write_file(skills / "tools" / ".codex-plugin" / "plugin.json", '{"name":"tools"}')
    nested = _skill(skills / "tools" / "skills" / "x", "description: x in tools\n")
    # An installed plugin: the active version (local wins), manifest, MCP file, skills.
    package = codex_home / "plugins" / "cache" / "market" / "plug"
    write_file(package / "1.0.0" / ".codex-plugin" / "plugin.json", '{"name":"old"}')
    root = package / "local"
    manifest = '{"name":"plug","interface":{"displayName":"Plug In"},"mcpServers":"./mcp.json"}'
    write_file(root / ".codex-plugin" / "plugin.json", manifest)
    write_file(root / "mcp.json", '{"mcpServers":{}}')
    gamma = _skill(root / "skills" / "gamma", "name: gamma\ndescription: Gamma\n")

    result = await discover(tmp_path)

    assert result == {
        "plugins": [
            {
                "id": "plug@market",
                "displayName": "Plug In",
                "remotePluginId": None,
                "version": "local",
                "root": path_to_uri(str(root)),
                "files": {
                    "manifest": {
                        "path": path_to_uri(str(root / ".codex-plugin" / "plugin.json")),
                        "contents": manifest,
                    },
                    "mcpConfig": {
                        "path": path_to_uri(str(root / "mcp.json")),
                        "contents": '{"mcpServers":{}}',
                    },
                    "appsConfig": None,
                },
                "skills": [
                    {
                        "name": "plug:gamma",
                        "description": "Gamma",
                        "shortDescription": None,
                        "path": path_to_uri(str(gamma)),
                        "dependencies": None,
                        "policy": None,
                    }
                ],
            }
        ],
        # Location order (CODEX_HOME/skills, ~/.agents/skills, /etc/codex/skills),
        # then path order within a location.
        "skills": [
            _standalone(alpha, skills, "codex-home-skills", "alpha", "Alpha skill does things"),
            {
                **_standalone(deps, skills, "codex-home-skills", "deps", "with deps"),
                "dependencies": {
                    "tools": [
                        {
                            "type": "mcp",
                            "value": "github",
                            "description": "gh",
                            "transport": None,
                            "command": None,
                            "url": None,
                            "oauthCallbackPort": None,
                        }
                    ]
                },
                "policy": {"allowImplicitInvocation": False, "products": []},
            },
            _standalone(spaced, skills, "codex-home-skills", "my dir", "spaced"),
            _standalone(nested, skills, "codex-home-skills", "tools:x", "x in tools"),
            {
                **_standalone(beta, agents, "user-agent-skills", "beta", "quoted: desc"),
                "shortDescription": "short beta",
            },
        ],
        "warnings": [METADATA_WARNING],
    }
    assert list(result["plugins"][0]) == [
        "id",
        "displayName",
        "remotePluginId",
        "version",
        "root",
        "files",
        "skills",
    ]


@pytest_twisted.ensureDeferred
async def test_inline_mcp_servers_remote_id_and_broken_plugins(tmp_path: Path) -> None:
    cache = tmp_path / "codex-home" / "plugins" / "cache" / "mk"
    # Semver order: 10.0.0 is newer than 9.0.0.
    write_file(cache / "p4" / "9.0.0" / ".codex-plugin" / "plugin.json", '{"name":"v9"}')
    manifest = '{"name":"p4","mcpServers":{"b":{"x":1},"a":2}}'
    write_file(cache / "p4" / "10.0.0" / ".codex-plugin" / "plugin.json", manifest)
    write_file(
        cache / "p4" / ".codex-remote-plugin-install.json",
        '{"schema_version":1,"remote_plugin_id":"  rp-123 "}',
    )
    (cache / "nomanifest" / "1.0.0").mkdir(parents=True)  # a warning, no plugin
    write_file(
        cache / "inline-apps" / "1.0.0" / ".codex-plugin" / "plugin.json", '{"apps":{"a":1}}'
    )
    write_file(cache / "bad name" / "1.0.0" / ".codex-plugin" / "plugin.json", "{}")  # not an id
    result = await discover(tmp_path)
    [plugin] = result["plugins"]
    manifest_path = path_to_uri(str(cache / "p4" / "10.0.0" / ".codex-plugin" / "plugin.json"))
    assert plugin["id"] == "p4@mk"
    assert (plugin["version"], plugin["remotePluginId"], plugin["displayName"]) == (
        "10.0.0",
        "rp-123",
        "p4",
    )
    # Inline MCP servers: their JSON, keys as written, under the manifest's path.
    assert plugin["files"]["mcpConfig"] == {
        "path": manifest_path,
        "contents": '{"b":{"x":1},"a":2}',
    }
    assert result["skills"] == []
    assert result["warnings"] == [METADATA_WARNING, METADATA_WARNING]


@pytest_twisted.ensureDeferred
async def test_missing_locations_are_an_empty_answer(tmp_path: Path) -> None:
    assert await discover(tmp_path) == {"plugins": [], "skills": [], "warnings": []}


def _many_skills(root: Path, prefix: str, count: int) -> None:
    for index in range(count):
        _skill(root / f"{prefix}{index:04d}", f"name: {prefix}{index:04d}\ndescription: d\n")


@pytest_twisted.ensureDeferred
async def test_at_most_2048_capabilities_with_the_limit_warning(tmp_path: Path) -> None:
    _many_skills(tmp_path / "codex-home" / "skills", "s", 1990)
    _many_skills(tmp_path / "home" / ".agents" / "skills", "u", 100)
    result = await discover(tmp_path)
    names = [skill["name"] for skill in result["skills"]]
    assert len(names) == cd.MAX_CAPABILITIES == 2048
    assert names[:2] == ["s0000", "s0001"] and names[1989:1991] == ["s1989", "u0000"]
    assert names[-1] == "u0057"
    assert result["warnings"] == ["capability discovery size limit reached"]


@pytest_twisted.ensureDeferred
async def test_a_root_walk_stops_at_2000_directories(tmp_path: Path) -> None:
    _many_skills(tmp_path / "codex-home" / "skills", "s", 2001)
    result = await discover(tmp_path)
    names = [skill["name"] for skill in result["skills"]]
    # The root is one of the 2000 directories; name order, breadth first.
    assert len(names) == 1999 and names[-1] == "s1998"
    assert result["warnings"] == [METADATA_WARNING]


def test_the_answer_stays_within_4_mib(tmp_path: Path) -> None:
    # 1000 skills with ~4.5 KiB descriptions: over 4 MiB in all. Skills are
    # admitted in order while they fit, the limit warning goes first (the
    # reference kept 884 of them for the same files under /tmp/h3b/fd).
    env = {"HOME": str(tmp_path / "home"), "CODEX_HOME": str(tmp_path / "codex-home")}
    words = " ".join(["word"] * 900)
    for index in range(1000):
        _skill(tmp_path / "codex-home" / "skills" / f"s{index:04d}", f"description: {words}\n")
    result = cd.discover(env, str(tmp_path / "no-system"))
    kept = len(result.skills)
    assert [skill.name for skill in result.skills] == [f"s{i:04d}" for i in range(kept)]
    assert result.warnings == ["capability discovery size limit reached"]
    skill_bytes = sum(len(msgspec.json.encode(skill)) for skill in result.skills)
    one_more = len(msgspec.json.encode(result.skills[0]))
    assert skill_bytes <= cd.MAX_RESPONSE_BYTES == 4 * 1024 * 1024 < skill_bytes + one_more
    assert len(msgspec.json.encode(result)) <= cd.MAX_RESPONSE_BYTES


@pytest_twisted.ensureDeferred
async def test_bad_params_are_precise_errors(tmp_path: Path) -> None:
    async with serving(tmp_path) as server:

        async def error(params: Any) -> Any:
            return (await server.request("capabilities/discoverV2", params))["error"]

        assert await error({"cwd": "rel"}) == {
            "code": -32602,
            "message": "invalid URI: relative URL without a base",
            "data": {"kind": "relativePath", "field": "cwd", "path": "rel"},
        }
        assert (await error({"cwd": "http://h/x"}))["message"] == (
            "unsupported path URI scheme `http`"
        )
        assert (await error({"cwd": "file:///a?b"}))["message"] == (
            "query parameters are not allowed in path URIs"
        )
        assert await error({}) == {
            "code": -32602,
            "message": "missing field `cwd`",
        }
        assert (await error({"cwd": 5}))["code"] == -32602
        assert (await error(None))["code"] == -32602
        # A native absolute path is accepted, as everywhere on this server.
        result = await server.call("capabilities/discoverV2", {"cwd": "/", "sandbox": None})
        assert result == {"plugins": [], "skills": [], "warnings": []}


def test_a_missing_codex_home_is_an_internal_error(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(RpcError) as caught:
        cd.discover({"CODEX_HOME": str(missing)})
    assert (caught.value.code, caught.value.message) == (
        -32603,
        f'failed to find Codex home: CODEX_HOME points to "{missing}", '
        "but that path does not exist",
    )


@pytest_twisted.ensureDeferred
async def test_handshake_first(tmp_path: Path) -> None:
    (tmp_path / "codex-home").mkdir()
    server = ServerProcess.start(env={"CODEX_HOME": str(tmp_path / "codex-home")})
    try:
        reply = await server.request("capabilities/discoverV2", {"cwd": "file:///"})
        assert reply["error"] == {
            "code": -32600,
            "message": "client must call initialize before using capability discovery methods",
        }
        await server.call("initialize", CODEX_INIT)
        reply = await server.request("capabilities/discoverV2", {"cwd": "file:///"})
        # The reference's texts (codex exec-server 0.171.0).
        assert reply["error"]["message"] == (
            "client must send initialized before using capability discovery methods"
        )
    finally:
        await server.stop()


# --- the front matter -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("front", "expected"),
    [
        ("name: a\ndescription: d\n", ("a", "d", None)),
        ("description: Build for AWS: ECS\n", ("dir", "Build for AWS: ECS", None)),
        ("description: >\n  folded\n  text\n", ("dir", "folded text", None)),
        ("description: |\n  lit\n  two\n", ("dir", "lit two", None)),
        (
            "name: '  spaced   out '\ndescription: \"tab\\there\"\n",
            ("spaced out", "tab here", None),
        ),
        ("description: d # comment\nmetadata:\n  short-description: s\n", ("dir", "d", "s")),
        ("description: [flow, list\n", ("dir", "[flow, list", None)),
        ("name: ''\ndescription: d\n", ("dir", "d", None)),
        ("name: &n anc\ndescription: *n\n", ("anc", "anc", None)),
    ],
)
def test_skill_front_matter(front: str, expected: tuple[str, str, str | None]) -> None:
    assert cd.parse_skill(f"---\n{front}---\n", "dir") == expected


@pytest.mark.parametrize(
    "contents",
    [
        "no front matter\n",
        "---\nname: a\n",  # not closed
        "---\n---\n",  # empty
        "---\nname: a\n---\n",  # no description
        "---\ndescription: d\nname: " + "n" * 65 + "\n---\n",  # name too long
        "---\ndescription: d\ndescription: e\n---\n",  # duplicate key
        "---\ndescription: [d]\n---\n",  # not a string
        "---\nmetadata: text\ndescription: d\n---\n",
        "---\njust text\n---\n",
    ],
)
def test_invalid_skill_front_matter(contents: str) -> None:
    with pytest.raises(cd.SkillParseError):
        cd.parse_skill(contents, "dir")


def test_skill_yaml_shapes() -> None:
    assert skill_yaml.loads("a:\n  - x\n  - k: v\n    j: w\nb: {c: [1, 'two']}\n") == {
        "a": ["x", {"k": "v", "j": "w"}],
        "b": {"c": ["1", "two"]},
    }
    assert skill_yaml.loads("a:\n- x\n- y\nb: ~\n") == {"a": ["x", "y"], "b": None}
    assert skill_yaml.loads('a: "\\u00e9\\x41"\nb: |-\n  k\n\n  l\n') == {"a": "éA", "b": "k\n\nl"}
    assert skill_yaml.loads("a: &m\n  k: v\nb: *m\nc:\n  - &s x\n  - *s\n") == {
        "a": {"k": "v"},
        "b": {"k": "v"},
        "c": ["x", "x"],
    }
    # Full YAML: an anchor inside a flow collection reads (the hand-written
    # subset parser refused it; the reference reads it).
    assert skill_yaml.loads("a: [&x 1, *x]") == {"a": ["1", "1"]}
    for bad in ["a: *x", "a: & 1", "a: !tag v", "a: 1\n  b: 2", "a: 'open", 'a: "\x7f"']:
        with pytest.raises(skill_yaml.YamlError):
            skill_yaml.loads(bad)


_keys = st.text("abcdefghijklmnopqrstuvwxyz_-0123456789", min_size=1, max_size=8).filter(
    lambda key: not key.startswith("-")
)


def _yaml_printable(ch: str) -> bool:
    # YAML's c-printable (1.2, and libyaml), less its line breaks (U+0085,
    # U+2028, U+2029 fold to a space inside a quoted scalar, as a newline
    # does): what json.dumps leaves unescaped must be in it (it escapes
    # everything below U+0020 itself).
    code = ord(ch)
    if code in (0x85, 0x2028, 0x2029):
        return False
    return code < 0x7F or 0xA0 <= code <= 0xFFFD or code >= 0x10000


_texts = st.text(st.characters(exclude_categories=["Cs"]).filter(_yaml_printable), max_size=30)


@given(st.dictionaries(_keys, _texts | st.dictionaries(_keys, _texts, max_size=3), max_size=5))
def test_skill_yaml_reads_quoted_documents(document: dict[str, Any]) -> None:
    # JSON strings are YAML double-quoted scalars: any text survives.
    lines = []
    for key, value in document.items():
        if isinstance(value, dict):
            lines.append(f"{key}:")
            lines += [f"  {k}: {json.dumps(v, ensure_ascii=False)}" for k, v in value.items()]
        else:
            lines.append(f"{key}: {json.dumps(value, ensure_ascii=False)}")
    expected = {k: (v or None) if isinstance(v, dict) else v for k, v in document.items()}
    assert skill_yaml.loads("\n".join(lines)) == (expected or None)


_line = st.text("abcdefghij XYZ:#'\"-{}[],&*!|>%@`", min_size=1, max_size=20).map(str.strip)


@given(st.lists(_line.filter(bool), min_size=1, max_size=5))
def test_skill_yaml_block_literals(lines: list[str]) -> None:
    text = "k: |-\n" + "".join(f"  {line}\n" for line in lines) + "after: x\n"
    assert skill_yaml.loads(text) == {"k": "\n".join(lines), "after": "x"}


_FULL_TOOL = (
    "dependencies:\n  tools:\n    - type: mcp\n      value: gh\n      description: d\n"
    "      transport: streamable_http\n      command: cmd\n      url: https://x\n"
    "      oauth_callback_port: 8080\n"
)


@pytest.mark.parametrize(
    ("text", "dependencies", "policy"),
    [
        # What the reference answered for each agents/openai.yaml.
        (
            _FULL_TOOL
            + "policy:\n  allow_implicit_invocation: true\n  products: [codex, CHATGPT]\n",
            {"tools": [["mcp", "gh", "d", "streamable_http", "cmd", "https://x", None]]},
            (True, ["codex", "chatgpt"]),
        ),
        (
            "dependencies:\n  tools:\n    - value: gh\n"
            "    - type: 5\n      value: 6\n      url: 7\n",
            {"tools": [["5", "6", None, None, None, "7", None]]},
            None,
        ),
        ("dependencies:\n  tools: []\npolicy: {}\n", None, (None, [])),
        ("policy:\n  allow_implicit_invocation: False\n", None, (False, [])),
        ("policy:\n  products: [ATLAS]\n", None, (None, ["atlas"])),
        ("interface:\n  display_name: X\n", None, None),
        # Any part of the wrong shape: both are null.
        ("policy:\n  allow_implicit_invocation: yes\n", None, None),
        ("policy:\n  allow_implicit_invocation: 'true'\n", None, None),
        ("policy:\n  products: [Codex]\n", None, None),
        ("policy:\n  products: [codex, unknown]\n", None, None),
        ("dependencies:\n  tools:\n    - x\n", None, None),
        ("dependencies:\n  tools: x\npolicy:\n  products: []\n", None, None),
        ("dependencies:\n  tools:\n    - type: mcp\n      value: [a]\n", None, None),
        ("interface: 5\npolicy:\n  products: [codex]\n", None, None),
        ("- a\n", None, None),
        ("dependencies: [\n", None, None),
    ],
)
def test_skill_dependencies_and_policy(text: str, dependencies: Any, policy: Any) -> None:
    found_dependencies, found_policy = cd.skill_extras(text)
    if dependencies is None:
        assert found_dependencies is None
    else:
        assert found_dependencies is not None
        assert [list(msgspec.structs.astuple(t)) for t in found_dependencies.tools] == (
            dependencies["tools"]
        )
    if policy is None:
        assert found_policy is None
    else:
        assert found_policy is not None
        assert (found_policy.allow_implicit_invocation, found_policy.products) == policy


_pieces = st.sampled_from(
    [*"ab :-#'\"|>[]{},\n\t&*!?%@`~.\\xu0+", "---", "...", "  - ", ": ", "\n  ", "\n    "]
)


@given(st.lists(_pieces, max_size=40).map("".join))
def test_any_text_is_read_or_refused(text: str) -> None:
    # Skill files are the user's: whatever they hold is an answer or a
    # warning, never an error of the server.
    with suppress(skill_yaml.YamlError):
        skill_yaml.loads(text)
    with suppress(cd.SkillParseError):
        cd.parse_skill(f"---\n{text}\n---\n", "dir")
    cd.skill_extras(text)


def test_deep_nesting_is_refused() -> None:
    for text in ["a: " + "[" * 100_000, "".join(" " * i + "k:\n" for i in range(3000))]:
        with pytest.raises(skill_yaml.YamlError):
            skill_yaml.loads(text)


def test_a_long_nested_line_reads() -> None:
    # "- - - ... x" nests a sequence per "- " on one line (the hand-written
    # parser once scanned such a line again per level).
    line = "- " * 200 + "x" * 1000
    expected: Any = "x" * 1000
    for _ in range(200):
        expected = [expected]
    assert skill_yaml.loads(f"a: 1\nb:\n{line}\n") == {"a": "1", "b": expected}


def test_duplicate_keys_and_non_scalar_keys_are_refused() -> None:
    # The reference's parser refuses both; PyYAML alone would keep the last.
    for bad in ["a: 1\na: 2\n", "k: {x: 1, x: 2}\n", "? [a]\n: b\n", "a\n---\nb\n"]:
        with pytest.raises(skill_yaml.YamlError):
            skill_yaml.loads(bad)


def test_quoted_scalars_are_marked_and_plain_nulls_are_none() -> None:
    document = skill_yaml.loads("a: 'true'\nb: true\nc: ~\nd:\ne: \"\"\nnull: x\n")
    assert document == {"a": "true", "b": "true", "c": None, "d": None, "e": "", "null": "x"}
    assert isinstance(document["a"], skill_yaml.Quoted)
    assert not isinstance(document["b"], skill_yaml.Quoted)


def test_aliases_of_aliases_stay_small() -> None:
    # 2**60 leaves if aliases were copied; they are the same objects.
    levels = "".join(f"a{i}: &a{i}\n  - *a{i - 1}\n  - *a{i - 1}\n" for i in range(1, 60))
    document = skill_yaml.loads("a0: &a0\n  - x\n  - x\n" + levels)
    assert document["a59"][0] is document["a58"]


# --- against the reference ----------------------------------------------------------------------

_SKILLS = {
    "alpha": "---\nname: alpha\ndescription: Alpha\nmetadata:\n  short-description: A\n---\n",
    "prose": "---\ndescription: Build for AWS: ECS # c\nargument-hint: <d: 7d>\n---\n",
    "flowmap": "---\ndescription: {a: b}\n---\n",
    "folded": "---\ndescription: >-\n  a\n  b\n\n  c\nname: f\n---\n",
    "anchor": "---\nname: &n anc\ndescription: *n\n---\n",
    "crlf": "---\r\nname: crlf\r\ndescription: d\r\n---\r\n",
    "number": "---\nname: 123\ndescription: true\n---\n",
    "meta-null": "---\ndescription: d\nmetadata:\n---\n",
    "doc-end": "---\ndescription: d\n...\n---\n",
    "nodesc": "---\nname: nodesc\n---\n",
    "nofront": "no front matter\n",
    "toolong": "---\ndescription: d\nname: " + "n" * 65 + "\n---\n",
    "a/b/c/d/e/f": "---\ndescription: sixth level\n---\n",
    "a/b/c/d/e/f/g": "---\ndescription: seventh level\n---\n",
    "tools/skills/x": "---\ndescription: namespaced\n---\n",
    "deps": "---\ndescription: deps\n---\n",
}
_OPENAI_YAML = (
    "dependencies:\n  tools:\n    - type: mcp\n      value: gh\n      url: https://x\n"
    "    - value: no-type\npolicy:\n  allow_implicit_invocation: False\n  products: [CODEX]\n"
)
_PLUGINS = {
    "mk/p/1.0.0/.codex-plugin/plugin.json": '{"name":"old"}',
    "mk/p/10.0.0/.codex-plugin/plugin.json": (
        '{"name":"p","interface":{"displayName":"P"},"mcpServers":{"b":1,"a":2}}'
    ),
    "mk/p/10.0.0/skills/s/SKILL.md": "---\ndescription: plugin skill\n---\n",
    "mk/p/.codex-remote-plugin-install.json": '{"schema_version":1,"remote_plugin_id":" r "}',
    "mk/q/local/.claude-plugin/plugin.json": '{"apps":"./apps.json","mcpServers":"./m.json"}',
    "mk/q/local/apps.json": "{}",
    "mk/q/local/m.json": "{}",
    "mk/q/2.0.0/.codex-plugin/plugin.json": "{}",
    "mk/inline-apps/1.0.0/.codex-plugin/plugin.json": '{"apps":{"a":1}}',
    "mk/no-manifest/1.0.0/README": "",
    "mk/bad name/1.0.0/.codex-plugin/plugin.json": "{}",
}


def _reference_tree(base: Path) -> None:
    skills = base / "codex-home" / "skills"
    for directory, text in _SKILLS.items():
        write_file(skills / directory / "SKILL.md", text)
    write_file(skills / "deps" / "agents" / "openai.yaml", _OPENAI_YAML)
    write_file(skills / "tools" / ".codex-plugin" / "plugin.json", '{"name":"tools"}')
    (skills / "a" / "loop").symlink_to("..")
    _skill(base / "home" / ".agents" / "skills" / "user", "description: user skill\n")
    for relative, text in _PLUGINS.items():
        write_file(base / "codex-home" / "plugins" / "cache" / relative, text)


class _ReferenceServer(ServerProcess):
    @classmethod
    def start_reference(cls, codex: Path, env: dict[str, str]) -> ServerProcess:
        argv = [str(codex), "exec-server", "--listen", "stdio"]
        proto = cls().launch(argv, env=env, description="codex exec-server (stdio)")
        proto.allow_stderr(".")  # its own warnings (PATH aliases under /tmp)
        return proto


@pytest_twisted.ensureDeferred
async def test_the_same_answer_as_the_reference_server(tmp_path: Path) -> None:
    try:
        codex = fetch()
    except FetchError as exc:
        pytest.skip(f"THE REAL CODEX CLI IS NOT AVAILABLE, the comparison did not run: {exc}")
    _reference_tree(tmp_path)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path / "home"),
        "CODEX_HOME": str(tmp_path / "codex-home"),
    }
    params = {"cwd": path_to_uri(str(tmp_path)), "sandbox": None}
    reference = _ReferenceServer.start_reference(codex, env)
    try:
        await reference.call("initialize", CODEX_INIT)
        reference.notify("initialized", {})
        expected = await reference.call("capabilities/discoverV2", params)
    finally:
        await reference.stop()
    async with serving(tmp_path) as server:
        assert await server.call("capabilities/discoverV2", params) == expected
    # The tree exercises what it is meant to.
    assert len(expected["plugins"]) == 2 and len(expected["skills"]) == 13
    assert len(expected["warnings"]) == 3


def _discovery_profiles(base: Path) -> dict[str, Any]:
    """Codex's read-only profile, ones that hide a skill or a plugin, ones that read little."""

    def restricted(*entries: tuple[Any, str]) -> Any:
        return {
            "permissions": {
                "type": "managed",
                "file_system": {
                    "type": "restricted",
                    "entries": [
                        {
                            "path": path
                            if isinstance(path, dict)
                            else {"type": "path", "path": path_to_uri(str(path))},
                            "access": access,
                        }
                        for path, access in entries
                    ],
                },
                "network": "restricted",
            },
            "cwd": path_to_uri(str(base)),
            "workspaceRoots": [path_to_uri(str(base))],
            "windowsSandboxLevel": "disabled",
            "windowsSandboxProxySettingsMode": "reconcile",
            "useLegacyLandlock": False,
        }

    root = {"type": "special", "value": {"kind": "root"}}
    skills = base / "codex-home" / "skills"
    return {
        "read-only": restricted((root, "read")),
        "deny a skill": restricted((root, "read"), (skills / "deps", "deny")),
        "deny a plugin": restricted(
            (root, "read"), (base / "codex-home" / "plugins" / "cache" / "mk", "deny")
        ),
        "read only the user's skills": restricted((base / "home", "read")),
        # Below a location: the directories above it show only the way there.
        "read only a plugin": restricted(
            (base / "codex-home" / "plugins" / "cache" / "mk" / "p", "read")
        ),
        "read only a skill": restricted((skills / "alpha", "read")),
    }


@pytest_twisted.ensureDeferred
async def test_sandboxed_discovery_as_the_reference_server(tmp_path: Path) -> None:
    """``capabilityDiscoverySandbox``: the scan sees what the request's profile may read."""
    codex = fetch()
    _reference_tree(tmp_path)
    (tmp_path / "tmp").mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path / "home"),
        "CODEX_HOME": str(tmp_path / "codex-home"),
        # The reference's sandbox helper refuses a CODEX_HOME under TMPDIR.
        "TMPDIR": str(tmp_path / "tmp"),
    }
    cwd = path_to_uri(str(tmp_path))
    profiles = _discovery_profiles(tmp_path)
    expected: dict[str, Any] = {}
    reference = _ReferenceServer.start_reference(codex, env)
    try:
        await reference.call("initialize", CODEX_INIT)
        reference.notify("initialized", {})
        for name, sandbox in profiles.items():
            params = {"cwd": cwd, "sandbox": sandbox}
            expected[name] = await reference.request("capabilities/discoverV2", params)
    finally:
        await reference.stop()
    got: dict[str, Any] = {}
    async with serving(tmp_path) as server:
        for name, sandbox in profiles.items():
            params = {"cwd": cwd, "sandbox": sandbox}
            got[name] = await server.request("capabilities/discoverV2", params)
    differences = [
        f"{name}: reference {json.dumps(expected[name])[:2000]}"
        f" | ours {json.dumps(got[name])[:2000]}"
        for name in profiles
        if {k: v for k, v in got[name].items() if k != "id"}
        != {k: v for k, v in expected[name].items() if k != "id"}
    ]
    assert not differences, "\n".join(differences)


def _confined_answer(guard: Any, params: cd.DiscoverV2Params) -> Any:
    """The registered handler's answer with ``guard``, its pool work run inline."""
    routes: dict[str, Any] = {}

    class Router:
        def add_method(self, method: Any, handler: Any) -> None:
            routes[method.name] = handler

    def run(func: Any, *args: Any, owner: Any) -> Any:
        return func(*args)

    cd.register(Router(), run, guard)
    return msgspec.to_builtins(routes[cd.CAPABILITIES_DISCOVER_V2](None, params))


@pytest.mark.parametrize("name", list(_discovery_profiles(Path("/b"))))
def test_sandboxed_discovery_under_landlock_as_in_a_mount_namespace(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Landlock (no CAP_SYS_ADMIN) cannot hide a path inside a readable tree,
    nor list the way to a readable path: the scan answers the same all the same."""
    from execserver import protocol as p
    from execserver.sandbox.fsguard import Guard

    _reference_tree(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CODEX_HOME", str(tmp_path / "codex-home"))
    sandbox = msgspec.convert(_discovery_profiles(tmp_path)[name], p.SandboxConfig)
    params = cd.DiscoverV2Params(path_to_uri(str(tmp_path)), sandbox)
    answers = [_confined_answer(Guard(how=how), params) for how in ("landlock", "mount-namespace")]
    assert answers[0] == answers[1]


def test_the_reported_executor_version_is_the_tested_codex_release() -> None:
    assert environment_info.EXECUTOR_VERSION == fetch_codex.VERSION


@pytest_twisted.ensureDeferred
async def test_each_answer_reads_the_files_afresh(tmp_path: Path) -> None:
    params = {"cwd": path_to_uri(str(tmp_path))}
    async with serving(tmp_path) as server:
        assert (await server.call("capabilities/discoverV2", params))["skills"] == []
        _skill(tmp_path / "codex-home" / "skills" / "new", "description: added\n")
        [skill] = (await server.call("capabilities/discoverV2", params))["skills"]
        assert skill["name"] == "new"


@pytest_twisted.ensureDeferred
async def test_plugins_come_first_and_count_with_their_skills(tmp_path: Path) -> None:
    # As the reference answered: the plugin (1 + 20 skills) is admitted
    # first, the standalone skills fill the rest of the 2048.
    _many_skills(tmp_path / "codex-home" / "skills", "s", 1990)
    _many_skills(tmp_path / "home" / ".agents" / "skills", "u", 60)
    root = tmp_path / "codex-home" / "plugins" / "cache" / "mk" / "p" / "1.0.0"
    write_file(root / ".codex-plugin" / "plugin.json", '{"name":"p"}')
    _many_skills(root / "skills", "k", 20)
    result = await discover(tmp_path)
    [plugin] = result["plugins"]
    assert len(plugin["skills"]) == 20 and plugin["skills"][0]["name"] == "p:k0000"
    assert len(result["skills"]) == 2027 == cd.MAX_CAPABILITIES - 21
    assert result["warnings"] == ["capability discovery size limit reached"]


def test_files_are_bounded_and_never_block(tmp_path: Path) -> None:
    # A SKILL.md at the 1 MiB limit is read, one byte over it is a warning
    # (unread); a FIFO SKILL.md is skipped; a FIFO or oversized remote-install
    # file is a location warning, never a hung read.
    env = {"HOME": str(tmp_path / "home"), "CODEX_HOME": str(tmp_path / "codex-home")}
    skills = tmp_path / "codex-home" / "skills"
    front = "---\nname: big\ndescription: d\n---\n"
    write_file(skills / "big" / "SKILL.md", front + "x" * (cd.MAX_FILE_BYTES - len(front)))
    (skills / "fifo").mkdir()
    os.mkfifo(skills / "fifo" / "SKILL.md")
    result = cd.discover(env, str(tmp_path / "no-system"))
    assert ([s.name for s in result.skills], result.warnings) == (["big"], [])
    write_file(skills / "big" / "SKILL.md", front + "x" * (cd.MAX_FILE_BYTES - len(front) + 1))
    result = cd.discover(env, str(tmp_path / "no-system"))
    assert (result.skills, result.warnings) == ([], [METADATA_WARNING])
    package = tmp_path / "codex-home" / "plugins" / "cache" / "mk" / "p"
    write_file(package / "1.0.0" / ".codex-plugin" / "plugin.json", '{"name":"p"}')
    os.mkfifo(package / cd.REMOTE_INSTALL_METADATA)
    [plugin] = cd.discover(env, str(tmp_path / "no-system")).plugins
    assert plugin.remote_plugin_id is None
    with pytest.raises(ValueError, match=r"^not a regular file$"):
        cd._read_remote_plugin_id(str(package / cd.REMOTE_INSTALL_METADATA))
    (package / cd.REMOTE_INSTALL_METADATA).unlink()
    body = '{"schema_version":1,"remote_plugin_id":"r"}'
    write_file(package / cd.REMOTE_INSTALL_METADATA, body.ljust(cd.MAX_REMOTE_METADATA_BYTES))
    assert cd._read_remote_plugin_id(str(package / cd.REMOTE_INSTALL_METADATA)) == "r"
    write_file(package / cd.REMOTE_INSTALL_METADATA, body.ljust(cd.MAX_REMOTE_METADATA_BYTES + 1))
    result = cd.discover(env, str(tmp_path / "no-system"))
    assert result.plugins[0].remote_plugin_id is None
    assert result.warnings[0] == cd.LOCATIONS_WARNING


def test_walk_depth_and_entry_limits(tmp_path: Path) -> None:
    # SKILL.md files up to 6 directory levels below a location are found,
    # not deeper; a location's walk stops after 20000 entries (every entry
    # of every directory it lists, breadth first in name order). The
    # reference (codex exec-server 0.171.0) answered the same for this tree.
    env = {"HOME": str(tmp_path / "home"), "CODEX_HOME": str(tmp_path / "codex-home")}
    skills = tmp_path / "codex-home" / "skills"
    deep = skills.joinpath(*(f"d{level}" for level in range(1, cd.MAX_SCAN_DEPTH + 2)))
    _skill(deep.parent, "name: six\ndescription: d\n")
    _skill(deep, "name: seven\ndescription: d\n")
    result = cd.discover(env, str(tmp_path / "no-system"))
    assert ([s.name for s in result.skills], result.warnings) == (["six"], [])
    crowded = tmp_path / "home" / ".agents" / "skills"
    crowded.mkdir(parents=True)
    # 19998 files, b-last and its SKILL.md: 20000 entries.
    for index in range(cd.MAX_ENTRIES_PER_ROOT - 2):
        (crowded / f"a{index:05d}").touch()
    _skill(crowded / "b-last", "name: last\ndescription: d\n")
    assert [s.name for s in cd.discover(env, str(tmp_path / "no-system")).skills] == [
        "six",
        "last",
    ]
    (crowded / "a-one-more").touch()
    result = cd.discover(env, str(tmp_path / "no-system"))
    assert ([s.name for s in result.skills], result.warnings) == (["six"], [METADATA_WARNING])


def test_at_most_512_plugins_and_64_warnings(tmp_path: Path) -> None:
    # 513 installed plugins without a manifest: 512 are locations (one
    # warning each, as a plugin without a manifest), the last a location
    # warning; the answer keeps 64 warnings (the reference's answer too).
    env = {"HOME": str(tmp_path / "home"), "CODEX_HOME": str(tmp_path / "codex-home")}
    cache = tmp_path / "codex-home" / "plugins" / "cache" / "mk"
    for index in range(cd.MAX_LOCATIONS + 1):
        (cache / f"p{index:03d}" / "local").mkdir(parents=True)
    found, warnings = cd.plugin_locations(str(tmp_path / "codex-home"))
    assert len(found) == cd.MAX_LOCATIONS == 512
    assert found[-1].plugin == cd.InstalledPlugin("p511@mk", "local", None)
    assert warnings == ["plugin cache reached its 512-location limit"]
    result = cd.discover(env, str(tmp_path / "no-system"))
    assert (result.plugins, result.skills) == ([], [])
    assert len(result.warnings) == cd.MAX_WARNINGS == 64
    assert result.warnings[0] == cd.LOCATIONS_WARNING
    assert set(result.warnings[1:]) == {METADATA_WARNING}
