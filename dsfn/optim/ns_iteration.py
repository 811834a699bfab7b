"""Newton-Schulz: Muon's orthogonalisation kernels (DeepSpeed's `original_muon.py`).

`newton_schulz` (`zeropower_via_newtonschulz5`, the quintic iteration) and
`gram_newton_schulz` (`zeropower_via_gram_newtonschulz`, iterating on the Gram matrix),
batched over leading dims, in a chosen dtype; `ns_compute_dtype(device)`, the default NS
dtype per device; `check_ns_args`, the checks of the NS settings. The maths and the dtype
rules are described in `dsfn.optim.muon`'s docstring; `orthogonalize` there scales and
shapes the result for one parameter.
"""
from __future__ import annotations

from typing import Any

import torch

from dsfn.checks import check_int
from dsfn.errors import ConfigError

__all__ = ["NS_COEFFS", "NS_EPS", "NS_METHODS", "check_ns_args", "gram_newton_schulz", "newton_schulz",
           "ns_compute_dtype"]

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_METHODS = ("standard", "gram")
NS_EPS = 1e-7


def ns_compute_dtype(device: torch.device | str) -> torch.dtype:
    """The default Newton-Schulz dtype on `device` (`ns_dtype=None`): bf16 where the device
    does bf16 arithmetic natively (CUDA compute capability >= 8.0), fp32 elsewhere (CPU,
    older GPUs, other devices). See "Deviations from DeepSpeed" in `dsfn.optim.muon`'s docstring."""
    from dsfn.ops.dispatch import device_supports_bf16  # lazy: dsfn.ops imports dsfn.optim
    return torch.bfloat16 if device_supports_bf16(device) else torch.float32


def _normalized(G: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """G (wide orientation: the caller transposes) / (‖G‖_F + eps) in `dtype`. Normalised in
    the wider of G's dtype and `dtype` (fp32 in place of fp16: fp32's range), then cast:
    DeepSpeed's order, since an fp16 cast first turns a finite gradient past 65504 (a
    loss-scaled one) into inf and the result into nan."""
    norm_dtype = torch.promote_types(G.dtype, dtype)
    if norm_dtype == torch.float16:
        norm_dtype = torch.float32
    X = G.to(norm_dtype)
    return (X / (X.norm(dim=(-2, -1), keepdim=True) + NS_EPS)).to(dtype)


def newton_schulz(G: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """DeepSpeed's `zeropower_via_newtonschulz5`: the quintic NS of `G` (batched over leading
    dims), computed and returned in `dtype`, same shape as `G`. `G` is not modified."""
    a, b, c = NS_COEFFS
    tall = G.size(-2) > G.size(-1)
    X = _normalized(G.mT if tall else G, dtype)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.mT if tall else X


def gram_newton_schulz(G: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """DeepSpeed's `zeropower_via_gram_newtonschulz`: the same map as `newton_schulz`, computed
    on the Gram matrix `R = X Xᵀ` (n x n, n = the short side) for non-square matrices, with a
    restart at iteration 2; square matrices use the standard iteration. Batched; in `dtype`."""
    a, b, c = NS_COEFFS
    tall = G.size(-2) > G.size(-1)
    X = _normalized(G.mT if tall else G, dtype)
    n, m = X.size(-2), X.size(-1)
    if m <= n:                                   # square: no saving, standard iteration
        for _ in range(steps):
            A = X @ X.mT
            B = b * A + c * A @ A
            X = a * X + B @ X
        return X.mT if tall else X
    R = X @ X.mT
    Q = None
    restart_at = 2
    for i in range(steps):
        if i == restart_at:
            X = Q @ X                            # Q is set: iterations 0 and 1 ran
            R = X @ X.mT
            Q = None
        Z = b * R + c * R @ R
        if Q is None:
            Q = Z.clone()
            Q.diagonal(dim1=-2, dim2=-1).add_(a)  # Q = a I + Z (ours: in place is pure)
        else:
            Q = a * Q + Z @ Q
        if i < steps - 1 and (i + 1) != restart_at:
            RZ = a * R + Z @ R
            R = a * RZ + Z @ RZ
    return (X.mT @ Q.mT) if tall else (Q @ X)


def check_ns_args(who: str, ns_steps: Any, ns_method: Any, ns_dtype: Any) -> None:
    check_int(f"{who}(ns_steps)", ns_steps, lo=1, hint="; Newton-Schulz needs at least one iteration (DeepSpeed: 5)")
    if ns_method not in NS_METHODS:
        raise ConfigError(f"{who}(ns_method={ns_method!r}): use 'gram' (DeepSpeed's default) or 'standard'")
    if ns_dtype is not None and not (isinstance(ns_dtype, torch.dtype) and ns_dtype.is_floating_point):
        raise ConfigError(f"{who}(ns_dtype={ns_dtype!r}): pass a floating torch dtype (torch.bfloat16, "
                          "torch.float16, torch.float32) or None for the device's (bf16 on a bf16-capable GPU, "
                          "fp32 elsewhere)")
