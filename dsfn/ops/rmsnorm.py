"""RMSNorm over the last dim: `y = x / sqrt(mean(x**2, -1) + eps) * weight`.

Three functions with one signature `(x, weight, eps=1e-6) -> y`:

- `rms_norm_torch`: the reference, plain torch ops under autograd;
- `rms_norm_triton`: Triton kernels forward and backward, as a `torch.autograd.Function`;
- `rms_norm`: the Triton path where `dispatch.use_triton` says so, the reference elsewhere.

x: floating, shape [..., D] (any leading dims, zero rows included, any D >= 1); weight:
floating, shape [D], on x's device. The arithmetic is float32 whatever the dtypes (x and
weight are read as float32, the mean of squares is a float32 sum); y has x's dtype and
x's shape. Backward gives grad_x (x's dtype) and grad_weight (weight's dtype, summed over
rows in float32). The Triton path is differentiable once (no double backward).

Kernels: the forward runs one row per program; a row longer than the block is walked in
blocks (two passes: sum of squares, then normalize). The backward runs row groups: each
program owns a run of rows and a float32 partial of grad_weight that torch sums at the
end. Row offsets are int64 (`row * stride` past 2**31 elements is safe); offsets within
a row are int32 (D < 2**31).
"""
from __future__ import annotations

from typing import Any

import torch

from dsfn.errors import ConfigError, LeafTypeError, ShapeError
from dsfn.ops import dispatch

__all__ = ["MAX_BLOCK", "RMSNormFunction", "rms_norm", "rms_norm_torch", "rms_norm_triton"]

