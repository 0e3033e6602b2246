"""EAGLE-1 draft layers (Li et al., 2024): one Llama decoder layer that
extrapolates the target's features, read in the checkpoint layout vLLM and
SGLang load (``EagleLlamaForCausalLM``)::

    folder/config.json          a LlamaConfig of the draft: hidden_size, num_attention_heads,
                                num_key_value_heads, intermediate_size, num_hidden_layers (1),
                                rms_norm_eps, rope_theta (rope_scaling), vocab_size
    folder/model.safetensors    (or pytorch_model.bin) names without a "model." prefix:
        fc.weight                               [H, 2H]   (fc.bias [H]: EAGLE's own checkpoints)
        layers.0.self_attn.{q,k,v,o}_proj.weight
        layers.0.post_attention_layernorm.weight
        layers.0.mlp.{gate,up,down}_proj.weight
        embed_tokens.weight, lm_head.weight     optional, never read: the target's are used

The draft row for position i reads the target's final (normed) hidden state
``h_i`` and the token at ``i + 1``::

    x  = fc([embed(t_{i+1}); h_i])                       (embedding first, as vLLM and SGLang)
    r  = x + o_proj(attn(x))                             (layer 0 has no input norm)
    f  = r + mlp(post_attention_layernorm(r))            (no final norm)
    lm_head(f) guesses t_{i+2};  (f, guess) is the next row's input

Attention is causal over the draft's own keys and values of positions 0..i
(Llama RoPE at position i); where they are kept is the caller's business
(``workers/spec_eagle.py``). ``vocab_shortlist`` in ``config.json`` (an
extension, as for Medusa heads: what ``train-heads`` writes) scores only those
rows of the LM head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from workers.model.config import ModelArchConfig
from workers.model.layers import RotaryEmbedding, rope_inv_freq

WEIGHTS = "model.safetensors"
_LAYER = "layers.0."
_PROJS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class EagleDraft(torch.nn.Module):
    """The draft layer's weights and its row computations (module doc)."""

    def __init__(self, arch: ModelArchConfig, fc_bias: bool = False) -> None:
        super().__init__()
        h, q, kv = arch.hidden_size, arch.q_size, arch.kv_size
        self.arch = arch
        self.num_heads, self.num_kv_heads = arch.num_attention_heads, arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.fc = torch.nn.Linear(2 * h, h, bias=fc_bias)
        shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                  "self_attn.o_proj": (h, q), "mlp.gate_proj": (arch.intermediate_size, h),
                  "mlp.up_proj": (arch.intermediate_size, h), "mlp.down_proj": (h, arch.intermediate_size)}
        self.proj = torch.nn.ParameterDict({name.replace(".", "_"): torch.nn.Parameter(torch.zeros(shape))
                                            for name, shape in shapes.items()})
        self.post_norm = torch.nn.Parameter(torch.ones(h))
        self.register_buffer("inv_freq", rope_inv_freq(arch.head_dim, arch.rope_theta, _llama3(arch)),
                             persistent=False)
        self.shortlist: Optional[torch.Tensor] = None  # token ids the LM head is scored on

    def w(self, name: str) -> torch.Tensor:
        return self.proj[name.replace(".", "_")]

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` [N, H] (the layer's input) and the rows' RoPE'd queries
        [N, heads, d], keys and values [N, kv heads, d]."""
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        n, d = x.shape[0], self.head_dim
        q = F.linear(x, self.w("self_attn.q_proj")).view(n, self.num_heads, d)
        k = F.linear(x, self.w("self_attn.k_proj")).view(n, self.num_kv_heads, d)
        v = F.linear(x, self.w("self_attn.v_proj")).view(n, self.num_kv_heads, d)
        freqs = positions.to(self.inv_freq.dtype)[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
        return x, RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output feature from its input ``x`` and the attention
        output [N, heads * d]."""
        r = x + F.linear(attn, self.w("self_attn.o_proj"))
        r32 = r.float()
        normed = (r32 * torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + self.arch.rms_norm_eps)).to(r.dtype)
        normed = normed * self.post_norm
        mlp = F.linear(F.silu(F.linear(normed, self.w("mlp.gate_proj"))) * F.linear(normed, self.w("mlp.up_proj")),
                       self.w("mlp.down_proj"))
        return r + mlp

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Batched attention: ``q`` [B, Q, heads, d], ``k`` / ``v`` [B, L, kv heads, d],
        ``mask`` [B, Q, L] (True: attend) -> [B, Q, heads * d]."""
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=2).transpose(1, 2)
        v = v.repeat_interleave(group, dim=2).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask.unsqueeze(1))
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)

    # ------------------------------------------------------------- checkpoint
    def save(self, folder: Path, extra_config: Optional[dict] = None) -> None:
        """Writes the layout of the module doc (safetensors, LlamaConfig)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {"fc.weight": self.fc.weight.detach().contiguous(),
                   f"{_LAYER}post_attention_layernorm.weight": self.post_norm.detach().contiguous()}
        if self.fc.bias is not None:
            tensors["fc.bias"] = self.fc.bias.detach().contiguous()
        for name in _PROJS:
            tensors[f"{_LAYER}{name}.weight"] = self.w(name).detach().contiguous()
        save_file(tensors, str(folder / WEIGHTS))
        a = self.arch
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": a.hidden_size,
                  "intermediate_size": a.intermediate_size, "num_attention_heads": a.num_attention_heads,
                  "num_key_value_heads": a.num_key_value_heads, "head_dim": a.head_dim, "num_hidden_layers": 1,
                  "rms_norm_eps": a.rms_norm_eps, "rope_theta": a.rope_theta,
                  "max_position_embeddings": a.max_position_embeddings, "vocab_size": a.vocab_size,
                  "hidden_act": "silu", "tie_word_embeddings": False, "bias": self.fc.bias is not None,
                  **(extra_config or {})}
        if self.shortlist is not None:
            config["vocab_shortlist"] = self.shortlist.tolist()
        (folder / "config.json").write_text(json.dumps(config, indent=2))

    @classmethod
    def load(cls, folder: Path, target: ModelArchConfig) -> "EagleDraft":
        """Reads an EAGLE-1 checkpoint made for ``target`` (the model it drafts for).

        Raises:
            ValueError: No such checkpoint, or one whose shapes or vocabulary
                do not fit the target.
        """
        folder = Path(folder)
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise ValueError(f"{folder} is not an EAGLE checkpoint: it has no config.json "
                             "(prefixserve train-heads --method eagle writes one)")
        config = json.loads(config_path.read_text())
        tensors = _read_tensors(folder)
        for key in ("hidden_size", "vocab_size"):
            if key in config and int(config[key]) != getattr(target, key):
                raise ValueError(f"{folder}: the EAGLE draft has {key} {config[key]}, the target "
                                 f"{getattr(target, key)}: it was made for another model")
        if int(config.get("num_hidden_layers", 1)) != 1:
            raise ValueError(f"{folder}: EAGLE drafts of {config['num_hidden_layers']} layers are not supported; "
                             "EAGLE-1 checkpoints have one decoder layer")
        draft_config = {**config, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1}
        draft_config.setdefault("rope_theta", target.rope_theta)
        arch = ModelArchConfig.from_hf_config(draft_config)
        draft = cls(arch, fc_bias="fc.bias" in tensors)
        expect = {"fc.weight": tuple(draft.fc.weight.shape),
                  f"{_LAYER}post_attention_layernorm.weight": (arch.hidden_size,)}
        expect.update({f"{_LAYER}{n}.weight": tuple(draft.w(n).shape) for n in _PROJS})
        embed = tensors.get("embed_tokens.weight")
        if embed is not None and tuple(embed.shape) != (target.vocab_size, target.hidden_size):
            raise ValueError(f"{folder}: embed_tokens.weight is {tuple(embed.shape)}, the target's embedding "
                             f"{(target.vocab_size, target.hidden_size)}: it was made for another model")
        for name, shape in expect.items():
            got = tensors.get(name)
            if got is None:
                raise ValueError(f"{folder}: {name} is missing: not an EAGLE-1 checkpoint in vLLM's layout")
            if tuple(got.shape) != shape:
                raise ValueError(f"{folder}: {name} is {tuple(got.shape)}, expected {shape} for a target of "
                                 f"hidden size {target.hidden_size}: it was made for another model")
        with torch.no_grad():
            draft.fc.weight.copy_(tensors["fc.weight"])
            if draft.fc.bias is not None:
                draft.fc.bias.copy_(tensors["fc.bias"])
            draft.post_norm.copy_(tensors[f"{_LAYER}post_attention_layernorm.weight"])
            for name in _PROJS:
                draft.w(name).copy_(tensors[f"{_LAYER}{name}.weight"])
        shortlist = config.get("vocab_shortlist")
        if shortlist is not None:
            ids = torch.tensor(shortlist, dtype=torch.long)
            if ids.dim() != 1 or not len(ids) or int(ids.min()) < 0 or int(ids.max()) >= target.vocab_size:
                raise ValueError(f"{folder}: vocab_shortlist must list token ids below {target.vocab_size}")
            draft.shortlist = ids
        return draft.eval()


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files (or ``pytorch_model.bin``), names without ``model.``."""
    files = sorted(folder.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for path in files:
            out.update(load_file(str(path)))
    elif (folder / "pytorch_model.bin").is_file():
        out = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{folder} has no weights: an EAGLE checkpoint needs model.safetensors or pytorch_model.bin")
    return {name.removeprefix("model."): t for name, t in out.items()}


def _llama3(arch: ModelArchConfig):
    from workers.model.config import Llama3RopeScaling

    return arch.rope_scaling if isinstance(arch.rope_scaling, Llama3RopeScaling) else None
