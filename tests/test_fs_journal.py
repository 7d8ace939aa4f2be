"""The journal's recovery rule: what a starting server removes, replays, and never touches.

Unit tests of :class:`execserver.fs.journal.Journal` on real files (the
SIGKILL tests in ``test_fs_crash.py`` drive the same code through the real
server).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from execserver.fs import journal as journal_module
from execserver.fs.journal import Journal

HEX = "0123456789abcdef"


def _dead_owner() -> str:
    """An owner on this boot whose process is gone (a pid with another start time)."""
    mine = journal_module.owner_of(os.getpid())
    assert mine is not None
    boot, pid, start = mine.split("-")
    return f"{boot}-{pid}-{int(start) + 1}"


def _opened(tmp_path: Path) -> Journal:
    found = Journal(str(tmp_path / "state"))
    assert found.open()
    return found


def test_only_the_dead_servers_own_temporary_files_are_removed(tmp_path: Path) -> None:
    found = _opened(tmp_path)
    dead = _dead_owner()
    here = tmp_path / "work"
    here.mkdir()
    elsewhere = tmp_path / "unrecorded"
    elsewhere.mkdir()
    (Path(found.directory) / f"{dead}.dirs").write_text(json.dumps(str(here)) + "\n")
    removed = here / f".exec-server-{dead}-{HEX}.tmp"
    removed.write_bytes(b"partial")
    kept = [
        here / "data.tmp",
        here / f".exec-server-{dead}-{HEX[:15]}.tmp",  # not 16 hex digits
        here / f".exec-server-{dead}-{HEX}.tmp.bak",
        here / f".exec-server-{found.owner}-{HEX}.tmp",  # a live server's (this one)
        here / f".exec-server-{HEX}.tmp",  # the old naming: no owner to check
        elsewhere / f".exec-server-{dead}-{HEX}.tmp",  # a directory it never recorded
    ]
    for path in kept:
        path.write_bytes(b"user data")
    link = here / f".exec-server-{dead}-{'f' * 16}.tmp"
    link.symlink_to(here / "data.tmp")  # not a regular file: left alone
    assert found.recover() == (0, 1)
    assert not removed.exists()
    assert all(path.read_bytes() == b"user data" for path in kept)
    assert link.is_symlink()
    assert not (Path(found.directory) / f"{dead}.dirs").exists()
    assert found.recover() == (0, 0)


def test_a_live_servers_records_are_left_alone(tmp_path: Path) -> None:
    found = _opened(tmp_path)
    other = Journal(found.root)  # the same process: alive
    assert other.open()
    temp = other.temp_path(str(tmp_path))
    Path(temp).write_bytes(b"in progress")
    assert found.recover() == (0, 0)
    assert Path(temp).exists()


def _record(found: Journal, owner: str, temp: Path, target: Path, size: int) -> Path:
    st = os.stat(target)
    record = Path(found.directory) / f"{owner}-{HEX}.copy"
    body = {"temp": str(temp), "target": str(target), "dev": st.st_dev, "ino": st.st_ino}
    record.write_text(json.dumps({**body, "size": size}))
    return record


def test_an_interrupted_copy_back_is_replayed_onto_the_same_inode(tmp_path: Path) -> None:
    found = _opened(tmp_path)
    dead = _dead_owner()
    target = tmp_path / "target"
    target.write_bytes(b"NEW-half" + b"old tail that is longer")
    os.link(target, tmp_path / "link")
    temp = tmp_path / f".exec-server-{dead}-{HEX}.tmp"
    temp.write_bytes(b"NEW-whole")
    record = _record(found, dead, temp, target, len(b"NEW-whole"))
    assert found.recover() == (1, 0)
    assert (tmp_path / "link").read_bytes() == b"NEW-whole"
    assert not temp.exists() and not record.exists()


def test_a_copy_record_that_does_not_match_writes_nothing(tmp_path: Path) -> None:
    found = _opened(tmp_path)
    dead = _dead_owner()
    target = tmp_path / "target"
    target.write_bytes(b"old")
    temp = tmp_path / f".exec-server-{dead}-{HEX}.tmp"
    temp.write_bytes(b"incomplete")
    # The temporary file is not the recorded size: the copy never began.
    _record(found, dead, temp, target, 1000)
    assert found.recover() == (0, 0)
    assert target.read_bytes() == b"old"
    # The target was replaced since (another inode at the path): not ours.
    temp.write_bytes(b"complete")
    record = _record(found, dead, temp, target, len(b"complete"))
    target.unlink()
    target.write_bytes(b"someone else's")
    body = json.loads(record.read_text())
    body["ino"] = os.stat(target).st_ino + 1
    record.write_text(json.dumps(body))
    assert found.recover() == (0, 0)
    assert target.read_bytes() == b"someone else's"
