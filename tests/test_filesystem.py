"""fs/* units: routing and handshake gate over the in-memory dispatcher, the
blocking operations on a real temporary directory, and hypothesis properties
(writeFile -> readFile round trips, copied trees compare equal, base64 errors).

The in-memory dispatcher is built on a fake clock, so the fs operations run
inline and every request is answered synchronously.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import os
import stat
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_twisted
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import Deferred

from execserver import fs
from execserver import protocol as p
from execserver.config import ServerConfig
from execserver.errors import RpcError
from execserver.fs.b64 import B64_SLICE, decoded_pieces, validate
from execserver.fs.ops import read_file
from tests.support.fakes import Harness, ready
from tests.support.harness import b64, with_timeout

FS_METHODS = [
    ("fs/readFile", {"path": "/"}),
    ("fs/writeFile", {"path": "/x", "dataBase64": ""}),
    ("fs/createDirectory", {"path": "/x"}),
    ("fs/getMetadata", {"path": "/"}),
    ("fs/readDirectory", {"path": "/"}),
    ("fs/remove", {"path": "/x"}),
    ("fs/copy", {"sourcePath": "/x", "destinationPath": "/y", "recursive": False}),
]


@pytest.fixture
def tmp(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    # Make everything removable again for pytest's cleanup.
    for root, dirs, _files in os.walk(tmp_path):
        for name in dirs:
            full = os.path.join(root, name)
            if not os.path.islink(full):
                os.chmod(full, 0o755)


# --- routing (the reference's routing and handshake tests, for fs/*) -----------


@pytest.mark.parametrize(("method", "params"), FS_METHODS)
def test_fs_methods_are_routed_and_gated_before_initialize(
    method: str, params: dict[str, Any]
) -> None:
    h = Harness()
    error = h.error(method, params)
    assert error == {
        "code": -32600,
        "message": "client must call initialize before using filesystem methods",
    }


@pytest.mark.parametrize(("method", "params"), FS_METHODS)
def test_fs_methods_require_initialized_notification(method: str, params: dict[str, Any]) -> None:
    h = Harness()
    h.result("initialize", {"clientName": "test"})
    error = h.error(method, params)
    assert error == {
        "code": -32600,
        "message": "client must send initialized before using filesystem methods",
    }


@pytest.mark.parametrize(("method", "params"), FS_METHODS)
def test_fs_params_are_validated_before_the_handshake(method: str, params: dict[str, Any]) -> None:
    h = Harness()
    error = h.error(method, {"unrelated": 1})
    assert error["code"] == -32602
    assert "missing required field" in error["message"]


@pytest.mark.parametrize(("method", "params"), FS_METHODS)
def test_relative_paths_are_invalid_params(method: str, params: dict[str, Any]) -> None:
    h = ready()
    bad = {k: ("relative/path" if k.endswith("ath") else v) for k, v in params.items()}
    error = h.error(method, bad)
    assert error["code"] == -32602
    assert error["message"] == "AbsolutePathBuf deserialized without a base path"
    assert error["data"]["kind"] == "relativePath"


def test_unknown_fs_method_is_the_baseline_error() -> None:
    h = ready()
    assert h.error("fs/rename", {"path": "/"}) == {
        "code": -32600,
        "message": "unknown method: fs/rename",
    }


def test_camel_case_params_decode_into_typed_structs() -> None:
    params = msgspec.json.decode(
        b'{"sourcePath":"/a","destinationPath":"/b","recursive":true}', type=p.FsCopyParams
    )
    assert params == p.FsCopyParams("/a", "/b", True)
    assert msgspec.json.decode(b'{"sourcePath":"/a","destinationPath":"/b"}', type=p.FsCopyParams)
    created = msgspec.json.decode(b'{"path":"/a"}', type=p.FsCreateDirectoryParams)
    assert created.recursive is None
    removed = msgspec.json.decode(b'{"path":"/a"}', type=p.FsRemoveParams)
    assert (removed.recursive, removed.force) == (None, None)


def test_baseline_metadata_shape_with_additive_fields() -> None:
    encoded = msgspec.json.decode(msgspec.json.encode(p.FsGetMetadataResponse(True, False, 1, 2)))
    assert encoded == {"isDirectory": True, "isFile": False, "createdAtMs": 1, "modifiedAtMs": 2}


# --- paths ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given_path", "normalised"),
    [
        ("/", "/"),
        ("/a/b", "/a/b"),
        ("/a/./b/", "/a/b"),
        ("//a//b", "/a/b"),
        ("/a/b/../c", "/a/b/../c"),
        ("/../..", "/"),
        ("/../a/./..", "/a/.."),
    ],
)
def test_dot_and_empty_components_are_dropped_and_dotdot_is_kept(
    given_path: str, normalised: str
) -> None:
    # ``..`` is resolved on the pool as the kernel does (tests/test_fs_safety.py).
    assert fs.absolute_path(given_path) == normalised


def test_nul_in_path_is_invalid_input() -> None:
    with pytest.raises(RpcError) as info:
        fs.absolute_path("/a\0b")
    assert info.value.code == -32600
    assert info.value.message == "file name contained an unexpected NUL byte"


# --- errors ---------------------------------------------------------------------


def test_os_errors_read_like_rust() -> None:
    error = fs.os_error(FileNotFoundError(errno.ENOENT, "whatever"))
    assert (error.code, error.message) == (-32603, "No such file or directory (os error 2)")
    assert error.data == {"kind": "notFound", "errno": 2}
    error = fs.os_error(OSError(errno.EINVAL, "x"))
    assert (error.code, error.data["kind"]) == (-32600, "invalidInput")
    assert fs.os_error(OSError(errno.ENOSPC, "x")).data == {"kind": "noSpace", "errno": 28}
    error = fs.os_error(OSError(errno.EMFILE, "x"))
    assert (error.code, error.message) == (-32603, "Too many open files (os error 24)")
    assert error.data == {"kind": "tooManyOpenFiles", "errno": 24}


# --- readFile / writeFile -------------------------------------------------------


def test_write_then_read(tmp: Path) -> None:
    h = ready()
    target = tmp / "note.txt"
    assert h.result("fs/writeFile", {"path": str(target), "dataBase64": b64(b"hello")}) == {}
    assert target.read_bytes() == b"hello"
    assert h.result("fs/readFile", {"path": str(target)}) == {"dataBase64": b64(b"hello")}


def test_read_response_is_what_msgspec_would_render(tmp: Path) -> None:
    for size in (0, 1, 2, 3, 4, B64_SLICE - 1, B64_SLICE + 1):
        data = os.urandom(size)
        expected = msgspec.json.encode(p.FsReadFileResponse(data))
        (tmp / "f").write_bytes(data)
        assert b"".join(read_file(str(tmp / "f"), size).parts) == expected


def test_read_limit_and_non_regular_files(tmp: Path) -> None:
    h = ready(ServerConfig(max_read_file_bytes=4))
    (tmp / "big").write_bytes(b"12345")
    (tmp / "ok").write_bytes(b"1234")
    error = h.error("fs/readFile", {"path": str(tmp / "big")})
    assert error["code"] == -32600
    assert error["message"] == "file is too large to read: limit is 4 bytes"
    assert error["data"] == {"kind": "fileTooLarge"}
    assert h.result("fs/readFile", {"path": str(tmp / "ok")}) == {"dataBase64": b64(b"1234")}
    os.mkfifo(tmp / "fifo")
    error = h.error("fs/readFile", {"path": str(tmp / "fifo")})
    assert (error["code"], error["data"]["kind"]) == (-32600, "notRegularFile")
    error = h.error("fs/readFile", {"path": str(tmp)})
    assert error == {
        "code": -32603,
        "message": "Is a directory (os error 21)",
        "data": {"kind": "isADirectory", "errno": 21},
    }
    error = h.error("fs/readFile", {"path": str(tmp / "missing")})
    assert error["message"] == "No such file or directory (os error 2)"


def test_read_files_whose_size_is_not_known_up_front() -> None:
    h = ready()
    data = base64.b64decode(h.result("fs/readFile", {"path": "/proc/self/status"})["dataBase64"])
    assert b"Pid:" in data


@pytest.mark.parametrize(
    ("text", "detail"),
    [
        ("@", "Invalid symbol 64, offset 0."),
        ("YQ", "Invalid padding"),
        ("YQ=", "Invalid padding"),
        ("YR==", "Invalid last symbol 82, offset 1."),
        ("=YQ=", "Invalid symbol 61, offset 0."),
        ("YWJj\n", "Invalid symbol 10, offset 4."),
        ("YW Jj", "Invalid symbol 32, offset 2."),
    ],
)
def test_invalid_base64_is_refused_with_the_reference_text(
    tmp: Path, text: str, detail: str
) -> None:
    h = ready()
    error = h.error("fs/writeFile", {"path": str(tmp / "f"), "dataBase64": text})
    assert error["code"] == -32600
    assert error["message"] == f"fs/writeFile requires valid base64 dataBase64: {detail}"
    assert error["data"] == {"kind": "invalidBase64"}
    assert not (tmp / "f").exists()


def test_data_base64_of_the_wrong_type_is_invalid_params(tmp: Path) -> None:
    h = ready()
    error = h.error("fs/writeFile", {"path": str(tmp / "f"), "dataBase64": 12})
    assert error["code"] == -32602
    assert "$.dataBase64" in error["message"]


def test_json_escapes_in_base64_are_understood(tmp: Path) -> None:
    h = ready()
    line = b'{"id":9,"method":"fs/writeFile","params":{"path":"%s","dataBase64":"YW\\/j"}}' % (
        str(tmp / "f").encode()
    )
    h.conn.message_received(line)
    assert h.response(9) == {"id": 9, "result": {}}
    assert (tmp / "f").read_bytes() == base64.b64decode("YW/j")


def test_write_keeps_mode_and_replaces_atomically(tmp: Path) -> None:
    h = ready()
    target = tmp / "script.sh"
    target.write_bytes(b"old")
    target.chmod(0o751)
    before = target.stat().st_ino
    h.result("fs/writeFile", {"path": str(target), "dataBase64": b64(b"new")})
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o751
    assert target.stat().st_ino != before  # a new inode was renamed into place
    assert sorted(os.listdir(tmp)) == ["script.sh"]  # no temporary file left


def test_write_through_hard_links_keeps_them_linked(tmp: Path) -> None:
    h = ready()
    (tmp / "a").write_bytes(b"old")
    os.link(tmp / "a", tmp / "b")
    h.result("fs/writeFile", {"path": str(tmp / "a"), "dataBase64": b64(b"new")})
    assert (tmp / "b").read_bytes() == b"new"
    assert (tmp / "a").stat().st_ino == (tmp / "b").stat().st_ino


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file away")
def test_write_keeps_owner_and_group(tmp: Path) -> None:
    h = ready()
    target = tmp / "theirs"
    target.write_bytes(b"old")
    os.chown(target, 4321, 4322)
    target.chmod(0o2750)
    h.result("fs/writeFile", {"path": str(target), "dataBase64": b64(b"new")})
    st_ = target.stat()
    assert (st_.st_uid, st_.st_gid, stat.S_IMODE(st_.st_mode)) == (4321, 4322, 0o2750)
    assert target.read_bytes() == b"new"


def test_write_in_place_when_the_owner_cannot_be_kept(tmp: Path, monkeypatch: Any) -> None:
    h = ready()
    target = tmp / "theirs"
    target.write_bytes(b"old")
    inode = target.stat().st_ino

    def refuse(fd: int, uid: int, gid: int) -> None:
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr("execserver.fs.ops.os.fchown", refuse)
    real_fstat = os.fstat

    def fstat_as_other_owner(fd: int) -> os.stat_result:
        result = real_fstat(fd)
        fields = list(result)
        fields[4] = result.st_uid + 1  # the temporary file would be ours, not theirs
        return os.stat_result(fields)

    monkeypatch.setattr("execserver.fs.ops.os.fstat", fstat_as_other_owner)
    h.result("fs/writeFile", {"path": str(target), "dataBase64": b64(b"new")})
    monkeypatch.undo()
    assert target.read_bytes() == b"new"
    assert target.stat().st_ino == inode
    assert os.listdir(tmp) == ["theirs"]


def test_write_new_file_gets_umask_mode(tmp: Path) -> None:
    h = ready()
    h.result("fs/writeFile", {"path": str(tmp / "new"), "dataBase64": ""})
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE((tmp / "new").stat().st_mode) == 0o666 & ~umask


def test_write_follows_a_symlink_and_replaces_its_target(tmp: Path) -> None:
    h = ready()
    (tmp / "real").write_bytes(b"old")
    (tmp / "link").symlink_to("real")
    h.result("fs/writeFile", {"path": str(tmp / "link"), "dataBase64": b64(b"new")})
    assert (tmp / "link").is_symlink()
    assert (tmp / "real").read_bytes() == b"new"
    (tmp / "dangling").symlink_to("created")
    h.result("fs/writeFile", {"path": str(tmp / "dangling"), "dataBase64": b64(b"x")})
    assert (tmp / "created").read_bytes() == b"x"


def test_write_errors(tmp: Path) -> None:
    h = ready()
    error = h.error("fs/writeFile", {"path": str(tmp / "no" / "parent"), "dataBase64": ""})
    assert error["message"] == "No such file or directory (os error 2)"
    assert error["data"] == {"kind": "notFound", "errno": 2}
    error = h.error("fs/writeFile", {"path": str(tmp), "dataBase64": ""})
    assert error["data"] == {"kind": "isADirectory", "errno": 21}


@contextlib.contextmanager
def _no_new_entries(directory: Path) -> Iterator[int]:
    """A directory nobody can create entries in; yields the errno a creation gets.

    Root ignores permission bits, so as root the directory is made
    immutable (``chattr +i``: no entry can be added, even by root, while
    the files already in it stay writable); otherwise it is made read-only.
    """
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            yield errno.EACCES
        finally:
            directory.chmod(0o755)
        return
    subprocess.run(["chattr", "+i", str(directory)], check=True, timeout=30)
    try:
        yield errno.EPERM
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=True, timeout=30)


def test_write_into_a_read_only_directory_falls_back_to_in_place(tmp: Path) -> None:
    h = ready()
    locked = tmp / "locked"
    locked.mkdir()
    (locked / "f").write_bytes(b"old contents")
    with _no_new_entries(locked) as refused:
        h.result("fs/writeFile", {"path": str(locked / "f"), "dataBase64": b64(b"new")})
        assert (locked / "f").read_bytes() == b"new"
        error = h.error("fs/writeFile", {"path": str(locked / "g"), "dataBase64": ""})
    assert error["data"] == {"kind": "permissionDenied", "errno": refused}


def test_unwritable_directory_falls_back_to_truncate_and_write(tmp: Path, monkeypatch: Any) -> None:
    """Where no temporary file can be created, the file is rewritten in place."""
    h = ready()
    target = tmp / "f"
    target.write_bytes(b"old contents")
    real_open = os.open

    def no_temp_files(path: Any, flags: int, mode: int = 0o777) -> int:
        if ".exec-server-" in str(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return real_open(path, flags, mode)

    monkeypatch.setattr("execserver.fs.ops.os.open", no_temp_files)
    inode = target.stat().st_ino
    h.result("fs/writeFile", {"path": str(target), "dataBase64": b64(b"new")})
    monkeypatch.undo()
    assert target.read_bytes() == b"new"
    assert target.stat().st_ino == inode


def test_a_failed_write_leaves_the_old_contents(tmp: Path, monkeypatch: Any) -> None:
    h = ready()
    target = tmp / "f"
    target.write_bytes(b"precious")

    def failing_write(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("execserver.fs.ops.os.write", failing_write)
    error = h.error("fs/writeFile", {"path": str(target), "dataBase64": b64(b"x" * 100)})
    monkeypatch.undo()
    assert error == {
        "code": -32603,
        "message": "No space left on device (os error 28)",
        "data": {"kind": "noSpace", "errno": 28},
    }
    assert target.read_bytes() == b"precious"
    assert os.listdir(tmp) == ["f"]


def test_write_to_a_fifo_is_refused_and_never_opened(tmp: Path) -> None:
    h = ready()
    os.mkfifo(tmp / "fifo")
    error = h.error("fs/writeFile", {"path": str(tmp / "fifo"), "dataBase64": ""})
    assert error == {
        "code": -32600,
        "message": "fs/writeFile only supports regular files",
        "data": {"kind": "notRegularFile"},
    }
    assert stat.S_ISFIFO((tmp / "fifo").lstat().st_mode)


# --- createDirectory / getMetadata / readDirectory / remove ---------------------


def test_create_directory(tmp: Path) -> None:
    h = ready()
    assert h.result("fs/createDirectory", {"path": str(tmp / "a" / "b")}) == {}
    assert (tmp / "a" / "b").is_dir()
    assert h.result("fs/createDirectory", {"path": str(tmp / "a" / "b")}) == {}
    error = h.error("fs/createDirectory", {"path": str(tmp / "x" / "y"), "recursive": False})
    assert error["data"] == {"kind": "notFound", "errno": 2}
    error = h.error("fs/createDirectory", {"path": str(tmp / "a"), "recursive": False})
    assert error["message"] == "File exists (os error 17)"
    assert error["data"] == {"kind": "alreadyExists", "errno": 17}
    (tmp / "file").write_bytes(b"")
    error = h.error("fs/createDirectory", {"path": str(tmp / "file")})
    assert error["data"]["kind"] == "alreadyExists"
    error = h.error("fs/createDirectory", {"path": str(tmp / "file" / "sub")})
    assert error["data"] == {"kind": "notADirectory", "errno": 20}


def test_get_metadata(tmp: Path) -> None:
    h = ready()
    (tmp / "f").write_bytes(b"12345")
    (tmp / "link").symlink_to("f")
    meta = h.result("fs/getMetadata", {"path": str(tmp / "f")})
    mtime_ms = (tmp / "f").stat().st_mtime_ns // 1_000_000
    assert meta["isFile"] is True and meta["isDirectory"] is False
    assert meta["modifiedAtMs"] == mtime_ms
    assert meta["createdAtMs"] >= 0
    assert (meta["isSymlink"], meta["size"]) == (False, 5)
    meta = h.result("fs/getMetadata", {"path": str(tmp / "link")})
    assert (meta["isFile"], meta["isSymlink"], meta["size"]) == (True, True, 5)
    meta = h.result("fs/getMetadata", {"path": str(tmp)})
    assert (meta["isDirectory"], meta["isFile"]) == (True, False)
    error = h.error("fs/getMetadata", {"path": str(tmp / "missing")})
    assert error["data"] == {"kind": "notFound", "errno": 2}


def test_read_directory(tmp: Path) -> None:
    h = ready()
    (tmp / "f").write_bytes(b"")
    (tmp / "d").mkdir()
    (tmp / "to-dir").symlink_to("d")
    (tmp / "dangling").symlink_to("nowhere")
    result = h.result("fs/readDirectory", {"path": str(tmp)})
    entries = {e["fileName"]: e for e in result["entries"]}
    assert entries["f"] == {
        "fileName": "f",
        "isDirectory": False,
        "isFile": True,
        "isSymlink": False,
    }
    assert entries["d"]["isDirectory"] is True
    assert (entries["to-dir"]["isDirectory"], entries["to-dir"]["isSymlink"]) == (True, True)
    assert entries["dangling"] == {
        "fileName": "dangling",
        "isDirectory": False,
        "isFile": False,
        "isSymlink": True,
    }
    error = h.error("fs/readDirectory", {"path": str(tmp / "f")})
    assert error["data"] == {"kind": "notADirectory", "errno": 20}


def test_read_directory_reports_undecodable_names_lossily(tmp: Path) -> None:
    h = ready()
    with open(os.path.join(os.fsencode(tmp), b"bad\xffname"), "wb"):
        pass
    result = h.result("fs/readDirectory", {"path": str(tmp)})
    assert [e["fileName"] for e in result["entries"]] == ["bad\ufffdname"]


def test_remove(tmp: Path) -> None:
    h = ready()
    (tmp / "d" / "e").mkdir(parents=True)
    (tmp / "d" / "e" / "f").write_bytes(b"")
    (tmp / "target").mkdir()
    (tmp / "target" / "keep").write_bytes(b"")
    (tmp / "link").symlink_to("target")
    assert h.result("fs/remove", {"path": str(tmp / "link")}) == {}
    assert (tmp / "target" / "keep").exists()  # a symlink is unlinked, never followed
    error = h.error("fs/remove", {"path": str(tmp / "d"), "recursive": False})
    assert error["data"] == {"kind": "directoryNotEmpty", "errno": errno.ENOTEMPTY}
    assert h.result("fs/remove", {"path": str(tmp / "d")}) == {}
    assert not (tmp / "d").exists()
    assert h.result("fs/remove", {"path": str(tmp / "missing")}) == {}
    error = h.error("fs/remove", {"path": str(tmp / "missing"), "force": False})
    assert error["data"] == {"kind": "notFound", "errno": 2}


# --- copy -----------------------------------------------------------------------


def test_copy_file_keeps_mode(tmp: Path) -> None:
    h = ready()
    (tmp / "src").write_bytes(b"payload")
    (tmp / "src").chmod(0o750)
    assert (
        h.result("fs/copy", {"sourcePath": str(tmp / "src"), "destinationPath": str(tmp / "dst")})
        == {}
    )
    assert (tmp / "dst").read_bytes() == b"payload"
    assert stat.S_IMODE((tmp / "dst").stat().st_mode) == 0o750


def test_copy_errors(tmp: Path) -> None:
    h = ready()
    (tmp / "dir" / "nested").mkdir(parents=True)
    (tmp / "f").write_bytes(b"keep me")

    def copy_error(source: Path, destination: Path, recursive: bool) -> dict[str, Any]:
        return h.error(
            "fs/copy",
            {
                "sourcePath": str(source),
                "destinationPath": str(destination),
                "recursive": recursive,
            },
        )

    error = copy_error(tmp / "dir", tmp / "out", False)
    assert error == {
        "code": -32600,
        "message": "fs/copy requires recursive: true when sourcePath is a directory",
        "data": {"kind": "recursiveRequired"},
    }
    destinations = (tmp / "dir", tmp / "dir" / "nested" / "copy", tmp / "dir" / "nested" / "..")
    for destination in destinations:
        error = copy_error(tmp / "dir", destination, True)
        assert error == {
            "code": -32600,
            "message": "fs/copy cannot copy a directory to itself or one of its descendants",
            "data": {"kind": "copyIntoItself"},
        }
    (tmp / "alias").symlink_to("dir")
    error = copy_error(tmp / "dir", tmp / "alias" / "inside", True)
    assert error["data"] == {"kind": "copyIntoItself"}
    os.mkfifo(tmp / "fifo")
    error = copy_error(tmp / "fifo", tmp / "out", False)
    assert error == {
        "code": -32600,
        "message": "fs/copy only supports regular files, directories, and symlinks",
        "data": {"kind": "unsupportedFileType"},
    }
    error = copy_error(tmp / "missing", tmp / "out", False)
    assert error["data"] == {"kind": "notFound", "errno": 2}
    error = copy_error(tmp / "f", tmp / "f", False)
    assert error["data"] == {"kind": "sameFile"}
    assert (tmp / "f").read_bytes() == b"keep me"
    error = copy_error(tmp / "f", tmp / "dir", False)
    assert error["data"] == {"kind": "isADirectory", "errno": 21}


def test_copy_symlink_is_recreated(tmp: Path) -> None:
    h = ready()
    (tmp / "link").symlink_to("../somewhere/else")
    h.result("fs/copy", {"sourcePath": str(tmp / "link"), "destinationPath": str(tmp / "copy")})
    assert os.readlink(tmp / "copy") == "../somewhere/else"
    error = h.error(
        "fs/copy", {"sourcePath": str(tmp / "link"), "destinationPath": str(tmp / "copy")}
    )
    assert error["data"] == {"kind": "alreadyExists", "errno": 17}


# --- hypothesis -----------------------------------------------------------------

_names = st.text(
    alphabet=st.characters(codec="utf-8", exclude_characters="/\0"), min_size=1, max_size=12
).filter(lambda n: n not in (".", ".."))


@st.composite
def trees(draw: Any, depth: int = 0) -> dict[str, Any]:
    """A directory: name -> bytes (file, with mode), str (symlink) or dict (subdirectory)."""
    names = draw(st.lists(_names, max_size=5, unique_by=lambda n: n.encode()))
    tree: dict[str, Any] = {}
    for name in names:
        kind = draw(st.sampled_from(["file", "link", "dir"] if depth < 3 else ["file", "link"]))
        if kind == "file":
            tree[name] = (
                draw(st.binary(max_size=64)),
                draw(st.sampled_from([0o600, 0o644, 0o755, 0o400, 0o4755])),
            )
        elif kind == "link":
            tree[name] = draw(st.sampled_from(["target", "../up", "/abs/path", "x/y"]))
        else:
            tree[name] = (
                draw(trees(depth=depth + 1)),
                draw(st.sampled_from([0o755, 0o700, 0o555])),
            )
    return tree


def materialise(root: str, tree: dict[str, Any]) -> None:
    for name, value in tree.items():
        path = os.path.join(root, name)
        if isinstance(value, str):
            os.symlink(value, path)
        elif isinstance(value[0], bytes):
            with open(path, "wb") as f:
                f.write(value[0])
            os.chmod(path, value[1])
        else:
            os.mkdir(path)
            materialise(path, value[0])
            os.chmod(path, value[1])


def snapshot(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for entry in os.scandir(root):
        st_ = entry.stat(follow_symlinks=False)
        if entry.is_symlink():
            out[entry.name] = ("link", os.readlink(entry.path))
        elif entry.is_dir(follow_symlinks=False):
            out[entry.name] = ("dir", stat.S_IMODE(st_.st_mode), snapshot(entry.path))
        else:
            with open(entry.path, "rb") as f:
                out[entry.name] = ("file", stat.S_IMODE(st_.st_mode), f.read())
    return out


def _unlock(root: str) -> None:
    for dirpath, dirs, _files in os.walk(root):
        for name in dirs:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                os.chmod(full, 0o755)


@settings(max_examples=50)
@given(tree=trees())
def test_copied_trees_compare_equal(tmp_path_factory: Any, tree: dict[str, Any]) -> None:
    base = str(tmp_path_factory.mktemp("copy"))
    source = os.path.join(base, "source")
    os.mkdir(source)
    materialise(source, tree)
    h = ready()
    try:
        destination = os.path.join(base, "destination")
        result = h.result(
            "fs/copy", {"sourcePath": source, "destinationPath": destination, "recursive": True}
        )
        assert result == {}
        assert snapshot(destination) == snapshot(source)
    finally:
        _unlock(base)


@settings(max_examples=100)
@given(data=st.binary(max_size=4096))
def test_write_then_read_round_trips_any_bytes(tmp_path_factory: Any, data: bytes) -> None:
    target = str(tmp_path_factory.mktemp("rt") / "f")
    h = ready()
    h.result("fs/writeFile", {"path": target, "dataBase64": b64(data)})
    read = h.result("fs/readFile", {"path": target})
    assert base64.b64decode(read["dataBase64"], validate=True) == data


@given(text=st.text(alphabet="ABCab01+/=@ \n", max_size=16))
def test_base64_acceptance_matches_strict_canonical_decoding(text: str) -> None:
    """Accepted iff canonical padded base64; then it decodes like the stdlib."""
    raw = msgspec.Raw(msgspec.json.encode(text))
    try:
        # As fs/writeFile decodes: checked first, then the fast path's pieces.
        slow = validate(raw)
        decoded = slow if slow is not None else b"".join(decoded_pieces(raw))
    except RpcError as exc:
        assert exc.code == -32600
        assert exc.message.startswith("fs/writeFile requires valid base64 dataBase64: ")
        assert fs.rust_base64_error(text.encode()) is not None
        with pytest.raises((binascii.Error, AssertionError)):
            value = base64.b64decode(text, validate=True)
            assert base64.b64encode(value).decode() == text
    else:
        assert base64.b64encode(decoded).decode() == text
        assert fs.rust_base64_error(text.encode()) is None


# --- the thread pool ------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_blocking_work_runs_on_a_bounded_pool_off_the_reactor_thread() -> None:
    from tests.support.harness import reactor

    run = fs.thread_pool_runner(reactor, threads=2)
    started: list[int] = []
    two_running: Deferred[None] = Deferred()
    release = threading.Event()

    def note_start() -> None:
        if len(started) == 2 and not two_running.called:
            two_running.callback(None)

    def work() -> int:
        started.append(threading.get_ident())
        reactor.callFromThread(note_start)
        assert release.wait(10)
        return threading.get_ident()

    try:
        calls = [run(work) for _ in range(3)]
        await with_timeout(two_running, 10, "two workers")
        assert len(started) == 2  # both threads are busy: the third call waits
        release.set()
        idents = [await with_timeout(d, 10, "work") for d in calls]
        assert threading.get_ident() not in idents
        assert len(set(idents)) <= 2
        assert len(started) == 3
    finally:
        release.set()
        run.stop()
