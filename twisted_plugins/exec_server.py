# A twistd plugin: one ServiceMaker line; the real module is imported lazily,
# after twistd has chosen the reactor. No __init__.py belongs in this folder.
from twisted.application.service import ServiceMaker

execServer = ServiceMaker(
    "exec-server",
    "execserver.service",
    "Remote execution server: JSON-RPC over stdio and WebSocket",
    "exec-server",
)
