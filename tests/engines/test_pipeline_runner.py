"""dsfn.engines.pipeline.runner and dsfn.engines.pipeline.split_backward: zero-bubble's split backward.

Properties: B fills the stage input's gradient and leaves the weights' for W; W fills them
exactly as one whole backward would (bitwise: the same kernels run on the same tensors);
B + W do one backward's matmul work, not two (FLOPs counted by torch.utils.flop_counter);
W frees the graph B kept; the ZBV schedule run split equals the same order run with whole
backwards (BW) bitwise, on one rank (local hand-offs) and on two gloo ranks, and the plain
single-process gradient within fp32 tolerance; misuse is a named error.

Model: dsfn's GPT, untied head (a tied one sums the two stages' contributions in the
schedule's order, which the split may change), cut by hand into stages of blocks: stage 0
runs the embeddings, the last the final norm, the head and the loss (scaled by 1/m).
"""
from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from dsfn.engines.pipeline.runner import StageLinks, run_rank
from dsfn.engines.pipeline.schedules import Action, Kind, build_schedule, zbv
from dsfn.engines.pipeline.split_backward import WeightIndex, backward_input
from dsfn.errors import ConfigError
from dsfn.models.gpt import GPT, GPTConfig
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks

CFG = GPTConfig.preset("tiny", n_layer=4, d_model=64, n_head=2, seq_len=16, tie_embeddings=False)
ROWS, T = 2, 16


def _model() -> GPT:
    return GPT(CFG, seed=0)


def _batches(m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, CFG.vocab_size, (m, ROWS, T + 1), generator=g)
    return [(x[:, :-1], x[:, 1:]) for x in ids]


def _stage_forward(model: GPT, n_stages: int, batches):
    """forward(stage, mb, h_in) for run_rank: blocks cut evenly over `n_stages`."""
    per = CFG.n_layer // n_stages
    m = len(batches)

    def forward(stage: int, mb: int, h_in: torch.Tensor | None) -> torch.Tensor:
        ids, tgt = batches[mb]
        x = h_in
        if stage == 0:
            x = model.tok_emb(ids) + model.pos_emb(torch.arange(T))
        for block in model.blocks[stage * per:(stage + 1) * per]:
            x = block(x)
        if stage < n_stages - 1:
            return x
        logits = model.lm_head(model.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), tgt.flatten()) / m
    return forward


def _unsplit(actions):
    """The same order with whole backwards: B -> BW, W dropped."""
    return [Action(a.rank, a.stage, a.chunk, a.mb, Kind.BW) if a.kind == Kind.B else a
            for a in actions if a.kind != Kind.W]


def _grads(model: GPT) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def _stage_case(kind: str):
    """(model, h_in or None, out, grad) of one stage of a 3-stage cut: 'first', 'middle', 'last'."""
    model = _model()
    ids, tgt = _batches(1)[0]
    torch.manual_seed(5)
    h_in = None if kind == "first" else torch.randn(ROWS, T, CFG.d_model, requires_grad=True)
    x = model.tok_emb(ids) + model.pos_emb(torch.arange(T)) if kind == "first" else h_in
    for block in model.blocks[:2]:
        x = block(x)
    if kind == "last":
        return model, h_in, F.cross_entropy(model.lm_head(model.ln_f(x)).flatten(0, 1), tgt.flatten()), None
    return model, h_in, x, torch.randn_like(x)


def _whole(kind: str):
    model, h_in, out, grad = _stage_case(kind)
    torch.autograd.backward(out, grad)
    return _grads(model), (None if h_in is None else h_in.grad.clone())


