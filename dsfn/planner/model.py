"""What the planner reads off a model: its dimensions, a FLOPs count, its parameters on meta.

`ModelFacts.of(x)` takes a Hugging Face config (a `PretrainedConfig`, or a dict with its
`model_type`), a preset name (`dsfn.planner.presets`), dsfn's `GPTConfig`, or an nn.Module
(its `.config`). Nothing is downloaded and no weight is made: the module the planner hands
to `estimate_memory` is built under `torch.device("meta")`.

The FLOPs count is the model's matmuls, read from its dimensions, per token of a sequence
of `seq` tokens (2 m n k per [m, k] x [k, n] product):

| part | forward FLOPs per token                                                              |
|------|---------------------------------------------------------------------------------------|
| attention projections (GQA) | 2 h (nh d + 2 nkv d) + 2 nh d h                                 |
| attention projections (MLA, DeepSeek) | 2 h qr + 2 qr nh dqk (or 2 h nh dqk without q LoRA) + 2 h (kvr + drope) + 2 kvr nh (dnope + dv) + 2 nh dv h |
| attention scores and values | 2 s_eff nh (dqk + dv), s_eff = s/2 causal (Gemma2's sliding layers: min(window, s)/... ) |
| dense MLP | 6 h I gated (SwiGLU / GeGLU), 4 h I plain (GPT-2)                                      |
| MoE MLP | 2 h E (router) + k 6 h I_e (routed experts) + 6 h I_s (shared experts)                   |
| head | 2 h V                                                                                      |

Backward is 2x the forward (a product's two input gradients), so a step is 3x the forward
and remat adds one more forward of the checkpointed layers. Causal attention is counted at
half the square (what a causal flash kernel computes); `torch.utils.flop_counter` counts
the full square, and the test comparing the two counts says so. Element-wise work (norms,
activations, softmax) is left out, as in the MFU convention (PaLM, Megatron).

Activations (`act_bytes_per_token`): the bytes a layer keeps for its backward per token,
counted on the meta model with `torch.autograd.graph.saved_tensors_hooks` at the
planned dtype (a 1- and a 2-layer copy: the difference is a layer, the rest the root:
embeddings, head, loss), split into the tensors of width `hidden` (replicated under tp) and
the others (split by tp). Where the forward cannot run on meta (data-dependent MoE
routing) it is Korthikanti et al.'s 34 s h bytes at 16 bits per layer, all of it split.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dsfn.errors import ConfigError

__all__ = ["ModelFacts"]

_DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2")
_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


def _get(cfg: Any, *keys: str, default: Any = None) -> Any:
    for k in keys:
        v = cfg.get(k) if isinstance(cfg, dict) else getattr(cfg, k, None)
        if v is not None:
            return v
    return default


@dataclass(frozen=True)
class ModelFacts:
    """A decoder-only LM's dimensions (module docstring). `moe_layers`: layers whose MLP is
    routed; `experts`, `top_k`, `expert_ffn` (I_e), `shared_ffn` (I_s summed over shared
    experts). `mla`: DeepSeek's (q_lora_rank, kv_lora_rank, qk_nope, qk_rope, v_head) or None.
    `config`: what the meta module is built from."""

    name: str
    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = False
    gated: bool = True
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    moe_layers: int = 0
    mla: tuple | None = None
    sliding_window: int | None = None
    sliding_layers: int = 0
    config: Any = field(default=None, compare=False, repr=False)

    # --- reading ----------------------------------------------------------------------------
    @classmethod
    def of(cls, model: Any) -> "ModelFacts":
        """The facts of a config, preset name, GPTConfig or nn.Module (module docstring)."""
        if isinstance(model, ModelFacts):
            return model
        if isinstance(model, str):
            from dsfn.planner.presets import preset_config
            return cls.of(preset_config(model))
        if isinstance(model, nn.Module):
            cfg = getattr(model, "config", None)
            if cfg is None:
                raise ConfigError(f"plan: the model {type(model).__name__} has no .config to read its dimensions "
                                  "from; pass its Hugging Face config (or a dsfn GPTConfig), or a dict with "
                                  "model_type, hidden_size, num_hidden_layers, ...")
            return cls.of(cfg)
        from dsfn.models.gpt import GPTConfig
        if isinstance(model, GPTConfig):
            return cls("dsfn-gpt", "gpt", model.n_layer, model.d_model, model.n_head, model.n_head,
                       model.d_model // model.n_head, model.mlp_ratio * model.d_model, model.vocab_size,
                       tied=model.tie_embeddings, gated=False, config=model)
        mt = _get(model, "model_type")
        if mt is None:
            raise ConfigError(f"plan: cannot read a model from {type(model).__name__}: pass a Hugging Face config "
                              "(transformers.AutoConfig / a dict with its 'model_type'), a preset name "
                              f"(dsfn.planner.presets.PRESETS), a dsfn GPTConfig or an nn.Module with a .config")
        if mt not in _DENSE + _MOE:
            raise ConfigError(f"plan: the FLOPs count cannot read model_type {mt!r}: it reads {sorted(_DENSE + _MOE)} "
                              "and dsfn's GPT; pass the config of one of those (or ModelFacts(...) built by hand)")
        need = {"hidden_size": _get(model, "hidden_size"), "num_hidden_layers": _get(model, "num_hidden_layers"),
                "num_attention_heads": _get(model, "num_attention_heads"), "vocab_size": _get(model, "vocab_size")}
        missing = [k for k, v in need.items() if not isinstance(v, int)]
        if missing:
            raise ConfigError(f"plan: the {mt} config lacks {missing}; the FLOPs count needs them")
        h, L, nh, V = need["hidden_size"], need["num_hidden_layers"], need["num_attention_heads"], need["vocab_size"]
        nkv = _get(model, "num_key_value_heads", default=nh)
        hd = _get(model, "head_dim", default=h // nh)
        ffn = _get(model, "intermediate_size", default=4 * h)
        tied = bool(_get(model, "tie_word_embeddings", default=False))
        kw: dict[str, Any] = {}
        if mt == "mixtral":
            kw = dict(experts=_get(model, "num_local_experts"), top_k=_get(model, "num_experts_per_tok"),
                      expert_ffn=ffn, moe_layers=L)
        elif mt in ("qwen2_moe", "qwen3_moe"):
            step = _get(model, "decoder_sparse_step", default=1) or 1
            only = set(_get(model, "mlp_only_layers", default=[]) or [])
            moe = sum(1 for i in range(L) if i not in only and (i + 1) % step == 0)
            kw = dict(experts=_get(model, "num_experts"), top_k=_get(model, "num_experts_per_tok"),
                      expert_ffn=_get(model, "moe_intermediate_size"), moe_layers=moe,
                      shared_ffn=_get(model, "shared_expert_intermediate_size", default=0) or 0)
        elif mt == "deepseek_v3":
            kw = dict(experts=_get(model, "n_routed_experts"), top_k=_get(model, "num_experts_per_tok"),
                      expert_ffn=_get(model, "moe_intermediate_size"),
                      shared_ffn=(_get(model, "n_shared_experts", default=0) or 0) * _get(model, "moe_intermediate_size"),
                      moe_layers=L - (_get(model, "first_k_dense_replace", default=0) or 0),
                      mla=(_get(model, "q_lora_rank"), _get(model, "kv_lora_rank"), _get(model, "qk_nope_head_dim"),
                           _get(model, "qk_rope_head_dim"), _get(model, "v_head_dim")))
            nkv = nh
        window = _get(model, "sliding_window")
        sliding = 0
        if window and mt in ("gemma2", "gemma3_text"):
            sliding = L // 2 if mt == "gemma2" else L - L // 6         # gemma2 alternates; gemma3 5 local : 1 global
        elif window and mt == "mistral" and _get(model, "use_sliding_window", default=True):
            sliding = L
        elif window and mt in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
            sliding = 0 if not _get(model, "use_sliding_window", default=False) else L
        name = _get(model, "_name_or_path", "name_or_path", default="") or mt
        return cls(name, mt, L, h, nh, nkv, hd, ffn, V, tied=tied, sliding_window=window if sliding else None,
                   sliding_layers=sliding, config=model, **kw)

    # --- counts ----------------------------------------------------------------------------
    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    def _attn_params(self) -> int:
        h, nh = self.hidden, self.heads
        if self.mla is not None:
            qr, kvr, dn, dr, dv = self.mla
            q = h * nh * (dn + dr) if not qr else h * qr + qr * nh * (dn + dr)
            return q + h * (kvr + dr) + kvr * nh * (dn + dv) + nh * dv * h
        return h * nh * self.head_dim + 2 * h * self.kv_heads * self.head_dim + nh * self.head_dim * h

    def _mlp_params(self, ffn: int) -> int:
        return (3 if self.gated else 2) * self.hidden * ffn

    def layer_params(self, moe: bool, active: bool = False) -> int:
        """Matmul parameters of one layer (norms and biases left out): attention + MLP; a MoE
        layer's experts all of them, or the `top_k` a token meets when `active`."""
        if not moe:
            return self._attn_params() + self._mlp_params(self.ffn)
        routed = (self.top_k if active else self.experts) * self._mlp_params(self.expert_ffn)
        return self._attn_params() + routed + self._mlp_params(self.shared_ffn) + self.hidden * self.experts

    @property
    def params(self) -> int:
        """Matmul + embedding parameters (norms left out)."""
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        return emb + self.dense_layers * self.layer_params(False) + self.moe_layers * self.layer_params(True)

    @property
    def active_params(self) -> int:
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        return emb + self.dense_layers * self.layer_params(False) + self.moe_layers * self.layer_params(True, True)

    def _attn_core(self, seq: int, causal: bool) -> float:
        """Forward FLOPs per token of attention's two products over `seq` tokens, summed over layers."""
        if self.mla is not None:
            _, _, dn, dr, dv = self.mla
            dqk, dvv = dn + dr, dv
        else:
            dqk = dvv = self.head_dim
        per = lambda s: 2 * self.heads * (dqk + dvv) * ((s + 1) / 2 if causal else s)  # noqa: E731
        full = self.layers - self.sliding_layers
        if self.sliding_layers:
            w = min(self.sliding_window, seq)
            # a causal sliding window: a token meets min(position + 1, w) keys
            keys = (w * (w + 1) / 2 + (seq - w) * w) / seq if causal else w
            local = 2 * self.heads * (dqk + dvv) * keys
        else:
            local = 0.0
        return full * per(seq) + self.sliding_layers * local

    def forward_flops_per_token(self, seq: int, causal: bool = True) -> float:
        """Forward FLOPs per token of a `seq`-token sequence (module docstring)."""
        mm = 2 * (self.dense_layers * self.layer_params(False) + self.moe_layers * self.layer_params(True, True))
        return mm + 2 * self.hidden * self.vocab + self._attn_core(seq, causal)

    def layer_forward_flops_per_token(self, seq: int) -> float:
        """Forward FLOPs per token of the decoder layers alone (remat recomputes these)."""
        return self.forward_flops_per_token(seq) - 2 * self.hidden * self.vocab

    def train_flops_per_token(self, seq: int) -> float:
        """Forward + backward (3x forward): the model FLOPs MFU is counted in."""
        return 3 * self.forward_flops_per_token(seq)

    # --- the module on meta ----------------------------------------------------------------
    def meta_module(self, layers: int | None = None) -> nn.Module:
        """The model built under torch.device("meta") (`layers`: a copy with that many layers)."""
        return _meta_module(self, layers)

    def act_bytes_per_token(self, seq: int, elem: int) -> tuple[float, float, float]:
        """(replicated-under-tp bytes per token per layer, split-under-tp bytes per token per
        layer, root bytes per token) kept for backward at element size `elem` (module docstring)."""
        return _act_bytes(self, seq, elem)


