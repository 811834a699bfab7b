"""Cross-entropy fused with the LM head, over vocabulary tiles.

    loss = linear_cross_entropy(hidden, weight, labels)        # hidden [N, D], weight [V, D]

computes exactly `F.cross_entropy((hidden @ weight.T + bias).float(), labels,
ignore_index=..., label_smoothing=..., reduction=...)` (the loss of `dsfn.models.gpt.gpt_loss`
with the head folded in) without ever holding the `[N, V]` logits, in forward or backward:

- forward: for each tile of `vocab_tile` vocabulary rows, the tile's logits
  `hidden @ weight[v0:v1].T (+ bias[v0:v1])` are made (a matmul in the input dtype, read
  in fp32), folded into a running per-row log-sum-exp, the target logit (picked from the
  tile that holds it) and, for label smoothing, the running sum of logits; then the tile
  is dropped. Only the per-row log-sum-exp (N fp32 values) is saved for backward.
- backward: each tile's logits are made again, turned into
  `dlogits = (softmax - (1 - eps) * onehot - eps / V) * scale` in place (`softmax =
  exp(logits - lse)`; `scale` = grad_out / number of non-ignored tokens for "mean", 0 on
  ignored rows), and used at once: `grad_hidden += dlogits @ weight[v0:v1]`,
  `grad_weight[v0:v1] = dlogits.T @ hidden`, `grad_bias[v0:v1] = dlogits.sum(0)`.

Extra memory beyond inputs and gradients: O(N * vocab_tile) for the tile (plus a
temporary or two of that size), O(N) for the per-row statistics and, when hidden is not
fp32, an fp32 [N, D] accumulator for grad_hidden. Never O(N * V).

Two implementations with one signature, picked by `dsfn.ops.dispatch.use_triton`:

- `linear_cross_entropy_torch`: the tiling above with torch ops (any device; the CPU
  default, so the CPU path saves memory as well).
- `linear_cross_entropy_triton`: the same tiling; the matmuls are torch matmuls on tile
  slices (cuBLAS on GPU), and the per-tile math is fused in two Triton kernels — forward
  (online max/log-sum-exp across the tile, target gather, logit sum, merged into the
  running statistics) and backward (softmax minus one-hot minus smoothing, times the row
  scale, written over the tile's logits in place). Row offsets are int64 (`N * vocab_tile`
  may pass 2**31).

Semantics, as torch's:
- "mean" divides by the number of non-ignored tokens; with none (an empty batch, or every
  label == ignore_index) the loss is nan and every gradient is zero, as torch gives.
- "sum" of an empty / all-ignored batch is 0; "none" returns per-token losses (0 where
  ignored) in the shape of `labels`.
- The loss is fp32 whatever the input dtype (logits are read as fp32, like `gpt_loss`).
- `hidden` may have leading dims `[..., D]` with `labels` of shape `[...]`.
- D = 0 (hidden `[N, 0]`, weight `[V, 0]`) is allowed: every logit is 0 (the bias, with
  one), so each token's loss is log(V) without a bias; the hidden and weight gradients are
  zero-sized, as torch gives for the materialised logits.
- A label outside [0, V) that is not ignore_index raises `ConfigError` (checked on the
  host: one device sync per call).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dsfn.errors import ConfigError, LeafTypeError, ShapeError
from dsfn.ops import dispatch

__all__ = ["linear_cross_entropy", "linear_cross_entropy_torch", "linear_cross_entropy_triton"]

REDUCTIONS = ("mean", "sum", "none")
# Auto tile: about this many logits per tile (64 MiB in fp32), between the two bounds.
_TILE_ELEMS = 1 << 24
_MIN_TILE, _MAX_TILE = 256, 16384


# ---------------------------------------------------------------------------------------
# validation


def _check(hidden, weight, labels, bias, ignore_index, label_smoothing, reduction, vocab_tile):
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise LeafTypeError(f"linear_cross_entropy: {name} must be a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise LeafTypeError(f"linear_cross_entropy: bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if not hidden.is_floating_point():
        raise LeafTypeError(f"linear_cross_entropy: hidden must be floating point, got {hidden.dtype}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != hidden.dtype:
            raise LeafTypeError(f"linear_cross_entropy: {name} dtype {t.dtype} differs from hidden's "
                                f"{hidden.dtype}; cast them to one dtype")
    if labels.dtype != torch.int64:
        raise LeafTypeError(f"linear_cross_entropy: labels must be int64 (torch.long), got {labels.dtype}; "
                            "use labels.long()")
    if hidden.dim() < 2:
        raise ShapeError(f"linear_cross_entropy: hidden must be [N, D] (or [..., D]), got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ShapeError(f"linear_cross_entropy: weight must be [V, D], got shape {tuple(weight.shape)}")
    V, D = weight.shape
    if hidden.shape[-1] != D:
        raise ShapeError(f"linear_cross_entropy: hidden's last dim {hidden.shape[-1]} != weight's D={D} "
                         f"(hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)})")
    if V == 0:
        raise ShapeError("linear_cross_entropy: weight has no vocabulary rows (V=0)")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ShapeError(f"linear_cross_entropy: labels shape {tuple(labels.shape)} must be hidden's leading "
                         f"shape {tuple(hidden.shape[:-1])}")
    if bias is not None and tuple(bias.shape) != (V,):
        raise ShapeError(f"linear_cross_entropy: bias must be [V]=[{V}], got shape {tuple(bias.shape)}")
    devices = {t.device for t in (hidden, weight, labels, bias) if t is not None}
    if len(devices) > 1:
        raise ConfigError(f"linear_cross_entropy: tensors on different devices {sorted(map(str, devices))}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ConfigError(f"linear_cross_entropy: ignore_index must be an int, got {ignore_index!r}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0.0 <= label_smoothing <= 1.0:
        raise ConfigError(f"linear_cross_entropy: label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    if reduction not in REDUCTIONS:
        raise ConfigError(f"linear_cross_entropy: reduction must be one of {list(REDUCTIONS)}, got {reduction!r}")
    if vocab_tile is not None and (isinstance(vocab_tile, bool) or not isinstance(vocab_tile, int) or vocab_tile < 1):
        raise ConfigError(f"linear_cross_entropy: vocab_tile must be a positive int or None, got {vocab_tile!r}")
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= V))
    if bool(bad.any()):
        first = labels[bad].flatten()[0].item()
        raise ConfigError(f"linear_cross_entropy: label {first} is outside [0, {V}) and is not "
                          f"ignore_index={ignore_index}")


def _auto_tile(n: int, v: int) -> int:
    """About _TILE_ELEMS logits per tile, a power of two in [_MIN_TILE, _MAX_TILE], at most V."""
    t = _MAX_TILE
    while t > _MIN_TILE and t * max(n, 1) > _TILE_ELEMS:
        t //= 2
    return min(t, v)


# ---------------------------------------------------------------------------------------
# per-tile math: torch


def _tile_logits(hidden, weight, bias, v0, v1):
    """[N, v1 - v0] logits of one vocabulary tile, in the input dtype (a fresh tensor)."""
    return F.linear(hidden, weight[v0:v1], None if bias is None else bias[v0:v1])


def _fwd_tile_torch(z, labels, v0, lse, tgt, sumz, smooth):
    zf = z.float()
    lse.copy_(torch.logaddexp(lse, torch.logsumexp(zf, dim=1)))
    local = labels - v0
    hit = (local >= 0) & (local < zf.shape[1])
    picked = zf.gather(1, local.clamp(0, zf.shape[1] - 1)[:, None]).squeeze(1)
    tgt.add_(torch.where(hit, picked, 0.0))
    if smooth:
        sumz.add_(zf.sum(dim=1))


def _bwd_tile_torch(z, labels, v0, lse, scale, smooth_coef, target_coef):
    """dlogits of the tile, in z's dtype (computed in fp32; z is overwritten when fp32)."""
    p = z.float().sub_(lse[:, None]).exp_()
    if smooth_coef:
        p.sub_(smooth_coef)
    local = labels - v0
    hit = (local >= 0) & (local < p.shape[1])
    p.scatter_add_(1, local.clamp(0, p.shape[1] - 1)[:, None], (hit.float() * -target_coef)[:, None])
    p.mul_(scale[:, None])
    return p.to(z.dtype)


