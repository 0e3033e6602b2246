"""Factories shared by the test packages: tiny random-init HF checkpoints and
the Hugging Face greedy oracle."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

# The one tiny model config of the tests (model, engine and integration tests).
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    # Peaked logits: greedy choices are decided by the weights, not float noise.
    initializer_range=0.2,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)


def make_hf_config(family: str, **overrides):
    """A tiny transformers config of ``family`` (llama | mistral | qwen2 | qwen3 |
    phi3 | phi3_longrope | gemma2 | gemma3 | mixtral | qwen2_moe | qwen3_moe);
    Mistral gets a sliding window of 8 unless told otherwise, Qwen3 its head_dim
    from the tiny sizes (its class defaults to 128), phi3_longrope Phi-3's
    longrope scaling with an original length of 20 (short and long factors far
    apart, so the switch changes the tokens), the MoE families 8 experts with
    top-2 routing (Qwen2-MoE a shared expert and a dense second layer)."""
    from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig, Phi3Config,
                              Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
               "phi3": Phi3Config, "phi3_longrope": Phi3Config, "gemma2": Gemma2Config,
               "gemma3": Gemma3TextConfig, "mixtral": MixtralConfig,
               "qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig}
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    defaults = {"mistral": {"sliding_window": 8},
                "qwen3": {"head_dim": head_dim},
                "phi3": {"pad_token_id": 0},  # its class default (32000) is outside the tiny vocabulary
                "phi3_longrope": {"pad_token_id": 0, "original_max_position_embeddings": 20,
                                  "rope_scaling": {"type": "longrope",
                                                   "short_factor": [1.0 + 0.1 * i for i in range(head_dim // 2)],
                                                   "long_factor": [1.0 + 0.9 * i for i in range(head_dim // 2)]}},
                # Interleaved local / global layers with their own RoPE bases; a scale that is not head_dim's.
                "gemma3": {"head_dim": head_dim, "query_pre_attn_scalar": 24, "sliding_window": 8,
                           "layer_types": ["sliding_attention", "full_attention"], "pad_token_id": 0,
                           "architectures": ["Gemma3ForCausalLM"],
                           "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                               "full_attention": {"rope_type": "default",
                                                                  "rope_theta": 1000000.0}}},
                # Alternating local / global layers (transformers' default), one RoPE base; caps small enough
                # to bend the scores and logits of these peaked weights.
                "gemma2": {"head_dim": head_dim, "query_pre_attn_scalar": 24, "sliding_window": 8,
                           "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0, "pad_token_id": 0,
                           "architectures": ["Gemma2ForCausalLM"]},
                "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 48},
                "qwen2_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                              "shared_expert_intermediate_size": 64, "mlp_only_layers": [1]},
                "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                              "head_dim": head_dim, "norm_topk_prob": True}}.get(family, {})
    return classes[family](**{**TINY, **defaults, **overrides})


def make_hf_model(config, seed: int = 0):
    """A random-init float32 HF model in eval mode; Qwen2's q/k/v biases and
    Qwen3's q/k norm weights made non-trivial (they start at 0 and 1)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if config.model_type in ("qwen2", "qwen2_moe"):  # make the q/k/v biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if config.model_type in ("gemma2", "gemma3_text"):  # their (1 + w) norms start at w = 0
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.3)
    if config.model_type in ("qwen3", "qwen3_moe"):
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
                layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
    return model


def make_tiny_model_dir(family: str, path: Path, seed: int = 0, with_tokenizer: bool = True, **overrides) -> Path:
    """Saves a random-init HF model of ``family`` (``make_hf_config``'s) to
    ``path``, with a tiny byte-level BPE ``tokenizer.json`` unless told not to."""
    model = make_hf_model(make_hf_config(family, **overrides), seed=seed)
    model.save_pretrained(path)
    if with_tokenizer:
        save_tiny_tokenizer(path, model.config.vocab_size)
    return path