_MODULES: dict[tuple, nn.Module] = {}
_ACTS: dict[tuple, tuple[float, float, float]] = {}


def _key(facts: ModelFacts) -> tuple:
    return dataclasses.astuple(dataclasses.replace(facts, config=None))


def _meta_module(facts: ModelFacts, layers: int | None) -> nn.Module:
    key = (_key(facts), layers)
    if key in _MODULES:
        return _MODULES[key]
    import warnings
    cfg = facts.config
    if facts.family == "gpt":
        from dsfn.models.gpt import GPT
        cfg = cfg if layers is None else dataclasses.replace(cfg, n_layer=layers)
        with torch.device("meta"):
            module = GPT(cfg)
    else:
        import transformers
        if isinstance(cfg, dict):
            cfg = dict(cfg)
            mt = cfg.pop("model_type")
            cfg = transformers.AutoConfig.for_model(mt, **cfg)
        else:
            cfg = copy.deepcopy(cfg)
        if layers is not None:
            cfg.num_hidden_layers = layers
            if getattr(cfg, "layer_types", None) is not None:
                cfg.layer_types = list(cfg.layer_types)[:layers]
            if facts.family == "deepseek_v3":         # every layer MoE: the copies' difference is one
                cfg.first_k_dense_replace = 0
        attn = getattr(cfg, "_attn_implementation_internal", None) or "sdpa"
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            try:
                module = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
            except ValueError:      # no sdpa for this family (Gemma2): eager, whose scores _saved leaves out
                module = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    if len(_MODULES) > 32:
        _MODULES.clear()
    _MODULES[key] = module
    return module


