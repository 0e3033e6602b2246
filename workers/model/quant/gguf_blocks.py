"""GGUF's block formats, decoded into the integer weights, per-group scales and
mins of ``qgemm.QuantWeight`` (``w = scale * q + min``).

For each format the scales and mins are computed with the float32 operations
``gguf.quants.dequantize`` uses (``d * sc``, ``dmin * m``), so a decoded weight
dequantizes to exactly gguf's value (``tests/unit/test_gguf_blocks.py``)::

    Q8_0   [d f16][32 x int8]                       q = x,        scale d
    Q4_0   [d f16][16 bytes: 32 nibbles]            q = nibble,   scale d,     min -8d (exact)
    Q4_1   [d f16][m f16][16 bytes]                 q = nibble,   scale d,     min m
    Q5_0   [d f16][qh 4 B: 32 fifth bits][16 B]     q = 0..31,    scale d,     min -16d (exact)
    Q5_1   [d f16][m f16][qh 4 B][16 B]             q = 0..31,    scale d,     min m
    Q4_K   [d][dmin][12 bytes 6-bit sc, m][128 B]   q = nibble,   scale d*sc,  min -(dmin*m), 8 groups of 32
    Q5_K   as Q4_K, plus 32 bytes of 5th bits       q = 0..31,    scale d*sc,  min -(dmin*m)
    Q6_K   [128 B low 4][64 B high 2][16 x int8 sc][d]  q = -32..31, scale d*sc, 16 groups of 16

Nibble order inside a block follows gguf: the low nibbles of the packed bytes
are the first elements, the high nibbles the next ones. Q5_0 / Q5_1 keep bit 4
of element i in bit i of the little-endian ``qh``. Q4_0 and Q5_0 are signed
(``d * (q - 8)``, ``d * (q - 16)``): as ``d * q + min`` each product and the
sum are exact in float32 (an f16 ``d`` times at most 5 bits), so the same
value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

QK_K = 256


@dataclass
class DecodedWeight:
    """A GGUF tensor as ``scale * q + min`` per group (rows = output features)."""

    q: np.ndarray  # [N, K] uint8 (bits 4: 0..15, bits 5: 0..31) or int8 (bits 8)
    scales: np.ndarray  # [N, ceil(K / group_size)] float32
    mins: Optional[np.ndarray]  # [N, ceil(K / group_size)] float32 or None
    bits: int
    group_size: int
    format: str

    def dequantize(self) -> np.ndarray:
        """``scale * q + min`` in float32, as gguf computes it."""
        k = self.q.shape[1]
        scale = np.repeat(self.scales, self.group_size, axis=1)[:, :k]
        out = scale * self.q.astype(np.float32)
        if self.mins is not None:
            out = out + np.repeat(self.mins, self.group_size, axis=1)[:, :k]
        return out

    def take_rows(self, rows: np.ndarray) -> "DecodedWeight":
        return DecodedWeight(self.q[rows], self.scales[rows], None if self.mins is None else self.mins[rows],
                             self.bits, self.group_size, self.format)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32).reshape(raw.shape[0])


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """Unpacks bytes [n, chunk/2 * c] into values [n, chunk * c]: per chunk of
    ``chunk`` values, the low nibbles first, then the high ones."""
    n = qs.shape[0]
    parts = qs.reshape(n, -1, 1, chunk // 2) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (parts & np.uint8(0x0F)).reshape(n, -1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scales and mins of a K-quant superblock (gguf's ``Q4_K.get_scale_min``)."""
    n = scales.shape[0]
    s = scales.view(np.uint8).reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(n, 8), mn.reshape(n, 8)


def decode(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> DecodedWeight:
    """Decodes a GGUF tensor's raw blocks (``reader.tensors[i].data``, rows of
    bytes) of ``shape`` ``(N, K)``.

    Raises:
        ValueError: A format without a decoder here (names the supported ones).
    """
    n, k = shape
    decoder = _DECODERS.get(type_name)
    if decoder is None:
        raise ValueError(f"GGUF tensor type {type_name} has no native kernel; supported: "
                         f"{', '.join(sorted(_DECODERS))} (or load without quantization='gguf')")
    per_block = QK_K if type_name.endswith("_K") else 32
    if k % per_block:
        raise ValueError(f"a {type_name} tensor needs rows of a multiple of {per_block} values, got {k}")
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, _BLOCK_BYTES[type_name])
    if blocks.shape[0] != n * k // per_block:
        raise ValueError(f"{type_name} tensor of shape {shape} holds {blocks.shape[0]} blocks, "
                         f"expected {n * k // per_block}")
    return decoder(blocks, n, k)


