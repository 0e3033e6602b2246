"""EAGLE-3 draft layers (Li et al., 2025), read in the checkpoint layout vLLM
(``Eagle3LlamaForCausalLM``, ``llama_eagle3.py``) and SGLang load::

    folder/config.json        a LlamaConfig of the draft (num_hidden_layers 1) plus
                              draft_vocab_size       rows of its own LM head (default vocab_size)
                              target_hidden_size     width of the target's features (default hidden_size)
                              eagle_aux_hidden_state_layer_ids   optional (also under eagle_config):
                                                     which target layers' inputs it reads;
                                                     default (2, L // 2, L - 3), vLLM's for Llama
    folder/model.safetensors  names without "model."; "midlayer." read as "layers.0.":
        fc.weight                                 [H, 3 * H_target]   (no bias)
        layers.0.input_layernorm.weight           [H]   norms the token embedding
        layers.0.hidden_norm.weight               [H]   norms the fused feature
        layers.0.self_attn.{q,k,v}_proj.weight    [*, 2H]  over [embed; feature]
        layers.0.self_attn.o_proj.weight, layers.0.post_attention_layernorm.weight,
        layers.0.mlp.{gate,up,down}_proj.weight
        norm.weight                               [H]   before the LM head
        lm_head.weight                            [V_draft, H]
        d2t                                       [V_draft] int64: target id = draft id + d2t[id]
        t2d                                       [V] bool (the draft's ids in the target's vocabulary;
                                                  read for its shape only, as vLLM skips it)
        embed_tokens.weight                       optional [V, H]: absent, the target's is shared

The target's *features* of position i are the residual stream entering three
of its layers (low, middle, high: ``aux_layer_ids``), concatenated. Row i of
the draft reads them (or, from the second guess on, its own previous output)
and the token at ``i + 1``::

    g  = fc([a_low; a_mid; a_high])        (a draft feature, H wide, is used as is)
    u  = [input_layernorm(embed(t_{i+1})); hidden_norm(g)]           [2H]
    r  = g + o_proj(attn(q, k, v of u))                              (norm_before_residual: hidden_norm(g) + ...)
    f  = r + mlp(post_attention_layernorm(r))                        the next row's feature
    lm_head(norm(f)) over the draft vocabulary; d2t maps the best one to a target id

Attention, the draft's paged KV and batching are EAGLE-1's
(``workers/spec_eagle.py``, ``workers/spec_eagle3.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from workers.model.config import ModelArchConfig
from workers.model.eagle import EagleDraft, _llama3, _read_tensors
from workers.model.layers import RotaryEmbedding, rope_inv_freq

WEIGHTS = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"
_LAYER = "layers.0."
_PROJS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_NORMS = {"input_norm": "layers.0.input_layernorm.weight", "hidden_norm": "layers.0.hidden_norm.weight",
          "post_norm": "layers.0.post_attention_layernorm.weight", "norm": "norm.weight"}


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's choice for Llama targets: the inputs of layers 2, L // 2 and L - 3."""
    return (2, num_layers // 2, num_layers - 3)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class Eagle3Draft(torch.nn.Module):
    """The EAGLE-3 layer's weights and row computations (module doc), with
    ``EagleDraft``'s interface (``qkv``, ``finish``, ``attend``) so the
    EAGLE-1 proposer and the EAGLE-2 trees run it unchanged."""

    attend = EagleDraft.attend

    def __init__(self, arch: ModelArchConfig, target_hidden_size: int, draft_vocab_size: int,
                 aux_layer_ids: tuple[int, ...], norm_before_residual: bool = False) -> None:
        super().__init__()
        h, q, kv, inter = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
        self.arch = arch
        self.target_hidden_size = target_hidden_size
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.norm_before_residual = norm_before_residual
        self.num_heads, self.num_kv_heads = arch.num_attention_heads, arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.fc = torch.nn.Linear(len(self.aux_layer_ids) * target_hidden_size, h, bias=False)
        shapes = {"self_attn.q_proj": (q, 2 * h), "self_attn.k_proj": (kv, 2 * h), "self_attn.v_proj": (kv, 2 * h),
                  "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
                  "mlp.down_proj": (h, inter)}
        self.proj = torch.nn.ParameterDict({name.replace(".", "_"): torch.nn.Parameter(torch.zeros(shape))
                                            for name, shape in shapes.items()})
        self.norms = torch.nn.ParameterDict({name: torch.nn.Parameter(torch.ones(h)) for name in _NORMS})
        self.lm_head = torch.nn.Parameter(torch.zeros(draft_vocab_size, h))
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("inv_freq", rope_inv_freq(arch.head_dim, arch.rope_theta, _llama3(arch)),
                             persistent=False)
        self.embed: Optional[torch.Tensor] = None  # its own token embedding, when the checkpoint has one
        self.shortlist = None  # EagleDraft's: the draft vocabulary plays its part here

    def w(self, name: str) -> torch.Tensor:
        return self.proj[name.replace(".", "_")]

    @property
    def token_ids(self) -> torch.Tensor:
        """The target's id of every draft-vocabulary id."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The residual ``x`` [N, H] and the rows' RoPE'd queries, keys and
        values; ``hidden`` is the target's fused features [N, 3 * H_target]
        or the draft's own features [N, H]."""
        eps = self.arch.rms_norm_eps
        g = self.fc(hidden) if hidden.shape[-1] != self.arch.hidden_size else hidden
        normed = _rms(g, self.norms["hidden_norm"], eps)
        x = normed if self.norm_before_residual else g
        u = torch.cat([_rms(embeds, self.norms["input_norm"], eps), normed], dim=-1)
        n, d = u.shape[0], self.head_dim
        q = F.linear(u, self.w("self_attn.q_proj")).view(n, self.num_heads, d)
        k = F.linear(u, self.w("self_attn.k_proj")).view(n, self.num_kv_heads, d)
        v = F.linear(u, self.w("self_attn.v_proj")).view(n, self.num_kv_heads, d)
        freqs = positions.to(self.inv_freq.dtype)[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos().to(u.dtype), freqs.sin().to(u.dtype)
        return x, RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output feature f (before the final norm) from its
        residual ``x`` and the attention output [N, heads * d]."""
        r = x + F.linear(attn, self.w("self_attn.o_proj"))
        normed = _rms(r, self.norms["post_norm"], self.arch.rms_norm_eps)
        mlp = F.linear(F.silu(F.linear(normed, self.w("mlp.gate_proj"))) * F.linear(normed, self.w("mlp.up_proj")),
                       self.w("mlp.down_proj"))
        return r + mlp

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Scores [N, V_draft] of features [N, H]."""
        return F.linear(_rms(features, self.norms["norm"], self.arch.rms_norm_eps), self.lm_head)

    # ------------------------------------------------------------- checkpoint
    def save(self, folder: Path, extra_config: Optional[dict] = None) -> None:
        """Writes vLLM's layout (module doc): ``midlayer.`` names, as the
        published EAGLE-3 checkpoints, and ``t2d`` built from ``d2t``."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        vocab = self.arch.vocab_size
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[self.token_ids.cpu()] = True
        tensors = {"fc.weight": self.fc.weight, "lm_head.weight": self.lm_head, "d2t": self.d2t, "t2d": t2d}
        tensors.update({name.replace(_LAYER, "midlayer."): self.norms[key] for key, name in _NORMS.items()})
        tensors.update({f"midlayer.{name}.weight": self.w(name) for name in _PROJS})
        save_file({k: t.detach().cpu().contiguous() for k, t in tensors.items()}, str(folder / WEIGHTS))
        a = self.arch
        config = {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": a.hidden_size,
                  "intermediate_size": a.intermediate_size, "num_attention_heads": a.num_attention_heads,
                  "num_key_value_heads": a.num_key_value_heads, "head_dim": a.head_dim, "num_hidden_layers": 1,
                  "rms_norm_eps": a.rms_norm_eps, "rope_theta": a.rope_theta,
                  "max_position_embeddings": a.max_position_embeddings, "vocab_size": vocab,
                  "draft_vocab_size": len(self.d2t), "target_hidden_size": self.target_hidden_size,
                  "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids), "hidden_act": "silu",
                  "tie_word_embeddings": False, **(extra_config or {})}
        (folder / "config.json").write_text(json.dumps(config, indent=2))

    @classmethod
    def load(cls, folder: Path, target: ModelArchConfig) -> "Eagle3Draft":
        """Reads an EAGLE-3 checkpoint made for ``target``.

        Raises:
            ValueError: No such checkpoint, or one whose shapes, vocabulary or
                feature layers do not fit the target.
        """
        folder = Path(folder)
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise ValueError(f"{folder} is not an EAGLE-3 checkpoint: it has no config.json "
                             "(prefixserve train-heads --method eagle3 writes one)")
        config = json.loads(config_path.read_text())
        tensors = {_canonical(name): t for name, t in _read_tensors(folder).items()}
        vocab = int(config.get("vocab_size", target.vocab_size))
        target_hidden = int(config.get("target_hidden_size") or config.get("hidden_size", target.hidden_size))
        if vocab != target.vocab_size:
            raise ValueError(f"{folder}: the EAGLE-3 draft has vocab_size {vocab}, the target {target.vocab_size}: "
                             "it was made for another model")
        if target_hidden != target.hidden_size:
            raise ValueError(f"{folder}: the EAGLE-3 draft reads features of width {target_hidden} "
                             f"(target_hidden_size), the target's are {target.hidden_size}: "
                             "it was made for another model")
        if int(config.get("num_hidden_layers", 1)) != 1:
            raise ValueError(f"{folder}: EAGLE-3 drafts of {config['num_hidden_layers']} layers are not supported; "
                             "vLLM's EAGLE-3 checkpoints have one decoder layer")
        draft_config = {**config, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1}
        draft_config.setdefault("rope_theta", target.rope_theta)
        arch = ModelArchConfig.from_hf_config(draft_config)
        draft_vocab = int(config.get("draft_vocab_size") or vocab)
        layer_ids = _aux_layer_ids(config, target.num_hidden_layers, folder)
        if 3 * target_hidden == arch.hidden_size:
            raise ValueError(f"{folder}: a draft {arch.hidden_size} wide over three features of width "
                             f"{target_hidden} is ambiguous (fused and own features have the same width)")
        draft = cls(arch, target_hidden, draft_vocab, layer_ids, bool(config.get("norm_before_residual", False)))
        # The norms first: an EAGLE-1 checkpoint has no hidden_norm, so it is named as what it is not.
        expect = {name: (arch.hidden_size,) for name in _NORMS.values()}
        expect.update({"fc.weight": tuple(draft.fc.weight.shape), "lm_head.weight": (draft_vocab, arch.hidden_size)})
        expect.update({f"{_LAYER}{n}.weight": tuple(draft.w(n).shape) for n in _PROJS})
        for name, shape in expect.items():
            got = tensors.get(name)
            if got is None:
                raise ValueError(f"{folder}: {name} is missing: not an EAGLE-3 checkpoint in vLLM's layout")
            if tuple(got.shape) != shape:
                raise ValueError(f"{folder}: {name} is {tuple(got.shape)}, expected {shape} for a target of "
                                 f"hidden size {target.hidden_size}: it was made for another model")
        _check_vocab_maps(folder, tensors, draft_vocab, vocab)
        embed = tensors.get("embed_tokens.weight")
        if embed is not None and tuple(embed.shape) != (vocab, arch.hidden_size):
            raise ValueError(f"{folder}: embed_tokens.weight is {tuple(embed.shape)}, expected "
                             f"{(vocab, arch.hidden_size)}: it was made for another model")
        if embed is None and arch.hidden_size != target.hidden_size:
            raise ValueError(f"{folder}: a draft {arch.hidden_size} wide over a target {target.hidden_size} wide "
                             "needs its own embed_tokens.weight")
        with torch.no_grad():
            draft.fc.weight.copy_(tensors["fc.weight"])
            draft.lm_head.copy_(tensors["lm_head.weight"])
            for key, name in _NORMS.items():
                draft.norms[key].copy_(tensors[name])
            for name in _PROJS:
                draft.w(name).copy_(tensors[f"{_LAYER}{name}.weight"])
            if "d2t" in tensors:
                draft.d2t.copy_(tensors["d2t"].long())
        draft.embed = embed
        return draft.eval()


def _canonical(name: str) -> str:
    return _LAYER + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def _aux_layer_ids(config: dict, num_layers: int, folder: Path) -> tuple[int, ...]:
    """The target layers whose inputs the draft reads (module doc), checked against the target's depth."""
    nested = config.get("eagle_config") or {}
    ids = config.get("eagle_aux_hidden_state_layer_ids") or nested.get("eagle_aux_hidden_state_layer_ids")
    ids = tuple(int(i) for i in ids) if ids else default_aux_layer_ids(num_layers)
    if len(ids) != 3 or not all(0 <= i < num_layers for i in ids):
        raise ValueError(f"{folder}: EAGLE-3 reads the inputs of three target layers, here {list(ids)}, but the "
                         f"target has {num_layers} layers (0..{num_layers - 1}); set eagle_aux_hidden_state_layer_ids "
                         "in its config.json")
    return ids


def _check_vocab_maps(folder: Path, tensors: dict[str, torch.Tensor], draft_vocab: int, vocab: int) -> None:
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None:
        if draft_vocab != vocab:
            raise ValueError(f"{folder}: a draft vocabulary of {draft_vocab} tokens (the target has {vocab}) "
                             "needs d2t, the draft-to-target id offsets")
    else:
        if tuple(d2t.shape) != (draft_vocab,) or d2t.is_floating_point():
            raise ValueError(f"{folder}: d2t must be {draft_vocab} integers (draft_vocab_size), got "
                             f"{tuple(d2t.shape)} {d2t.dtype}")
        ids = torch.arange(draft_vocab) + d2t.long()
        if int(ids.min()) < 0 or int(ids.max()) >= vocab or len(ids.unique()) != draft_vocab:
            raise ValueError(f"{folder}: d2t maps draft ids outside the target's vocabulary of {vocab} tokens, "
                             "or two draft ids to one target id: it was made for another model")
    if t2d is not None and tuple(t2d.shape) != (vocab,):
        raise ValueError(f"{folder}: t2d is {tuple(t2d.shape)}, expected ({vocab},) for the target's vocabulary")
