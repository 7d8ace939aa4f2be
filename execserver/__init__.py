"""exec-server: run and steer processes and touch files over JSON-RPC."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("exec-server")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.1.0"
