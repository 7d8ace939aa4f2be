"""The operator's floor (``--sandbox-floor``) as a policy of the profile language."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from execserver.sandbox.policy import SandboxPolicy

FLOOR_MODES: Final = ("read-only", "workspace-write")


def floor_policy(mode: str, writable_roots: Sequence[str], network: bool) -> SandboxPolicy:
    """The policy of ``--sandbox-floor MODE [--floor-writable-root DIR]... [--floor-no-network]``.

    Built through the additive mode form (``readOnly``/``workspaceWrite``)
    so it means exactly what a client asking for it gets; workspace-write
    roots get the default read-only carve-outs (``.git``, ``.codex``,
    ``.agents``) of the profile language.
    """
    from execserver import protocol as p
    from execserver.sandbox.policy import resolve

    if mode == "read-only":
        wire = p.SandboxConfig(mode="readOnly", network=network)
    else:
        wire = p.SandboxConfig(
            mode="workspaceWrite", writable_roots=list(writable_roots), network=network
        )
    return resolve(wire, cwd="/", env={})
