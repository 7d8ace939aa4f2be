"""``environmentConfig/read``: the executor's own Codex config, by key path, as the reference.

Pure parts (the TOML writer, key-path selection, the layer loader with a
temporary system directory) are tested directly; the method itself through
the real server over stdio, with ``CODEX_HOME`` and ``HOME`` set for it.
docs/protocol.md, "environmentConfig/read".
"""

from __future__ import annotations

import datetime
import os
import pwd
import socket
import threading
import tomllib
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from hypothesis import given
from hypothesis import strategies as st

from execserver import protocol as p
from execserver.codex import environment_config as ec
from execserver.codex.toml_writer import dumps
from execserver.errors import RpcError
from execserver.fs.paths import path_to_uri
from tests.support.codex_config import CODEX_INIT, read_params, serving, write_file

# --- the TOML writer --------------------------------------------------------------------------

_keys = st.text(max_size=8)
_scalars = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
    st.text(st.characters(exclude_categories=["Cs"]), max_size=12),
    st.dates(),
    st.times(),
    st.datetimes(),
    st.datetimes(timezones=st.just(datetime.UTC)),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_keys, inner, max_size=4),
    max_leaves=12,
)


@given(st.dictionaries(_keys, _values, max_size=5))
def test_toml_writer_round_trips_what_tomllib_reads(document: dict[str, Any]) -> None:
    assert tomllib.loads(dumps(document)) == document


def test_toml_writer_shapes() -> None:
    assert dumps({}) == ""
    doc = {"model": "m", "mcp_servers": {"a b": {"url": "u", "env": {"K": "v"}}, "e": {}}}
    assert dumps(doc) == (
        'model = "m"\n\n[mcp_servers."a b"]\nurl = "u"\n\n[mcp_servers."a b".env]\nK = "v"\n'
        "\n[mcp_servers.e]\n"
    )
    assert dumps({"x": [{"a": 1}, 'q"\n\x01'], "f": float("inf")}) == (
        'x = [{ a = 1 }, "q\\"\\n\\u0001"]\nf = inf\n'
    )


# --- selecting key paths ----------------------------------------------------------------------


def _stack(*tables: dict[str, Any], cloud: int = 1) -> ec.Stack:
    return ec.Stack([ec.Layer(f"l{i}", "/b", t) for i, t in enumerate(tables)], cloud)


def test_selection_keeps_requested_paths_and_drops_empty_layers() -> None:
    stack = _stack(
        {"a": {"b": 1, "c": 2}, "ignored": True},
        {"a": 5, "only": 1},
        {"other": 1},
        {"a": {"c": {"deep": 1}}},
        cloud=2,
    )
    selected = ec.project(stack, [["a", "c"], ["only"]])
    assert [layer.toml for layer in selected.layers] == [
        {"a": {"c": 2}},
        # A non-table where a table was asked for still overrides lower layers.
        {"a": 5, "only": 1},
        {"a": {"c": {"deep": 1}}},
    ]
    assert [layer.source for layer in selected.layers] == ["l0", "l1", "l3"]
    assert selected.cloud_insertion_index == 2
    # A shorter path selects everything under it, whatever the order.
    assert ec.project(stack, [["a", "c"], ["a"]]).layers[0].toml == {"a": {"b": 1, "c": 2}}
    assert ec.project(stack, [["a"], ["a", "c"]]).layers[0].toml == {"a": {"b": 1, "c": 2}}
    # Nothing requested of a stack: nothing kept, the cloud goes first.
    assert ec.project(stack, []) == ec.Stack([], 0)
    assert ec.project(_stack({"x": 1}, cloud=1), [["y"]]) == ec.Stack([], 0)


# --- the loader -------------------------------------------------------------------------------


