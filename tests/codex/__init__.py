"""Helper processes for the Codex CLI tests: the binary's fetcher and the fake
model it talks to (run as ``python -m tests.codex.*``).
"""
