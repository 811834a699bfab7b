"""The Triton kernels of the fused AdamW step (`dsfn.ops.adamw`), and dsfn's shared Triton helpers.

- `adamw_kernel`: one tensor, `cdiv(numel, BLOCK)` programs; `adamw_multi_kernel`: a group
  of tensors in one launch (`dsfn.ops.multi_tensor`'s pointer and chunk tables); both run
  `adamw_block`, so they are bitwise one another. The arithmetic and its rounding are
  described in `dsfn.ops.adamw`'s docstring; the launches and their arguments are there.
- `block_offsets` (int64 element offsets of a flat 1-D kernel), `to_bf16_rtne` and
  `cast_rne` (float32 -> bf16/fp16, round to nearest even on every backend): used by the
  other kernels of `dsfn.ops` too.

`triton` is None where it is not importable; the kernels are then not defined.
"""
from __future__ import annotations

__all__ = ["adamw_block", "adamw_kernel", "adamw_multi_kernel", "block_offsets", "cast_rne", "to_bf16_rtne", "triton"]

try:
    import triton
    import triton.language as tl
except ImportError:   # pragma: no cover - triton is a dependency on linux x86_64 only
    triton = None

if triton is not None:
    @triton.jit
    def block_offsets(pid, BLOCK: tl.constexpr):
        """Element offsets `pid * BLOCK + [0, BLOCK)` of a flat 1-D kernel, in int64.

        The product is taken after widening `pid`, so offsets past 2**31 elements (8 GiB of
        fp32) do not wrap. dsfn's flat 1-D kernels compute their offsets here.
        """
        return pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)

    @triton.jit
    def to_bf16_rtne(x):
        """float32 -> bfloat16, round to nearest even like `Tensor.to`; NaN -> 0x7FC0.

        Written on the bits so that it is exact on every backend: the interpreter's own
        fp32 -> bf16 cast truncates, and its "rtne" mode rounds ties up.
        """
        u = x.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(x != x, 0x7FC0, r)                # noqa: PLR0124 (x != x: NaN)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def cast_rne(x, dtype: tl.constexpr):
        """float32 `x` as `dtype`, rounded to nearest even on every backend (see to_bf16_rtne)."""
        if dtype == tl.bfloat16:
            return to_bf16_rtne(x)
        else:
            return x.to(dtype)

    @triton.jit
    def adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, coef_ptr, p_out, m_out, v_out, lowp_out, n,
                      w1, beta2, w2, eps,
                      BLOCK: tl.constexpr, LERP_SMALL: tl.constexpr, WRITE_LOWP: tl.constexpr):
        offs = block_offsets(tl.program_id(0), BLOCK)
        mask = offs < n
        decay = tl.load(coef_ptr)
        neg_step_size = tl.load(coef_ptr + 1)
        bc2_sqrt = tl.load(coef_ptr + 2)
        adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, p_out, m_out, v_out, lowp_out, offs, mask,
                     decay, neg_step_size, bc2_sqrt, w1, beta2, w2, eps, LERP_SMALL, WRITE_LOWP)

    @triton.jit
    def adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, p_out, m_out, v_out, lowp_out, offs, mask,
                     decay, neg_step_size, bc2_sqrt, w1, beta2, w2, eps,
                     LERP_SMALL: tl.constexpr, WRITE_LOWP: tl.constexpr):
        """The AdamW update of the elements `offs` (where `mask`): both kernels run this, so
        the per-tensor and the multi-tensor launch are bitwise one another."""
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        # torch.lerp: one rounding of w*(g - m) + m (its vector kernel is an fma), and for
        # weights >= 0.5 the form anchored at g
        if LERP_SMALL:
            m = tl.fma(g - m, w1, m)
        else:
            m = tl.fma(g - m, w1 - 1.0, g)
        v = tl.fma(w2 * g, g, v * beta2)           # addcmul: torch's vector kernels contract it too
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p * decay + tl.div_rn(neg_step_size * m, denom)
        tl.store(p_out + offs, p, mask=mask)
        tl.store(m_out + offs, m, mask=mask)
        tl.store(v_out + offs, v, mask=mask)
        if WRITE_LOWP:
            tl.store(lowp_out + offs, cast_rne(p, lowp_out.dtype.element_ty), mask=mask)

    @triton.jit
    def adamw_multi_kernel(ptrs, chunks, coef_ptr, w1, beta2, w2, eps,
                            G_DTYPE: tl.constexpr, L_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
                            ITERS: tl.constexpr, LERP_SMALL: tl.constexpr, WRITE_LOWP: tl.constexpr):
        """One program: a chunk of BLOCK * ITERS elements of one tensor of the group.

        `ptrs` rows (dsfn.ops.multi_tensor.pointer_table): param, grad, exp_avg, exp_avg_sq,
        param_out, exp_avg_out, exp_avg_sq_out, lowp_out, numel; `chunks` rows: tensor, start."""
        pid = tl.program_id(0).to(tl.int64)
        t = tl.load(chunks + 2 * pid)
        start = tl.load(chunks + 2 * pid + 1)
        row = ptrs + 9 * t
        p_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
        g_ptr = tl.load(row + 1).to(tl.pointer_type(G_DTYPE))
        m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
        p_out = tl.load(row + 4).to(tl.pointer_type(tl.float32))
        m_out = tl.load(row + 5).to(tl.pointer_type(tl.float32))
        v_out = tl.load(row + 6).to(tl.pointer_type(tl.float32))
        lowp_out = tl.load(row + 7).to(tl.pointer_type(L_DTYPE))
        n = tl.load(row + 8)
        decay = tl.load(coef_ptr)
        neg_step_size = tl.load(coef_ptr + 1)
        bc2_sqrt = tl.load(coef_ptr + 2)
        # the chunk's blocks that hold elements: a small tensor's program stops after its own
        for i in range(tl.minimum(ITERS, tl.cdiv(n - start, BLOCK))):
            offs = start + i * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, p_out, m_out, v_out, lowp_out, offs, offs < n,
                         decay, neg_step_size, bc2_sqrt, w1, beta2, w2, eps, LERP_SMALL, WRITE_LOWP)
