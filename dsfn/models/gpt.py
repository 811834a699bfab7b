"""A small decoder-only GPT (GPT-2 layout) for examples, tests and benchmarks.

Shapes: B = batch, T = sequence length (<= config.seq_len), D = d_model, H = n_head,
V = vocab_size.

The module is plain PyTorch; dsfn trains it through `dsfn.functionalize(model)`.
Repeated `Block`s are the natural ZeRO-3 / activation-checkpointing units, which the
class advertises the way Hugging Face models do (`_no_split_modules`).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPT",
    "MLP",
    "PRESETS",
    "Block",
    "CausalSelfAttention",
    "GPTConfig",
    "generate",
    "gpt_loss",
    "greedy_generate",
    "tp_plan",
]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of `GPT`. Defaults are a byte-level model of ~0.8M parameters."""

    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_head={self.n_head}")
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def preset(cls, name: str, **overrides) -> GPTConfig:
        """A named size, optionally with fields overridden (e.g. `preset("small", seq_len=64)`).

        - "tiny"  (~0.17M params): unit tests.
        - "small" (~1.8M): the default of `examples/train_gpt.py`; trains visibly on 2 CPU cores.
        - "27m"   (27.4M): 6 layers, d512, seq 128, vocab 8192, untied head — the GPT the
          peers (DDP, FSDP2, DeepSpeed) were measured on (`measured.md`).
        - "50m"   (~50M): 8 layers, d640, same vocab and head as "27m".
        """
        try:
            base = PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown GPT preset {name!r}; choose one of {sorted(PRESETS)}") from None
        return dataclasses.replace(base, **overrides)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def num_params(self) -> int:
        """Parameter count of `GPT(self)` from the shapes alone (a tied weight counted once)."""
        d, h = self.d_model, self.mlp_ratio * self.d_model
        block = (2 * 2 * d                 # two LayerNorms
                 + d * 3 * d + 3 * d       # qkv
                 + d * d + d               # attn.proj
                 + d * h + h + h * d + d)  # mlp
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2) + self.seq_len * d
        return emb + self.n_layer * block + 2 * d   # + final LayerNorm


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, seq_len=64, n_layer=3, n_head=4, d_model=64),
    "small": GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=6, d_model=192),
    # 6*12*512^2 (blocks) + 2*8192*512 (untied embeddings) + 128*512 (positions) ≈ 27.37M,
    # the 27.4M-parameter model of the peers' measurements.
    "27m": GPTConfig(vocab_size=8192, seq_len=128, n_layer=6, n_head=8, d_model=512,
                     tie_embeddings=False),
    "50m": GPTConfig(vocab_size=8192, seq_len=128, n_layer=8, n_head=10, d_model=640,
                     tie_embeddings=False),
}


