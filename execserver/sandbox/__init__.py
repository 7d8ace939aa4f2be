"""Confinement of processes and fs/* calls: the sandbox a client asks for.

``policy`` turns the wire's ``sandbox`` (the seed's ``mode`` form, our
additive ``readOnly``/``workspaceWrite`` modes, or the current reference's
permission profile) into one immutable :class:`~execserver.sandbox.policy.SandboxPolicy`
that the process side and the fs side both enforce; ``fsguard`` enforces it
on fs/* calls.
"""
