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


def uneven_label_batches(lengths: tuple[int, ...], rows: int, vocab: int, seed: int = 0) -> list[dict]:
    """One `token_batches` batch per length in `lengths`, every other row's first 5 labels
    ignored (-100): sequence chunks (and dp halves alike) hold different numbers of valid
    targets, so a loss normalised per part instead of over the whole batch differs."""
    out = []
    for i, t in enumerate(lengths):
        b = token_batches(1, rows, t, vocab, seed=seed + i)[0]
        lab = b["labels"].clone()
        for r in range(0, rows, 2):
            lab[r, :5] = -100
        out.append({"input_ids": b["input_ids"], "labels": lab})
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
    q/k RMSNorms, which its tp plan marks `replicated_with_grad_allreduce`), "gemma2"
    (tied, soft-capped logits, explicit head_dim 16), "mistral" (sdpa, a sliding window of 5
    on every layer), "mixtral" (4 experts, top-2, its router load-balancing loss added to
    the loss with coefficient 0.5) or "qwen2_moe" (the same, and a gated shared expert on
    every layer: an ordinary parameter under expert parallel) or "deepseek_v3" (MLA, a sigmoid
    router with an `e_score_correction_bias` buffer, a shared expert). Defaults: vocab 101 (odd, so vocabulary
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
             "gemma2": dict(head_dim=16, attn_implementation="eager"),
             "mistral": dict(sliding_window=5, attn_implementation="sdpa"),
             # intermediate 96: torch's grouped_mm (HF's MoE kernel) wants 16-byte strides
             "mixtral": dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                             output_router_logits=True, router_aux_loss_coef=0.5),
             # DeepSeek-V3: MLA attention, a sigmoid router with its e_score_correction_bias buffer
             # (aux-loss-free balancing), 4 routed experts (top-2) and a shared expert, every layer MoE
             "deepseek_v3": dict(moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                                 num_experts_per_tok=2, first_k_dense_replace=0, n_group=1, topk_group=1,
                                 q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                 v_head_dim=16, num_key_value_heads=8, tie_word_embeddings=False),
             # Qwen2-MoE: 4 routed experts (top-2) and a gated shared expert on every layer
             "qwen2_moe": dict(moe_intermediate_size=96, shared_expert_intermediate_size=96, num_experts=4,
                               num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                               output_router_logits=True, router_aux_loss_coef=0.5, tie_word_embeddings=False)}
    classes = {"llama": ("LlamaForCausalLM", "LlamaConfig"), "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
               "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"), "gemma2": ("Gemma2ForCausalLM", "Gemma2Config"),
               "mistral": ("MistralForCausalLM", "MistralConfig"), "mixtral": ("MixtralForCausalLM", "MixtralConfig"),
               "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig"),
               "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config")}
    if family not in classes:
        raise ValueError(f"make_tiny_causal_lm: family {family!r}; choose one of {sorted(classes)}")
    model_cls, cfg_cls = (getattr(transformers, n) for n in classes[family])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_cls(cfg_cls(**{**fields, **extra[family], **config}))


