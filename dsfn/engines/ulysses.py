"""The Ulysses all-to-alls: sequence-sharded <-> head-sharded attention over an sp axis.

Machinery shared by `dsfn.transforms.sequence_parallel` (which wraps causal sdpa calls,
`UlyssesSDPA`) and `dsfn.integrations.hf` (which wraps a Hugging Face attention): each
rank holds [B, H, T/n, d] (its tokens, every head); `seq_to_heads` makes it
[B, H/n, T, d] (every token, its head group) with one all-to-all, attention runs locally,
and `heads_to_seq` sends the result back. Each one's adjoint is the other. Key/value heads
fewer than n are repeated first (`kv_replication`, `replicate_kv`: DeepSpeed Ulysses's
kv_replication_factor, in Hugging Face's `repeat_kv` order). Imports no transform.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from dsfn.errors import MeshError
from dsfn.runtime import collectives as C
from dsfn.runtime.mesh import current_mesh
from dsfn.engines.sdpa_mode import CausalSDPAMode

__all__ = ["UlyssesSDPA", "heads_to_seq", "kv_replication", "replicate_kv", "seq_to_heads", "ulysses_sdpa"]



def seq_to_heads(x: torch.Tensor, axis: str) -> torch.Tensor:
    """[B, H, T/n, d] (this rank's tokens, all heads) -> [B, H/n, T, d] (all tokens, head group r)."""
    return _AllToAll.apply(x, axis, True)


def heads_to_seq(x: torch.Tensor, axis: str) -> torch.Tensor:
    """[B, H/n, T, d] (all tokens, head group r) -> [B, H, T/n, d] (this rank's tokens, all heads)."""
    return _AllToAll.apply(x, axis, False)


def _s2h(x: torch.Tensor, axis: str) -> torch.Tensor:
    n = current_mesh().size(axis)
    b, h, t, d = x.shape
    send = x.reshape(b, n, h // n, t, d).permute(1, 0, 2, 3, 4).contiguous()    # chunk j -> rank j (heads j)
    got = C.all_to_all(send, axis)                                              # chunk i <- rank i (tokens i)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * t, d)


def _h2s(x: torch.Tensor, axis: str) -> torch.Tensor:
    n = current_mesh().size(axis)
    b, hn, t, d = x.shape
    send = x.reshape(b, hn, n, t // n, d).permute(2, 0, 1, 3, 4).contiguous()   # chunk j -> rank j (tokens j)
    got = C.all_to_all(send, axis)                                              # chunk i <- rank i (heads i)
    return got.permute(1, 0, 2, 3, 4).reshape(b, n * hn, t // n, d)


class _AllToAll(torch.autograd.Function):
    """One Ulysses all-to-all (`to_heads`: _s2h, else _h2s); its adjoint is the other one."""

    @staticmethod
    def forward(ctx, x, axis, to_heads):
        ctx.axis, ctx.to_heads = axis, to_heads
        return (_s2h if to_heads else _h2s)(x, axis)

    @staticmethod
    def backward(ctx, g):
        return (_h2s if ctx.to_heads else _s2h)(g.contiguous(), ctx.axis), None, None


def ulysses_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, axis: str = "sp",
                 **sdpa_kwargs: Any) -> torch.Tensor:
    """Causal `F.scaled_dot_product_attention` of sequence-sharded q [B, H, T/sp, d] and k, v
    [B, Hkv, T/sp, d] as Ulysses attention over `axis` (the manual integration: call it in a
    model's attention and use `sequence_parallel(auto=False)`). Grouped-query attention
    (Hkv < H) needs `enable_gqa=True`, as for sdpa itself; key/value heads fewer than sp are
    replicated (`replicate_kv`). Returns [B, H, T/sp, d]."""
    n = current_mesh().size(axis)
    if n == 1:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, **sdpa_kwargs)
    f = kv_replication(query.shape[1], key.shape[1], n, "ulysses_sdpa")
    key, value = replicate_kv(key, f), replicate_kv(value, f)
    q, k, v = (seq_to_heads(t, axis) for t in (query, key, value))
    return heads_to_seq(F.scaled_dot_product_attention(q, k, v, is_causal=True, **sdpa_kwargs), axis)


def kv_replication(heads: int, kv_heads: int, n: int, where: str) -> int:
    """The factor f by which the key/value heads must be repeated so that n (sp) divides them:
    f = n / gcd(kv_heads, n) (1 when n divides kv_heads; DeepSpeed Ulysses's
    `kv_replication_factor`). n must divide the query heads (Ulysses gives each rank whole
    heads), and the query heads must be a multiple of the key/value heads (GQA); then
    kv_heads * f divides the query heads too, so each rank's H/n query heads need exactly
    its kv_heads * f / n key/value heads (see `replicate_kv`)."""
    if heads % n:
        valid = [d for d in range(1, heads + 1) if heads % d == 0]
        raise MeshError(f"sequence_parallel: sp={n} does not divide the {heads} query heads of {where} (on this rank, "
                        f"after any tensor-parallel split); Ulysses gives each sp rank whole query heads: valid sp "
                        f"degrees are {valid}")
    if kv_heads < 1 or heads % kv_heads:
        raise MeshError(f"sequence_parallel: {where} has {heads} query heads and {kv_heads} key/value heads (on this "
                        "rank); grouped-query attention needs the query heads to be a multiple of the key/value "
                        "heads, which a tensor-parallel split must keep (choose tp dividing both)")
    return n // math.gcd(kv_heads, n)


def replicate_kv(x: torch.Tensor, f: int) -> torch.Tensor:
    """[B, Hkv, T, d] -> [B, Hkv * f, T, d], head j repeated f times in place (j*f ... j*f+f-1):
    HF's `repeat_kv` order, so query head h keeps its key/value head (h // (H / Hkv) before,
    h // (H / (Hkv * f)) after, the same head). Autograd sums the copies' gradients back."""
    return x if f == 1 else x.repeat_interleave(f, dim=1)


class UlyssesSDPA(CausalSDPAMode):
    """Runs every causal `F.scaled_dot_product_attention` call as Ulysses attention."""

    def attend(self, func, q, k, v, args):
        n = current_mesh().size(self.axis)
        f = kv_replication(q.shape[1], k.shape[1], n, "a scaled_dot_product_attention call")
        k, v = replicate_kv(k, f), replicate_kv(v, f)
        q, k, v = (seq_to_heads(t, self.axis) for t in (q, k, v))
        rest = {key: args[key] for key in ("dropout_p", "scale", "enable_gqa") if key in args}
        out = func(q, k, v, is_causal=True, **rest)      # the mode is off inside its own handler
        return heads_to_seq(out, self.axis)
