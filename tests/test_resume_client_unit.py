"""RemoteProcess catch-up after a resume: ordering, de-duplication, gaps (pure).

The handle gets live notifications (``accept_*``) and catch-up reads
(``catch_up``) in any interleaving; what it delivers must be one ordered
stream without duplicates, exit and close in their seq places.
"""

from __future__ import annotations

from typing import Any

from execserver import protocol as p
from execserver.client.process import RemoteProcess
from execserver.client.types import GapEvent, OutputEvent


def handle() -> tuple[RemoteProcess, list[object]]:
    proc = RemoteProcess(api=None, process_id="p")  # type: ignore[arg-type]
    delivered: list[object] = []

    def output(event: OutputEvent) -> None:
        if isinstance(event, GapEvent):
            delivered.append(("gap", event.from_seq, event.to_seq))
        else:
            delivered.append(event.seq)

    proc.add_output_listener(output, gaps=True)
    proc.exited().addCallback(lambda code: delivered.append(("exit", code)))
    proc.closed().addCallback(lambda _: delivered.append("closed"))
    return proc, delivered


def chunk(seq: int) -> p.ProcessOutputChunk:
    return p.ProcessOutputChunk(seq, "stdout", b"x")


def read(seqs: list[int], next_seq: int, **extra: Any) -> p.ReadResponse:
    return p.ReadResponse(
        chunks=[chunk(s) for s in seqs],
        next_seq=next_seq,
        exited=extra.pop("exited", False),
        exit_code=extra.pop("exit_code", None),
        **extra,
    )


def live(proc: RemoteProcess, seq: int) -> None:
    proc.accept_output(OutputEvent("p", "stdout", b"x", seq))


def test_live_events_during_catch_up_wait_and_duplicates_are_dropped() -> None:
    proc, delivered = handle()
    live(proc, 1)
    proc.begin_catch_up()
    live(proc, 4)  # arrives before the read's answer
    live(proc, 5)
    assert not proc.catch_up(read([2, 3, 4], 5))  # 5 waits live: done
    proc.end_catch_up()
    live(proc, 5)  # a duplicate
    live(proc, 6)
    assert delivered == [1, 2, 3, 4, 5, 6]


def test_exit_and_close_are_delivered_in_their_seq_places() -> None:
    proc, delivered = handle()
    proc.begin_catch_up()
    # Output 1, exit 2, a grandchild's output 3, close 4.
    more = proc.catch_up(
        read([1, 3], 4, exited=True, exit_code=0, exited_seq=2, closed=True, closed_seq=4)
    )
    assert more
    assert not proc.catch_up(
        read([], 5, exited=True, exit_code=0, exited_seq=2, closed=True, closed_seq=4)
    )
    proc.end_catch_up()
    proc.accept_exit(2, 0, None, None)  # live duplicates change nothing
    proc.accept_close(4)
    assert delivered == [1, ("exit", 0), 3, "closed"]


def test_a_gap_is_delivered_where_the_lost_output_was() -> None:
    proc, delivered = handle()
    live(proc, 1)
    proc.begin_catch_up()
    proc.catch_up(read([7, 8], 9, gap=p.SeqGap(2, 6)))
    proc.catch_up(read([], 9))
    proc.end_catch_up()
    assert delivered == [1, ("gap", 2, 6), 7, 8]