# ---------------------------------------------------------------------------------------
# per-tile math: Triton

try:
    import triton
    import triton.language as tl
except ImportError:   # pragma: no cover - triton is a dependency on linux x86_64 only
    triton = None

if triton is not None:
    @triton.jit
    def _ce_fwd_tile_kernel(z_ptr, stride_zn, labels_ptr, lse_ptr, tgt_ptr, sumz_ptr,
                            n_rows, tile_width, v0,
                            SMOOTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
        """One block of rows of a logits tile: online max / sum-exp across the tile, the
        target logit and (SMOOTH) the logit sum, merged into the running row statistics."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        row_ok = rows < n_rows
        local = tl.load(labels_ptr + rows, mask=row_ok, other=-1) - v0
        row_ptr = z_ptr + rows * stride_zn                          # int64 offsets
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_M], tl.float32)
        tgt = tl.zeros([BLOCK_M], tl.float32)
        sz = tl.zeros([BLOCK_M], tl.float32)
        for c in range(0, tile_width, BLOCK_V):
            cols = c + tl.arange(0, BLOCK_V)
            ok = row_ok[:, None] & (cols < tile_width)[None, :]
            z = tl.load(row_ptr[:, None] + cols[None, :], mask=ok, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)   # no (-inf) - (-inf)
            s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(z - m_ref[:, None]), axis=1)
            m = m_new
            tgt += tl.sum(tl.where(ok & (cols[None, :] == local[:, None]), z, 0.0), axis=1)
            if SMOOTH:
                sz += tl.sum(tl.where(ok, z, 0.0), axis=1)
        tile_lse = m + tl.log(tl.where(s > 0, s, 1.0))              # s == 0 only where m == -inf
        old = tl.load(lse_ptr + rows, mask=row_ok, other=float("-inf"))
        mx = tl.maximum(old, tile_lse)
        mx_ref = tl.where(mx == float("-inf"), 0.0, mx)
        both = tl.exp(old - mx_ref) + tl.exp(tile_lse - mx_ref)
        tl.store(lse_ptr + rows, mx + tl.log(tl.where(both > 0, both, 1.0)), mask=row_ok)
        tl.store(tgt_ptr + rows, tl.load(tgt_ptr + rows, mask=row_ok, other=0.0) + tgt, mask=row_ok)
        if SMOOTH:
            tl.store(sumz_ptr + rows, tl.load(sumz_ptr + rows, mask=row_ok, other=0.0) + sz, mask=row_ok)

    @triton.jit
    def _ce_bwd_tile_kernel(z_ptr, stride_zn, labels_ptr, lse_ptr, scale_ptr,
                            n_rows, tile_width, v0, smooth_coef, target_coef,
                            BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
        """Overwrite a logits tile with its dlogits: (exp(z - lse) - eps/V - (1-eps)*onehot) * scale."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        row_ok = rows < n_rows
        local = tl.load(labels_ptr + rows, mask=row_ok, other=-1) - v0
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
        row_ptr = z_ptr + rows * stride_zn                          # int64 offsets
        for c in range(0, tile_width, BLOCK_V):
            cols = c + tl.arange(0, BLOCK_V)
            ok = row_ok[:, None] & (cols < tile_width)[None, :]
            ptrs = row_ptr[:, None] + cols[None, :]
            z = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
            d = tl.exp(z - lse[:, None]) - smooth_coef
            d = d - tl.where(cols[None, :] == local[:, None], target_coef, 0.0)
            d = d * scale[:, None]
            tl.store(ptrs, d.to(z_ptr.dtype.element_ty), mask=ok)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


# Largest (BLOCK_M, BLOCK_V) under the interpreter: big blocks, since numpy ops on a block
# are cheap and each program instance is not (tests shrink them to cover the loops and masks).
_INTERP_BLOCKS = (64, 2048)


def _launch_cfg(n: int, t: int):
    """(BLOCK_M, BLOCK_V, num_warps): on GPU one row per program and wide column blocks
    (untuned: no GPU measurement yet)."""
    if dispatch.interpreting():
        bm, bv = _INTERP_BLOCKS
        return min(bm, _next_pow2(n)), min(bv, _next_pow2(t)), 4
    return 1, min(4096, _next_pow2(t)), 8


def _fwd_tile_triton(z, labels, v0, lse, tgt, sumz, smooth):
    n, t = z.shape
    if n == 0:
        return
    bm, bv, warps = _launch_cfg(n, t)
    with dispatch.device_guard(z):              # Triton launches on the current device, not z's
        _ce_fwd_tile_kernel[(triton.cdiv(n, bm),)](
            z, z.stride(0), labels, lse, tgt, sumz, n, t, v0,
            SMOOTH=bool(smooth), BLOCK_M=bm, BLOCK_V=bv, num_warps=warps)


def _bwd_tile_triton(z, labels, v0, lse, scale, smooth_coef, target_coef):
    n, t = z.shape
    if n > 0:
        bm, bv, warps = _launch_cfg(n, t)
        with dispatch.device_guard(z):
            _ce_bwd_tile_kernel[(triton.cdiv(n, bm),)](
                z, z.stride(0), labels, lse, scale, n, t, v0, float(smooth_coef), float(target_coef),
                BLOCK_M=bm, BLOCK_V=bv, num_warps=warps)
    return z


# ---------------------------------------------------------------------------------------
# the autograd function


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, label_smoothing, reduction, tile, impl):
        fwd_tile = _fwd_tile_triton if impl == "triton" else _fwd_tile_torch
        N, V = hidden.shape[0], weight.shape[0]
        f32 = {"dtype": torch.float32, "device": hidden.device}
        lse = torch.full((N,), float("-inf"), **f32)
        tgt = torch.zeros(N, **f32)
        sumz = torch.zeros(N, **f32)
        smooth = label_smoothing > 0
        for v0 in range(0, V, tile):
            v1 = min(V, v0 + tile)
            fwd_tile(_tile_logits(hidden, weight, bias, v0, v1), labels, v0, lse, tgt, sumz, smooth)
        valid = labels != ignore_index
        row = lse - (1.0 - label_smoothing) * tgt
        if smooth:
            row = row - (label_smoothing / V) * sumz
        row = torch.where(valid, row, 0.0)
        n_valid = valid.sum()
        if reduction == "none":
            loss = row
        elif reduction == "sum":
            loss = row.sum()
        else:
            loss = row.sum() / n_valid          # 0 / 0 = nan for no valid token, as torch
        ctx.save_for_backward(hidden, weight, bias, labels, lse, n_valid)
        ctx.cfg = (ignore_index, float(label_smoothing), reduction, tile, impl)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        hidden, weight, bias, labels, lse, n_valid = ctx.saved_tensors
        ignore_index, eps, reduction, tile, impl = ctx.cfg
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grads = [None] * 9
        if not (need_h or need_w or need_b):
            return tuple(grads)
        bwd_tile = _bwd_tile_triton if impl == "triton" else _bwd_tile_torch
        N, D = hidden.shape
        V = weight.shape[0]
        valid = (labels != ignore_index).float()
        g = grad_out.float()
        if reduction == "mean":
            g = g / n_valid.clamp(min=1)        # all ignored: every row's scale is 0 anyway
        scale = (valid * g).contiguous()        # [N]: 0-dim g broadcasts
        acc_dtype = torch.float32
        gh = torch.zeros(N, D, dtype=acc_dtype, device=hidden.device) if need_h else None
        # contiguous whatever weight's layout (e.g. a transposed tied embedding): tiles are row blocks
        gw = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if need_w else None
        gb = torch.empty(V, dtype=bias.dtype, device=bias.device) if need_b else None
        smooth_coef, target_coef = eps / V, 1.0 - eps
        for v0 in range(0, V, tile):
            v1 = min(V, v0 + tile)
            dz = bwd_tile(_tile_logits(hidden, weight, bias, v0, v1), labels, v0, lse, scale,
                          smooth_coef, target_coef)
            if need_h:
                if dz.dtype == acc_dtype:
                    gh.addmm_(dz, weight[v0:v1])
                else:
                    gh.add_(dz @ weight[v0:v1])
            if need_w:
                torch.mm(dz.t(), hidden, out=gw[v0:v1])
            if need_b:
                gb[v0:v1] = dz.sum(0, dtype=torch.float32)
            del dz
        if need_h:
            grads[0] = gh.to(hidden.dtype)
        grads[1], grads[2] = gw, gb
        return tuple(grads)


