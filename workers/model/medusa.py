"""Medusa heads (Cai et al., 2024): extra decoding heads on the model's last
hidden state, head i guessing the token i + 2 places ahead (the model's own
LM head gives the next one).

Head i is ``medusa_num_layers`` residual blocks ``x + SiLU(W x + b)``, then a
vocabulary projection: its own (``{i}.{L}.weight``) or, when the checkpoint
has none, the model's LM head (what ``prefixserve train-heads`` writes: the
heads stay a few MB). The checkpoint layout is Medusa's own::

    folder/config.json                  {"medusa_num_heads": 4, "medusa_num_layers": 1,
                                         "hidden_size": ..., "vocab_size": ...}
    folder/medusa_lm_head.safetensors   "{i}.{j}.linear.weight" [H, H], "{i}.{j}.linear.bias" [H],
                                        optional "{i}.{L}.weight" [V, H]

Token-conditioned heads (``"medusa_token_conditioned": true``; what
``train-heads`` writes, an extension of the layout, Hydra's idea in its
simplest form) also read the token the model just sampled from that hidden
state, which plain Medusa heads ignore although it is known when they run:
their first block is ``x + SiLU(W [x; e(t)] + b)``, ``W`` of ``[H, 2H]``,
``e`` the model's input embedding (bound with ``bind_embedding``). On the
default model's chat answers this raises head 0's top-1 accuracy by about a
quarter (0.196 to 0.253 on unseen questions, same data).

``propose`` takes the top-1 token of the first k heads for each row: the
speculator's proposals for the next step, verified by the target like any
other (``workers/engine/spec_decode.py``). ``propose_candidates`` gives the m
likeliest combinations of the heads' top tokens (by the product of the
heads' probabilities, as Medusa's trees choose), which the speculator merges
into a tree.

Heads that read the model's LM head pay for a pass over it every step (on
the default model, 49152 x 576 floats: a fifth of the weights). With a
``vocab_shortlist`` in ``config.json`` (the ids of the tokens the model says
most often, which ``train-heads`` writes; FR-Spec's frequency-ranked
drafting vocabulary) they score only those rows, packed once when the heads
are bound to the model (``bind_lm_head``): a guess outside the shortlist is
never made, and nothing else changes (guesses are verified like any other).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

WEIGHTS = "medusa_lm_head.safetensors"


class MedusaHeads(torch.nn.Module):
    """Args: hidden size, vocabulary, number of heads and residual blocks per
    head; ``own_lm_head``: each head has its own vocabulary projection."""

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1,
                 own_lm_head: bool = False, token_conditioned: bool = False) -> None:
        super().__init__()
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers = num_heads, num_layers
        self.token_conditioned = token_conditioned
        self.weights = torch.nn.ParameterList()
        self.biases = torch.nn.ParameterList()
        for k in range(num_heads * num_layers):
            width = 2 * hidden_size if token_conditioned and k % num_layers == 0 else hidden_size
            self.weights.append(torch.nn.Parameter(torch.zeros(hidden_size, width)))
            self.biases.append(torch.nn.Parameter(torch.zeros(hidden_size)))
        self.lm_heads = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(vocab_size, hidden_size)) for _ in range(num_heads)] if own_lm_head else [])
        self.shortlist: Optional[torch.Tensor] = None  # token ids the shared LM head is scored on (module doc)
        self._short_head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # set by bind_lm_head
        self._embed: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # set by bind_embedding
        self._blocks: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # every head's block, one GEMM

    def transform(self, hidden: torch.Tensor, head: int, token_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Head ``head``'s residual blocks over ``hidden`` [N, H] (and, for
        token-conditioned heads, ``token_embeds`` [N, H]: the embeddings of
        the tokens sampled from those rows)."""
        x = hidden
        for j in range(self.num_layers):
            k = head * self.num_layers + j
            inputs = torch.cat([x, token_embeds], dim=1) if self.token_conditioned and j == 0 else x
            x = x + F.silu(F.linear(inputs, self.weights[k], self.biases[k]))
        return x

    def bind_embedding(self, embed: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The model's input embedding (token ids -> [N, H]), which token-conditioned heads read."""
        self._embed = embed

    def _token_embeds(self, tokens: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if not self.token_conditioned:
            return None
        if tokens is None or self._embed is None:
            raise ValueError("token-conditioned Medusa heads need the sampled tokens and bind_embedding()")
        return self._embed(tokens)

    def logits(self, hidden: torch.Tensor, head: int, lm_head: Callable[[torch.Tensor], torch.Tensor],
               tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.transform(hidden, head, self._token_embeds(tokens))
        return F.linear(x, self.lm_heads[head]).float() if len(self.lm_heads) else lm_head(x).float()

    def bind_lm_head(self, lm_head: torch.nn.Module) -> None:
        """Packs, once for every later proposal, on CPU: every head's block
        into one GEMM (one block per head); with a shortlist and no own
        projections, the model's LM-head rows of the shortlisted tokens."""
        from workers.model import gemm

        lib = gemm.load() if self.weights[0].device.type == "cpu" else None
        if lib is not None and self.num_layers == 1 and self.weights[0].dtype == torch.float32:
            # One packed GEMM for every head's block (they read the same input): a pass over
            # 4 x 576 x 1152 floats at batch 1 is ~0.4 ms this way, 1.6 ms through F.linear.
            stacked = torch.cat([w.detach() for w in self.weights]).float().contiguous()
            self._blocks = gemm.PackedWeight(stacked, torch.cat([b.detach() for b in self.biases]).float(), lib).matmul
        if self.shortlist is None or len(self.lm_heads):
            return
        packed = getattr(lm_head, "packed", None)
        rows = packed.rows(self.shortlist) if packed is not None else lm_head.weight.detach()[self.shortlist]
        rows = rows.float().contiguous()
        if lib is not None:
            self._short_head = gemm.PackedWeight(rows, None, lib).matmul
        else:
            self._short_head = lambda x: F.linear(x.to(rows.dtype), rows)

    def _head_logits(self, hidden: torch.Tensor, k: int, lm_head: Callable[[torch.Tensor], torch.Tensor],
                     tokens: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``[N, k, V']`` logits of the first ``k`` heads for each row, and the
        token id of each column when they cover the shortlist only (None: the
        column is the token)."""
        if len(self.lm_heads):
            return torch.stack([self.logits(hidden, i, lm_head, tokens) for i in range(k)], dim=1), None
        # One pass of the shared LM head over every head's rows (one GEMM, not k).
        embeds = self._token_embeds(tokens)
        if self._blocks is not None:  # x + SiLU(W x + b) of every head at once, then head-major rows
            inputs = hidden if embeds is None else torch.cat([hidden, embeds], dim=1)
            pre = self._blocks(inputs.float().contiguous()).view(len(hidden), self.num_heads, -1)[:, :k]
            x = (hidden.unsqueeze(1) + F.silu(pre)).transpose(0, 1).reshape(k * len(hidden), -1)
        else:
            x = torch.cat([self.transform(hidden, i, embeds) for i in range(k)])
        if self._short_head is not None:
            logits, ids = self._short_head(x).float(), self.shortlist
        else:
            logits, ids = lm_head(x).float(), None
        return logits.view(k, hidden.shape[0], -1).transpose(0, 1), ids

    @torch.inference_mode()
    def propose(self, hidden: torch.Tensor, k: int, lm_head: Callable[[torch.Tensor], torch.Tensor],
                tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[N, k]`` top-1 tokens of the first ``k`` heads for each row of
        ``hidden`` (the model's final, normed hidden states; ``tokens``: the
        token sampled from each, which token-conditioned heads need)."""
        logits, ids = self._head_logits(hidden, min(k, self.num_heads), lm_head, tokens)
        best = logits.argmax(dim=-1)
        return best if ids is None else ids[best]

    @torch.inference_mode()
    def propose_candidates(self, hidden: torch.Tensor, k: int, m: int,
                           lm_head: Callable[[torch.Tensor], torch.Tensor],
                           tokens: Optional[torch.Tensor] = None) -> list[list[list[int]]]:
        """Per row of ``hidden``: up to ``m`` candidate continuations of ``k``
        tokens (head i's choice at position i), likeliest first by the sum of
        the heads' log-probabilities; the first is ``propose``'s."""
        if m <= 1:
            return [[row] for row in self.propose(hidden, k, lm_head, tokens).tolist()]
        logits, ids = self._head_logits(hidden, min(k, self.num_heads), lm_head, tokens)
        top_lp, top_ids = torch.log_softmax(logits, dim=-1).topk(m, dim=-1)  # [N, k, m]
        if ids is not None:
            top_ids = ids[top_ids]
        out = []
        for lps, tokens in zip(top_lp.tolist(), top_ids.tolist()):
            out.append([[tokens[i][r] for i, r in enumerate(ranks)] for ranks in _best_rank_tuples(lps, m)])
        return out

    # ------------------------------------------------------------- checkpoint
    def save(self, folder: Path, extra_config: Optional[dict] = None) -> None:
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for i in range(self.num_heads):
            for j in range(self.num_layers):
                k = i * self.num_layers + j
                tensors[f"{i}.{j}.linear.weight"] = self.weights[k].detach().contiguous()
                tensors[f"{i}.{j}.linear.bias"] = self.biases[k].detach().contiguous()
            if len(self.lm_heads):
                tensors[f"{i}.{self.num_layers}.weight"] = self.lm_heads[i].detach().contiguous()
        save_file(tensors, str(folder / WEIGHTS))
        config = {"medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers,
                  "hidden_size": self.hidden_size, "vocab_size": self.vocab_size, **(extra_config or {})}
        if self.token_conditioned:
            config["medusa_token_conditioned"] = True
        if self.shortlist is not None:
            config["vocab_shortlist"] = self.shortlist.tolist()
        (folder / "config.json").write_text(json.dumps(config, indent=2))

    @classmethod
    def load(cls, folder: Path, hidden_size: int, vocab_size: int) -> "MedusaHeads":
        """Reads a Medusa checkpoint folder made for a model of this hidden
        size and vocabulary.

        Raises:
            ValueError: No such checkpoint, or one for another model's shapes.
        """
        from safetensors import safe_open

        folder = Path(folder)
        config_path, weights_path = folder / "config.json", folder / WEIGHTS
        if not config_path.is_file() or not weights_path.is_file():
            raise ValueError(f"{folder} is not a Medusa checkpoint: it needs config.json and {WEIGHTS} "
                             "(prefixserve train-heads writes one)")
        config = json.loads(config_path.read_text())
        num_heads, num_layers = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
        conditioned = bool(config.get("medusa_token_conditioned", False))
        with safe_open(str(weights_path), framework="pt", device="cpu") as f:
            names = set(f.keys())
            own = f"0.{num_layers}.weight" in names
            heads = cls(hidden_size, vocab_size, num_heads, num_layers, own_lm_head=own,
                        token_conditioned=conditioned)
            for i in range(num_heads):
                for j in range(num_layers):
                    k = i * num_layers + j
                    weight = f.get_tensor(f"{i}.{j}.linear.weight")
                    if tuple(weight.shape) != tuple(heads.weights[k].shape):
                        raise ValueError(f"{folder}: head {i} has hidden size {weight.shape[0]}, the model "
                                         f"{hidden_size}: these heads were trained for another model"
                                         if weight.shape[0] != hidden_size else
                                         f"{folder}: block {j} of head {i} reads {weight.shape[1]} inputs, not "
                                         f"{heads.weights[k].shape[1]}: medusa_token_conditioned in config.json "
                                         "does not match the weights")
                    heads.weights[k].data.copy_(weight)
                    heads.biases[k].data.copy_(f.get_tensor(f"{i}.{j}.linear.bias"))
                if own:
                    proj = f.get_tensor(f"{i}.{num_layers}.weight")
                    if tuple(proj.shape) != (vocab_size, hidden_size):
                        raise ValueError(f"{folder}: head {i} projects to {proj.shape[0]} tokens, the model has "
                                         f"{vocab_size}: these heads were trained for another model")
                    heads.lm_heads[i].data.copy_(proj)
        shortlist = config.get("vocab_shortlist")
        if shortlist is not None:
            ids = torch.tensor(shortlist, dtype=torch.long)
            if ids.dim() != 1 or not len(ids) or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
                raise ValueError(f"{folder}: vocab_shortlist must list token ids below {vocab_size}")
            heads.shortlist = ids
        return heads.eval()


def _best_rank_tuples(logprobs: list[list[float]], m: int) -> list[tuple[int, ...]]:
    """The ``m`` rank tuples (one rank per position, ranks into each
    position's descending ``logprobs``) with the largest sums, best first."""
    import heapq

    k = len(logprobs)
    start = (0,) * k
    heap = [(-sum(lp[0] for lp in logprobs), start)]
    seen = {start}
    out: list[tuple[int, ...]] = []
    while heap and len(out) < m:
        neg, ranks = heapq.heappop(heap)
        out.append(ranks)
        for i in range(k):
            if ranks[i] + 1 < len(logprobs[i]):
                nxt = ranks[:i] + (ranks[i] + 1,) + ranks[i + 1 :]
                if nxt not in seen:
                    seen.add(nxt)
                    heapq.heappush(heap, (neg + logprobs[i][ranks[i]] - logprobs[i][ranks[i] + 1], nxt))
    return out
