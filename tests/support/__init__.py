"""Shared test helpers: the only modules test modules import from each other.

- ``server_process``: the base of every server a test starts (the installed
  console script, its stderr captured, teardown checks, kill and reap).
- ``harness``: paths, environments, ``with_timeout``, /proc probes, and the
  real server over stdio (``ServerProcess``).
- ``ws_harness``: the real server on WebSocket addresses (``WsServerProcess``),
  a test WebSocket client, raw HTTP requests.
- ``raw_server``: the real server over blocking pipes (``RawServer``).
- ``server_checks``: the teardown checks ``conftest.py`` applies to each server.
- ``polling``: ``until`` / ``until_blocking`` / ``until_asyncio``, the one
  bounded poll for conditions that raise no event.
- ``aio_harness``: running asyncio client code from the Twisted-driven suite.
- ``client_fakes``: scripted and local fake servers for the client tests.
- ``client_adapters``: one interface over the three client libraries and the CLI.
- ``cutting_proxy``: a TCP proxy that cuts or stalls connections.
- ``fakes``: recording fakes for unit tests of the dispatcher and session.
- ``bounds``: the documented figures the tests assert.
- ``fuzz_target``: the codec and dispatcher fuzz target.

Test modules (``test_*.py``) never import each other: what two of them share
lives here.
"""
