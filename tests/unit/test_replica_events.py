"""Folding a batch of KV events into the net change the directory applies."""

from __future__ import annotations

import random

from workers.engine.block_pool import AllBlocksCleared, BlockRemoved, BlockStored
from workers.replica import net_kv_changes


def stored(*hashes):
    return BlockStored(tuple(hashes), b"root", 4)


def removed(*hashes):
    return BlockRemoved(tuple(hashes))


def test_store_then_remove_in_one_batch_cancels_out():
    # Removing a hash the directory never saw is a no-op there, so it may be listed.
    assert net_kv_changes([stored(b"a", b"b"), removed(b"a")]) == (False, [b"a"], [b"b"])


def test_remove_then_store_keeps_the_block():
    assert net_kv_changes([removed(b"a"), stored(b"a")]) == (False, [], [b"a"])


def test_clear_drops_earlier_changes():
    assert net_kv_changes([stored(b"a"), removed(b"z"), AllBlocksCleared(), stored(b"b")]) == (True, [], [b"b"])


def test_net_change_equals_replaying_events_on_any_start_state():
    # Valid histories only, as a block pool emits them: a hash is stored when
    # absent and removed when present.
    rng = random.Random(0)
    universe = [bytes([i]) for i in range(8)]
    for _ in range(500):
        start = {h for h in universe if rng.random() < 0.5}
        truth, events = set(start), []
        for _ in range(rng.randint(0, 6)):
            kind = rng.random()
            absent, present = sorted(set(universe) - truth), sorted(truth)
            if kind < 0.1:
                events.append(AllBlocksCleared())
                truth.clear()
            elif kind < 0.6 and absent:
                picks = rng.sample(absent, rng.randint(1, min(3, len(absent))))
                events.append(stored(*picks))
                truth |= set(picks)
            elif present:
                picks = rng.sample(present, rng.randint(1, min(3, len(present))))
                events.append(removed(*picks))
                truth -= set(picks)
        cleared, gone, added = net_kv_changes(events)
        applied = set() if cleared else set(start)
        applied = (applied - set(gone)) | set(added)
        assert applied == truth