def make_default_shaped_model_dir(path: Path, seed: int = 0) -> Path:
    """A random-init model with the default model's shape (SmolLM2-135M: 30
    layers, hidden 576, 9 query / 3 KV heads, vocabulary 49152, tied
    embeddings) and a tokenizer, for machines without the default model."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2)
    model = make_hf_model(config, seed=seed)
    model.save_pretrained(path)
    save_tiny_tokenizer(path, config.vocab_size)
    return path


def save_tiny_tokenizer(path: Path, vocab_size: int) -> None:
    """Trains a byte-level BPE of at most ``vocab_size`` tokens on a few
    sentences and saves it as ``tokenizer.json`` (ids 0-2 are special)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["hello world", "the quick brown fox jumps over the lazy dog", "prefix caching and paged attention"]
    tok.train_from_iterator(corpus * 20, trainer)
    tok.save(str(Path(path) / "tokenizer.json"))


# A chat template in the shape of ChatML, small enough to reason about in tests.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_router_tokenizer(folder: Path, template: str = CHAT_TEMPLATE, fingerprint: str = "fp-test"):
    """A ``RouterTokenizer`` over the tiny BPE (saved into ``folder``) with ``template``."""
    from tokenizers import Tokenizer

    from cluster.shared.chat_template import ChatTemplate
    from router.tokenizer import RouterTokenizer

    save_tiny_tokenizer(folder, 512)
    tokenizer = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    return RouterTokenizer(tokenizer, ChatTemplate(template, bos_token="<s>", eos_token="</s>"), fingerprint)


def import_blocking(modules: Sequence[str], blocked: Sequence[str], cwd: Path) -> Any:
    """Imports ``modules`` in a fresh interpreter where importing any of the
    ``blocked`` top-level packages raises ImportError."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {tuple(blocked)!r}:\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        f"import {', '.join(modules)}\n"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def hf_greedy(model_dir: Path, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int]) -> list[list[int]]:
    """Greedy continuations from transformers, one prompt at a time (no padding),
    generating exactly ``max_new_tokens`` (EOS ignored)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # Run to the length like ignore_eos does: EOS may be generated, never stops.
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_new_tokens):
            ids = torch.tensor([list(prompt)])
            gen = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                do_sample=False, pad_token_id=0,
            )
            outs.append(gen[0, len(prompt) :].tolist())
    return outs


def make_test_certs(folder: Path) -> dict[str, str]:
    """A CA, a server certificate (127.0.0.1, localhost) and a client certificate signed
    by it, as ``<stem>.crt`` / ``<stem>.key`` PEM files; returns ``{stem: folder/stem}``
    for ``ca``, ``server`` and ``client``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def build(subject: str, key, issuer_name, issuer_key, ca: bool, san=None):
        builder = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(issuer_name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san is not None:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def save(stem: str, cert, key) -> None:
        (folder / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (folder / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = build("prefixserve test CA", ca_key, name("prefixserve test CA"), ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    server = build("127.0.0.1", server_key, ca.subject, ca_key, ca=False, san=san)
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = build("client", client_key, ca.subject, ca_key, ca=False)
    save("ca", ca, ca_key)
    save("server", server, server_key)
    save("client", client, client_key)
    return {stem: str(folder / stem) for stem in ("ca", "server", "client")}


class OracleProposer:
    """Proposes the tokens a plain run produced after this prompt, every third
    proposed position changed to another token (so it is rejected)."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]) -> None:
        self.continuations = continuations
        self.calls = 0

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        for prompt, continuation in self.continuations.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                drafts = list(continuation[done : done + k])
                self.calls += 1
                if drafts and self.calls % 3 == 0:
                    drafts[-1] = (drafts[-1] + 1) % 500 + 3
                return drafts
        return []

    def drop(self, request_id: str) -> None:
        pass


class TreeOracleProposer(OracleProposer):
    """Candidates for a tree of proposals: first a wrong guess for the next
    token followed by the expected continuation (rejected at its root), then
    the expected continuation with every third call's last token changed, then
    one that leaves it at its second token. The sequence's samples walk the
    second candidate's branch, so accepted tokens sit away from their
    positions and are moved there."""

    def propose_candidates(self, request_id: str, token_ids: list[int], k: int, m: int) -> list[list[int]]:
        right = self.propose(request_id, token_ids, k)
        if not right:
            return []
        wrong_first = [(right[0] + 7) % 500 + 3, *right[1:]]
        candidates = [wrong_first, right]
        if len(right) > 2:
            candidates.append([right[0], (right[1] + 11) % 500 + 3, *right[2:]])
        return candidates[:m]


def resident_bytes(tensor: Any) -> int:
    """Bytes of ``tensor``'s pages that are resident (mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) * page
