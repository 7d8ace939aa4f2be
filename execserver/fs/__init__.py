"""The seven ``fs/*`` methods, with the reference's behaviour and error texts.

One concept per module:

- :mod:`~execserver.fs.paths`: paths (``..`` as the kernel resolves it) and
  the error mapping;
- :mod:`~execserver.fs.b64`: base64 of results and params, in slices;
- :mod:`~execserver.fs.ops`: the blocking operations (run on the pool);
- :mod:`~execserver.fs.local`: the rule for running small calls inline;
- :mod:`~execserver.fs.pool`: the bounded worker pool;
- :mod:`~execserver.fs.budget`: the reply budget;
- :mod:`~execserver.fs.handlers`: the handlers and their routes.

The package imports nothing of the dispatcher (:class:`handlers.Router` is
what it needs of one), so the dispatcher imports it without a cycle.
"""

from execserver.fs.b64 import (
    B64_SLICE,
    rust_base64_error,
)
from execserver.fs.budget import Charge, Charged, ReplyBudget
from execserver.fs.handlers import FileSystem, ReadFileWire, WriteFileWire, register
from execserver.fs.ops import (
    SMALL_READ_BYTES,
    ReadRange,
    copy,
    create_directory,
    encoded_result_size,
    get_metadata,
    read_directory,
    read_file,
    removal_target,
    remove,
    stat_for_read,
    write_file,
    write_range,
)
from execserver.fs.paths import (
    BUSY_KIND,
    FAMILY,
    ROOT_MESSAGE,
    absolute_path,
    created_at_ms,
    os_error,
    resolve_path,
)
from execserver.fs.pool import FS_THREADS, PoolRunner, Runner, inline_runner, thread_pool_runner

__all__ = [
    "B64_SLICE",
    "BUSY_KIND",
    "FAMILY",
    "FS_THREADS",
    "ROOT_MESSAGE",
    "SMALL_READ_BYTES",
    "Charge",
    "Charged",
    "FileSystem",
    "PoolRunner",
    "ReadFileWire",
    "ReadRange",
    "ReplyBudget",
    "Runner",
    "WriteFileWire",
    "absolute_path",
    "copy",
    "create_directory",
    "created_at_ms",
    "encoded_result_size",
    "get_metadata",
    "inline_runner",
    "os_error",
    "read_directory",
    "read_file",
    "register",
    "removal_target",
    "remove",
    "resolve_path",
    "rust_base64_error",
    "stat_for_read",
    "thread_pool_runner",
    "write_file",
    "write_range",
]
