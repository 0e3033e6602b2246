"""KV transfers between replicas in ``prefixserve simulate`` (``--transfers off,on``).

With transfers on, ``prefix_cost`` prices a fetch of the prefix from its
holder (``router/policies/kv_fetch.py``; the simulator hands it the same
figures it simulates with: ``--fetch-bytes-per-s``, ``--fetch-overhead-s``,
``--holder-read-bytes-per-s``, ``--kv-bytes-per-token``,
``--prefill-tokens-per-s``), and when the chosen replica's ranking entry
names a holder, the replica fetches before it prefills, as
``fetch_and_generate`` does (``docs/KV_TRANSFER.md``):

- it asks for the blocks of the prompt past its own leading hits; the holder
  answers with the leading run of those it holds (none: fallback
  ``not_held``);
- the fetch takes ``bytes / fetch_bytes_per_s + fetch_overhead_s +
  bytes / holder_read_bytes_per_s``; the receiver's prefill starts no
  earlier than its end (the copy runs beside the receiver's queue, not in it);
- the holder's read occupies its prefill queue for ``bytes /
  holder_read_bytes_per_s`` (the CPU it takes from its own steps) and touches
  the blocks in its LRU (a released pin puts them at the recent end);
- the blocks enter the receiver's LRU as cached blocks with the same hashes,
  published as one KV event batch (stores and the evictions they cause), so
  the directory (and the routers) see the copy at once;
- at most ``kv_transfer_max_concurrent`` (2) fetches per receiver and exports
  per holder are in flight; another is refused (fallback ``busy``) and the
  request prefills.

Simulated replicas have cores of their own (no core group), so a fetch's
receiver is charged its own queue, as ``prefix_cost`` charges a receiver
in a core group too (``router/policies/prefix_cost.py``).

Reported per run: fetches per 100 requests, GB moved, tokens served by
transfer, fallbacks.
"""

from __future__ import annotations

import argparse
from typing import Any

from router.policies.kv_fetch import (
    DEFAULT_FETCH_HOLDER_BYTES_PER_S,
    DEFAULT_FETCH_OVERHEAD_S,
    DEFAULT_KV_BYTES_PER_TOKEN,
    MEASURED_FETCH_BYTES_PER_S,
)

MAX_CONCURRENT = 2  # cache.kv_transfer_max_concurrent's default; exports are limited alike
FETCHING_POLICIES = ("prefix_cost",)  # the policies that price fetches


def add_transfer_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transfers", default="off", help="comma-separated: off, on (runs each; on: prefix_cost "
                        "prices fetching a prefix from its holder and the replicas fetch)")
    parser.add_argument("--fetch-bytes-per-s", type=float, default=MEASURED_FETCH_BYTES_PER_S,
                        help="KV transfer bandwidth, end to end")
    parser.add_argument("--fetch-overhead-s", type=float, default=DEFAULT_FETCH_OVERHEAD_S,
                        help="fixed time of one fetch")
    parser.add_argument("--holder-read-bytes-per-s", type=float, default=DEFAULT_FETCH_HOLDER_BYTES_PER_S,
                        help="the holder's read of the blocks it sends")
    parser.add_argument("--kv-bytes-per-token", type=float, default=DEFAULT_KV_BYTES_PER_TOKEN,
                        help="KV bytes per token (default model, float32)")


def transfer_modes(args: argparse.Namespace) -> list[bool]:
    """The ``--transfers`` modes to run, in order; raises ValueError naming a bad one."""
    names = [m.strip() for m in str(args.transfers).split(",") if m.strip()]
    bad = [m for m in names if m not in ("off", "on")]
    if bad or not names:
        raise ValueError(f"--transfers must list off and/or on, got {args.transfers!r}")
    if min(args.fetch_bytes_per_s, args.kv_bytes_per_token) <= 0 or min(args.fetch_overhead_s,
                                                                         args.holder_read_bytes_per_s) < 0:
        raise ValueError("--fetch-bytes-per-s and --kv-bytes-per-token must be > 0, --fetch-overhead-s and "
                         "--holder-read-bytes-per-s >= 0")
    return [m == "on" for m in names]


def policy_params(args: argparse.Namespace, policy: str, on: bool) -> dict[str, Any]:
    """The fetch pricing a policy gets with transfers on: the simulated figures."""
    if not on or policy not in FETCHING_POLICIES:
        return {}
    return {"fetch_bytes_per_s": args.fetch_bytes_per_s, "fetch_overhead_s": args.fetch_overhead_s,
            "fetch_holder_bytes_per_s": args.holder_read_bytes_per_s, "kv_bytes_per_token": args.kv_bytes_per_token,
            "prefill_tokens_per_s": args.prefill_tokens_per_s}


class Transfers:
    """The fleet's fetches (module doc) and their counts."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.num_fetches = 0
        self.num_blocks = 0
        self.fallbacks: dict[str, int] = {}
        self._fetching: dict[str, list[float]] = {}  # replica -> end times of its fetches in flight
        self._exporting: dict[str, list[float]] = {}  # replica -> end times of its exports in flight

    def fetch(self, fleet, rid: str, holder_id: str, chain: list[bytes], now: float) -> float:
        """Copies the holder's blocks of ``chain`` past the receiver's hits into the
        receiver (and publishes them); returns when they are there (``now`` if nothing moved)."""
        r, holder, args = fleet.replicas[rid], fleet.replicas[holder_id], self.args
        own = 0
        while own < len(chain) and chain[own] in r.cache:
            own += 1
        run = own
        while run < len(chain) and chain[run] in holder.cache:
            run += 1
        if run == own:
            return self._fallback("not_held", now)
        if _in_flight(self._fetching, rid, now) >= MAX_CONCURRENT or \
                _in_flight(self._exporting, holder_id, now) >= MAX_CONCURRENT:
            return self._fallback("busy", now)
        blocks = chain[own:run]
        num_bytes = len(blocks) * args.block_size * args.kv_bytes_per_token
        read_s = num_bytes / args.holder_read_bytes_per_s if args.holder_read_bytes_per_s else 0.0
        done = now + num_bytes / args.fetch_bytes_per_s + args.fetch_overhead_s + read_s
        self._fetching.setdefault(rid, []).append(done)
        self._exporting.setdefault(holder_id, []).append(done)
        holder.busy_until = max(holder.busy_until, now) + read_s
        for block in blocks:
            holder.cache.move_to_end(block)
        fleet.store(rid, blocks)
        self.num_fetches += 1
        self.num_blocks += len(blocks)
        return done

    def _fallback(self, reason: str, now: float) -> float:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        return now

    def results(self, num_requests: int) -> dict[str, Any]:
        gb = self.num_blocks * self.args.block_size * self.args.kv_bytes_per_token / 1e9
        return {"fetches_per_100": round(100 * self.num_fetches / max(num_requests, 1), 2),
                "fetched_gb": round(gb, 3), "fetched_tokens": self.num_blocks * self.args.block_size,
                "fetch_fallbacks": dict(sorted(self.fallbacks.items()))}


def _in_flight(ends: dict[str, list[float]], rid: str, now: float) -> int:
    live = [t for t in ends.get(rid, ()) if t > now]
    ends[rid] = live
    return len(live)