class Routed(nn.Module):
    """A data-dependent model (MoE-style routing): rows with x[:, 0] > 0 go to expert 0, the
    others to expert 1, and an expert no row reached is not called, so its parameters take
    no part in the loss. `experts_in_a_list=True` keeps the experts in an nn.ModuleList
    (ZeRO-3 then gathers each as its own unit). Shapes: x [B, 6] -> [B, 3]."""

    D, H, OUT = 6, 8, 3

    def __init__(self, experts_in_a_list: bool = True, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(self.D, self.H)
        experts = [nn.Linear(self.H, self.OUT), nn.Linear(self.H, self.OUT)]
        if experts_in_a_list:
            self.experts = nn.ModuleList(experts)
        else:
            self.e0, self.e1 = experts
        self.in_list = experts_in_a_list

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        experts = list(self.experts) if self.in_list else [self.e0, self.e1]
        route = x[:, 0] > 0
        out = x.new_zeros(x.shape[0], self.OUT)
        for sel, expert in ((route, experts[0]), (~route, experts[1])):
            if bool(sel.any()):
                out = out.index_put((sel.nonzero().squeeze(1),), expert(h[sel]))
        return out


def routed_batches(n_batches: int, rows: int, seed: int = 0) -> list[dict]:
    """Batches for `Routed`: the first half of every batch's rows routes to expert 0, the
    second half to expert 1 (so on 2 dp ranks each rank reaches one expert only)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        x = torch.randn(rows, Routed.D, generator=g)
        x[:, 0] = x[:, 0].abs() + 0.1
        x[rows // 2:, 0] *= -1
        out.append({"x": x, "y": torch.randn(rows, Routed.OUT, generator=g)})
    return out


class BatchNormMLP(nn.Module):
    """Linear -> BatchNorm1d -> tanh -> Linear: a model with mutable buffers (running stats)
    whose training forward normalises by each batch's own statistics. Shapes: x [B, 6] -> [B, 3]."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(6, 10)
        self.norm = nn.BatchNorm1d(10)
        self.out = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.inp(x))))


class TinyExperts(nn.Module):
    """E experts as fused tensors, the expert on dim 0 (w_in [E, F, H], w_out [E, H, F]), with
    Hugging Face's experts contract: `forward(hidden [T, H], top_k_index [T, k], top_k_weights
    [T, k]) -> [T, H]` = sum_j weights[t, j] * expert_{index[t, j]}(hidden[t]), a plain
    Python loop over the experts that were hit (the reference arithmetic)."""

    def __init__(self, num_experts: int, hidden: int, ffn: int):
        super().__init__()
        self.num_experts = num_experts
        self.w_in = nn.Parameter(torch.randn(num_experts, ffn, hidden) / hidden ** 0.5)
        self.w_out = nn.Parameter(torch.randn(num_experts, hidden, ffn) / ffn ** 0.5)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            if token.numel() == 0:
                continue
            y = torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(hidden[token], self.w_in[e])),
                                           self.w_out[e])
            out = out.index_add(0, token, y * top_k_weights[token, slot, None])
        return out


class TinyMoE(nn.Module):
    """A regression model with one MoE layer and a shared expert: x [B, S, d_in] -> [B, S, 1].
    The router is a Linear with a bias (softmax, top-k, weights renormalised over the k, as
    Mixtral's); `router_bias` fixes that bias (e.g. to send every token to a few experts);
    `experts` is a `TinyExperts` (plan `{"experts": "experts"}`), `shared` an ordinary Linear."""

    def __init__(self, num_experts: int = 4, k: int = 2, d_in: int = 6, hidden: int = 8, ffn: int = 12,
                 router_bias: list[float] | None = None, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.k = k
        self.embed = nn.Linear(d_in, hidden)
        self.router = nn.Linear(hidden, num_experts)
        if router_bias is not None:
            with torch.no_grad():
                self.router.bias.copy_(torch.tensor(router_bias))
        self.experts = TinyExperts(num_experts, hidden, ffn)
        self.shared = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = torch.tanh(self.embed(x)).reshape(b * s, -1)
        probs = torch.softmax(self.router(h), dim=-1)
        weights, index = torch.topk(probs, self.k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        h = h + self.experts(h, index, weights) + self.shared(h)
        return self.head(h).reshape(b, s, 1)


def moe_batches(n_batches: int, batch_size: int, seq: int, d_in: int = 6, seed: int = 0) -> list[dict]:
    """Regression batches for `TinyMoE`: {"x": [B, S, d_in], "y": [B, S, 1]}."""
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(batch_size, seq, d_in, generator=g), "y": torch.randn(batch_size, seq, 1, generator=g)}
            for _ in range(n_batches)]
