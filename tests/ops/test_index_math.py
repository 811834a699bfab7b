"""Index math past 2**31 elements, on CPU, without 8 GiB of memory.

The kernels' offsets must be int64: an int32 `pid * BLOCK` or `row * stride` wraps past
2**31 and addresses memory 2**32 elements before the right place. These tests run the
real kernels (Triton's interpreter: real pointers, numpy int32 arithmetic that wraps like
the GPU's) at element offsets past 2**31 with:

- tensors that are views into one large *virtual* mapping (anonymous mmap with
  MAP_NORESERVE): only the pages the kernels touch get memory (a few MiB), and the place
  an int32 offset would wrap to is mapped too (zeros), so a wrapped kernel reads and
  writes the wrong elements and the comparison fails instead of crashing;
- for the flat AdamW kernel, the last programs of a grid of 2**21 + 1 programs (the
  interpreter is made to number its few programs from a base, as a GPU numbers the tail
  of a huge grid), so its `block_offsets` straddle 2**31;
- for RMSNorm, a row stride near 2**31 so that row 2 starts past 2**31 elements.
"""
from __future__ import annotations

import mmap
import platform
import sys

import numpy as np
import pytest
import torch

from dsfn.ops import adamw as A
from dsfn.ops import rmsnorm as R

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
interp = pytest.importorskip("triton.runtime.interpreter")

TWO31 = 2**31
TWO32 = 2**32


def _int32(x):
    """What int32 arithmetic makes of the exact offsets `x` (numpy int32 wraps silently)."""
    return np.asarray(x, dtype=np.int64).astype(np.int32).astype(np.int64)


