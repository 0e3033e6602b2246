"""The cache hand-over's hit rate (docs/KV_TRANSFER.md, "Hand-over on scale-down"; issue
33's scale-down figure, in one process): three replicas serve 300 requests drawn from N
system prompts of 256 tokens (Zipf 1.2) plus a 32-token question each, every system
prompt routed to one replica (i mod 3, as a prefix-aware router keeps a tenant on its
holder). Then the third replica stops, without a hand-over, with one (64 MiB budget),
or with one capped at 1 MiB, and the two survivors serve the next 100 requests of the
same mix, each routed to the survivor that holds the longest prefix of it (the other
one on a tie, alternating). Prints the survivors' share of prompt tokens served from
cache over those 100 requests, and over the stopped replica's tenants alone. The tiny
random-init model: a hit rate depends on the hashes, not on the weights (8 KiB per
16-token block). Run: ``.venv/bin/python scripts/kv_handover_hit_rate.py 32``."""
import asyncio
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.engine.test_kv_handover import FakeDirectory, LocalReceiver  # noqa: E402
from tests.engine.test_kv_transfer import make_side, run  # noqa: E402
from tests.factories import make_tiny_model_dir  # noqa: E402
from workers.kv_handover import hand_over  # noqa: E402

ENGINE = dict(block_size=16, num_kv_blocks=2048)


def workload(num_systems: int, num: int, seed: int) -> list[int]:
    """The system prompt of each request (Zipf 1.2)."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** 1.2 for i in range(num_systems)]
    return rng.choices(range(num_systems), weights, k=num)


def prompt_of(systems: list[list[int]], system: int, rng: random.Random) -> list[int]:
    return systems[system] + [rng.randrange(3, 500) for _ in range(32)]


async def one_run(model_dir: Path, systems: list[list[int]], budget: int) -> tuple[float, float, object]:
    sides = [make_side(model_dir, **ENGINE) for _ in range(3)]
    rng = random.Random(1)
    for i, system in enumerate(workload(len(systems), 300, 1)):
        await run(sides[system % 3], f"a{i}", prompt_of(systems, system, rng), 1)
    survivors, stopping = sides[:2], sides[2]
    usage = {"s0": 0.0, "s1": 0.1}  # the directory's KV use: s0 has the most room
    result = await hand_over(stopping.transfer, FakeDirectory(usage), lambda rid: LocalReceiver(
        survivors[int(rid[1])]), "me", "", budget, 30.0)
    stopping.close()
    rng = random.Random(2)
    cached = total = moved_cached = moved_total = 0
    tie = 0
    for i, system in enumerate(workload(len(systems), 100, 2)):
        prompt = prompt_of(systems, system, rng)
        hashes, _ = survivors[0].transfer.prefix_hashes(prompt)
        held = [side.transfer.ledger.num_cached_leading(hashes) for side in survivors]
        if held[0] == held[1]:
            target, tie = survivors[tie], 1 - tie
        else:
            target = survivors[held.index(max(held))]
        got = await run(target, f"b{i}", prompt, 1)
        cached, total = cached + got[2], total + len(prompt)
        if system % 3 == 2:  # a tenant of the stopped replica
            moved_cached, moved_total = moved_cached + got[2], moved_total + len(prompt)
    for side in survivors:
        side.close()
    return cached / total, moved_cached / max(1, moved_total), result


async def main(model_dir: Path, num_systems: int) -> None:
    rng = random.Random(3)
    systems = [[rng.randrange(3, 500) for _ in range(256)] for _ in range(num_systems)]
    for mode, budget in (("no hand-over", 0), ("hand-over", 64 * 2**20), ("hand-over 1 MiB", 2**20)):
        rate, moved, result = await one_run(model_dir, systems, budget)
        print(f"{num_systems} system prompts, {mode}: {result.outcome}, {result.blocks} blocks, {result.bytes} bytes "
              f"in {result.seconds:.3f}s; next 100 requests hit {rate:.3f}, the stopped replica's tenants {moved:.3f}")


if __name__ == "__main__":
    asyncio.run(main(make_tiny_model_dir("llama", Path(tempfile.mkdtemp())), int(sys.argv[1])))