def _run(impl, hidden, weight, labels, bias, ignore_index, label_smoothing, reduction, vocab_tile):
    lead = labels.shape
    h = hidden.reshape(labels.numel(), hidden.shape[-1])      # not -1: ambiguous when D == 0
    y = labels.reshape(-1).contiguous()
    tile = vocab_tile if vocab_tile is not None else _auto_tile(h.shape[0], weight.shape[0])
    loss = _LinearCrossEntropy.apply(h, weight, bias, y, int(ignore_index), float(label_smoothing),
                                     reduction, int(tile), impl)
    return loss.reshape(lead) if reduction == "none" else loss


# ---------------------------------------------------------------------------------------
# public API


def linear_cross_entropy_torch(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               bias: torch.Tensor | None = None, ignore_index: int = -100,
                               label_smoothing: float = 0.0, reduction: str = "mean",
                               vocab_tile: int | None = None) -> torch.Tensor:
    """The torch reference: the vocabulary-tiled loss with torch ops (see the module docstring).

    Args:
        hidden: [N, D] (or [..., D]) floating point, the LM head's input.
        weight: [V, D], the head's weight (same dtype as hidden).
        labels: int64 [N] (or [...]); ignore_index marks tokens without a loss.
        bias: optional [V].
        ignore_index, label_smoothing, reduction: as `torch.nn.functional.cross_entropy`.
        vocab_tile: vocabulary rows per tile; None picks one so a tile holds about 2**24
            logits (between 256 and 16384 rows, at most V).

    Returns: fp32 loss — 0-dim for "mean"/"sum", labels' shape for "none".

    Raises:
        LeafTypeError: a non-tensor, labels not int64, non-float or mismatched dtypes.
        ShapeError: wrong dims, hidden's D != weight's D, labels/bias shape mismatch, V = 0.
        ConfigError: bad reduction / label_smoothing / vocab_tile / ignore_index, a label
            outside [0, V) that is not ignore_index, tensors on different devices.
    """
    _check(hidden, weight, labels, bias, ignore_index, label_smoothing, reduction, vocab_tile)
    return _run("torch", hidden, weight, labels, bias, ignore_index, label_smoothing, reduction, vocab_tile)