def _virtual(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of `numel` elements backed by address space only (pages on first touch)."""
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"):
        pytest.skip("MAP_NORESERVE mappings are set up for Linux x86_64/aarch64 only")
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    try:
        buf = mmap.mmap(-1, nbytes, flags=flags)
    except (OSError, OverflowError) as e:   # e.g. vm.overcommit_memory=2
        pytest.skip(f"cannot reserve {nbytes / 2**30:.0f} GiB of address space: {e}")
    return torch.frombuffer(buf, dtype=dtype)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def test_int32_offsets_wrap():
    """The failure mode the int64 offsets avoid."""
    assert _int32(TWO31 + 5) == -TWO31 + 5
    assert _int32(2 * (TWO31 - 2**20)) == -2**21
    assert _int32((2**21) * 1024 + 7) == -TWO31 + 7


@triton.jit
def _offsets_probe(out_ptr, pid_base, BLOCK: tl.constexpr):
    offs = A.block_offsets(tl.program_id(0) + pid_base, BLOCK)       # int32 pid, as on a GPU
    tl.store(out_ptr + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), offs)


def test_block_offsets_are_int64():
    """The helper every flat kernel uses, for program ids whose offsets pass 2**31 and 2**32."""
    BLOCK, base = 1024, 2**21 - 1                 # program ids 2**21 - 1 .. 2**22 + 1
    grid = 2**21 + 3
    pids = np.array([0, 1, 2, grid - 1])
    out = torch.full((4 * BLOCK,), -1, dtype=torch.int64)
    for i, p in enumerate(pids):                  # one probe program per id
        o = torch.empty(BLOCK, dtype=torch.int64)
        _offsets_probe[(1,)](o, int(base + p), BLOCK=BLOCK)
        out[i * BLOCK:(i + 1) * BLOCK] = o
    want = (base + pids[:, None]) * BLOCK + np.arange(BLOCK)[None, :]
    assert want.max() > TWO32 and want.min() < TWO31
    assert np.array_equal(out.numpy().reshape(4, BLOCK), want)
    assert not np.array_equal(_int32(want), want)          # an int32 helper would have wrapped


def _shift_program_ids(monkeypatch, base: int):
    """Number the interpreter's programs from `base`: a launch of k programs runs ids
    base .. base+k-1, the tail of a grid of base+k programs."""
    b = interp.interpreter_builder
    seen = []
    set_dim, set_idx = b.set_grid_dim, b.set_grid_idx

    def dim(nx, ny, nz):
        set_dim(nx + base, ny, nz)

    def idx(x, y, z):
        seen.append(x + base)
        set_idx(x + base, y, z)
    monkeypatch.setattr(b, "set_grid_dim", dim)
    monkeypatch.setattr(b, "set_grid_idx", idx)
    return seen


@pytest.mark.parametrize("lowp", [None, torch.bfloat16])
def test_adamw_kernel_past_2_31_elements(monkeypatch, lowp):
    BLOCK = 1024
    n = TWO31 + 1000                               # not a multiple of BLOCK: the last program is masked
    programs = -(-n // BLOCK)                      # 2**21 + 1
    lo = (programs - 2) * BLOCK                    # the last two programs: TWO31 - 1024 .. n
    assert lo < TWO31 < n
    # seven fp32 tensors of n elements, each a view starting past 2**31 in one mapping (so
    # an int32 offset, 2**32 lower, still lands inside it); spaced CHUNK apart, they overlap
    # only where nothing is touched
    CHUNK = 8 * BLOCK
    big = _virtual(TWO31 + n + 8 * CHUNK, torch.float32)
    views = [big[TWO31 + i * CHUNK:][:n] for i in range(7)]
    p, g, m, v, p_out, m_out, v_out = views
    lowp_out = _virtual(TWO31 + n + CHUNK, lowp)[TWO31:][:n] if lowp is not None else None
    gen = torch.Generator().manual_seed(0)
    tail = slice(lo, n)
    k = n - lo
    p[tail] = torch.randn(k, generator=gen)
    g[tail] = torch.randn(k, generator=gen)
    m[tail] = torch.randn(k, generator=gen) * 0.1
    v[tail] = torch.rand(k, generator=gen) * 1e-2
    for t in (p_out, m_out, v_out):
        t[lo - 8:n] = 7.0                           # sentinels, also just before the first lane
    sentinel_after = big[TWO31 + 4 * CHUNK + n:][:8]    # p_out's neighbour past its end: untouched
    lr, step = torch.tensor(1e-2, dtype=torch.float64), torch.tensor(3)
    kw = {"lr": lr, "step": step, "weight_decay": 0.1, "lowp_dtype": lowp}
    prep = A._prepare(p, g, m, v, lr, step, 0.9, 0.999, 1e-8, 0.1, lowp,
                      (p_out, m_out, v_out) + ((lowp_out,) if lowp is not None else ()))
    dst = A._outputs(prep, p)
    args, kwargs = A._kernel_args(p, g, m, v, prep, dst, BLOCK)
    assert args[9] == n and isinstance(args[9], int)
    seen = _shift_program_ids(monkeypatch, programs - 2)
    A._adamw_kernel[(2,)](*args, **kwargs)
    monkeypatch.undo()
    assert seen == [programs - 2, programs - 1]

    ref = A.adamw_update_torch(p[tail].clone(), g[tail].clone(), m[tail].clone(), v[tail].clone(), **kw)
    torch.testing.assert_close(p_out[tail], ref.param, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m_out[tail], ref.exp_avg, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(v_out[tail], ref.exp_avg_sq, rtol=1e-6, atol=1e-7)
    if lowp is not None:
        assert torch.equal(lowp_out[tail], p_out[tail].to(lowp))
    for t in (p_out, m_out, v_out):
        assert (t[lo - 8:lo] == 7.0).all()          # nothing before the first program's lanes
    assert (sentinel_after == 0).all()              # and nothing past n (masked lanes)
    # where int32 offsets (those past 2**31) would have gone: untouched zeros at the start
    # of the mapping (view i starts at TWO31 + i * CHUNK, 2**32 above its wrapped lanes)
    wrapped = TWO31 + _int32(np.arange(TWO31, n))
    assert wrapped.min() == 0 and wrapped.max() < CHUNK
    assert (big[:8 * CHUNK] == 0).all()
    assert _rss_mib() < 4096


@pytest.mark.parametrize("block", [None, 16])
def test_rmsnorm_rows_past_2_31_elements(block):
    """Rows 0..2 of x with a row stride of 2**31 - 2**20 elements: row 2 starts at
    2**32 - 2**21, which int32 `row * stride` wraps to -2**21. x starts 2**22 elements into
    the mapping, so the wrapped row exists: it holds different values (a decoy)."""
    D = 50                                          # not a power of two; block 16 loops over the row
    S = TWO31 - 2**20
    B = 2**22
    big = _virtual(B + 2 * S + D + 1024, torch.float32)
    x = big.as_strided((3, D), (S, 1), B)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(3, D, generator=gen)
    x.copy_(rows)
    wrapped_row = B + int(_int32(2 * S))            # where int32 math would read row 2
    assert 0 <= wrapped_row < B
    big[wrapped_row:wrapped_row + D] = 100.0 + torch.arange(D, dtype=torch.float32)   # decoy
    assert 2 * S + B > TWO31 and _int32(2 * S) < 0

    w = torch.randn(D, generator=gen) + 1
    xs = x.detach().requires_grad_()
    ws = w.clone().requires_grad_()
    y = R.rms_norm_triton(xs, ws, 1e-6, block=block)
    dy = torch.randn(3, D, generator=gen)
    y.backward(dy)
    xr, wr = rows.clone().requires_grad_(), w.clone().requires_grad_()
    yr = R.rms_norm_torch(xr, wr, 1e-6)
    yr.backward(dy)
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ws.grad, wr.grad, rtol=1e-5, atol=1e-5)
    assert _rss_mib() < 4096