# ---------------------------------------------------------------------------------------------
# split_backward: B then W on one stage
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["first", "middle", "last"])
def test_b_fills_the_input_gradient_and_w_the_weights_later_bitwise(kind):
    """After B alone: the input's gradient is there (bitwise the whole backward's), no weight
    has a gradient yet; after W: every weight's gradient is the whole backward's, bitwise.
    The first stage has no input: its B computes nothing, W does it all."""
    ref, ref_h = _whole(kind)
    model, h_in, out, grad = _stage_case(kind)
    w = backward_input(out, grad, h_in, WeightIndex(list(model.parameters())))
    del out
    assert all(p.grad is None for p in model.parameters()), "B filled weight gradients: W was not deferred"
    if h_in is not None:
        assert torch.equal(h_in.grad, ref_h)
    w.run()
    got = _grads(model)
    assert sum(g is not None for g in got.values()) >= 12       # the stage's blocks, at least
    for name, g in got.items():
        assert (g is None) == (ref[name] is None), name
        assert g is None or torch.equal(g, ref[name]), name
    with pytest.raises(ConfigError, match="ran twice"):
        w.run()


@pytest.mark.parametrize("kind", ["middle", "last"])
def test_b_plus_w_do_one_backwards_work_not_two(kind):
    """FLOPs (torch.utils.flop_counter: matmuls and attention) of B + W equal the whole
    backward's within 1% — W re-enters the graph at the weight branches, not at the output —
    and each of B and W does between a quarter and three quarters of it (the input and the
    weight gradients of a linear layer are one matmul each)."""
    model, h_in, out, grad = _stage_case(kind)
    with FlopCounterMode(display=False) as whole:
        torch.autograd.backward(out, grad)
    model, h_in, out, grad = _stage_case(kind)
    idx = WeightIndex(list(model.parameters()))
    with FlopCounterMode(display=False) as b:
        w = backward_input(out, grad, h_in, idx)
    del out
    with FlopCounterMode(display=False) as wf:
        w.run()
    total, fb, fw = whole.get_total_flops(), b.get_total_flops(), wf.get_total_flops()
    assert total > 0
    assert abs((fb + fw) / total - 1) < 0.01, (fb, fw, total)
    assert 0.25 * total < fb < 0.75 * total and 0.25 * total < fw < 0.75 * total, (fb, fw, total)


def test_w_frees_the_graph_b_kept():
    """The tensors the stage's graph saved (activations) live from B to W — W needs them —
    and none of them after W, even while the caller still holds the spent WeightGrad.
    (Each saved tensor is tracked through a detached alias: a hook that handed back the
    tensor itself would tie an output to its own grad_fn, a cycle that never frees.)"""
    saved: list[weakref.ref] = []

    def pack(t):
        alias = t.detach()
        saved.append(weakref.ref(alias))
        return alias
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model, h_in, out, grad = _stage_case("middle")
    leaves = {x.untyped_storage().data_ptr() for x in [h_in, *model.parameters()]}

    def alive() -> int:
        return sum(1 for r in saved if r() is not None and r().untyped_storage().data_ptr() not in leaves)
    assert alive() > 10
    w = backward_input(out, grad, h_in, WeightIndex(list(model.parameters())))
    del out
    assert alive() > 10, "B freed what W needs"
    w.run()
    assert alive() == 0, f"{alive()} saved tensors still alive after W"


# ---------------------------------------------------------------------------------------------
# run_rank: the ZBV schedule split vs unsplit
# ---------------------------------------------------------------------------------------------

def _run(actions, n_stages: int, rank_of, m: int, timeline=None):
    model = _model()
    batches = _batches(m)
    links = StageLinks(rank_of, m, torch.device("cpu"))
    losses = run_rank(actions, n_stages, links, _stage_forward(model, n_stages, batches), timeline=timeline,
                      weights=list(model.parameters()))
    return losses, _grads(model)


def _reference(n_stages: int, m: int):
    """Plain torch in one process: each micro-batch's loss / m back-propagated in turn."""
    model = _model()
    forward = _stage_forward(model, n_stages, _batches(m))
    losses = []
    for j in range(m):
        x = None
        for s in range(n_stages):
            x = forward(s, j, x)
        x.backward()
        losses.append(x.detach())
    return losses, _grads(model)