def _q8_0(b: np.ndarray, n: int, k: int) -> DecodedWeight:
    d = _f16(b[:, :2])
    q = b[:, 2:].view(np.int8).reshape(n, k)
    return DecodedWeight(q, d.reshape(n, k // 32), None, 8, 32, "q8_0")


def _q4_0(b: np.ndarray, n: int, k: int) -> DecodedWeight:
    d = _f16(b[:, :2]).reshape(n, k // 32)
    q = _nibbles(b[:, 2:], 32).reshape(n, k)
    return DecodedWeight(q, d, (d * np.float32(-8)).astype(np.float32), 4, 32, "q4_0")


def _q4_1(b: np.ndarray, n: int, k: int) -> DecodedWeight:
    d, m = _f16(b[:, :2]).reshape(n, k // 32), _f16(b[:, 2:4]).reshape(n, k // 32)
    q = _nibbles(b[:, 4:], 32).reshape(n, k)
    return DecodedWeight(q, d, m, 4, 32, "q4_1")


def _k_head(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-group scale ``d * sc`` and min ``-(dmin * m)`` of Q4_K / Q5_K superblocks."""
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    scale = (d[:, None] * sc.astype(np.float32)).astype(np.float32)
    minimum = -(dmin[:, None] * mn.astype(np.float32)).astype(np.float32)
    return scale, minimum


def _q4_k(b: np.ndarray, n: int, k: int) -> DecodedWeight:
    scale, minimum = _k_head(b)
    q = _nibbles(b[:, 16:], 64).reshape(n, k)
    return DecodedWeight(q, scale.reshape(n, k // 32), minimum.reshape(n, k // 32), 4, 32, "q4_k")


def _q5_k(b: np.ndarray, n: int, k: int) -> DecodedWeight:
    scale, minimum = _k_head(b)
    qh = b[:, 16:48]
    low = _nibbles(b[:, 48:], 64).reshape(-1, 8, 32)
    high = ((qh.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & np.uint8(1))
    q = (low | (high << np.uint8(4))).reshape(n, k)
    return DecodedWeight(q, scale.reshape(n, k // 32), minimum.reshape(n, k // 32), 5, 32, "q5_k")


def _fifth_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 values 0..31 per block of 32: nibbles, plus bit i of ``qh`` as bit 4 of element i."""
    low = _nibbles(qs, 32)
    high = (np.ascontiguousarray(qh).view("<u4") >> np.arange(32, dtype=np.uint32)) & np.uint32(1)
    return low | (high.astype(np.uint8) << np.uint8(4))


def _q5_0(b: np.ndarray, n: int, k: int) -> DecodedWeight:
    d = _f16(b[:, :2]).reshape(n, k // 32)
    q = _fifth_bits(b[:, 2:6], b[:, 6:]).reshape(n, k)
    return DecodedWeight(q, d, (d * np.float32(-16)).astype(np.float32), 5, 32, "q5_0")


def _q5_1(b: np.ndarray, n: int, k: int) -> DecodedWeight:
    d, m = _f16(b[:, :2]).reshape(n, k // 32), _f16(b[:, 2:4]).reshape(n, k // 32)
    q = _fifth_bits(b[:, 4:8], b[:, 8:]).reshape(n, k)
    return DecodedWeight(q, d, m, 5, 32, "q5_1")


def _q6_k(b: np.ndarray, n: int, k: int) -> DecodedWeight:
    ql, qh = b[:, :128], b[:, 128:192]
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    scale = (d[:, None] * sc).astype(np.float32)
    low = _nibbles(ql, 128).reshape(-1, 4, 32)  # per 128: 64 bytes -> 128 values, low then high nibbles
    high = ((qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1))
            & np.uint8(3)).reshape(-1, 4, 32)
    q = ((low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << np.uint8(4))).astype(np.int8) - np.int8(32))
    return DecodedWeight(q.reshape(n, k), scale.reshape(n, k // 16), None, 8, 16, "q6_k")


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q4_K": _q4_k,
             "Q5_K": _q5_k, "Q6_K": _q6_k}
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
