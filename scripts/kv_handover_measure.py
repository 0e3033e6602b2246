"""The cache hand-over measured in one process (docs/KV_TRANSFER.md, "Hand-over on
scale-down"): the default model, a 512-token prefix cached on a stopping replica, handed
over to three receivers in turn (``import_pushed``, as ``import_kv`` runs it); prints the
blocks, bytes and seconds of each hand-over and the TTFT of each receiver's first request
against the stopping replica's cold prefill. Run:
``.venv/bin/python scripts/kv_handover_measure.py``."""

import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.engine.test_kv_handover import FakeDirectory, LocalReceiver  # noqa: E402
from tests.engine.test_kv_transfer import make_side, run  # noqa: E402
from workers.kv_handover import hand_over  # noqa: E402


async def main(stopping, receivers) -> None:
    prompt = [random.Random(1).randrange(3, 20000) for _ in range(513)]
    began = time.perf_counter()
    cold = await run(stopping, "cold", prompt, 1)
    cold_s = time.perf_counter() - began
    for i, side in enumerate(receivers):
        res = await hand_over(stopping.transfer, FakeDirectory({"r": 0.0}), lambda rid: LocalReceiver(side), "me",
                              "", 64 * 2**20, 10.0)
        began = time.perf_counter()
        got = await run(side, "after", prompt, 1)
        print(f"round {i}: {res.outcome}, {res.blocks} blocks, {res.bytes / 1e6:.1f} MB, hand-over "
              f"{res.seconds:.3f}s; first request: {got[2]} cached tokens, TTFT {time.perf_counter() - began:.3f}s "
              f"(cold prefill {cold_s:.3f}s), same tokens {got[0] == cold[0]}")


if __name__ == "__main__":
    sides = [make_side(None, num_kv_blocks=256) for _ in range(4)]
    try:
        asyncio.run(main(sides[0], sides[1:]))
    finally:
        for s in sides:
            s.close()