def test_layers_in_the_reference_order(tmp_path: Path) -> None:
    system = tmp_path / "etc"
    home = tmp_path / "home" / ".codex"
    work = tmp_path / "repo" / "sub"
    (tmp_path / "repo" / ".git").mkdir(parents=True)
    write_file(system / "config.toml", 'model = "system"\n')
    write_file(system / "requirements.toml", 'allowed_sandbox_modes = ["read-only"]\n')
    write_file(
        system / "managed_config.toml", 'model = "managed"\nsandbox_mode = "workspace-write"\n'
    )
    repo = tmp_path / "repo"
    write_file(
        home / "config.toml", f'model = "user"\n[projects."{repo}"]\ntrust_level = "trusted"\n'
    )
    write_file(repo / ".codex" / "config.toml", 'model = "repo"\nmodel_provider = "evil"\n')
    write_file(work / ".codex" / "config.toml", 'model = "sub"\n')
    config, requirements = ec.load_layers(str(work), str(home), str(system))
    assert [(layer.source, layer.base_dir, layer.toml.get("model")) for layer in config.layers] == [
        (f"system ({system}/config.toml)", str(system), "system"),
        (f"user ({home}/config.toml)", str(home), "user"),
        (f"project ({repo}/.codex/config.toml)", f"{repo}/.codex", "repo"),
        (f"project ({work}/.codex/config.toml)", f"{work}/.codex", "sub"),
        (f"legacy managed_config.toml ({system}/managed_config.toml)", str(system), "managed"),
    ]
    assert config.cloud_insertion_index == 1
    # A project may not choose where credentials go.
    assert "model_provider" not in config.layers[2].toml
    assert requirements == ec.Stack(
        [
            ec.Layer(
                f"{system}/requirements.toml",
                str(system),
                {"allowed_sandbox_modes": ["read-only"]},
            ),
            ec.Layer(
                f"{system}/managed_config.toml",
                str(home),
                {"allowed_sandbox_modes": ["read-only", "workspace-write"]},
            ),
        ],
        1,
    )


def test_untrusted_projects_and_markers(tmp_path: Path) -> None:
    system = tmp_path / "etc"
    home = tmp_path / "home"
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    write_file(repo / ".codex" / "config.toml", 'model = "repo"\n')
    config, requirements = ec.load_layers(str(repo), str(home), str(system))
    assert [layer.source.split(" ")[0] for layer in config.layers] == ["system", "user"]
    assert requirements == ec.Stack([], 0)
    # Marked untrusted: still not loaded; a broken file there is not an error...
    write_file(home / "config.toml", f'[projects."{repo}"]\ntrust_level = "untrusted"\n')
    write_file(repo / ".codex" / "config.toml", "model = \n")
    assert len(ec.load_layers(str(repo), str(home), str(system))[0].layers) == 2
    # ...but one that cannot be read at all is, as in the reference.
    (repo / ".codex" / "config.toml").unlink()
    (repo / ".codex" / "config.toml").mkdir()
    with pytest.raises(ec.ConfigLoadError) as caught:
        ec.load_layers(str(repo), str(home), str(system))
    assert str(caught.value) == (
        f"Failed to read project config file {repo}/.codex/config.toml: "
        "Is a directory (os error 21)"
    )
    # Trusted and broken: an error naming the file and the position.
    (repo / ".codex" / "config.toml").rmdir()
    write_file(repo / ".codex" / "config.toml", "model = \n")
    write_file(home / "config.toml", f'[projects."{repo}"]\ntrust_level = "trusted"\n')
    with pytest.raises(ec.ConfigLoadError) as caught:
        ec.load_layers(str(repo), str(home), str(system))
    assert str(caught.value).startswith(
        f"Error parsing project config file {repo}/.codex/config.toml: "
        f"{repo}/.codex/config.toml:1:9: "
    )
    # No markers: the project is cwd alone, so the parent's .codex is not read.
    write_file(repo / ".codex" / "config.toml", 'model = "repo"\n')
    (repo / "sub").mkdir()
    write_file(
        home / "config.toml",
        f'project_root_markers = []\n[projects."{repo}/sub"]\ntrust_level = "trusted"\n',
    )
    assert len(ec.load_layers(str(repo / "sub"), str(home), str(system))[0].layers) == 2
    write_file(home / "config.toml", "project_root_markers = [1]\n")
    with pytest.raises(ec.ConfigLoadError, match=r"^project_root_markers must be an array"):
        ec.load_layers(str(repo), str(home), str(system))


