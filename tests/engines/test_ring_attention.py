"""Ring attention (dsfn.engines.ring_attention) equals plain SDPA on the whole sequence: each
rank's outputs are the reference's rows of its head and tail chunks, and the gradients of its
q, k, v the reference's gradients there, at n = 2, 3, 4 ranks, for causal, sliding-window,
packed-document and padded masks and grouped-query heads (fp32: rtol 1e-5, atol 1e-5, the
softmax sums reassociated across blocks).

Negative controls: a skipped K/V block, and the head-tail layout undone on the reference's
side (plain contiguous chunks), both fail."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dsfn.engines import ring_attention as R
from dsfn.runtime import init_mesh
from dsfn.runtime.mesh import current_mesh
from dsfn.testing import run_on_ranks

B, H, HKV, D = 2, 4, 2, 8
TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, seq, D, generator=g)
    k = torch.randn(B, HKV, seq, D, generator=g)
    v = torch.randn(B, HKV, seq, D, generator=g)
    dout = torch.randn(B, H, seq, D, generator=g)
    return q, k, v, dout


def _documents(seq, kind):
    if kind == "packed":      # three documents per row, boundaries differing by row
        doc = torch.zeros(B, seq, dtype=torch.long)
        doc[0, seq // 3:] = 1
        doc[0, 2 * seq // 3:] = 2
        doc[1, seq // 4:] = 1
        doc[1, seq // 2 + 1:] = 2
        return doc
    if kind == "padded":      # row 1's last 5 positions are padding
        doc = torch.zeros(B, seq, dtype=torch.long)
        doc[1, seq - 5:] = -1
        return doc
    return None


def _reference(seq, causal, window, kind):
    """Plain SDPA on the whole sequence, K/V repeated to the query heads."""
    q, k, v, dout = _inputs(seq)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    pos = torch.arange(seq)
    mask = R.visible(pos, pos, _documents(seq, kind), _documents(seq, kind), causal, window)   # [B|1, T, T]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1),
                                         attn_mask=mask.unsqueeze(1))
    # a query that sees nothing (padding) gives 0, as the ring does (SDPA gives NaN there)
    seen = mask.any(-1).unsqueeze(1).unsqueeze(-1)
    out = torch.where(seen, out, torch.zeros_like(out))
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _ring(n, seq, causal, window, kind, bug=None):
    init_mesh(cp=n)
    me = current_mesh().local_rank("cp")
    q, k, v, dout = _inputs(seq)
    pos = R.head_tail_positions(seq, n, me)
    doc = _documents(seq, kind)
    take = lambda t: t[:, :, pos].clone().requires_grad_()       # noqa: E731
    ql, kl, vl = take(q), take(k), take(v)
    if bug == "skip_block":
        orig = R._pairs

        def skipping(mask, cq, ck):
            out = list(orig(mask, cq, ck))
            return out[:-1] if len(out) > 1 else out
        R._pairs = skipping
    out = R.ring_attention(ql, kl, vl, "cp", pos, None if doc is None else doc[:, pos], causal, window)
    out.backward(dout[:, :, pos])
    return pos, out.detach(), ql.grad, kl.grad, vl.grad


CASES = [(True, None, None), (True, 5, None), (True, None, "packed"), (True, None, "padded"), (False, None, None)]


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("causal,window,kind", CASES)
def test_ring_attention_equals_sdpa_on_the_whole_sequence(n, causal, window, kind):
    seq = 24
    ref = _reference(seq, causal, window, kind)
    for pos, out, dq, dk, dv in run_on_ranks(_ring, n, n, seq, causal, window, kind, timeout=120):
        torch.testing.assert_close(out, ref[0][:, :, pos], **TOL)
        torch.testing.assert_close(dq, ref[1][:, :, pos], **TOL)
        torch.testing.assert_close(dk, ref[2][:, :, pos], **TOL)
        torch.testing.assert_close(dv, ref[3][:, :, pos], **TOL)


def test_head_tail_layout_gives_every_rank_the_same_causal_work():
    n, seq = 4, 32
    work = []
    for r in range(n):
        pos = R.head_tail_positions(seq, n, r)
        assert pos.numel() == seq // n and len(set(pos.tolist())) == pos.numel()
        work.append(int(R.visible(pos, torch.arange(seq), None, None, True, None).sum()))
    assert len(set(work)) == 1                      # balanced; contiguous chunks would not be
    contiguous = [int(R.visible(torch.arange(r * 8, (r + 1) * 8), torch.arange(seq), None, None, True, None).sum())
                  for r in range(n)]
    assert len(set(contiguous)) == n
    with pytest.raises(Exception, match="not a multiple of 8"):
        R.head_tail_positions(30, 4, 0)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 8), c=st.integers(1, 6), window=st.one_of(st.none(), st.integers(1, 20)))
def test_head_tail_layout_partitions_the_sequence_and_balances_causal_work(n, c, window):
    """Any cp degree and chunk size: the ranks' positions cover the sequence exactly once,
    every rank's queries see the same number of causal keys, and the chunk pairs the ring
    computes (the fully masked ones skipped) hold every visible (query, key) pair of the whole
    sequence, with or without a sliding window."""
    seq = 2 * n * c
    every = torch.cat([R.head_tail_positions(seq, n, r) for r in range(n)])
    assert sorted(every.tolist()) == list(range(seq))
    keys = torch.arange(seq)
    work = {int(R.visible(R.head_tail_positions(seq, n, r), keys, None, None, True, None).sum()) for r in range(n)}
    assert len(work) == 1
    # the chunk pairs the ring computes cover every visible (query, key) of the whole sequence once
    mask = R.visible(keys, keys, None, None, True, window)
    covered = 0
    for r in range(n):
        q = R.head_tail_positions(seq, n, r)
        for k in range(n):
            kp = R.head_tail_positions(seq, n, k)
            covered += sum(int(sub.sum()) for _, _, sub in R._pairs(R.visible(q, kp, None, None, True, window), c, c))
    assert covered == int(mask.sum())


def test_negative_control_a_skipped_block_or_a_contiguous_layout_differs():
    seq = 24
    ref = _reference(seq, True, None, None)
    got = run_on_ranks(_ring, 2, 2, seq, True, None, None, "skip_block", timeout=120)
    assert any(not torch.allclose(out, ref[0][:, :, pos], **TOL) for pos, out, *_ in got)
    # the ring's rows read against contiguous chunks instead of the head-tail ones
    got = run_on_ranks(_ring, 2, 2, seq, True, None, None, timeout=120)
    assert any(not torch.allclose(out, ref[0][:, :, r * 12:(r + 1) * 12], **TOL) for r, (_, out, *_r) in enumerate(got))


def _softcap_reference(seq, cap, window):
    """Eager attention with Gemma2's logit soft-capping: c * tanh(q k^T scale / c), then the mask."""
    q, k, v, dout = _inputs(seq)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    pos = torch.arange(seq)
    mask = R.visible(pos, pos, None, None, True, window)
    s = q @ k.repeat_interleave(H // HKV, 1).transpose(-1, -2) * D ** -0.5
    s = (torch.tanh(s / cap) * cap).masked_fill(~mask.unsqueeze(1), float("-inf"))
    out = s.softmax(-1) @ v.repeat_interleave(H // HKV, 1)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _ring_softcap(n, seq, cap, window):
    init_mesh(cp=n)
    q, k, v, dout = _inputs(seq)
    pos = R.head_tail_positions(seq, n, current_mesh().local_rank("cp"))
    ql, kl, vl = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
    out = R.ring_attention(ql, kl, vl, "cp", pos, None, True, window, softcap=cap)
    out.backward(dout[:, :, pos])
    return pos, out.detach(), ql.grad, kl.grad, vl.grad


@pytest.mark.parametrize("n,window", [(2, None), (3, 7)])
def test_soft_capped_scores_equal_eager_attention(n, window):
    """Gemma2's soft-capping (cap 1.5: it bites, the scores of these inputs reach ~4) in the
    forward and through the cap's derivative in backward."""
    seq, cap = 24, 1.5
    ref = _softcap_reference(seq, cap, window)
    plain = _reference(seq, True, window, None)
    assert not torch.allclose(ref[0], plain[0], **TOL), "the cap must change the output for the test to see it"
    for pos, out, dq, dk, dv in run_on_ranks(_ring_softcap, n, n, seq, cap, window, timeout=120):
        torch.testing.assert_close(out, ref[0][:, :, pos], **TOL)
        torch.testing.assert_close(dq, ref[1][:, :, pos], **TOL)
        torch.testing.assert_close(dk, ref[2][:, :, pos], **TOL)
        torch.testing.assert_close(dv, ref[3][:, :, pos], **TOL)


def _ring_counting(n, seq, kind):
    """The ring at n ranks: how many chunk pairs its forward ran on the fused CPU kernel."""
    calls = []
    orig = R._FLASH_CPU

    def counting(*a, **k):
        calls.append(1)
        return orig(*a, **k)
    R._FLASH_CPU = counting
    _ring(n, seq, True, None, kind)
    return len(calls)


def test_whole_and_causal_pairs_run_on_the_fused_kernel_and_masked_ones_do_not():
    """The causal head-tail layout's computed pairs are all whole or diagonal (fused: 3 of
    the own block's 4, 2 of the other's at cp 2); packed documents' are neither (explicit)."""
    assert run_on_ranks(_ring_counting, 2, 2, 24, None, timeout=120) == [5, 5]
    assert run_on_ranks(_ring_counting, 2, 2, 24, "packed", timeout=120) == [0, 0]
