"""``exec-server --check-sandbox``: what confinement works on this host."""

from __future__ import annotations

from typing import Any

from execserver.containment import limits_report
from execserver.sandbox.engine import SandboxEngine


def check_sandbox(options: Any) -> int:
    """Print each mechanism's state, the one a server would use, and which
    resource limits it can enforce; 0 if a sandbox mechanism works."""
    engine: SandboxEngine = options.sandbox()
    engine.start()
    try:
        assert engine.support is not None
        for line in engine.support.lines():
            print(line)
        for line in limits_report(options["process-containment"]):
            print(f"limits:           {line}")
        if engine.mechanism is None:
            print(f"mechanism:        none ({engine.unavailable()})")
            return 1
        chosen = f"--sandbox-mechanism {engine.requested}"
        print(f"mechanism:        {engine.describe()} + seccomp ({chosen})")
        return 0
    finally:
        engine.stop()
