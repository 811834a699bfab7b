"""Tiny deterministic models and data for tests and property checks."""
from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """Linear-tanh stack; `sizes` = [in, hidden..., out]."""

    def __init__(self, sizes: list[int]):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def make_mlp(sizes: list[int], seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP(sizes)


def regression_batches(n_batches: int, batch_size: int, d_in: int, d_out: int, seed: int = 0) -> list[dict]:
    """Random regression batches {"x": [B, d_in], "y": [B, d_out]} from a fixed generator."""
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(batch_size, d_in, generator=g), "y": torch.randn(batch_size, d_out, generator=g)}
            for _ in range(n_batches)]


def token_batches(n_batches: int, batch_size: int, seq_len: int, vocab: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        ids = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g)
        out.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    return out


def make_tiny_llama(seed: int = 0, **config):
    """A small Hugging Face `LlamaForCausalLM` with random weights (needs the `hf` extra).

    Defaults: vocab 128, hidden 64, 3 layers, 4 heads (2 kv heads), tied embeddings;
    `config` overrides any `LlamaConfig` field.
    """
    import warnings

    import transformers
    torch.manual_seed(seed)
    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**fields, **config}))


def make_tiny_causal_lm(family: str = "llama", seed: int = 0, **config):
    """A small random-weight Hugging Face causal LM (no download; needs the `hf` extra).

    `family`: "llama" (tied embeddings), "qwen2" (q/k/v biases, untied), "qwen3" (per-head
    q/k RMSNorms, which its tp plan marks `replicated_with_grad_allreduce`) or "gemma2"
    (tied, soft-capped logits, explicit head_dim 16). Defaults: vocab 101 (odd, so vocabulary
    splits pad), hidden 64, intermediate 90, 2 layers, 8 query / 4 key-value heads (tp 2
    and 4 divide them); `config` overrides any field.
    """
    import warnings

    import transformers
    torch.manual_seed(seed)
    fields = dict(vocab_size=101, hidden_size=64, intermediate_size=90, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=64)
    extra = {"llama": dict(tie_word_embeddings=True), "qwen2": dict(tie_word_embeddings=False),
             "qwen3": dict(head_dim=8, tie_word_embeddings=False),
             "gemma2": dict(head_dim=16, attn_implementation="eager")}
    classes = {"llama": ("LlamaForCausalLM", "LlamaConfig"), "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
               "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"), "gemma2": ("Gemma2ForCausalLM", "Gemma2Config")}
    if family not in classes:
        raise ValueError(f"make_tiny_causal_lm: family {family!r}; choose one of {sorted(classes)}")
    model_cls, cfg_cls = (getattr(transformers, n) for n in classes[family])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_cls(cfg_cls(**{**fields, **extra[family], **config}))
