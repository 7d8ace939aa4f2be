"""A blocking exec-server client for scripts and notebooks.

Built on :mod:`execserver.aio` running in one background event-loop thread
(started by the first client, stopped when the last one closes), and safe
to use from several threads at once::

    from execserver.sync import connect

    with connect() as client:  # a local server over stdio; or "ws://host:port"
        result = client.run(["make", "test"], timeout=600)
        print(result.exit_code, result.stdout.decode())

See docs/client.md for the three clients side by side.
"""

from execserver.sync.client import DEFAULT_CALL_TIMEOUT, Client, Process, connect

__all__ = ["DEFAULT_CALL_TIMEOUT", "Client", "Process", "connect"]
