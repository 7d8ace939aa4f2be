"""``process/start`` under a sandbox: the profile asked for, the floor, the wrapped command.

The session calls :func:`confine` with the start's ``sandbox`` (any form
:mod:`execserver.sandbox.policy` resolves) and its validated spec: the
policy is resolved against the start's ``cwd`` and environment, confined at
least to the operator's floor (``--sandbox-floor``), and, when it confines,
the spec is rewritten by the :class:`SandboxEngine` to run under bubblewrap
or Landlock; where neither works the start is refused (``-32602``, naming
what is missing). A process is never started less confined than asked.
"""

from __future__ import annotations

from typing import Any

from execserver.errors import RpcError
from execserver.processes import ManagedProcess
from execserver.sandbox import denied
from execserver.sandbox.engine import CANNOT_ENFORCE, SANDBOX_TYPE, SandboxEngine
from execserver.sandbox.policy import apply_floor, resolve
from execserver.spawn import ProcessSpec


def confine(
    engine: SandboxEngine | None, sandbox: Any, spec: ProcessSpec
) -> tuple[ProcessSpec, bool]:
    """``spec`` as it must run for ``sandbox``, and whether it is confined."""
    floor = engine.floor if engine is not None else None
    if sandbox is None and floor is None:
        return spec, False
    policy = resolve(sandbox, cwd=spec.cwd, env=spec.env)
    policy = apply_floor(policy, floor)
    if not policy.confined:
        return spec, False
    if engine is None:
        raise RpcError.invalid_params(f"{CANNOT_ENFORCE}: this server has no sandbox")
    legacy = bool(getattr(sandbox, "use_legacy_landlock", False))
    return engine.wrap(spec, policy, legacy), True


def likely_denied(proc: ManagedProcess) -> bool:
    """Whether the sandbox probably stopped ``proc`` (see :mod:`execserver.sandbox.denied`)."""
    read = proc.output.read(0, None)
    return denied.likely_denied(
        proc.exit_code, proc.timed_out is not None, (chunk.data for chunk in read.chunks)
    )


__all__ = ["SANDBOX_TYPE", "SandboxEngine", "confine", "likely_denied"]
