"""The code under test is the installed package, not this checkout.

``.ci/run`` installs with ``pip install '.[test]'`` into a fresh virtual
environment and sets ``EXECSERVER_TEST_INSTALLED=1``: these tests then must
pass. In a development environment with an editable install they skip (the
"installed" code is the checkout there by design).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import execserver
from tests.support.harness import BIN, REPO_ROOT, console_script, server_env

REQUIRED = os.environ.get("EXECSERVER_TEST_INSTALLED") == "1"


def _editable() -> bool:
    text = importlib.metadata.distribution("exec-server").read_text("direct_url.json")
    return bool(text and json.loads(text).get("dir_info", {}).get("editable"))


def _from_checkout() -> bool:
    return Path(execserver.__file__ or "").resolve().is_relative_to(REPO_ROOT)


@pytest.fixture(autouse=True)
def _installed_copy_required() -> None:
    if not REQUIRED and (_from_checkout() or _editable()):
        pytest.skip(
            f"execserver comes from the checkout here ({execserver.__file__}: an editable "
            "install or the checkout on sys.path); set EXECSERVER_TEST_INSTALLED=1 to "
            "require an installed copy, as .ci/run does"
        )


def _site_packages() -> set[Path]:
    return {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")}


def _under_site_packages(path: str) -> bool:
    resolved = Path(path).resolve()
    return any(resolved.is_relative_to(site) for site in _site_packages())


def test_the_test_process_imports_the_installed_package() -> None:
    assert not _editable(), "EXECSERVER_TEST_INSTALLED=1 but exec-server is installed editable"
    assert execserver.__file__ is not None
    assert _under_site_packages(execserver.__file__), (
        f"pytest imported {execserver.__file__}, not the copy in {_site_packages()}"
    )
    assert not Path(execserver.__file__).resolve().is_relative_to(REPO_ROOT)


def test_the_servers_the_tests_start_import_the_installed_package(tmp_path: Path) -> None:
    # The harness runs the console scripts next to sys.executable with
    # server_env(); their interpreter must resolve `execserver` the same way.
    for name in ("exec-server", "exec-server-client", "twistd"):
        with open(console_script(name), "rb") as script:
            shebang = script.readline()
        interpreter = Path(os.fsdecode(shebang[2:].strip()))
        assert interpreter.parent == BIN, (name, shebang)
    found = subprocess.run(
        [
            sys.executable,
            "-c",
            "import execserver.transports, execserver.client; print(execserver.__file__)",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
        env=server_env(),
        cwd=tmp_path,
    ).stdout.strip()
    assert _under_site_packages(found), found


def test_every_module_and_data_file_of_the_checkout_is_installed() -> None:
    # A subpackage or data file left out of pyproject.toml's packaging lists
    # passes every other test if they import the checkout; not this one.
    installed = {str(f).replace(os.sep, "/") for f in importlib.metadata.files("exec-server") or []}
    wanted = {
        f"execserver/{p.relative_to(REPO_ROOT / 'execserver').as_posix()}"
        for p in (REPO_ROOT / "execserver").rglob("*")
        if p.is_file()
        and (p.suffix == ".py" or p.name == "py.typed")
        and "__pycache__" not in p.parts
    }
    wanted |= {f"twisted/plugins/{p.name}" for p in (REPO_ROOT / "twisted_plugins").glob("*.py")}
    missing = sorted(wanted - installed)
    assert not missing, f"not installed (check [tool.setuptools] in pyproject.toml): {missing}"


def test_twistd_finds_the_installed_plugin(tmp_path: Path) -> None:
    result = subprocess.run(
        [console_script("twistd"), "--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=server_env(),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "exec-server" in result.stdout
