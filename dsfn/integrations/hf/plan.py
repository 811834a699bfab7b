"""A Hugging Face model's tensor-parallel plan, for `tensor_parallel("auto")`: the
model's own `_tp_plan`, else its config's `base_model_tp_plan` under the base model's prefix;
and its expert-parallel plan (`base_model_ep_plan`), for `expert_parallel("auto")`.
"""
from __future__ import annotations

from torch import nn


def tensor_parallel_plan(module: nn.Module) -> dict[str, str]:
    """A Hugging Face model's full tp plan ({module pattern: HF style}), or {}: its `_tp_plan`,
    else its config's `base_model_tp_plan` under the base model's prefix."""
    plan = getattr(module, "_tp_plan", None) or {}
    return dict(plan) if plan else _base_model_plan(module, "base_model_tp_plan")


def expert_parallel_plan(module: nn.Module) -> dict[str, str]:
    """A Hugging Face MoE model's expert-parallel plan ({module or parameter pattern: HF style},
    e.g. `model.layers.*.mlp.experts: ep_dispatch_experts`, `...experts.gate_up_proj:
    grouped_gemm`), or {}: its config's `base_model_ep_plan` under the base model's prefix
    (transformers 5's MoE configs: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, gpt-oss, ...)."""
    return _base_model_plan(module, "base_model_ep_plan")


def _base_model_plan(module: nn.Module, key: str) -> dict[str, str]:
    """The config's plan `key` ({pattern: style}, written for the base model), its patterns
    under the base model's prefix when `module` wraps it (a ...ForCausalLM's "model.")."""
    plan = dict(getattr(getattr(module, "config", None), key, None) or {})
    prefix = getattr(module, "base_model_prefix", "")
    base = getattr(module, prefix, None) if prefix else None
    if plan and isinstance(base, nn.Module) and base is not module:
        plan = {f"{prefix}.{k}": v for k, v in plan.items()}
    return plan

