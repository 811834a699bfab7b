"""`from_ds_moe(...)`: the arguments of DeepSpeed's `deepspeed.moe.layer.MoE(...)` layer as
`expert_parallel` options and the ep mesh size.

DeepSpeed configures its classic MoE in the model code, not in ds_config:
`MoE(hidden_size, expert, num_experts, ep_size, k, capacity_factor, eval_capacity_factor,
min_capacity, use_residual, noisy_gate_policy, drop_tokens, use_rts, ...,
top2_2nd_expert_sampling)`. dsfn keeps the model's own router and experts module (an experts
module with Hugging Face's contract) and takes the dispatch's options from here:

- `ep_size` -> the mesh's ep axis (`init_mesh(dp=world // ep_size, ep=ep_size)`);
- `capacity_factor`, `min_capacity` -> the same names, with DeepSpeed's capacity
  ceil(T / E x capacity_factor x k), at least min_capacity, per rank; `drop_tokens=False` ->
  dropless (capacity_factor None), as DeepSpeed's;
- `k` -> checked against the model's `num_experts_per_tok` when a model is given (its router
  chooses);
- `eval_capacity_factor`: the dispatch runs in training steps only (ignored, with a warning);
- refused, by name, because dsfn would not reproduce them: `use_rts=True` with dropping
  (DeepSpeed's random choice of the kept tokens; dsfn keeps the first ones, first choices
  before second ones: pass use_rts=False), `noisy_gate_policy`, `use_residual` (PR-MoE),
  `top2_2nd_expert_sampling=True` with k=2 (noise on the second choice: the router's job),
  `enable_expert_tensor_parallelism`.
"""
from __future__ import annotations

import warnings
from typing import Any

from dsfn.errors import ConfigError

__all__ = ["from_ds_moe"]


def from_ds_moe(ep_size: int = 1, k: int = 1, capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0,
                min_capacity: int = 4, drop_tokens: bool = True, use_rts: bool = True,
                noisy_gate_policy: str | None = None, use_residual: bool = False,
                enable_expert_tensor_parallelism: bool = False, top2_2nd_expert_sampling: bool = True,
                model: Any = None) -> dict[str, Any]:
    """{"ep": the ep mesh size, "options": `expert_parallel` keyword arguments} for DeepSpeed's
    `MoE(...)` arguments (its defaults here); a ConfigError lists what dsfn does not reproduce
    (module docstring). `expert_parallel("auto", model=model, **out["options"])`."""
    refused = []
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ConfigError(f"from_ds_moe(ep_size={ep_size!r}): an int >= 1")
    if drop_tokens and use_rts:
        refused.append("use_rts=True: DeepSpeed keeps a random choice of the tokens over capacity; dsfn keeps the "
                       "first ones (first choices before second ones, in token order): pass use_rts=False")
    if noisy_gate_policy is not None:
        refused.append(f"noisy_gate_policy={noisy_gate_policy!r}: gate noise is the router's (the model's) job")
    if use_residual:
        refused.append("use_residual=True (PR-MoE's residual expert): write it in the model as a shared expert")
    if k == 2 and top2_2nd_expert_sampling:
        refused.append("top2_2nd_expert_sampling=True: noise on the second choice is the router's job; pass False")
    if enable_expert_tensor_parallelism:
        refused.append("enable_expert_tensor_parallelism=True: expert tensor parallel is not supported")
    own_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    if own_k is not None and own_k != k:
        refused.append(f"k={k}: the model's router chooses top-{own_k} (num_experts_per_tok)")
    if refused:
        raise ConfigError("DeepSpeed MoE arguments dsfn does not reproduce; change them as noted:\n"
                          + "\n".join(f"  - {r}" for r in refused))
    if drop_tokens and eval_capacity_factor != capacity_factor:
        warnings.warn(f"from_ds_moe: eval_capacity_factor={eval_capacity_factor} is ignored (dsfn dispatches in "
                      "training steps only)", UserWarning, stacklevel=2)
    options = ({"capacity_factor": float(capacity_factor), "min_capacity": int(min_capacity)} if drop_tokens
               else {"capacity_factor": None})
    return {"ep": ep_size, "options": options}
