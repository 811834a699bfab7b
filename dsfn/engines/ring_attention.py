"""Ring attention over a context-parallel axis: each rank's queries attend to every rank's
keys and values as the K/V blocks travel around the ring, the partial softmaxes merged by
log-sum-exp (the machinery under context parallel; imports no transform).

Layout (`head_tail_positions`). The global sequence of S tokens is cut into 2n chunks of c =
S / 2n; rank r of the n ranks holds chunks r and 2n - 1 - r (its "head" and "tail"), so
under a causal mask every rank does the same work (Megatron's and torchtitan's load
balancing). A rank's local sequence is those two chunks, concatenated: 2c positions.

`ring_attention(q, k, v, axis, positions, ...)`: q [B, H, T, D] (this rank's T = 2c query
rows), k / v [B, Hkv, T, D] (this rank's keys and values; Hkv divides H: grouped-query
attention keeps its Hkv heads on the wire, repeated to the query heads only inside a
block's compute), `positions` [T] the global index of each local row. `documents` [B, T]
(optional, int): a key is visible only to queries of the same document (packed sequences),
-1 marks padding (visible to nobody). `causal`: key index <= query index; `window` w: query
index - key index < w (a sliding window, with causal). A query that sees no key gives 0.

Forward: n steps; at step s the rank holds the K/V block of rank (r - s) mod n (its keys'
positions and documents travel with it), starts sending it on to rank r + 1 (`ring_shift`)
and computes its queries against it meanwhile: for each (query chunk, key chunk) pair whose
mask is not all False (the others are skipped: under the head-tail causal layout a third of
them), scores in fp32, the block's output and log-sum-exp merged into the running ones.
Backward (flash attention's, per block, from the saved output and log-sum-exp): the same
ring, the next K/V block in flight while this one is used; dQ stays home, each block's dK /
dV accumulate as they travel after it and come home with one last shift. Chunk pairs seen
whole or as the causal diagonal run on PyTorch's fused flash attention for CPU (forward and
backward, which return and take the log-sum-exp); other masks, soft-capping and other
devices on the explicit fp32 path (a fused GPU path is not built yet).

Equal to plain softmax attention on the whole sequence (`tests/engines/test_ring_attention.py`,
against `torch.nn.functional.scaled_dot_product_attention` at n = 2, 3, 4) up to fp32
reassociation of the softmax sums.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from dsfn.errors import ShapeError
from dsfn.runtime import collectives as C
from dsfn.runtime.mesh import current_mesh
from dsfn.engines.sdpa_mode import CausalSDPAMode

__all__ = ["RingCall", "head_tail_positions", "ring_attention", "visible"]


@dataclass(frozen=True)
class RingCall:
    """One ring attention call on this rank, as `explain` reports it (`record=` of
    `ring_attention`): n ranks, the K/V block's shape [B, Hkv, T, D] and element bytes,
    whether documents travel with it, and the (query chunk, key chunk) pairs computed of
    the n x 4 (the others are fully masked: skipped) with their query-key products."""
    n: int
    rows: int
    kv_heads: int
    heads: int
    seq: int
    head_dim: int
    itemsize: int
    documents: bool
    pairs: int
    pairs_total: int
    products: int           # visible query-key pairs x heads x rows over the computed pairs

    @property
    def block_bytes(self) -> int:
        """Bytes of one travelling block: K and V, their positions (int64) and documents (int64)."""
        kv = 2 * self.rows * self.kv_heads * self.seq * self.head_dim * self.itemsize
        return kv + 8 * self.seq + (8 * self.rows * self.seq if self.documents else 0)

    @property
    def grad_bytes(self) -> int:
        """Bytes of the dK / dV (fp32) that travel with a block in backward."""
        return 2 * self.rows * self.kv_heads * self.seq * self.head_dim * 4

    @property
    def wire_bytes(self) -> int:
        """This rank's bytes sent for the call: n - 1 shifts of the block in forward and again
        in backward, and n of its dK / dV (the last brings them home)."""
        return 2 * (self.n - 1) * self.block_bytes + self.n * self.grad_bytes


def head_tail_positions(seq_len: int, n: int, rank: int) -> torch.Tensor:
    """The global positions [2c] rank `rank` of `n` holds (chunks rank and 2n - 1 - rank of c =
    seq_len / 2n); a ShapeError when 2n does not divide seq_len."""
    if seq_len % (2 * n):
        raise ShapeError(f"context parallel over {n} ranks cuts the sequence into {2 * n} chunks; its length "
                         f"{seq_len} is not a multiple of {2 * n}: pad it to {math.ceil(seq_len / (2 * n)) * 2 * n}")
    c = seq_len // (2 * n)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * n - 1 - rank) * c, (2 * n - rank) * c)])


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: torch.Tensor | None, k_doc: torch.Tensor | None,
            causal: bool, window: int | None) -> torch.Tensor:
    """[B or 1, Tq, Tk] bool: which keys each query sees (module docstring)."""
    m = torch.ones(q_pos.numel(), k_pos.numel(), dtype=torch.bool, device=q_pos.device)
    diff = q_pos[:, None] - k_pos[None, :]
    if causal:
        m = m & (diff >= 0)
    if window is not None:
        m = m & (diff < window)
    m = m.unsqueeze(0)
    if q_doc is not None:
        m = m & (q_doc[:, :, None] == k_doc[:, None, :]) & (k_doc[:, None, :] >= 0)
    return m


def _repeat(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, H, T, D] -> [B, Hkv, T, D]: the query heads of one kv head summed (GQA's gradient)."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x.view(b, h // groups, groups, t, d).sum(2)


def _pairs(mask: torch.Tensor, cq: int, ck: int):
    """(query slice, key slice, sub-mask) of each chunk pair whose mask has a True."""
    for i in range(0, mask.shape[-2], cq):
        for j in range(0, mask.shape[-1], ck):
            sub = mask[:, i:i + cq, j:j + ck]
            if bool(sub.any()):
                yield slice(i, i + cq), slice(j, j + ck), sub


def _scores(qf: torch.Tensor, kf: torch.Tensor, qs: slice, ks: slice, sub: torch.Tensor, scale: float,
            softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scaled scores of one (query chunk, key chunk) pair, -inf where the mask hides the key
    (forward and backward's recompute alike); with `softcap` c (Gemma2's logit soft-capping)
    c * tanh(s / c), and the tanh itself (backward's factor 1 - tanh^2), else None."""
    sc = (qf[:, :, qs] @ kf[:, :, ks].transpose(-1, -2)) * scale
    th = None
    if softcap:
        th = torch.tanh(sc / softcap)
        sc = th * softcap
    return sc.masked_fill(~sub.unsqueeze(1), -math.inf), th


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _kernel_pair(q: torch.Tensor, sub: torch.Tensor, softcap: float | None) -> bool | None:
    """How a chunk pair runs on a fused attention kernel (CPU: PyTorch's flash attention for
    CPU, which returns the log-sum-exp the merge needs): False for a pair every query sees
    whole, True for the causal diagonal (same positions), None for any other mask (documents,
    windows, padding) or soft-capping: the explicit fp32 path."""
    if _FLASH_CPU is None or q.device.type != "cpu" or softcap or sub.shape[0] != 1 or sub.shape[1] != sub.shape[2]:
        return None
    if bool(sub.all()):
        return False
    tril = torch.ones(sub.shape[1:], dtype=torch.bool, device=sub.device).tril()
    return True if bool((sub[0] == tril).all()) else None


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, axis, q_pos, q_doc, causal, window, scale, chunk, record, softcap):
        n = current_mesh().size(axis)
        pairs = products = 0
        groups = q.shape[1] // k.shape[1]
        b, h, t, d = q.shape
        # [B, H, T, D] laid out as [B, T, H, D]: the caller's transpose back to the model's layout
        # is then a view, and the output saved for backward is the one the model uses (no copy)
        out = torch.zeros(b, t, h, d, dtype=torch.float32, device=q.device).transpose(1, 2)
        lse = torch.full((b, h, t), -math.inf, dtype=torch.float32, device=q.device)
        qf = q.float()
        block = [k, v, q_pos] + ([q_doc] if q_doc is not None else [])
        for s in range(n):
            shift = C.ring_shift(block, axis) if s < n - 1 else None      # the next block travels meanwhile
            kk, vv, k_pos = block[:3]
            mask = visible(q_pos, k_pos, q_doc, block[3] if q_doc is not None else None, causal, window)
            kf, vf = _repeat(kk.float(), groups), _repeat(vv.float(), groups)
            for qs, ks, sub in _pairs(mask, chunk, chunk):
                pairs += 1
                if record is not None:          # (a host sync: only when explain asks)
                    products += int(sub.sum()) * h * (b // sub.shape[0])
                fused = _kernel_pair(q, sub, softcap)
                if fused is not None:
                    blk_out, blk_lse = _FLASH_CPU(qf[:, :, qs], kf[:, :, ks], vf[:, :, ks], 0.0, fused, scale=scale)
                else:
                    sc, _ = _scores(qf, kf, qs, ks, sub, scale, softcap)
                    m = sc.amax(-1)
                    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
                    p = torch.exp(sc - m.unsqueeze(-1))
                    l_ = p.sum(-1)
                    blk_lse = torch.where(l_ > 0, m + torch.log(l_), torch.full_like(l_, -math.inf))
                    blk_out = (p @ vf[:, :, ks]) / l_.clamp_min(1e-30).unsqueeze(-1)
                new = torch.logaddexp(lse[:, :, qs], blk_lse)
                safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
                a = torch.exp(lse[:, :, qs] - safe).unsqueeze(-1)
                w = torch.exp(blk_lse - safe).unsqueeze(-1)
                out[:, :, qs] = out[:, :, qs] * a + blk_out * w
                lse[:, :, qs] = new
            if shift is not None:
                block = shift.wait()
        ctx.save_for_backward(q, k, v, out, lse, q_pos, *([q_doc] if q_doc is not None else []))
        ctx.axis, ctx.causal, ctx.window, ctx.scale, ctx.chunk = axis, causal, window, scale, chunk
        ctx.softcap = softcap
        ctx.has_doc = q_doc is not None
        if record is not None:
            record(RingCall(n, b, k.shape[1], h, t, d, k.element_size(), q_doc is not None, pairs,
                            n * (t // chunk) ** 2, products))
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, q_pos, *rest = ctx.saved_tensors
        q_doc = rest[0] if ctx.has_doc else None
        axis, scale, chunk = ctx.axis, ctx.scale, ctx.chunk
        n = current_mesh().size(axis)
        groups = q.shape[1] // k.shape[1]
        qf, do = q.float(), dout.float()
        delta = (do * out).sum(-1)                                    # [B, H, T]
        dq = torch.zeros_like(qf)
        safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        dk_acc = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv_acc = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        block = [k, v, q_pos] + ([q_doc] if q_doc is not None else [])
        for s in range(n):
            # the next K/V block travels while this one is used; its dK / dV follow after
            shift = C.ring_shift(block, axis) if s < n - 1 else None
            kk, vv, k_pos = block[:3]
            mask = visible(q_pos, k_pos, q_doc, block[3] if q_doc is not None else None, ctx.causal, ctx.window)
            kf, vf = _repeat(kk.float(), groups), _repeat(vv.float(), groups)
            dk_blk = torch.zeros_like(kf)
            dv_blk = torch.zeros_like(vf)
            for qs, ks, sub in _pairs(mask, chunk, chunk):
                fused = _kernel_pair(q, sub, ctx.softcap)
                if fused is not None:
                    gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                        do[:, :, qs], qf[:, :, qs], kf[:, :, ks], vf[:, :, ks], out[:, :, qs], lse[:, :, qs],
                        0.0, fused, scale=scale)
                    dq[:, :, qs] += gq
                    dk_blk[:, :, ks] += gk
                    dv_blk[:, :, ks] += gv
                    continue
                sc, th = _scores(qf, kf, qs, ks, sub, scale, ctx.softcap)
                p = torch.exp(sc - safe_lse[:, :, qs].unsqueeze(-1))
                p = torch.where(torch.isinf(lse[:, :, qs]).unsqueeze(-1), torch.zeros_like(p), p)
                dv_blk[:, :, ks] += p.transpose(-1, -2) @ do[:, :, qs]
                dp = do[:, :, qs] @ vf[:, :, ks].transpose(-1, -2)
                ds = p * (dp - delta[:, :, qs].unsqueeze(-1))
                if th is not None:           # through the cap: d(c tanh(s/c))/ds = 1 - tanh^2
                    ds = ds * (1 - th * th)
                dq[:, :, qs] += (ds @ kf[:, :, ks]) * scale
                dk_blk[:, :, ks] += (ds.transpose(-1, -2) @ qf[:, :, qs]) * scale
            dk_acc = dk_acc + _fold(dk_blk, groups)
            dv_acc = dv_acc + _fold(dv_blk, groups)
            # the gradients move on after their block; after n shifts they are home
            dk_acc, dv_acc = C.ring_shift([dk_acc, dv_acc], axis).wait()
            if shift is not None:
                block = shift.wait()
        return (dq.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype), None, None, None, None, None, None, None,
                None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: str, positions: torch.Tensor,
                   documents: torch.Tensor | None = None, causal: bool = True, window: int | None = None,
                   scale: float | None = None, record: Callable[[RingCall], None] | None = None,
                   softcap: float | None = None) -> torch.Tensor:
    """Softmax attention of this rank's queries over the keys of every rank along `axis`
    ([B, H, T, D], module docstring); `positions` [T] this rank's global indices (two chunks of
    T / 2 under the head-tail layout: the chunk pairs are skipped or computed as units).
    `record`: called with the forward's `RingCall` (explain's figures). `softcap` c: scores
    soft-capped to c * tanh(s / c) before the softmax (Gemma2's attention logits)."""
    if q.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:] \
            or q.shape[1] % k.shape[1]:
        raise ShapeError(f"ring_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; expected "
                         "q [B, H, T, D] and k, v [B, Hkv, T, D] with Hkv dividing H")
    if positions.shape != (q.shape[2],):
        raise ShapeError(f"ring_attention: positions {tuple(positions.shape)}, expected [{q.shape[2]}]")
    if documents is not None and documents.shape != q.shape[:1] + q.shape[2:3]:
        raise ShapeError(f"ring_attention: documents {tuple(documents.shape)}, expected [{q.shape[0]}, {q.shape[2]}]")
    chunk = q.shape[2] // 2 if q.shape[2] % 2 == 0 else q.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _Ring.apply(q, k, v, axis, positions.long(), None if documents is None else documents.long(),
                       bool(causal), window, scale, chunk, record, float(softcap) if softcap else None)


class RingSDPA(CausalSDPAMode):
    """Runs every causal `F.scaled_dot_product_attention` call (no mask: a non-HF model's
    attention, e.g. `dsfn.models.gpt`) as ring attention over `axis`, the local rows at global
    `positions` [T] (the head-tail layout)."""

    who = "context_parallel"

    def __init__(self, axis: str, positions: torch.Tensor, record: Callable[[RingCall], None] | None = None):
        super().__init__(axis)
        self.positions, self.record = positions, record

    def attend(self, func, q, k, v, args):
        from dsfn.errors import ConfigError
        if args.get("dropout_p", 0.0):
            raise ConfigError("context_parallel: attention dropout is not supported by ring attention; set the "
                              "model's attention dropout to 0")
        return ring_attention(q, k, v, self.axis, self.positions, causal=True, scale=args.get("scale"),
                              record=self.record)