def _same(a: dict, b: dict, exact: bool) -> list[str]:
    bad = []
    for n in a:
        if (a[n] is None) != (b[n] is None):
            bad.append(n)
        elif a[n] is not None and not (torch.equal(a[n], b[n]) if exact
                                       else torch.allclose(a[n], b[n], rtol=1e-5, atol=1e-7)):
            bad.append(n)
    return bad


def test_zbv_on_one_rank_split_equals_unsplit_bitwise_and_plain_torch():
    """p = 1 (stages 0 and 1 on this rank, their hand-off local): the ZBV order with B and W
    split gives the gradients and losses of the same order with whole backwards bitwise, and
    plain torch's within fp32 tolerance; every weight of both stages got a gradient."""
    m = 4
    sched = zbv(1, m)
    assert any(a.kind == Kind.W for a in sched[0])
    records = []
    split_losses, split = _run(sched[0], 2, [0, 0], m, timeline=records)
    whole_losses, whole = _run(_unsplit(sched[0]), 2, [0, 0], m)
    ref_losses, ref = _reference(2, m)
    assert all(g is not None for g in split.values())
    assert _same(split, whole, exact=True) == []
    assert _same(split, ref, exact=False) == []
    assert torch.equal(torch.stack(split_losses), torch.stack(whole_losses))
    assert torch.allclose(torch.stack(split_losses), torch.stack(ref_losses), rtol=1e-6)
    assert [sl.action for sl in records] == list(sched[0])
    assert all(sl.end > sl.start for sl in records if sl.kind == Kind.W)


def _ranks_case(m: int):
    init_mesh(pp=2)
    rank = torch.distributed.get_rank()
    sched = build_schedule("zbv", 2, m)
    rank_of = [0] * 4
    for acts in sched:
        for a in acts:
            rank_of[a.stage] = a.rank
    records: list = []
    split_losses, split = _run(sched[rank], 4, rank_of, m, timeline=records)
    whole_losses, whole = _run(_unsplit(sched[rank]), 4, rank_of, m)
    return split_losses, split, whole_losses, whole, records, list(sched[rank])


def test_zbv_on_two_ranks_split_equals_unsplit_bitwise_and_plain_torch():
    """p = 2 gloo ranks, 4 stages in V placement: each rank's gradients equal the unsplit
    order's bitwise and plain torch's within fp32 tolerance (each weight lives on one rank);
    the timeline holds every action, W's with its own compute time."""
    m = 4
    ref_losses, ref = _reference(4, m)
    out = run_on_ranks(_ranks_case, 2, m, timeout=240)
    filled = set()
    for split_losses, split, whole_losses, whole, records, actions in out:
        assert _same(split, whole, exact=True) == []
        ours = {n for n, g in split.items() if g is not None}
        filled |= ours
        assert _same({n: split[n] for n in ours}, {n: ref[n] for n in ours}, exact=False) == []
        assert [sl.action for sl in records] == actions
        assert all(sl.end > sl.start for sl in records if sl.kind == Kind.W)
        if split_losses:                  # rank 0 holds the last stage (V placement)
            assert torch.equal(torch.stack(split_losses), torch.stack(whole_losses))
            assert torch.allclose(torch.stack(split_losses), torch.stack(ref_losses), rtol=1e-6)
    assert filled == set(ref), "some weight got no gradient on any rank"
    assert [bool(o[0]) for o in out] == [True, False]


# ---------------------------------------------------------------------------------------------
# misuse
# ---------------------------------------------------------------------------------------------

