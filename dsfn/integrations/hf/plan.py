"""A Hugging Face model's tensor-parallel plan, for `tensor_parallel("auto")`: the
model's own `_tp_plan`, else its config's `base_model_tp_plan` under the base model's prefix.
"""
from __future__ import annotations

from torch import nn


def tensor_parallel_plan(module: nn.Module) -> dict[str, str]:
    """A Hugging Face model's full tp plan ({module pattern: HF style}), or {}: its `_tp_plan`,
    else its config's `base_model_tp_plan` under the base model's prefix."""
    plan = getattr(module, "_tp_plan", None) or {}
    if not plan:
        cfg = getattr(module, "config", None)
        plan = dict(getattr(cfg, "base_model_tp_plan", None) or {})
        prefix = getattr(module, "base_model_prefix", "")
        base = getattr(module, prefix, None) if prefix else None
        if plan and isinstance(base, nn.Module) and base is not module:
            plan = {f"{prefix}.{k}": v for k, v in plan.items()}
    return dict(plan)


def expert_parallel_plan(module: nn.Module) -> dict[str, str]:
    """A Hugging Face MoE model's expert-parallel plan ({module or parameter pattern: HF style},
    e.g. `model.layers.*.mlp.experts: ep_dispatch_experts`, `...experts.gate_up_proj:
    grouped_gemm`), or {}: its config's `base_model_ep_plan` under the base model's prefix
    (transformers 5's MoE configs: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, gpt-oss, ...)."""
    cfg = getattr(module, "config", None)
    plan = dict(getattr(cfg, "base_model_ep_plan", None) or {})
    prefix = getattr(module, "base_model_prefix", "")
    base = getattr(module, prefix, None) if prefix else None
    if plan and isinstance(base, nn.Module) and base is not module:
        plan = {f"{prefix}.{k}": v for k, v in plan.items()}
    return plan

