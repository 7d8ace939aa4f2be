"""fs/watchMissing's watch logic under an exact order of kernel events.

A ``WatchHub`` on a ``MemoryReactorClock``: the inotify instance is real
(the kernel queues the events of each file operation before it returns),
but it is read only when the test says so and re-checks run only when the
clock is advanced, so each scenario fixes the order of reads, re-checks and
file operations the integration test hit by chance (about one run in four
on a loaded machine: the watch on ``d0/sub/AGENTS.md`` never fired after
``d0/sub`` was deleted and made again).

Twisted's ``INotify`` adds ``IN_DELETE_SELF`` to every watch; on it, it
forgets that directory and closes the whole instance, so ``IN_IGNORED``
never reaches the server and every other directory's kernel watch goes with
the instance.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.testing import MemoryReactorClock

from execserver.codex.watch import WatchHub


def _drain(reactor: MemoryReactorClock) -> None:
    """Read what the kernel queued, then run what that scheduled (bounded)."""
    for _ in range(5):
        for reader in list(reactor.getReaders()):
            reader.doRead()
        reactor.advance(0)


def _hub() -> tuple[MemoryReactorClock, WatchHub, list[object]]:
    reactor = MemoryReactorClock()
    return reactor, WatchHub(reactor), []


def test_a_directory_made_again_before_the_recheck_is_watched_again(tmp_path: Path) -> None:
    reactor, hub, fired = _hub()
    sub = tmp_path / "d0" / "sub"
    sub.mkdir(parents=True)
    hub.add("conn", "deep", [str(sub / "AGENTS.md")], [], lambda: fired.append("deep"))
    sub.rmdir()
    # The deletion's events are read; the directory is back before the re-check.
    for reader in list(reactor.getReaders()):
        reader.doRead()
    sub.mkdir()
    reactor.advance(0)
    _drain(reactor)
    assert fired == []
    (sub / "AGENTS.md").write_text("rules\n")
    _drain(reactor)
    assert fired == ["deep"]
    assert hub.count() == 0


def test_a_directory_made_again_before_its_deletion_is_read(tmp_path: Path) -> None:
    reactor, hub, fired = _hub()
    sub = tmp_path / "d0" / "sub"
    sub.mkdir(parents=True)
    hub.add("conn", "deep", [str(sub / "AGENTS.md")], [], lambda: fired.append("deep"))
    sub.rmdir()
    sub.mkdir()
    _drain(reactor)
    assert fired == []
    (sub / "AGENTS.md").write_text("rules\n")
    _drain(reactor)
    assert fired == ["deep"]


def test_other_directories_stay_watched_after_one_is_deleted(tmp_path: Path) -> None:
    reactor, hub, fired = _hub()
    for name in ("d0", "d1"):
        (tmp_path / name / "sub").mkdir(parents=True)
    hub.add("conn", "deep", [str(tmp_path / "d0" / "sub" / "x")], [], lambda: fired.append(0))
    hub.add("conn", "other", [str(tmp_path / "d1" / "sub" / "y")], [], lambda: fired.append(1))
    (tmp_path / "d0" / "sub").rmdir()
    _drain(reactor)
    assert fired == []
    (tmp_path / "d1" / "sub" / "y").write_text("")
    _drain(reactor)
    assert fired == [1]
    (tmp_path / "d0" / "sub").mkdir()
    (tmp_path / "d0" / "sub" / "x").write_text("")
    _drain(reactor)
    assert fired == [1, 0]
    assert hub.count() == 0
    # Nothing watched any more: the instance is closed.
    assert hub.inotify.directories() == 0
    assert list(reactor.getReaders()) == []


def test_a_directory_made_before_its_parent_is_watched_is_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reactor, hub, fired = _hub()
    deep = tmp_path / "a" / "b" / "AGENTS.md"
    hub.add("conn", 1, [str(deep)], [], lambda: fired.append(1))
    use = hub.inotify.use

    def late(directory: str, watch: Any) -> None:
        # a/b is made after the re-check found a, before a's kernel watch.
        if directory == str(tmp_path / "a"):
            (tmp_path / "a" / "b").mkdir(exist_ok=True)
        use(directory, watch)

    monkeypatch.setattr(hub.inotify, "use", late)
    (tmp_path / "a").mkdir()
    _drain(reactor)
    assert fired == []
    deep.write_text("rules\n")
    _drain(reactor)
    assert fired == [1]


def test_a_directory_gone_before_it_is_watched_is_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reactor, hub, fired = _hub()
    deep = tmp_path / "a" / "AGENTS.md"
    hub.add("conn", 1, [str(deep)], [], lambda: fired.append(1))
    use = hub.inotify.use

    def late(directory: str, watch: Any) -> None:
        # a is deleted after the re-check found it, before its kernel watch.
        if directory == str(tmp_path / "a"):
            with contextlib.suppress(FileNotFoundError):
                (tmp_path / "a").rmdir()
        use(directory, watch)

    monkeypatch.setattr(hub.inotify, "use", late)
    (tmp_path / "a").mkdir()
    _drain(reactor)
    assert fired == []
    monkeypatch.setattr(hub.inotify, "use", use)
    (tmp_path / "a").mkdir()
    _drain(reactor)
    deep.write_text("rules\n")
    _drain(reactor)
    assert fired == [1]


def test_a_watch_moved_deeper_falls_back_when_the_deeper_directory_goes(tmp_path: Path) -> None:
    reactor, hub, fired = _hub()
    deep = tmp_path / "a" / "AGENTS.md"
    hub.add("conn", 1, [str(deep)], [], lambda: fired.append(1))
    (tmp_path / "a").mkdir()
    _drain(reactor)
    (tmp_path / "a").rmdir()
    _drain(reactor)
    # Back on tmp_path: a made again is seen, then the path in it.
    (tmp_path / "a").mkdir()
    _drain(reactor)
    assert fired == []
    deep.write_text("rules\n")
    _drain(reactor)
    assert fired == [1]
