"""A symlink swapped under a path as fast as a thread can: the race the sandbox
and filesystem-guard tests run writes through, to show no byte gets out.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

#: How long stopping the swapping thread may take (it checks its stop flag per swap).
JOIN_SECONDS = 30


@dataclass
class SymlinkRace:
    """``work/flip`` points at ``work/inside`` or at ``outside``, swapped by a thread.

    Each swap is an atomic ``rename`` of a prepared link over ``flip``, so the
    path always exists and resolves to one side or the other.
    """

    work: Path
    inside: Path
    outside: Path
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def flip(self) -> Path:
        return self.work / "flip"

    def start(self) -> None:
        """Start swapping (until the ``symlink_race`` block ends)."""
        self._thread = threading.Thread(target=self._swap)
        self._thread.start()

    def _swap(self) -> None:
        to_in, to_out = str(self.work / ".to-in"), str(self.work / ".to-out")
        while not self._stop.is_set():
            for target, link in ((self.outside, to_out), (self.inside, to_in)):
                with contextlib.suppress(FileExistsError):
                    os.symlink(target, link)
                os.replace(link, self.flip)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=JOIN_SECONDS)
            assert not self._thread.is_alive(), "the swapping thread did not stop"


@contextlib.contextmanager
def symlink_race(base: Path) -> Iterator[SymlinkRace]:
    """Lay out ``base/work/inside`` and ``base/outside`` with ``base/work/flip``
    pointing inside; :meth:`SymlinkRace.start` starts the swapping, which
    stops (the thread joined, bounded) when the block ends."""
    race = SymlinkRace(base / "work", base / "work" / "inside", base / "outside")
    race.inside.mkdir(parents=True)
    race.outside.mkdir()
    os.symlink(race.inside, race.flip)
    try:
        yield race
    finally:
        race.stop()
