"""Multi-tensor launches: one Triton kernel over a group of tensors (apex's multi_tensor_apply).

A per-tensor kernel costs a host launch (and its scalar set-up) per parameter tensor: on a
1B Llama that is 147 launches per optimizer step, each a few microseconds of host time
while the GPU waits. A multi-tensor kernel takes the group's tensors through two tables:

- the pointer table, int64 `[n_tensors, n_columns + 1]`: row i holds the data pointers of
  tensor i's operands (param, grad, ... as the kernel defines its columns) and, last, its
  element count. It changes when the tensors do (new outputs every step), so it is built
  each launch on the host, in pinned memory on CUDA, and copied without blocking.
- the chunk table, int64 `[n_programs, 2]`: program k processes elements
  `[start, start + chunk)` of tensor `index` (`(index, start)` in row k). It depends only on
  the element counts and the chunk size, so it is cached per (counts, chunk, device).

A program loops `ITERS` times over `BLOCK` elements (chunk = BLOCK * ITERS), so a group of
any size is one launch of about `total / chunk` programs and no program is idle. Every
operand must be contiguous (the kernel walks raw pointers); offsets are int64.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

__all__ = ["TL_DTYPES", "chunk_table", "flat_views", "pointer_table"]


def _tl_dtypes() -> dict[torch.dtype, object]:
    try:
        import triton.language as tl
    except ImportError:   # pragma: no cover - triton is a dependency on linux x86_64 only
        return {}
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# torch dtype -> the Triton element type a kernel casts a table pointer to
TL_DTYPES = _tl_dtypes()


@functools.lru_cache(maxsize=64)
def _chunk_rows(numels: tuple[int, ...], chunk: int) -> tuple[tuple[int, int], ...]:
    return tuple((i, s) for i, n in enumerate(numels) for s in range(0, n, chunk))


_CHUNK_TABLES: dict[tuple, torch.Tensor] = {}


def chunk_table(numels: Sequence[int], chunk: int, device: torch.device) -> torch.Tensor:
    """int64 `[n_programs, 2]` on `device`: (tensor index, first element) of each program's
    chunk, over tensors of `numels` elements (empty tensors get no program). Cached: the
    same counts on the same device return the same tensor (it is never written)."""
    key = (tuple(int(n) for n in numels), int(chunk), torch.device(device))
    t = _CHUNK_TABLES.get(key)
    if t is None:
        rows = _chunk_rows(key[0], key[1])
        t = host_to_device(torch.tensor(rows, dtype=torch.int64).reshape(-1, 2), key[2])
        if len(_CHUNK_TABLES) > 256:        # a bound: groups of changing shapes must not leak
            _CHUNK_TABLES.clear()
        _CHUNK_TABLES[key] = t
    return t


def pointer_table(columns: Sequence[Sequence[torch.Tensor]], device: torch.device) -> torch.Tensor:
    """int64 `[n_tensors, len(columns) + 1]` on `device`: row i is
    `(columns[0][i].data_ptr(), ..., columns[-1][i].data_ptr(), columns[0][i].numel())`.

    The caller keeps every tensor alive until the kernel has run (they are its operands)."""
    n = len(columns[0])
    rows = [[c[i].data_ptr() for c in columns] + [columns[0][i].numel()] for i in range(n)]
    return host_to_device(torch.tensor(rows, dtype=torch.int64), torch.device(device))


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host table on `device`: pinned and copied without blocking on CUDA (the caching
    host allocator keeps the pinned block until the copy has run)."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def flat_views(shapes: Sequence[torch.Size], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Contiguous tensors of `shapes`, views into one fresh flat buffer (one view op each:
    a group's results cost one allocation and no per-leaf split)."""
    numels = [int(torch.Size(s).numel()) for s in shapes]
    flat = torch.empty(sum(numels), dtype=dtype, device=device)
    out, offset = [], 0
    for s, n in zip(shapes, numels):
        s = tuple(s)
        stride, acc = [], 1
        for d in reversed(s):
            stride.append(acc)
            acc *= max(d, 1)
        out.append(flat.as_strided(s, tuple(reversed(stride)), offset))
        offset += n
    return out
