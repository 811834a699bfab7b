"""Grouped dtype casts: `[t.to(dtype) for t in tensors]` in one launch per source dtype.

Mixed precision casts every gradient to the master dtype and every updated master weight
back to the compute dtype, each step: one kernel per tensor (2 x 147 on a 1B Llama) when
done leaf by leaf. `cast_tensors` takes the whole group through one multi-tensor Triton
kernel (`dsfn.ops.multi_tensor`'s tables) where dispatch picks Triton, and `Tensor.to` per
tensor elsewhere. Rounding is `Tensor.to`'s (round to nearest even; NaN stays NaN), so the
two are bitwise one another.

`cast_tensors(tensors, dtype, out=None)`:
- tensors: floating tensors (float32, bfloat16, float16) on one device, any shapes; any
  layout (non-contiguous ones are made contiguous first).
- out: None, or one destination per tensor (contiguous, that shape, `dtype`, that device;
  e.g. the previous step's low-precision parameters in a donated step).
Returns one tensor per input: the input itself where it already has `dtype` and no `out`
was given (as `Tensor.to`), else the cast. Fresh results of a launch are views into one
flat buffer.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from dsfn.errors import LeafTypeError, ShapeError
from dsfn.ops import dispatch

__all__ = ["cast_tensors", "cast_tensors_torch"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_BLOCK = 1024
DEFAULT_ITERS = 16


def _check(tensors: Sequence[torch.Tensor], dtype: torch.dtype, out: Sequence[torch.Tensor] | None) -> None:
    if dtype not in _DTYPES:
        raise LeafTypeError(f"cast_tensors(dtype={dtype}): use torch.float32, torch.bfloat16 or torch.float16")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.dtype not in _DTYPES:
            raise LeafTypeError(f"cast_tensors: tensors[{i}] is {getattr(t, 'dtype', type(t).__name__)}; pass "
                                "float32, bfloat16 or float16 tensors")
    if out is not None:
        if len(out) != len(tensors):
            raise ShapeError(f"cast_tensors: {len(tensors)} tensors but {len(out)} destinations")
        for i, (t, o) in enumerate(zip(tensors, out)):
            if (not isinstance(o, torch.Tensor) or o.dtype != dtype or o.shape != t.shape or o.device != t.device
                    or not o.is_contiguous()):
                raise ShapeError(f"cast_tensors: out[{i}] must be a contiguous {dtype} tensor of shape "
                                 f"{tuple(t.shape)} on {t.device}")


def cast_tensors_torch(tensors: Sequence[torch.Tensor], dtype: torch.dtype,
                       out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The reference: `Tensor.to` (or `copy_` into `out`) per tensor."""
    _check(tensors, dtype, out)
    if out is None:
        return [t.to(dtype) for t in tensors]
    with torch.no_grad():
        return [o.copy_(t) for o, t in zip(out, tensors)]


def cast_tensors(tensors: Sequence[torch.Tensor], dtype: torch.dtype,
                 out: Sequence[torch.Tensor] | None = None, *, block: int = DEFAULT_BLOCK,
                 iters: int = DEFAULT_ITERS) -> list[torch.Tensor]:
    """See the module docstring."""
    tensors = list(tensors)
    if not tensors:
        return []
    devices = {t.device for t in tensors if isinstance(t, torch.Tensor)}
    if len(devices) != 1 or not dispatch.use_triton(*tensors, *(out or ()), dtypes=(dtype,)):
        return cast_tensors_torch(tensors, dtype, out)
    _check(tensors, dtype, out)
    from dsfn.ops.multi_tensor import TL_DTYPES, chunk_table, flat_views, pointer_table
    result: list[torch.Tensor] = list(out) if out is not None else list(tensors)
    todo = [i for i, t in enumerate(tensors) if t.numel() and (out is not None or t.dtype != dtype)]
    if out is None:
        fresh = [i for i, t in enumerate(tensors) if t.dtype != dtype]
        for i, v in zip(fresh, flat_views([tensors[i].shape for i in fresh], dtype, tensors[0].device)):
            result[i] = v
    by_src: dict[torch.dtype, list[int]] = {}
    for i in todo:
        by_src.setdefault(tensors[i].dtype, []).append(i)
    device = tensors[0].device
    srcs = [t.contiguous() for t in tensors]
    with dispatch.device_guard(tensors[0]):
        for src_dtype, idx in by_src.items():
            table = pointer_table([[srcs[i] for i in idx], [result[i] for i in idx]], device)
            chunks = chunk_table([tensors[i].numel() for i in idx], block * iters, device)
            _cast_multi_kernel[(chunks.shape[0],)](table, chunks, S_DTYPE=TL_DTYPES[src_dtype],
                                                   D_DTYPE=TL_DTYPES[dtype], BLOCK=block, ITERS=iters, num_warps=4)
    return result


try:
    import triton
    import triton.language as tl
except ImportError:   # pragma: no cover - triton is a dependency on linux x86_64 only
    triton = None

if triton is not None:
    from dsfn.ops.adamw import cast_rne

    @triton.jit
    def _cast_multi_kernel(ptrs, chunks, S_DTYPE: tl.constexpr, D_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
                           ITERS: tl.constexpr):
        """One program: BLOCK * ITERS elements of one tensor; `ptrs` rows: src, dst, numel."""
        pid = tl.program_id(0).to(tl.int64)
        t = tl.load(chunks + 2 * pid)
        start = tl.load(chunks + 2 * pid + 1)
        # a bfloat16 source is read as its bits and widened by a shift: exact on every backend
        # (the interpreter's own bf16 -> fp32 conversion flushes subnormals to zero)
        if S_DTYPE == tl.bfloat16:
            src = tl.load(ptrs + 3 * t).to(tl.pointer_type(tl.uint16))
        else:
            src = tl.load(ptrs + 3 * t).to(tl.pointer_type(S_DTYPE))
        dst = tl.load(ptrs + 3 * t + 1).to(tl.pointer_type(D_DTYPE))
        n = tl.load(ptrs + 3 * t + 2)
        # the chunk's blocks that hold elements: a small tensor's program stops after its own
        for i in range(tl.minimum(ITERS, tl.cdiv(n - start, BLOCK))):
            offs = start + i * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            mask = offs < n
            if S_DTYPE == tl.bfloat16:
                x = (tl.load(src + offs, mask=mask, other=0).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            else:
                x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)    # exact: every source fits
            tl.store(dst + offs, cast_rne(x, D_DTYPE), mask=mask)