def linear_cross_entropy_triton(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                bias: torch.Tensor | None = None, ignore_index: int = -100,
                                label_smoothing: float = 0.0, reduction: str = "mean",
                                vocab_tile: int | None = None) -> torch.Tensor:
    """The Triton implementation; arguments and result as `linear_cross_entropy_torch`.

    Raises ConfigError where Triton cannot run on these tensors (no triton, or CPU without
    TRITON_INTERPRET=1), besides the argument errors of `linear_cross_entropy_torch`.
    """
    _check(hidden, weight, labels, bias, ignore_index, label_smoothing, reduction, vocab_tile)
    tensors = [t for t in (hidden, weight, labels, bias) if t is not None]
    why = "triton is not importable" if triton is None else dispatch.triton_problem(*tensors)
    if why is not None:
        raise ConfigError(f"linear_cross_entropy_triton: Triton kernels cannot run on "
                          f"{sorted({t.device.type for t in tensors})}: {why} (triton importable: "
                          f"{triton is not None}, TRITON_INTERPRET: {dispatch.interpreting()}); "
                          "use linear_cross_entropy")
    return _run("triton", hidden, weight, labels, bias, ignore_index, label_smoothing, reduction, vocab_tile)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         bias: torch.Tensor | None = None, ignore_index: int = -100,
                         label_smoothing: float = 0.0, reduction: str = "mean",
                         vocab_tile: int | None = None) -> torch.Tensor:
    """`F.cross_entropy((hidden @ weight.T + bias).float(), labels, ...)` without the [N, V] logits.

    Runs `linear_cross_entropy_triton` where `dispatch.use_triton` says so (CUDA tensors by
    default), `linear_cross_entropy_torch` elsewhere. Arguments, result and errors as
    `linear_cross_entropy_torch`.
    """
    _check(hidden, weight, labels, bias, ignore_index, label_smoothing, reduction, vocab_tile)
    tensors = [t for t in (hidden, weight, labels, bias) if t is not None]
    impl = "triton" if dispatch.use_triton(*tensors) else "torch"
    return _run(impl, hidden, weight, labels, bias, ignore_index, label_smoothing, reduction, vocab_tile)
