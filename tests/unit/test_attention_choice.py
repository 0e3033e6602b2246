"""What attention_backend auto builds on each kind of machine, and why."""

from __future__ import annotations

import logging

import pytest
import torch

from workers.model.attention import auto_choice, cpu_decode, get_attention_backend


@pytest.mark.parametrize("dtype, block_size, flash, triton, want", [
    (torch.bfloat16, 256, True, True, "flash_attn"),
    (torch.float16, 512, True, False, "flash_attn"),
    (torch.bfloat16, 16, True, True, "triton"),  # the default block size: flash-attn cannot page it
    (torch.float32, 256, True, True, "triton"),  # flash-attn has no float32
    (torch.bfloat16, 256, False, True, "triton"),
    (torch.bfloat16, 16, False, False, "torch"),
    (None, None, True, True, "triton"),  # dtype and block size unknown: flash-attn is not assumed
])
def test_auto_on_cuda(dtype, block_size, flash, triton, want):
    name, reason = auto_choice("cuda", dtype, block_size, has_flash_attn=flash, has_triton=triton)
    assert name == want
    if want != "flash_attn":
        assert "flash-attn" in reason  # says what kept flash-attn out
    if block_size == 16 and flash:
        assert "multiple of 256" in reason


def test_auto_on_cpu_is_torch_whatever_is_installed():
    assert auto_choice("cpu", torch.float32, 16, has_flash_attn=True, has_triton=True)[0] == "torch"


def test_auto_logs_its_choice(caplog):
    with caplog.at_level(logging.INFO, logger="workers.model.attention"):
        backend = get_attention_backend("auto", "cpu", dtype=torch.float32, block_size=16)
    assert backend.name == "torch"
    assert any("attention backend auto: torch" in r.getMessage() for r in caplog.records)


def test_soft_capped_models_run_on_the_torch_backend(caplog):
    # Gemma 2 caps its attention scores; only the torch backend can (attention/softcap.py).
    with caplog.at_level(logging.INFO, logger="workers.model.attention"):
        assert get_attention_backend("auto", "cuda", dtype=torch.bfloat16, block_size=256,
                                     attn_softcap=True).name == "torch"
    assert any("soft-caps attention scores" in r.getMessage() for r in caplog.records)
    assert get_attention_backend("torch", "cpu", attn_softcap=True).name == "torch"
    for name in ("triton", "flash_attn"):
        with pytest.raises(ValueError, match=f"attention_backend '{name}' cannot soft-cap attention scores.*"
                                             "use attention_backend 'torch'"):
            get_attention_backend(name, "cuda", dtype=torch.bfloat16, block_size=256, attn_softcap=True)
    # batch_invariant serves it: the per-query native decode kernel caps scores; still CPU float32 only.
    if cpu_decode.load() is not None:
        backend = get_attention_backend("auto", "cpu", batch_invariant=True, attn_softcap=True)
        assert backend.name == "torch" and backend.batch_invariant
    with pytest.raises(ValueError, match="batch_invariant runs on CPU in float32"):
        get_attention_backend("torch", "cpu", dtype=torch.bfloat16, batch_invariant=True, attn_softcap=True)
