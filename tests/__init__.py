"""The test suite; shared helpers live in ``tests/support/``, the Codex CLI's
helper processes in ``tests/codex/``.
"""
