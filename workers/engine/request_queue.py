"""The scheduler's bookkeeping: every unfinished sequence, in exactly one of
three queues, and the order that decides who runs first and who is preempted.

    waiting   sorted by key: new requests, and those preempted for recompute
    running   admission order: sequences holding device blocks
    swapped   sorted by key: preempted to the CPU swap pool

A sequence's key is ``(priority, arrival_time, arrival index)``: lower runs
first (vLLM's convention), the largest is preempted first, and the arrival
index breaks ties between equal arrival times. Nothing here touches blocks;
the scheduler frees them before it ends a sequence.
"""

from __future__ import annotations

import bisect
from typing import Iterator, Optional

from cluster.shared.types import FinishReason
from workers.engine.sequence import Sequence, SequenceStatus


class RequestQueue:
    """Unfinished sequences by request id, and their three queues."""

    def __init__(self) -> None:
        self.waiting: list[Sequence] = []  # sorted by key
        self.running: list[Sequence] = []  # admission order
        self.swapped: list[Sequence] = []  # sorted by key
        self._by_id: dict[str, Sequence] = {}
        self._arrival_index: dict[str, int] = {}
        self._next_arrival_index = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Sequence]:
        """Every unfinished sequence (no particular order)."""
        return iter(self._by_id.values())

    def get(self, request_id: str) -> Optional[Sequence]:
        """The unfinished sequence with this id, or None. No mutation."""
        return self._by_id.get(request_id)

    def key(self, seq: Sequence) -> tuple[int, float, int]:
        """Scheduling order: smaller goes first, largest is preempted first."""
        return (seq.priority, seq.arrival_time, self._arrival_index[seq.request_id])

    def add(self, seq: Sequence) -> None:
        """Queues a new waiting sequence (mutates).

        Raises:
            ValueError: The request id is already in use.
        """
        assert seq.status is SequenceStatus.WAITING and not seq.block_ids and seq.num_computed_tokens == 0
        self._register(seq)
        bisect.insort(self.waiting, seq, key=self.key)

    def add_running(self, seq: Sequence) -> None:
        """Adds a sequence that already holds device blocks (a fork of a running
        one) at the end of ``running`` (mutates).

        Raises:
            ValueError: The request id is already in use.
        """
        self._register(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _register(self, seq: Sequence) -> None:
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already in use: use a unique id")
        self._by_id[seq.request_id] = seq
        self._arrival_index[seq.request_id] = self._next_arrival_index
        self._next_arrival_index += 1

    def requeue(self, seq: Sequence, status: SequenceStatus) -> None:
        """Puts a sequence taken off ``running`` back as WAITING or SWAPPED, in
        key order: a preempted sequence's key predates every later arrival of
        its priority, so it goes before them (mutates)."""
        assert status in (SequenceStatus.WAITING, SequenceStatus.SWAPPED) and seq not in self.running
        seq.status = status
        queue = self.waiting if status is SequenceStatus.WAITING else self.swapped
        bisect.insort(queue, seq, key=self.key)

    def remove(self, seq: Sequence, reason: FinishReason, message: Optional[str] = None) -> None:
        """Takes a sequence out of its queue as FINISHED with ``reason`` (mutates;
        the caller has freed its blocks)."""
        queue = {
            SequenceStatus.WAITING: self.waiting,
            SequenceStatus.RUNNING: self.running,
            SequenceStatus.SWAPPED: self.swapped,
        }[seq.status]
        queue.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_message = message if message is not None else seq.finish_message
        del self._by_id[seq.request_id]
        del self._arrival_index[seq.request_id]

    def check_integrity(self, max_num_seqs: int) -> None:
        """Asserts that every sequence is in exactly the queue of its status, in
        order. No mutation."""
        queued = self.waiting + self.running + self.swapped
        assert len(queued) == len(self._by_id) == len({s.request_id for s in queued})
        assert all(self._by_id[s.request_id] is s for s in queued)
        assert len(self.running) <= max_num_seqs
        assert all(s.status is SequenceStatus.WAITING for s in self.waiting)
        assert all(s.status is SequenceStatus.RUNNING for s in self.running)
        assert all(s.status is SequenceStatus.SWAPPED for s in self.swapped)
        keys = [self.key(s) for s in self.waiting]
        assert keys == sorted(keys), "waiting queue out of order"
        keys = [self.key(s) for s in self.swapped]
        assert keys == sorted(keys), "swapped queue out of order"
