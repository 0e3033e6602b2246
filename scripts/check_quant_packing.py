"""Checks prefixserve's GPTQ / AWQ checkpoint packing against AutoAWQ's own
packing code (``awq/utils/packing_utils.py``, pure torch), from its PyPI sdist:

    .venv/bin/pip download --no-deps autoawq==0.2.9 -d /tmp/autoawq && tar xzf /tmp/autoawq/*.tar.gz -C /tmp/autoawq
    .venv/bin/python scripts/check_quant_packing.py /tmp/autoawq/autoawq-0.2.9/awq/utils/packing_utils.py

AWQ tensors unpacked with AutoAWQ's ``unpack_awq`` + ``reverse_awq_order`` must
give our integers, zeros and scales; its ``unpack_reorder_pack`` (AWQ to the
exllama / GPTQ v1 layout, zeros minus one) must give our GPTQ tensors.
Not part of the test suite (it needs the download); exits 1 on a mismatch.

Zero point 0 (a group whose weights are all >= 0) is left out: GPTQ v1 stores
``zero - 1`` = -1 there, which AutoAWQ's int8 shifts and AutoGPTQ's uint32 OR
spill into the neighbouring nibbles differently; we store 15 in the nibble
alone and read it back as 0.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.model.quant import gptq  # noqa: E402
from workers.model.quant.checkpoint_writer import pack_layer

logger = logging.getLogger("check_quant_packing")


def main(packing_utils: str) -> int:
    spec = importlib.util.spec_from_file_location("autoawq_packing", packing_utils)
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    rng = np.random.default_rng(0)
    failed = 0
    for n, k, group in ((64, 128, 32), (576, 1536, 128), (192, 576, 64)):
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        d = gptq.rtn(w, group)
        zeros = np.rint(-d.mins / d.scales).astype(np.int64)
        awq_t = {name: t.contiguous() for name, t in pack_layer(d, "awq").items()}
        gptq_t = {name: t.contiguous() for name, t in pack_layer(d, "gptq").items()}
        iw, iz = ref.reverse_awq_order(*ref.unpack_awq(awq_t["qweight"], awq_t["qzeros"], 4), 4)
        qw, qz = ref.unpack_reorder_pack(awq_t["qweight"], awq_t["qzeros"], 4)
        checks = {
            "awq integers": torch.equal(torch.bitwise_and(iw, 15).long(), torch.from_numpy(d.q.T.astype(np.int64))),
            "awq zeros": torch.equal(torch.bitwise_and(iz, 15).long(), torch.from_numpy(zeros.T)),
            "scales": torch.equal(awq_t["scales"].float(), torch.from_numpy(d.scales.T)),
            "gptq qweight": torch.equal(qw, gptq_t["qweight"]),
            "gptq qzeros": torch.equal(qz, gptq_t["qzeros"]),
        }
        logger.info("%dx%d group %d: %s", n, k, group, ", ".join(f"{c} {'ok' if v else 'DIFFERENT'}"
                                                               for c, v in checks.items()))
        failed += not all(checks.values())
    return 1 if failed else 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(main(sys.argv[1]))
