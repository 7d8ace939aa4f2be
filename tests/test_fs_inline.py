"""Units of cheap fs calls (issue 13, item 1): the inline rule's pieces and
the pool's single wake-up for a batch of results.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from twisted.internet.task import Clock

from execserver.fs import local
from execserver.fs.local import Locality, remote_mounts
from execserver.fs.pool import PoolRunner
from tests.support.polling import until_blocking

MOUNTINFO = """\
22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw
23 22 0:5 / /proc rw - proc proc rw
24 22 0:40 / /mnt/with\\040space rw - nfs4 server:/x rw
25 22 0:41 / /home/me/fuse rw - fuse.sshfs me@host: rw
26 22 0:42 / /tmp rw - tmpfs tmpfs rw
"""


def test_non_local_mounts_are_read_from_mountinfo() -> None:
    assert remote_mounts(MOUNTINFO) == {"/proc", "/mnt/with space", "/home/me/fuse"}


def _locality(tmp_path: Path, extra: str = "") -> tuple[Locality, Clock]:
    clock = Clock()
    clock.advance(100)
    info = tmp_path / "mountinfo"
    info.write_text(f"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n{extra}")
    return Locality(clock=clock.seconds, mountinfo=str(info)), clock


def test_a_local_directory_is_trusted_for_a_while(tmp_path: Path) -> None:
    locality, clock = _locality(tmp_path)
    directory = str(tmp_path.resolve())
    assert not locality.trusted(directory)
    locality.verify(directory)
    assert locality.trusted(directory)
    assert local.inline_eligible(locality, directory + "/f", directory)
    assert not local.inline_eligible(locality, directory + "/../f", directory)
    clock.advance(local.VERIFIED_SECONDS)
    assert not locality.trusted(directory)


def test_symlinks_and_remote_mounts_are_never_trusted(tmp_path: Path) -> None:
    real = tmp_path.resolve() / "real"
    (real / "nfs").mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    locality, _ = _locality(tmp_path, f"30 22 0:50 / {real}/nfs rw - nfs server:/e rw\n")
    locality.verify(str(tmp_path.resolve() / "link"))
    assert not locality.trusted(str(tmp_path.resolve() / "link"))
    locality.verify(str(real / "nfs"))
    assert not locality.trusted(str(real / "nfs"))
    locality.verify(str(real))
    assert locality.trusted(str(real))
    # A trusted directory, but the entry is the remote mount point itself.
    assert not local.inline_eligible(locality, str(real / "nfs"), str(real))


def test_inline_calls_step_aside_for_symlinks_and_large_or_odd_files(tmp_path: Path) -> None:
    (tmp_path / "target").write_bytes(b"t")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    (tmp_path / "big").write_bytes(b"b" * 70_000)
    for call in (
        lambda: local.get_metadata(str(tmp_path / "link")),
        lambda: local.read_small_file(str(tmp_path / "link"), 65536),
        lambda: local.read_small_file(str(tmp_path / "big"), 65536),
        lambda: local.read_directory(Locality(), str(tmp_path)),  # it holds a symlink
    ):
        try:
            call()
        except local.NotInline:
            continue
        raise AssertionError("expected NotInline")
    metadata = local.get_metadata(str(tmp_path / "target"))
    assert (metadata.is_file, metadata.size, metadata.is_symlink) == (True, 1, False)


class _Reactor:
    """Records callFromThread instead of waking a reactor."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def callFromThread(self, func: Any, *args: Any) -> None:
        self.calls.append((func, args))

    def addSystemEventTrigger(self, *args: Any) -> None:
        pass


def test_results_finished_before_the_reactor_runs_come_back_in_one_wake_up() -> None:
    fake = _Reactor()
    runner = PoolRunner(fake, threads=2, clock=Clock())
    try:
        deferreds = [runner(lambda n=n: n * n) for n in range(8)]

        def all_done() -> bool:
            with runner._lock:
                return len(runner._done) == 8

        until_blocking(all_done, "the eight results", timeout=10, interval=0.01)
        assert len(runner._done) == 8
        assert len(fake.calls) == 1  # one wake-up for eight results
        func, args = fake.calls[0]
        func(*args)
        assert [d.result for d in deferreds] == [n * n for n in range(8)]
    finally:
        runner.stop()
