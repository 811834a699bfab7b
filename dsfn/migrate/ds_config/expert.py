"""AutoEP's `expert_parallel` section -> `expert_parallel("auto", model=model)` over an `ep`
mesh axis of `autoep_size` ranks.

DeepSpeed's AutoEP (0.19.2+) borrows its ep ranks from the data-parallel ones: the stage's
ranks (world / (pp x sp x tp)) all see different rows, dense parameters are data parallel
over all of them, experts over the ranks holding the same ones. dsfn's mesh is
`{"dp": stage / ep, "ep": ep}` (`ParallelLayout`), the batch split over both, ZeRO over dp.

Keys: `enabled` (false: the rest is not read, as in DeepSpeed); `autoep_size` (must divide
the data-parallel ranks and the model's expert count); `preset_model` (the layer detection:
dsfn reads the model's own `base_model_ep_plan`, which names the same modules); `top_k`
("auto", or the model's own `num_experts_per_tok`); `use_grouped_mm` / `grouped_mm_backend`
(kernel choice: the model's experts implementation runs, warned as ignored); the routing
overrides (`route_norm`, `route_scale`, `score_func`, `score_apply`, `num_expert_groups`,
`num_limited_groups`, `routed_scaling_factor`) at their defaults only, since dsfn runs the
model's own router; `load_balance_coeff` absent or null (DeepSpeed rejects any other value:
expert_bias balancing is not supported there either); custom detection patterns refused.
"""
from __future__ import annotations

from typing import Any, Mapping

from dsfn.errors import ConfigError
from dsfn.migrate.ds_config.report import KeyReport
from dsfn.migrate.ds_config.values import whole_number

_PRESETS = ("mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3", "llama4")
_ROUTING_DEFAULTS = {"route_norm": None, "route_scale": 1.0, "score_func": "auto", "score_apply": "auto",
                     "num_expert_groups": None, "num_limited_groups": None, "routed_scaling_factor": "auto"}
_CUSTOM = ("moe_layer_pattern", "expert_pattern", "router_pattern", "expert_w1", "expert_w2", "expert_w3",
           "num_experts_attr", "top_k_attr", "has_shared_experts", "shared_experts_pattern")


def read_expert_parallel(block: Any, model: Any, report: KeyReport) -> int:
    """The ep size (1: no expert parallel) from the `expert_parallel` section."""
    if block is None:
        return 1
    if not isinstance(block, Mapping):
        raise ConfigError(f"ds_config expert_parallel={block!r}: expected an object such as "
                          "{'enabled': true, 'autoep_size': 4}")
    block = dict(block)
    if not block.pop("enabled", False):
        return 1
    ep = whole_number("expert_parallel.autoep_size", block.pop("autoep_size", 1) or 1)
    preset = block.pop("preset_model", None)
    if preset is not None and preset not in _PRESETS:
        raise ConfigError(f"ds_config expert_parallel.preset_model={preset!r}: DeepSpeed's presets are {_PRESETS}")
    top_k = block.pop("top_k", "auto")
    own_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    if top_k != "auto" and top_k != own_k:
        report.refuse("expert_parallel.top_k", f"dsfn runs the model's own router (top-{own_k}); set \"auto\" or "
                      "the model's num_experts_per_tok")
    for key in ("use_grouped_mm", "grouped_mm_backend"):
        if key in block:
            block.pop(key)
            report.ignore(f"expert_parallel.{key}", "the kernel: the model's experts implementation runs")
    for key, default in _ROUTING_DEFAULTS.items():
        if key in block and block.pop(key) != default:
            report.refuse(f"expert_parallel.{key}", "dsfn runs the model's own router; routing overrides are not "
                          f"reproduced (leave it out, or {default!r})")
    coeff = block.pop("load_balance_coeff", None)
    if coeff is not None:
        report.refuse("expert_parallel.load_balance_coeff", f"{coeff!r}: expert_bias (aux-loss-free) balancing is "
                      "not supported (DeepSpeed rejects it too); set it to null or omit it")
    for key in _CUSTOM:
        if key in block:
            block.pop(key)
            report.refuse(f"expert_parallel.{key}", "custom MoE detection: dsfn reads the model's base_model_ep_plan; "
                          "for other models write expert_parallel(plan={'<experts module>': 'experts'}, model=...)")
    for key in block:
        report.refuse(f"expert_parallel.{key}", "not an AutoEP key dsfn knows")
    if ep > 1 and model is None:
        raise ConfigError("ds_config expert_parallel.autoep_size > 1 needs the model: "
                          "from_ds_config(config, model=model)")
    return ep