MAX_BLOCK = 4096          # elements of a row handled at once; longer rows loop over blocks
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(x: Any, weight: Any, eps: Any) -> float:
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise LeafTypeError(f"rms_norm: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise LeafTypeError(f"rms_norm: {name} has dtype {t.dtype}; use float32, bfloat16 or float16")
    if x.dim() < 1:
        raise ShapeError("rms_norm: x must have at least one dim (normalized over the last)")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ShapeError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({x.shape[-1]},) "
                         f"for x of shape {tuple(x.shape)}")
    if x.shape[-1] == 0:
        raise ShapeError(f"rms_norm: x of shape {tuple(x.shape)} has an empty last dim; nothing to normalize")
    if x.device != weight.device:
        raise ConfigError(f"rms_norm: x is on {x.device} and weight on {weight.device}; move them to one device")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ConfigError(f"rms_norm(eps={eps!r}): pass a number >= 0, e.g. 1e-6")
    return float(eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The reference: float32 torch ops, differentiable by autograd."""
    eps = _check(x, weight, eps)
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.float()).to(x.dtype)


# ---------------------------------------------------------------------------------------
# Triton kernels

try:
    import triton
    import triton.language as tl
except ImportError:   # pragma: no cover - triton is a dependency on linux x86_64 only
    triton = None
else:
    from dsfn.ops.adamw import cast_rne

if triton is not None:
    @triton.jit
    def _rms_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, stride_x, stride_y, D, eps,
                        BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        y_row = y_ptr + row * stride_y
        if ONE_BLOCK:
            cols = tl.arange(0, BLOCK)
            mask = cols < D
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + cols, cast_rne(x * rstd * w, y_ptr.dtype.element_ty), mask=mask)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, D, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x = tl.load(x_row + cols, mask=cols < D, other=0.0).to(tl.float32)
                acc += x * x
            rstd = 1.0 / tl.sqrt_rn(tl.sum(acc, axis=0) / D + eps)
            for start in range(0, D, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < D
                x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(y_row + cols, cast_rne(x * rstd * w, y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def _rms_bwd_kernel(x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dw_ptr, stride_x, stride_dy, stride_dx,
                        M, D, rows_per_program, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
        # dx = rstd * (g - xhat * mean(g * xhat)),  g = dy * w,  xhat = x * rstd
        # dw[pid] = sum over this program's rows of dy * xhat   (float32 partial)
        pid = tl.program_id(0).to(tl.int64)
        row_start = pid * rows_per_program
        row_end = tl.minimum(row_start + rows_per_program, M)
        dw_row = dw_ptr + pid * D
        if ONE_BLOCK:
            cols = tl.arange(0, BLOCK)
            mask = cols < D
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            dw = tl.zeros([BLOCK], dtype=tl.float32)
            for r in range(row_start, row_end):
                row = tl.cast(r, tl.int64)        # the interpreter's loop variable is a Python int
                rstd = tl.load(rstd_ptr + row)
                x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
                xhat = x * rstd
                g = dy * w
                c = tl.sum(g * xhat, axis=0) / D
                dx = (g - xhat * c) * rstd
                tl.store(dx_ptr + row * stride_dx + cols, cast_rne(dx, dx_ptr.dtype.element_ty), mask=mask)
                dw += dy * xhat
            tl.store(dw_row + cols, dw, mask=mask)
        else:
            # dw_row starts zeroed (torch.zeros) and is this program's alone: accumulate in place
            for r in range(row_start, row_end):
                row = tl.cast(r, tl.int64)
                rstd = tl.load(rstd_ptr + row)
                x_row = x_ptr + row * stride_x
                dy_row = dy_ptr + row * stride_dy
                acc = tl.zeros([BLOCK], dtype=tl.float32)
                for start in range(0, D, BLOCK):
                    cols = start + tl.arange(0, BLOCK)
                    mask = cols < D
                    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
                    dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
                    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                    acc += dy * w * (x * rstd)
                c = tl.sum(acc, axis=0) / D
                for start in range(0, D, BLOCK):
                    cols = start + tl.arange(0, BLOCK)
                    mask = cols < D
                    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
                    dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
                    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                    xhat = x * rstd
                    dx = (dy * w - xhat * c) * rstd
                    tl.store(dx_ptr + row * stride_dx + cols, cast_rne(dx, dx_ptr.dtype.element_ty), mask=mask)
                    dw = tl.load(dw_row + cols, mask=mask, other=0.0)
                    tl.store(dw_row + cols, dw + dy * xhat, mask=mask)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _rows(t: torch.Tensor, D: int) -> torch.Tensor:
    """t as [rows, D] with unit column stride (a view where possible)."""
    t2 = t.reshape(-1, D)
    return t2 if t2.stride(-1) == 1 or t2.shape[0] == 0 else t2.contiguous()


def _num_programs(M: int, device: torch.device) -> int:
    if device.type == "cuda":
        return min(M, 4 * torch.cuda.get_device_properties(device).multi_processor_count)
    return min(M, 8)          # the interpreter runs programs one after another


class RMSNormFunction(torch.autograd.Function):
    """Triton RMSNorm: `apply(x, weight, eps, block)`; block None picks min(next_pow2(D), MAX_BLOCK)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, block: int | None) -> torch.Tensor:
        D = x.shape[-1]
        x2 = _rows(x, D)
        weight = weight.contiguous()
        M = x2.shape[0]
        BLOCK = block or min(_next_pow2(D), MAX_BLOCK)
        y = torch.empty((M, D), dtype=x.dtype, device=x.device)
        rstd = torch.empty((M,), dtype=torch.float32, device=x.device)
        if M > 0:
            with dispatch.device_guard(x2):      # Triton launches on the current device, not x's
                _rms_fwd_kernel[(M,)](x2, weight, y, rstd, x2.stride(0), y.stride(0), D, eps,
                                      BLOCK=BLOCK, ONE_BLOCK=D <= BLOCK, num_warps=_warps(BLOCK))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.block = BLOCK
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        M, D = x2.shape
        BLOCK = ctx.block
        dy2 = _rows(dy, D)
        dx = torch.empty((M, D), dtype=x2.dtype, device=x2.device)
        G = _num_programs(M, x2.device)
        if G == 0:
            return dx.view(ctx.x_shape), torch.zeros_like(weight), None, None
        rows_per_program = triton.cdiv(M, G)
        G = triton.cdiv(M, rows_per_program)
        dw_partial = torch.zeros((G, D), dtype=torch.float32, device=x2.device)
        with dispatch.device_guard(x2):
            _rms_bwd_kernel[(G,)](x2, weight, dy2, rstd, dx, dw_partial, x2.stride(0), dy2.stride(0), dx.stride(0),
                                  M, D, rows_per_program, BLOCK=BLOCK, ONE_BLOCK=D <= BLOCK,
                                  num_warps=_warps(BLOCK))
        dw = dw_partial.sum(0).to(weight.dtype)
        return dx.view(ctx.x_shape), dw, None, None


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                    block: int | None = None) -> torch.Tensor:
    """The Triton path; arguments and result as `rms_norm_torch`.

    `block` (a power of two; default min(next_pow2(D), MAX_BLOCK)) is how many elements of
    a row a program handles at once. Raises ConfigError where Triton cannot run on these
    tensors (no triton, or CPU without TRITON_INTERPRET=1).
    """
    eps = _check(x, weight, eps)
    why = "triton is not importable" if triton is None else dispatch.triton_problem(x, weight)
    if why is not None:
        raise ConfigError(f"rms_norm_triton: Triton kernels cannot run on {x.device.type}: {why} (triton importable: "
                          f"{triton is not None}, TRITON_INTERPRET: {dispatch.interpreting()}); use rms_norm")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1
                              or block & (block - 1)):
        raise ConfigError(f"rms_norm_triton(block={block!r}): use a power of two or None")
    return RMSNormFunction.apply(x, weight, eps, block)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim (module docstring): Triton where `dispatch.use_triton` says
    so (CUDA tensors by default), the torch reference elsewhere."""
    tensors = [t for t in (x, weight) if isinstance(t, torch.Tensor)]
    if tensors and dispatch.use_triton(*tensors):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_torch(x, weight, eps)