def test_the_codex_home_is_not_a_project_layer(tmp_path: Path) -> None:
    home = tmp_path / ".codex"
    (tmp_path / ".git").mkdir()
    write_file(
        home / "config.toml", f'model = "user"\n[projects."{tmp_path}"]\ntrust_level = "trusted"\n'
    )
    config, _ = ec.load_layers(str(tmp_path), str(home), str(tmp_path / "etc"))
    assert [layer.source.split(" ")[0] for layer in config.layers] == ["system", "user"]


def test_a_worktree_is_trusted_through_its_main_checkout(tmp_path: Path) -> None:
    main = tmp_path / "main"
    (main / ".git" / "worktrees" / "wt").mkdir(parents=True)
    write_file(main / ".git" / "worktrees" / "wt" / "commondir", "../..\n")
    tree = tmp_path / "wt"
    write_file(tree / ".git", f"gitdir: {main}/.git/worktrees/wt\n")
    write_file(tree / ".codex" / "config.toml", 'model = "wt"\n')
    home = tmp_path / "home"
    write_file(home / "config.toml", f'[projects."{main}"]\ntrust_level = "trusted"\n')
    assert ec.find_repo_root(str(tree)) == str(main)
    config, _ = ec.load_layers(str(tree), str(home), str(tmp_path / "etc"))
    assert config.layers[-1].toml == {"model": "wt"}


def test_codex_home_errors(tmp_path: Path) -> None:
    assert ec.find_codex_home({"HOME": "/h"}) == "/h/.codex"
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    assert ec.find_codex_home({"CODEX_HOME": str(link)}) == str(tmp_path)
    missing = str(tmp_path / 'no "such"')
    with pytest.raises(ec.ConfigLoadError) as caught:
        ec.find_codex_home({"CODEX_HOME": missing})
    quoted = missing.replace('"', '\\"')
    assert str(caught.value) == f'CODEX_HOME points to "{quoted}", but that path does not exist'
    file = write_file(tmp_path / "file", "")
    with pytest.raises(ec.ConfigLoadError) as caught:
        ec.find_codex_home({"CODEX_HOME": str(file)})
    assert str(caught.value) == f'CODEX_HOME points to "{file}", but that path is not a directory'


def test_validation_order_and_texts() -> None:
    def params(cwd: str, config: Any, requirements: Any) -> ec.EnvironmentConfigReadParams:
        return ec.EnvironmentConfigReadParams(cwd, config, requirements)

    cases = [
        (params("rel", [], []), ec.NO_SELECTORS),
        (params("rel", [["a"], []], []), ec.EMPTY_SELECTOR),
        (params("rel", [], [[]]), ec.EMPTY_SELECTOR),
        (params("rel", [["a"]], []), "AbsolutePathBuf deserialized without a base path"),
        (params("file://host/x", [["a"]], []), "AbsolutePathBuf deserialized without a base path"),
    ]
    for value, message in cases:
        with pytest.raises(RpcError) as caught:
            ec.validate(value)
        assert (caught.value.code, caught.value.message) == (p.INVALID_PARAMS, message)
    assert ec.validate(params("file:///tmp/a%20b", [["a"]], [])) == "/tmp/a b"


# --- through the real server ------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_codex_request_with_layers_every_field(tmp_path: Path) -> None:
    home = tmp_path / "codex-home"
    work = tmp_path / "work dir"
    (work / ".git").mkdir(parents=True)
    write_file(
        home / "config.toml",
        'model = "gpt"\n[mcp_servers.docs]\nurl = "http://127.0.0.1:9/mcp"\n'
        f'[projects."{work}"]\ntrust_level = "trusted"\n',
    )
    write_file(
        work / ".codex" / "config.toml", '[mcp_servers.local]\ncommand = "tool"\nargs = ["-v"]\n'
    )
    async with serving(tmp_path) as server:
        info = server.last_init["environmentInfo"]  # type: ignore[attr-defined]
        assert info["capabilities"]["environmentConfigRead"] is True
        result = await server.call("environmentConfig/read", read_params(path_to_uri(str(work))))
    assert result == {
        "userHomeDir": path_to_uri(str(tmp_path / "user")),
        "codexHomeDir": path_to_uri(str(home)),
        "hostname": socket.gethostname(),
        "config": {
            "layers": [
                {
                    "source": f"user ({home}/config.toml)",
                    "baseDir": path_to_uri(str(home)),
                    "toml": '[mcp_servers.docs]\nurl = "http://127.0.0.1:9/mcp"\n',
                },
                {
                    "source": f"project ({work}/.codex/config.toml)",
                    "baseDir": path_to_uri(f"{work}/.codex"),
                    "toml": '[mcp_servers.local]\ncommand = "tool"\nargs = ["-v"]\n',
                },
            ],
            "cloudInsertionIndex": 0,
        },
        "requirements": {"layers": [], "cloudInsertionIndex": 0},
    }
    assert list(result) == ["userHomeDir", "codexHomeDir", "hostname", "config", "requirements"]