def test_a_split_schedule_needs_the_weights_and_each_b_its_w():
    model = _model()
    batches = _batches(2)
    fwd = _stage_forward(model, 2, batches)
    sched = zbv(1, 2)[0]
    with pytest.raises(ConfigError, match="weights="):
        run_rank(sched, 2, StageLinks([0, 0], 2, torch.device("cpu")), fwd)
    no_w = [a for a in sched if not (a.kind == Kind.W and a.stage == 1 and a.mb == 1)]
    with pytest.raises(ConfigError, match=r"B ran without its W for \(stage, micro-batch\) \[\(1, 1\)\]"):
        run_rank(no_w, 2, StageLinks([0, 0], 2, torch.device("cpu")), fwd, weights=list(model.parameters()))
    twice = list(sched) + [Action(0, 1, 1, 0, Kind.W)]
    with pytest.raises(ConfigError, match="no B before it"):
        run_rank(twice, 2, StageLinks([0, 0], 2, torch.device("cpu")), fwd, weights=list(model.parameters()))


def test_the_weights_must_be_leaves_that_require_grad():
    w = torch.ones(2, requires_grad=True)
    with pytest.raises(ConfigError, match="leaf tensors that require grad"):
        WeightIndex([w * 2])
    with pytest.raises(ConfigError, match="leaf tensors that require grad"):
        WeightIndex([torch.ones(2)])


# ---------------------------------------------------------------------------------------------
# StageLinks: one message per transfer, receives posted ahead
# ---------------------------------------------------------------------------------------------

def _count_messages(m: int):
    """1F1B at p = 2 through run_rank, counting this rank's isend / irecv / blocking recv."""
    import torch.distributed as dist
    calls = {"isend": 0, "irecv": 0, "recv": 0}
    real = {k: getattr(dist, k) for k in calls}

    def counting(k):
        def f(*a, **kw):
            calls[k] += 1
            return real[k](*a, **kw)
        return f
    for k in calls:
        setattr(dist, k, counting(k))
    try:
        init_mesh(pp=2)
        rank = dist.get_rank()
        sched = build_schedule("1f1b", 2, m)
        losses, grads = _run(sched[rank], 2, [0, 1], m)
    finally:
        for k, f in real.items():
            setattr(dist, k, f)
    return calls, grads


def test_each_transfer_is_one_message_and_receives_are_posted_ahead():
    """1F1B, p = 2, m = 4: rank 0 sends m activations plus one header (micro-batch 0's),
    rank 1 sends m bare gradients; rank 0 posts every gradient's receive ahead (no blocking
    receive), rank 1 blocks only for micro-batch 0's activation (its header gives the shape)
    and posts the header's and the other activations' receives. Gradients equal plain torch's."""
    m = 4
    _, ref = _reference(2, m)
    out = run_on_ranks(_count_messages, 2, m, timeout=120)
    (c0, g0), (c1, g1) = out
    assert c0 == {"isend": m + 1, "irecv": m, "recv": 0}, c0
    assert c1 == {"isend": m, "irecv": 1 + (m - 1), "recv": 1}, c1
    for g in (g0, g1):
        ours = {n for n, x in g.items() if x is not None}
        assert ours and _same({n: g[n] for n in ours}, {n: ref[n] for n in ours}, exact=False) == []


def _uneven_send():
    init_mesh(pp=2)            # every rank builds the mesh (the send counters read it)
    rank = torch.distributed.get_rank()
    links = StageLinks([0, 1], 2, torch.device("cpu"))
    if rank == 0:
        links.send(torch.ones(2, 3), 1, 1, 0, backward=False)
        try:
            links.send(torch.ones(1, 3), 1, 1, 1, backward=False)
            err = "ok"
        except ConfigError as e:
            err = str(e)
        links.finish()
        return err
    got = links.recv(0, 1, 0, backward=False)
    links.finish()
    return tuple(got.shape)


def test_a_micro_batch_of_another_shape_is_a_named_error():
    """The bare activations of micro-batches > 0 reuse micro-batch 0's header: a different
    shape is refused on the sending rank, naming both shapes."""
    err, shape = run_on_ranks(_uneven_send, 2, timeout=60)
    assert shape == (2, 3)
    assert "micro-batch 1's activation into stage 1 is (1, 3)" in err and "(2, 3)" in err, err
