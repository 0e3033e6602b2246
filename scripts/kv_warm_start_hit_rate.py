"""Warm start's hit rate (docs/KV_TRANSFER.md, "Warm start"; issue 33's scale-up figure,
in one process): a holder serves 200 requests drawn from N system prompts of 256
tokens (Zipf 1.2) plus a 32-token question each; a new replica then starts cold, warm
(64 MiB budget) or warm with a 1 MiB budget, and serves the next 100 requests of the
same mix. Prints the share of prompt tokens served from its cache over its first 10 and
first 100 requests. The tiny random-init model: a hit rate depends on the hashes, not on
the weights (bytes do: 8 KiB per 16-token block here). Run:
``.venv/bin/python scripts/kv_warm_start_hit_rate.py 32``."""
import asyncio
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.engine.test_kv_transfer import make_side, run  # noqa: E402
from tests.engine.test_kv_warm_start import FakeDirectory  # noqa: E402
from tests.factories import make_tiny_model_dir  # noqa: E402
from workers.kv_transfer import LocalHolder  # noqa: E402
from workers.kv_warm_start import warm_start  # noqa: E402

ENGINE = dict(block_size=16, num_kv_blocks=2048)


def workload(systems: list[list[int]], num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** 1.2 for i in range(len(systems))]
    return [rng.choices(systems, weights)[0] + [rng.randrange(3, 500) for _ in range(32)] for _ in range(num)]


async def main(model_dir: Path, num_systems: int) -> None:
    rng = random.Random(3)
    systems = [[rng.randrange(3, 500) for _ in range(256)] for _ in range(num_systems)]
    holder = make_side(model_dir, **ENGINE)
    for i, prompt in enumerate(workload(systems, 200, 1)):
        await run(holder, f"h{i}", prompt, 1)
    directory = FakeDirectory({"holder": set(holder.pool.cached_block_hashes())})
    for mode, budget in (("cold", 0), ("warm", 64 * 2**20), ("warm-1MiB", 2**20)):
        new = make_side(model_dir, **ENGINE)
        res = await warm_start(new.transfer, directory, lambda rid: LocalHolder(holder.transfer), "me", "",
                               budget, 10.0)
        cached, total = [0, 0], [0, 0]  # first 10, first 100
        for i, prompt in enumerate(workload(systems, 100, 2)):
            got = await run(new, f"n{i}", prompt, 1)
            for k, first in enumerate((10, 100)):
                if i < first:
                    cached[k] += got[2]
                    total[k] += len(prompt)
        print(f"{num_systems} system prompts, {mode}: warm start {res.outcome}, {res.blocks} blocks, {res.bytes} "
              f"bytes; hit rate first 10 {cached[0] / total[0]:.3f}, first 100 {cached[1] / total[1]:.3f}")
        new.close()
    holder.close()


if __name__ == "__main__":
    asyncio.run(main(make_tiny_model_dir("llama", Path(tempfile.mkdtemp())), int(sys.argv[1])))
