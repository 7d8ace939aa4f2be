"""Shared test helpers: the only modules test modules import from each other.

Test modules (``test_*.py``) never import each other: what two of them share
lives here.

Servers and processes
- ``server_process``: ``ServerProcessBase``, the base of every server a test
  starts (launch, stderr kept, exit recorded, teardown checks, kill and reap).
- ``stdio_server``: the real server over stdio (``ServerProcess``).
- ``ws_harness``: the real server on WebSocket addresses (``WsServerProcess``),
  a test WebSocket client, raw HTTP requests, another client's timed output.
- ``raw_server``: the real server over blocking pipes (``RawServer``) and a
  handshaken ``server`` fixture of it.
- ``server_checks``: the teardown checks ``conftest.py`` applies to each server.
- ``children``: non-server child processes, their output collected.
- ``cli``: ``exec-server-client`` runs (``Cli``, ``run``).
- ``harness``: paths, environments, ``with_timeout`` / ``observe``, ``b64``,
  /proc probes (pids, RSS), the JSON-RPC bookkeeping of the test clients.

Waiting
- ``polling``: ``until`` / ``until_asyncio`` / ``until_blocking``, the one
  bounded poll for conditions that raise no event.
- ``aio_harness``: running asyncio client code from the Twisted-driven suite.

Scenarios shared by several test modules
- ``escapees``: processes that try to escape containment, and their checks.
- ``sandbox``: the sandbox tests' directories, profiles and stdio server.
- ``races``: a symlink swapped under a path by a thread.
- ``streams``: a known output stream, cut points in it, a reconnecting client.
- ``resume_handshake``: ``initialize`` as the resume tests send it.
- ``auth``: bearer-token files and tokens; waiting for a reload on stderr.
- ``tls``: a test PKI and the server on ``wss://``.
- ``fs_checks``: fs/* checks run over stdio and WebSocket alike.
- ``fs_stalls``: a FIFO held open that nobody writes; ``/metrics`` gauges.
- ``metrics_probe``: idle TCP connections; waiting for a ``/metrics`` counter.
- ``ws_wire``: the WebSocket transport in-process (fake clock, raw frames).
- ``codex_session`` / ``codex_config`` / ``codex_cli``: the Codex dialect's
  handshake, environment configuration files, and the real Codex CLI.

Fakes and data
- ``client_fakes``: scripted and local fake servers for the client tests.
- ``client_adapters``: one interface over the three client libraries and the CLI.
- ``cutting_proxy``: a TCP proxy that cuts or stalls connections.
- ``fakes``: recording fakes for unit tests of the dispatcher and session.
- ``bounds``: the documented figures the tests assert.
- ``fuzz_target``: the codec and dispatcher fuzz target.

The old top-level paths (``tests/harness.py``, ``tests/ws_harness.py``, ...)
are transitional re-exports for the wave that moved them here.
"""
