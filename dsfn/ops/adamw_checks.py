"""The checks of the fused AdamW step's operands (`dsfn.ops.adamw`, `dsfn.ops.cpu_adam`).

`check_adam_operands`: types, dtypes and shapes of (param, grad, exp_avg, exp_avg_sq);
`check_scalar_tensor`: a tensor lr or step; `check_out`: the `out=` destinations. Each
raises LeafTypeError, ShapeError or ConfigError with the caller's name in the message.
"""
from __future__ import annotations

import torch

from dsfn.errors import ConfigError, LeafTypeError, ShapeError

__all__ = ["GRAD_DTYPES", "LOWP_DTYPES", "check_adam_operands", "check_out", "check_scalar_tensor"]

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOWP_DTYPES = (torch.bfloat16, torch.float16)


def check_scalar_tensor(name: str, t: torch.Tensor, floating: bool) -> None:
    if t.dim() > 1 or t.numel() != 1:
        raise ConfigError(f"adamw_update({name}=tensor of shape {tuple(t.shape)}): pass a tensor of shape () or (1,)")
    if floating and not t.is_floating_point():
        raise ConfigError(f"adamw_update({name}=tensor of dtype {t.dtype}): {name} must be floating point, "
                          "e.g. torch.tensor(1e-3, dtype=torch.float64)")
    if t.is_complex() or t.dtype == torch.bool:
        raise ConfigError(f"adamw_update({name}=tensor of dtype {t.dtype}): expected a real number")


def check_adam_operands(who: str, param, grad, exp_avg, exp_avg_sq,
                        extra: tuple = ()) -> tuple[tuple[str, torch.Tensor], ...]:
    """Types, dtypes and shapes of an AdamW step's operands (fp32 param and moments, a
    float32/bfloat16/float16 grad, all of param's shape); `extra` (name, tensor, dtypes,
    hint) pairs are checked for type and dtype too. Returns the (name, tensor) pairs."""
    named = (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq))
    for name, t in named + tuple((n, t) for n, t, _, _ in extra):
        if not isinstance(t, torch.Tensor):
            raise LeafTypeError(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in named:
        if name == "grad":
            if t.dtype not in GRAD_DTYPES:
                raise LeafTypeError(f"{who}: grad has dtype {t.dtype}; use float32, bfloat16 or float16")
        elif t.dtype != torch.float32:
            raise LeafTypeError(f"{who}: {name} has dtype {t.dtype}; param, exp_avg and exp_avg_sq must "
                                "be float32 (the fp32 master weights and their moments)")
    for name, t, dtypes, hint in extra:
        if t.dtype not in dtypes:
            raise LeafTypeError(f"{who}: {name} has dtype {t.dtype}; {hint}")
    named += tuple((n, t) for n, t, _, _ in extra)
    for name, t in named[1:]:
        if t.shape != param.shape:
            raise ShapeError(f"{who}: {name} has shape {tuple(t.shape)} but param has "
                             f"{tuple(param.shape)}; pass the grad and moments of this param")
    return named


def check_out(out, lowp_dtype: torch.dtype | None, param: torch.Tensor) -> tuple[tuple | None, torch.dtype | None]:
    """`out` as a tuple (or None) and the low-precision dtype (out[3]'s where given), after
    checking each destination's type, dtype, shape, layout and device against `param`."""
    if out is not None:
        out = tuple(out)
        if len(out) not in (3, 4):
            raise ConfigError(f"adamw_update(out=...): pass (param, exp_avg, exp_avg_sq[, param_lowp]), "
                              f"got {len(out)} entries")
        if len(out) == 4:
            if not isinstance(out[3], torch.Tensor):
                raise LeafTypeError(f"adamw_update: out[3] must be a torch.Tensor, got {type(out[3]).__name__}")
            if lowp_dtype is not None and lowp_dtype != out[3].dtype:
                raise ConfigError(f"adamw_update: lowp_dtype={lowp_dtype} but out[3] has dtype {out[3].dtype}")
            lowp_dtype = out[3].dtype
    if lowp_dtype is not None and lowp_dtype not in LOWP_DTYPES:
        raise ConfigError(f"adamw_update(lowp_dtype={lowp_dtype}): use torch.bfloat16, torch.float16 or None")
    if out is not None:
        names = ("param", "exp_avg", "exp_avg_sq", "param_lowp")
        for i, t in enumerate(out):
            if not isinstance(t, torch.Tensor):
                raise LeafTypeError(f"adamw_update: out[{i}] ({names[i]}) must be a torch.Tensor, "
                                    f"got {type(t).__name__}")
            want = lowp_dtype if i == 3 else torch.float32
            if t.dtype != want:
                raise LeafTypeError(f"adamw_update: out[{i}] ({names[i]}) has dtype {t.dtype}, expected {want}")
            if t.shape != param.shape:
                raise ShapeError(f"adamw_update: out[{i}] ({names[i]}) has shape {tuple(t.shape)}, expected "
                                 f"{tuple(param.shape)}")
            if not t.is_contiguous():
                raise ShapeError(f"adamw_update: out[{i}] ({names[i]}) must be contiguous")
            if t.device != param.device:
                raise ConfigError(f"adamw_update: out[{i}] ({names[i]}) is on {t.device}, the params on "
                                  f"{param.device}")
    return out, lowp_dtype