def _saved(module: nn.Module, seq: int, elem: int, hidden: int) -> tuple[float, float]:
    """(bytes of width-`hidden` tensors, other bytes) saved for backward by one forward of a
    [1, seq] batch on the meta module, at element size `elem`, storages counted once."""
    seen: set = set()
    out = [0.0, 0.0]
    dtype = {2: torch.bfloat16, 4: torch.float32}.get(elem, torch.float32)     # the model runs in it

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        # a weight (or its transpose) is state, not an activation; a view counts its base once
        square = base.dim() >= 4 and base.shape[-1] == base.shape[-2] == seq       # [b, heads, s, s]
        # attention's [.., s, s] scores: meta runs sdpa's math path, which keeps them; the
        # flash / memory-efficient kernels a training run uses (CPU's flash too) do not
        if t.is_floating_point() and t.dim() and not square and not isinstance(base, nn.Parameter) \
                and id(base) not in seen:
            seen.add(id(base))
            keep.append(base)           # ids stay unique while the forward runs
            out[0 if base.shape[-1] == hidden else 1] += base.numel() * base.element_size()
        return t
    keep: list = []
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    module = module.to(dtype)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = module(ids)
        logits = logits.logits if hasattr(logits, "logits") else logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
    return out[0], out[1]


def _act_bytes(facts: ModelFacts, seq: int, elem: int) -> tuple[float, float, float]:
    key = (_key(facts), seq, elem)
    if key in _ACTS:
        return _ACTS[key]
    try:
        r1, s1 = _saved(facts.meta_module(1), seq, elem, facts.hidden)
        r2, s2 = _saved(facts.meta_module(2), seq, elem, facts.hidden)
        rep, split = (r2 - r1) / seq, (s2 - s1) / seq
        root = (r1 + s1) / seq - rep - split
    except Exception:       # noqa: BLE001  (a forward meta cannot run: data-dependent routing)
        from dsfn.estimate_activations import ACT_VALUES_PER_LAYER
        rep, split = 0.0, ACT_VALUES_PER_LAYER * facts.hidden * elem
        root = facts.hidden * elem + 3 * facts.vocab * 4      # embedding out, fp32 logits + softmax
    _ACTS[key] = (rep, split, root)
    return _ACTS[key]
