"""The router-local prefix index (cluster/shared/directory/index.py): the same
answers as the Redis directory's LOOKUP, against a model of per-replica sets."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.shared.directory.index import PrefixIndex

H = [bytes([i]) * 16 for i in range(12)]


def test_lookup_counts_leading_blocks_and_work_follows_the_match():
    index = PrefixIndex()
    for rid in ("a", "b", "c"):
        index.load_snapshot(rid, epoch=1, seq=0, blocks=[])
    assert index.apply("a", 1, 1, False, [], H[:5])
    assert index.apply("b", 1, 1, False, [], H[:2] + H[3:5])
    assert index.lookup(H[:6]) == {"a": 5, "b": 2}
    before = index.lookup_ops
    assert index.lookup([H[9]]) == {}
    assert index.lookup_ops - before == 1  # a cold chain costs one probe, whatever the fleet


def test_out_of_order_batch_unsyncs_until_a_snapshot():
    index = PrefixIndex()
    index.load_snapshot("a", epoch=1, seq=3, blocks=H[:3])
    assert not index.apply("a", 1, 5, False, [], [H[3]])  # batch 4 was lost
    assert index.lookup(H[:4]) == {}
    assert not index.apply("a", 1, 6, False, [], [H[4]])  # still not credited
    index.load_snapshot("a", epoch=1, seq=6, blocks=H[:5])
    assert index.lookup(H[:5]) == {"a": 5}
    assert not index.apply("a", 0, 7, False, [H[0]], [])  # an older epoch changes nothing
    assert index.lookup(H[:5]) == {"a": 5}


def test_register_drop_clear_and_contracts():
    index = PrefixIndex()
    index.load_snapshot("a", epoch=1, seq=0, blocks=H[:4], contract="x")
    index.load_snapshot("b", epoch=1, seq=0, blocks=H[:4], contract="y")
    assert index.lookup(H[:4], contract="x") == {"a": 4, "b": -1}
    index.register("a", epoch=2)  # a restart: nothing credited until its snapshot
    assert index.lookup(H[:4]) == {"b": 4}
    index.register("a", epoch=1)  # a stale registration is ignored
    assert index.replica("a").epoch == 2
    index.apply("b", 1, 1, True, [], [H[7]])  # cleared, then stored
    assert index.lookup(H[:4]) == {} and index.lookup([H[7]]) == {"b": 1}
    assert index.lookup([H[7]], contract="x") == {"b": -1}
    index.drop("b")
    assert index.lookup([H[7]], contract="x") == {} and index.num_blocks == 0 and index.num_entries == 0


ops = st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from(["store", "remove", "clear", "snapshot", "skip"]),
                         st.lists(st.sampled_from(H), max_size=5)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops=ops, chain_len=st.integers(0, 12))
def test_matches_a_model_of_per_replica_sets(ops, chain_len):
    index, truth, seqs, synced = PrefixIndex(), {}, {}, {}
    for rid in "abc":
        index.load_snapshot(rid, 1, 0, [])
        truth[rid], seqs[rid], synced[rid] = set(), 0, True
    for rid, op, hashes in ops:
        if op == "snapshot":
            seqs[rid] += 1
            index.load_snapshot(rid, 1, seqs[rid], truth[rid])
            synced[rid] = True
            continue
        seqs[rid] += 2 if op == "skip" else 1  # "skip": a lost batch that stored nothing
        if op == "store":
            truth[rid] |= set(hashes)
        elif op == "remove":
            truth[rid] -= set(hashes)
        elif op == "clear":
            truth[rid] = set()
        ok = index.apply(rid, 1, seqs[rid], op == "clear", hashes if op == "remove" else [],
                         hashes if op == "store" else [])
        synced[rid] = synced[rid] and ok
    chain = H[:chain_len]
    expected = {}
    for rid in "abc":
        n = 0
        while synced[rid] and n < len(chain) and chain[n] in truth[rid]:
            n += 1
        if n:
            expected[rid] = n
    assert index.lookup(chain) == expected
    assert index.num_entries == sum(len(truth[r]) for r in "abc" if synced[r])
