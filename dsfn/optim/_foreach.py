"""Private helpers: validation of an optimizer's betas and foreach arithmetic over leaf lists
(scalar checks live in `dsfn.checks`, below the ops and optimizers that both use them).

All arithmetic goes through `torch._foreach_*` over the whole list of leaves (one call per
op); out-of-place ops produce the new tensors, and in-place ops are applied only to those
fresh tensors.
"""
from __future__ import annotations

from typing import Any

import torch

from dsfn.checks import check_real
from dsfn.errors import ConfigError


def check_betas(betas: Any, who: str) -> tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ConfigError(f"{who}(betas={betas!r}): pass two coefficients, e.g. betas=(0.9, 0.999)")
    b1 = check_real(f"{who}(betas[0])", betas[0], lo=0.0, hi=1.0, hi_open=True,
                    hint="; the first-moment decay lies in [0, 1), e.g. 0.9")
    b2 = check_real(f"{who}(betas[1])", betas[1], lo=0.0, hi=1.0, hi_open=True,
                    hint="; the second-moment decay lies in [0, 1), e.g. 0.999")
    return b1, b2


def mul_scalar(tensors: list[torch.Tensor], s: float | torch.Tensor, *, promote: bool) -> list[torch.Tensor]:
    """New tensors `t * s`; each result keeps its input's dtype.

    A tensor `s` (0-dim or shape (1,), any float dtype) follows one of torch's two rules,
    which differ only for 0-dim leaves (0-dim tensors promote each other):
    - `promote=True`: like the in-place tensor op `t.mul_(s)`: the product is taken in
      the promoted dtype (float64 for a 0-dim float32 leaf and a float64 lr) and stored
      in `t`'s dtype;
    - `promote=False`: like a Scalar argument (`alpha=`, `value=`): `s` is first rounded
      to `t`'s dtype.
    Either way a float64 lr never turns a float32 leaf into float64. `s` is moved to the
    leaves' device (a 0-dim copy) when needed.
    """
    if not tensors:
        return []
    if not isinstance(s, torch.Tensor):
        return list(torch._foreach_mul(tensors, s))
    s = s.reshape(())
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    out: list[Any] = [None] * len(tensors)
    for (device, dtype), idx in groups.items():
        # non_blocking: a blocking host-to-device copy would synchronise the stream
        sc = s.to(device=device, non_blocking=True) if promote else s.to(dtype=dtype).to(device, non_blocking=True)
        for i, r in zip(idx, torch._foreach_mul([tensors[i] for i in idx], sc)):
            out[i] = r if r.dtype == dtype else r.to(dtype)
    return out
