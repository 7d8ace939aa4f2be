"""What fs/writeFile and fs/copy keep and refuse, through the real installed server (stdio).

- the atomic replacement keeps the old file's extended attributes: user
  attributes, the POSIX ACL with its named entries, file capabilities (set
  last: a write or chown clears them), with its mode, owner and group;
- ``fs/copy`` onto an existing FIFO is ``unsupportedFileType``;
- a ranged read at offset 2^63-1 is the documented empty result, and a
  write there that fails leaves no new empty file behind.
"""

from __future__ import annotations

import base64
import os
import struct
from pathlib import Path

from tests.support.raw_server import RawServer, handshaken_raw_server

__all__ = ["handshaken_raw_server"]  # the fixture ``server``, used by name

I64_MAX = 2**63 - 1


def _error(server: RawServer, method: str, params: dict[str, object]) -> dict[str, object]:
    request = server.request(method, params)
    message = server.read_message()
    assert message.get("id") == request, message
    assert "error" in message, message
    error: dict[str, object] = message["error"]
    return error


def _acl(*entries: tuple[int, int, int]) -> bytes:
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *entry) for entry in entries)


UNDEFINED = 0xFFFFFFFF
#: user::rw- user:1234:r-- group::r-- mask::rw- other::---
ACL = _acl(
    (0x01, 6, UNDEFINED),
    (0x02, 4, 1234),
    (0x04, 4, UNDEFINED),
    (0x10, 6, UNDEFINED),
    (0x20, 0, UNDEFINED),
)
#: VFS_CAP_REVISION_2 | effective, permitted CAP_NET_BIND_SERVICE.
CAPABILITY = struct.pack("<IIIII", 0x02000001, 1 << 10, 0, 0, 0)


def _attributes(path: Path) -> dict[str, bytes]:
    return {name: os.getxattr(path, name) for name in sorted(os.listxattr(path))}


def test_the_atomic_write_keeps_xattrs_the_acl_and_file_capabilities(
    server: RawServer, tmp_path: Path
) -> None:
    target = tmp_path / "tool"
    target.write_bytes(b"old contents")
    os.chown(target, 4321, 4322)
    os.chmod(target, 0o750)
    os.setxattr(target, "user.origin", b"downloaded")
    os.setxattr(target, "user.empty", b"")
    os.setxattr(target, "system.posix_acl_access", ACL)
    os.setxattr(target, "security.capability", CAPABILITY)
    before = os.stat(target)
    attributes = _attributes(target)
    assert set(attributes) >= {"user.origin", "system.posix_acl_access", "security.capability"}

    new = b"new contents, longer than the old ones"
    server.call("fs/writeFile", {"path": str(target), "dataBase64": base64.b64encode(new).decode()})

    after = os.stat(target)
    assert target.read_bytes() == new
    assert after.st_ino != before.st_ino  # replaced, not written in place
    assert (after.st_uid, after.st_gid, after.st_mode) == (
        before.st_uid,
        before.st_gid,
        before.st_mode,
    )
    assert _attributes(target) == attributes
    assert _temps(tmp_path) == []


def _temps(directory: Path) -> list[Path]:
    return list(directory.glob(".exec-server-*.tmp"))


def test_a_hard_linked_write_keeps_the_links_and_every_attribute(
    server: RawServer, tmp_path: Path
) -> None:
    target = tmp_path / "linked"
    target.write_bytes(b"x" * 100_000)
    os.link(target, tmp_path / "other")
    os.setxattr(target, "user.kept", b"yes")
    os.chmod(target, 0o640)
    new = b"short"
    server.call("fs/writeFile", {"path": str(target), "dataBase64": base64.b64encode(new).decode()})
    assert (tmp_path / "other").read_bytes() == new
    assert os.path.samefile(target, tmp_path / "other")
    assert os.getxattr(target, "user.kept") == b"yes"
    assert os.stat(target).st_mode & 0o7777 == 0o640
    assert _temps(tmp_path) == []
    assert list((tmp_path / "state" / "writes").glob("*.copy")) == []


def test_copy_onto_an_existing_fifo_is_unsupported_file_type(
    server: RawServer, tmp_path: Path
) -> None:
    source = tmp_path / "source"
    source.write_bytes(b"data")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    error = _error(server, "fs/copy", {"sourcePath": str(source), "destinationPath": str(fifo)})
    assert error == {
        "code": -32600,
        "message": "fs/copy only supports regular files, directories, and symlinks",
        "data": {"kind": "unsupportedFileType"},
    }
    assert fifo.is_fifo()


def test_a_ranged_read_at_the_largest_offset_is_empty(server: RawServer, tmp_path: Path) -> None:
    target = tmp_path / "small"
    target.write_bytes(b"0123456789")
    for offset in (I64_MAX, I64_MAX - 1, 2**62, 10, 11):
        result = server.call("fs/readFile", {"path": str(target), "offset": offset})
        assert result == {"dataBase64": "", "size": 10}, offset
        result = server.call("fs/readFile", {"path": str(target), "offset": offset, "length": 5})
        assert result == {"dataBase64": "", "size": 10}, offset


def test_a_failed_far_offset_write_leaves_no_new_file(server: RawServer, tmp_path: Path) -> None:
    target = tmp_path / "far"
    error = _error(
        server, "fs/writeFile", {"path": str(target), "dataBase64": "AAAA", "offset": I64_MAX}
    )
    assert error["code"] == -32603 or error["code"] == -32600, error
    assert not target.exists()
    # Through a dangling symlink: its would-be target is not left behind either.
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "made")
    _error(server, "fs/writeFile", {"path": str(link), "dataBase64": "AAAA", "offset": I64_MAX})
    assert link.is_symlink() and not (tmp_path / "made").exists()
    # An existing file is left as it was (its size too).
    target.write_bytes(b"keep")
    _error(server, "fs/writeFile", {"path": str(target), "dataBase64": "AAAA", "offset": I64_MAX})
    assert target.read_bytes() == b"keep"


def test_an_acl_the_directory_would_give_the_new_file_is_not_added(
    server: RawServer, tmp_path: Path
) -> None:
    """A default ACL on the directory: the replaced file keeps having none, as before."""
    directory = tmp_path / "with-default-acl"
    directory.mkdir()
    target = directory / "plain"
    target.write_bytes(b"old")
    os.chmod(target, 0o640)
    os.setxattr(directory, "system.posix_acl_default", ACL)
    assert "system.posix_acl_access" not in os.listxattr(target)
    server.call("fs/writeFile", {"path": str(target), "dataBase64": "bmV3"})
    assert target.read_bytes() == b"new"
    assert "system.posix_acl_access" not in os.listxattr(target)
    assert os.stat(target).st_mode & 0o7777 == 0o640
