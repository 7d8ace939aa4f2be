"""Nothing process-wide happens because a module was imported or a service built.

Only the composition roots (``service.makeService``, ``cli.main``) import the
global reactor; the process-wide settings happen in ``startService``.
"""

from __future__ import annotations

import subprocess
import sys

from tests.support.harness import server_env

IMPORT_EVERY_MODULE = """
import importlib, pkgutil, sys
import execserver
names = [
    m.name for m in pkgutil.walk_packages(execserver.__path__, "execserver.")
    if not m.name.endswith("__main__")
]
for name in names:
    importlib.import_module(name)
    assert "twisted.internet.reactor" not in sys.modules, f"importing {name} installed the reactor"
print(len(names))
"""

BUILD_A_SERVICE = """
import os, resource, sys
inherited = os.dup(0)
os.set_inheritable(inherited, True)
before = (os.fstat(1), resource.getrlimit(resource.RLIMIT_NOFILE), sys.stdout)
from twisted.internet.epollreactor import EPollReactor
from execserver.service import Options, build_service
options = Options()
options.parseOptions(["--listen", "stdio://", "--listen", "ws://127.0.0.1:0"])
service = build_service(options, EPollReactor())  # a reactor object, not installed
after = (os.fstat(1), resource.getrlimit(resource.RLIMIT_NOFILE), sys.stdout)
assert before == after, (before, after)
assert os.get_inheritable(inherited), "an inherited descriptor was sealed"
assert "twisted.internet.reactor" not in sys.modules
print("ok")
"""


def run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=server_env(),
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_no_module_of_the_package_installs_the_global_reactor() -> None:
    assert int(run(IMPORT_EVERY_MODULE)) > 30


def test_building_a_service_changes_nothing_process_wide() -> None:
    assert run(BUILD_A_SERVICE).strip() == "ok"