def tp_plan() -> dict:
    """`GPT`'s tensor-parallel plan (for `dsfn.transforms.tensor_parallel(plan, model=...)`):
    Megatron's split. The fused qkv Linear is split per part (rank r holds [q_r; k_r; v_r]:
    its heads of each), attn.proj and mlp.proj are rowwise, mlp.fc colwise, the token
    embedding vocab-parallel and the (tied) LM head colwise with its output gathered."""
    from dsfn.transforms.tensor_parallel import packed
    return {"tok_emb": "embedding_rowwise",
            "blocks.*.attn.qkv": packed("colwise", 3),
            "blocks.*.attn.proj": "rowwise",
            "blocks.*.mlp.fc": "colwise",
            "blocks.*.mlp.proj": "rowwise",
            "lm_head": "colwise_rep"}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection (GPT-2's `c_attn`)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)   # [D] -> [q | k | v], each [D]
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D] -> [B, T, D]."""
        B, T, _ = x.shape
        # chunk/-1 rather than D/H: under tensor parallel this rank holds H/tp heads ([q_r|k_r|v_r])
        q, k, v = self.qkv(x).chunk(3, dim=-1)                 # 3 x [B, T, D]
        # [B, T, D] -> [B, H, T, D/H]
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """D -> mlp_ratio*D -> GELU -> D."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D] -> [B, T, D]."""
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D] -> [B, T, D]."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer: token + learned position embeddings, `n_layer` Blocks,
    final LayerNorm, linear head (tied to the token embedding when `tie_embeddings`).

    `forward(input_ids: Long[B, T]) -> logits: Float[B, T, V]`.

    Parameters are initialised deterministically from `seed` with a private generator
    (the global RNG is neither read nor advanced): GPT-2 style normal(0, 0.02), biases 0,
    and residual output projections scaled by 1/sqrt(2*n_layer).
    """

    # Hugging Face convention: modules that must stay whole (ZeRO-3 / remat units).
    _no_split_modules: ClassVar[list[str]] = ["Block"]

    def __init__(self, config: GPTConfig | None = None, seed: int = 0):
        super().__init__()
        cfg = config if config is not None else GPTConfig()
        self.config = cfg
        # torch's layer constructors draw their default init from the global RNG; fork it so
        # building a model does not shift the caller's random stream (reset_parameters
        # overwrites those values anyway).
        with torch.random.fork_rng(devices=[]):
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
            self.drop = nn.Dropout(cfg.dropout)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            # One Parameter object under two names; functionalize keeps it once.
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Re-initialise every parameter from `seed` (same seed -> same weights)."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)

        def normal_(p: torch.Tensor, std: float) -> None:
            # Sample on CPU with the private generator so the result is device-independent.
            p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=g))

        seen: set[int] = set()
        for mod_name, module in self.named_modules():  # fixed order -> fixed draws per seed
            for name, p in module.named_parameters(recurse=False):
                if id(p) in seen:                      # the tied lm_head weight: already drawn
                    continue
                seen.add(id(p))
                full = f"{mod_name}.{name}" if mod_name else name
                if isinstance(module, nn.LayerNorm):
                    p.fill_(1.0 if name == "weight" else 0.0)
                elif name == "bias":
                    p.zero_()
                elif full.endswith(("attn.proj.weight", "mlp.proj.weight")):
                    normal_(p, resid_std)              # keeps the residual stream's variance O(1)
                else:
                    normal_(p, 0.02)

    def num_params(self, include_position: bool = True) -> int:
        """Number of distinct parameters (a tied weight counted once)."""
        n = sum(p.numel() for p in self.parameters())  # .parameters() already deduplicates
        return n if include_position else n - self.pos_emb.weight.numel()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids: Long[B, T] -> logits Float[B, T, V]. `position_ids` (Long[B, T] or [T],
        default 0..T-1): each token's position in its sequence, < seq_len — given when the
        tokens are a slice of a longer sequence (sequence parallelism)."""
        T = input_ids.shape[1]
        if position_ids is None:
            if T > self.config.seq_len:
                raise ValueError(f"sequence length {T} exceeds config.seq_len={self.config.seq_len}")
            position_ids = torch.arange(T, device=input_ids.device)
        elif position_ids.numel() and int(position_ids.max()) >= self.config.seq_len:
            raise ValueError(f"position {int(position_ids.max())} exceeds config.seq_len={self.config.seq_len}")
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(position_ids))   # [B, T, D]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))                            # [B, T, V]


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy. logits: [B, T, V], targets: Long[B, T] -> 0-dim."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


@torch.no_grad()
def generate(logits_fn: Callable[[torch.Tensor], torch.Tensor], prompt: torch.Tensor,
             max_new_tokens: int, seq_len: int, temperature: float = 0.0,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Append `max_new_tokens` tokens to `prompt`, greedily (temperature 0) or sampled.

    logits_fn: Long[B, T] -> Float[B, T, V] (a module, or `lambda ids: apply_fn(params, ids)`).
    prompt: Long[B, T0]. Returns Long[B, T0 + max_new_tokens]. With temperature > 0 each
    token is drawn from softmax(logits / temperature) using `generator` (seed it for a
    reproducible sample). The context is cropped to the last `seq_len` tokens (no KV
    cache: this is for short samples).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    ids = prompt
    for _ in range(max_new_tokens):
        logits = logits_fn(ids[:, -seq_len:])[:, -1].float()           # [B, V]
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)     # [B, 1]
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def greedy_generate(logits_fn: Callable[[torch.Tensor], torch.Tensor], prompt: torch.Tensor,
                    max_new_tokens: int, seq_len: int) -> torch.Tensor:
    """`generate` with temperature 0: always the most likely next token."""
    return generate(logits_fn, prompt, max_new_tokens, seq_len)