@pytest_twisted.ensureDeferred
async def test_missing_config_is_empty_layers_as_in_the_reference_trace(tmp_path: Path) -> None:
    (tmp_path / "codex-home").mkdir()
    async with serving(tmp_path) as server:
        result = await server.call("environmentConfig/read", read_params(str(tmp_path)))
    # What the reference answered Codex in the recorded trace.
    assert result["config"] == {"layers": [], "cloudInsertionIndex": 0}
    assert result["requirements"] == {"layers": [], "cloudInsertionIndex": 0}


@pytest_twisted.ensureDeferred
async def test_bad_params_are_precise_errors(tmp_path: Path) -> None:
    (tmp_path / "codex-home").mkdir()
    async with serving(tmp_path) as server:

        async def error(params: Any) -> Any:
            return (await server.request("environmentConfig/read", params))["error"]

        assert await error(read_params("/tmp", (), ())) == {
            "code": -32602,
            "message": "at least one config or requirements path is required",
        }
        assert await error(read_params("/tmp", (("a",), ()), ())) == {
            "code": -32602,
            "message": "TOML paths must contain at least one key segment",
        }
        relative = await error(read_params("work"))
        assert relative["code"] == -32602
        # The current dialect's text (codex exec-server 0.171.0's).
        assert relative["message"] == "invalid URI: relative URL without a base"
        assert relative["data"] == {"kind": "relativePath", "field": "cwd", "path": "work"}
        missing = await error({"cwd": "/tmp", "configPaths": [["a"]]})
        assert missing == {
            "code": -32602,
            "message": "missing field `requirementsPaths`",
        }
        wrong = await error({"cwd": "/tmp", "configPaths": [["a", 1]], "requirementsPaths": []})
        assert wrong == {
            "code": -32602,
            "message": "Expected `str`, got `int` - at `$.configPaths[0][1]`",
        }
        assert (await error(None))["code"] == -32602


@pytest_twisted.ensureDeferred
async def test_handshake_first(tmp_path: Path) -> None:
    async with serving(tmp_path, init=None) as server:
        error = (await server.request("environmentConfig/read", read_params("/tmp")))["error"]
        assert error == {
            "code": -32600,
            "message": "client must call initialize before using environment config methods",
        }
        await server.call("initialize", CODEX_INIT)
        error = (await server.request("environmentConfig/read", read_params("/tmp")))["error"]
        assert error["message"] == (
            "client must send initialized before using environment config methods"
        )


@pytest_twisted.ensureDeferred
async def test_unreadable_or_broken_config_and_a_missing_codex_home(tmp_path: Path) -> None:
    home = tmp_path / "codex-home"
    (home / "config.toml").mkdir(parents=True)
    async with serving(tmp_path) as server:
        error = (await server.request("environmentConfig/read", read_params("/tmp")))["error"]
        assert error == {
            "code": -32603,
            "message": "failed to load executor-local config: Failed to read config file "
            f"{home}/config.toml: Is a directory (os error 21)",
        }
        (home / "config.toml").rmdir()
        write_file(home / "config.toml", "[mcp_servers\n")
        error = (await server.request("environmentConfig/read", read_params("/tmp")))["error"]
        assert error["code"] == -32603
        assert error["message"].startswith(
            f"failed to load executor-local config: {home}/config.toml:1:"
        )
        write_file(home / "config.toml", 'model = "fixed"\n')
        assert (await server.call("environmentConfig/read", read_params("/tmp")))["config"][
            "layers"
        ] == []
    missing = tmp_path / "nowhere"
    async with serving(tmp_path, CODEX_HOME=str(missing)) as server:
        error = (await server.request("environmentConfig/read", read_params("/tmp")))["error"]
        assert error == {
            "code": -32603,
            "message": f'failed to find Codex home: CODEX_HOME points to "{missing}", '
            "but that path does not exist",
        }


@pytest_twisted.ensureDeferred
async def test_a_seed_client_is_not_offered_environment_info(tmp_path: Path) -> None:
    # Seed-era clients see the seed initialize (no environmentInfo, so no
    # capability), and never call the method; calling it anyway is answered.
    (tmp_path / "codex-home").mkdir()
    async with serving(tmp_path, init={"clientName": "seed"}) as server:
        assert "environmentInfo" not in server.last_init  # type: ignore[attr-defined]
        result = await server.call("environmentConfig/read", read_params(os.fspath(tmp_path)))
        assert result["config"] == {"layers": [], "cloudInsertionIndex": 0}


def test_undecodable_or_malformed_user_config(tmp_path: Path) -> None:
    home = tmp_path / "home"
    etc = str(tmp_path / "etc")
    home.mkdir()
    (home / "config.toml").write_bytes(b'model = "\xff"\n')
    with pytest.raises(ec.ConfigLoadError) as caught:
        ec.load_layers(str(tmp_path), str(home), etc)
    assert str(caught.value) == (
        f"Failed to read config file {home}/config.toml: stream did not contain valid UTF-8"
    )
    for text, message in [
        ("projects = 1\n", "invalid type for `projects`: expected a table"),
        ('[projects]\n"/x" = 2\n', "invalid type for `projects./x`: expected a table"),
        (
            '[projects."/x"]\ntrust_level = "maybe"\n',
            "unknown variant `maybe`, expected `trusted` or `untrusted`",
        ),
    ]:
        write_file(home / "config.toml", text)
        with pytest.raises(ec.ConfigLoadError) as caught:
            ec.load_layers(str(tmp_path), str(home), etc)
        assert str(caught.value) == message


def _load_in_thread(cwd: str, home: Path, etc: str) -> BaseException | None:
    """``load_layers``' error; fails (instead of hanging the test) if it blocks."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            ec.load_layers(cwd, str(home), etc)
            outcome.append(None)
        except BaseException as exc:  # handed to the test thread
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():
        # Release the blocked open(2) so the thread ends with the test.
        for fifo in home.glob("*.toml"):
            if fifo.is_fifo():
                os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
        worker.join(10)
        pytest.fail("reading the config blocked")
    return outcome[0]


def test_a_fifo_or_an_oversized_config_is_an_error_not_a_hang(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    etc = str(tmp_path / "etc")
    os.mkfifo(home / "config.toml")
    caught = _load_in_thread(str(tmp_path), home, etc)
    assert isinstance(caught, ec.ConfigLoadError)
    assert str(caught) == f"Failed to read config file {home}/config.toml: not a regular file"
    (home / "config.toml").unlink()
    # Bounded: at the limit it is read, one byte over it is refused unread.
    padding = "#" * (ec.MAX_CONFIG_BYTES - len('model = "x"\n') - 1) + "\n"
    (home / "config.toml").write_text('model = "x"\n' + padding)
    assert _load_in_thread(str(tmp_path), home, etc) is None
    (home / "config.toml").write_text('model = "x"\n' + padding + "\n")
    caught = _load_in_thread(str(tmp_path), home, etc)
    assert str(caught) == (
        f"Failed to read config file {home}/config.toml: "
        f"file exceeds the {ec.MAX_CONFIG_BYTES}-byte limit"
    )


@pytest_twisted.ensureDeferred
async def test_an_empty_home_is_the_password_database_home_in_both_answers(
    tmp_path: Path,
) -> None:
    # With HOME set but empty, environment/info reported file:/// while
    # environmentConfig/read reported the password database's home.
    (tmp_path / "codex-home").mkdir()
    async with serving(tmp_path, HOME="") as server:
        info = server.last_init["environmentInfo"]  # type: ignore[attr-defined]
        result = await server.call("environmentConfig/read", read_params(str(tmp_path)))
    home = path_to_uri(pwd.getpwuid(os.getuid()).pw_dir)
    assert info["userHomeDir"] == home
    assert result["userHomeDir"] == home
