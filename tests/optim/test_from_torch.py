"""dsfn.optim.from_torch: elementwise torch optimizers as GradientTransformations.

- Single process: from_torch equals the same torch.optim class on nn.Parameters, bitwise
  (params and every state tensor) through `apply`, and within rtol 1e-6 through
  `update` + `apply_updates` (p' - p then p + u rounds); inputs are never written.
- Refusals: torch's LBFGS / SparseAdam / Adafactor / Muon by name; the elementwise probe
  catches a per-tensor normalising optimizer, a cross-parameter one, a factored-state
  one and one that keeps state in its param_groups.
- 2 gloo ranks under compose(shard_zero(3), offload("cpu")) equal a plain torch training
  loop in one process (rtol 1e-5: the 2-rank gradient mean rounds in another order).
- A checkpoint saved under ZeRO-3 on 2 ranks loads into a plain single-process layout and
  continuing gives the uninterrupted run's result.
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsfn
from dsfn import checkpoint as ck
from dsfn import tree
from dsfn.errors import ConfigError
from dsfn.optim.base import apply_updates
from dsfn.optim.torch_optim import FromTorchState, from_torch
from dsfn.optim.transform import current_lr
from dsfn.runtime import init_mesh
from dsfn.state.layout import FlatShard, Offloaded, Placed, is_placed
from dsfn.testing import assert_trees_close, run_on_ranks
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import train_step_for
from dsfn.transforms import compose, offload, shard_zero

STEPS = 6   # RAdam with betas (0.9, 0.9) rectifies from step 6 on: both of its branches run

CASES = {
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "Adam-amsgrad-maximize": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, maximize=True, weight_decay=1e-2)),
    "SGD-nesterov": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    "SGD-dampening": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, dampening=0.3)),
    "SGD-plain": (torch.optim.SGD, dict(lr=1e-2)),
    "Adagrad": (torch.optim.Adagrad, dict(lr=1e-2, lr_decay=1e-2, initial_accumulator_value=0.1)),
    "RMSprop-centered": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.9, centered=True, weight_decay=1e-3)),
    "Adamax": (torch.optim.Adamax, dict(lr=1e-2, weight_decay=1e-2)),
    "NAdam": (torch.optim.NAdam, dict(lr=1e-2, weight_decay=1e-2, decoupled_weight_decay=True)),
    "RAdam": (torch.optim.RAdam, dict(lr=1e-2, betas=(0.9, 0.9))),
    "ASGD": (torch.optim.ASGD, dict(lr=1e-2, t0=2)),
    "Rprop": (torch.optim.Rprop, dict(lr=1e-2)),
    "Adadelta": (torch.optim.Adadelta, dict(lr=1.0)),
    "Adam-fused": (torch.optim.Adam, dict(lr=1e-2, fused=True)),
}


def _params(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(s, generator=g) for i, s in enumerate(shapes)}


def _grads(params, steps, seed):
    g = torch.Generator().manual_seed(seed + 1000)
    return [{k: torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in range(steps)]


def _torch_run(cls, hyper, params, grads, lrs=None):
    """The torch optimizer on nn.Parameters: final params and {key: {name: state}}."""
    ps = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = cls(list(ps.values()), **hyper)
    for t, g in enumerate(grads):
        if lrs is not None:
            opt.param_groups[0]["lr"] = lrs[t]
        for k, p in ps.items():
            p.grad = g[k].clone()
        opt.step()
    state = {}
    for k, p in ps.items():
        for key, v in opt.state[p].items():
            state.setdefault(key, {})[k] = v
    return {k: p.detach() for k, p in ps.items()}, state


def _clone(t):
    return tree.map(lambda x: x.clone(), t)


def _assert_unchanged(before, after, what):
    for (p, a), (_, b) in zip(tree.leaves_with_path(before), tree.leaves_with_path(after)):
        assert torch.equal(a, b), f"{what} leaf {p} was written"


def _dsfn_run(tx, params, grads, via="apply"):
    state = tx.init(params)
    for g in grads:
        snap = (_clone(params), _clone(g), _clone(state))
        if via == "apply":
            new_params, new_state = tx.apply(g, state, params)
        else:
            updates, new_state = tx.update(g, state, params)
            new_params = apply_updates(params, updates)
        _assert_unchanged(snap[0], params, "params")
        _assert_unchanged(snap[1], g, "grads")
        _assert_unchanged(snap[2], state, "state")
        params, state = new_params, new_state
    return params, state


def _assert_state_matches(state, ref_state, exact=True, rtol=0.0, atol=0.0):
    assert isinstance(state, FromTorchState)
    keys = set(state.tensors) | set(state.scalars)
    assert keys == set(ref_state), (keys, set(ref_state))
    for key, per_param in ref_state.items():
        for name, v in per_param.items():
            mine = state.tensors[key][name] if key in state.tensors else state.scalars[key]
            v = v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=mine.dtype)
            if exact:
                assert mine.dtype == v.dtype and torch.equal(mine, v), (key, name, mine, v)
            else:
                torch.testing.assert_close(mine, v, rtol=rtol, atol=atol, msg=f"{key} of {name}")


# ----------------------------------------------------------------------------------------------
# equals torch.optim, single process
# ----------------------------------------------------------------------------------------------

SHAPES = [(4, 3), (3,), (), (2, 1, 5)]


@pytest.mark.parametrize("case", list(CASES))
def test_equals_torch_bitwise_and_pure(case):
    """STEPS steps through `apply`: params and every state entry bitwise torch's; no input
    (params, grads, state) is written at any step."""
    cls, hyper = CASES[case]
    params = _params(SHAPES, 0)
    grads = _grads(params, STEPS, 0)
    ref_p, ref_s = _torch_run(cls, hyper, params, grads)
    p, s = _dsfn_run(from_torch(cls, **hyper), params, grads, "apply")
    for k in params:
        assert torch.equal(p[k], ref_p[k]), (k, p[k], ref_p[k])
    _assert_state_matches(s, ref_s)
    assert int(s.count) == STEPS
    assert float(current_lr(s)) == hyper["lr"]


@pytest.mark.parametrize("case", ["AdamW", "RMSprop-centered", "NAdam"])
def test_update_path_matches_torch(case):
    """`update` + `apply_updates` (p + (p' - p) may round): params and state (which sees the
    params through weight decay) within rtol 1e-6 of torch."""
    cls, hyper = CASES[case]
    params = _params(SHAPES, 1)
    grads = _grads(params, STEPS, 1)
    ref_p, ref_s = _torch_run(cls, hyper, params, grads)
    p, s = _dsfn_run(from_torch(cls, **hyper), params, grads, "update")
    assert_trees_close(p, ref_p, rtol=1e-6, atol=1e-7)
    _assert_state_matches(s, ref_s, exact=False, rtol=1e-6, atol=1e-7)


def test_lr_schedule_and_current_lr():
    """A schedule f(count) gives the lr of each update (torch run with the same lr set on its
    param group every step); the state records it for current_lr."""
    sched = lambda count: 1e-2 * 0.5 ** float(count)
    params = _params(SHAPES, 2)
    grads = _grads(params, 4, 2)
    ref_p, ref_s = _torch_run(torch.optim.NAdam, {}, params, grads, lrs=[sched(t) for t in range(4)])
    tx = from_torch(torch.optim.NAdam, lr=sched)
    assert float(current_lr(tx.init(params))) == 1e-2
    p, s = _dsfn_run(tx, params, grads)
    for k in params:
        assert torch.equal(p[k], ref_p[k])
    _assert_state_matches(s, ref_s)
    assert float(current_lr(s)) == sched(3)          # the lr of the last update
    # no lr given: the class default is used and recorded
    assert float(current_lr(from_torch(torch.optim.Adam).init(params))) == 1e-3


def test_partition_gives_per_group_hyper_parameters():
    """partition() of two from_torch transforms equals one torch optimizer with two param groups."""
    params = _params(SHAPES, 3)
    grads = _grads(params, 4, 3)
    labels = {k: ("decay" if v.dim() >= 2 else "no_decay") for k, v in params.items()}
    tx = dsfn.optim.partition({"decay": from_torch(torch.optim.AdamW, lr=1e-2, weight_decay=0.5),
                               "no_decay": from_torch(torch.optim.AdamW, lr=3e-2, weight_decay=0.0)}, labels)
    ps = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = torch.optim.AdamW([{"params": [ps[k] for k in ps if labels[k] == "decay"], "weight_decay": 0.5},
                             {"params": [ps[k] for k in ps if labels[k] == "no_decay"], "lr": 3e-2,
                              "weight_decay": 0.0}], lr=1e-2)
    for g in grads:
        for k, p in ps.items():
            p.grad = g[k].clone()
        opt.step()
    p, _ = _dsfn_run(tx, params, grads, "update")
    assert_trees_close(p, {k: v.detach() for k, v in ps.items()}, rtol=1e-6, atol=1e-7)


class Lion(torch.optim.Optimizer):
    """A third-party elementwise optimizer (Lion: sign of an interpolated momentum)."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p)
                m = st["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.lerp_(p.grad, 1 - b2)


def test_third_party_elementwise_optimizer_passes_the_probe_and_matches():
    params = _params(SHAPES, 4)
    grads = _grads(params, 4, 4)
    ref_p, ref_s = _torch_run(Lion, dict(lr=1e-2, weight_decay=0.1), params, grads)
    p, s = _dsfn_run(from_torch(Lion, lr=1e-2, weight_decay=0.1), params, grads)
    for k in params:
        assert torch.equal(p[k], ref_p[k])
    _assert_state_matches(s, ref_s)


class _LrOnly(torch.optim.Optimizer):
    """Base of the test optimizers below: one hyper-parameter, `lr`."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))


class GradWritingSGD(_LrOnly):
    """Elementwise, but writes the gradient: scales `p.grad` in place before using it."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.grad.mul_(0.5)
                p.add_(p.grad, alpha=-group["lr"])


class GradKeepingSGD(_LrOnly):
    """Elementwise, but keeps the gradient tensor itself as its state."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                prev = st.get("last_grad", torch.zeros_like(p))
                p.add_(p.grad + prev, alpha=-group["lr"])
                st["last_grad"] = p.grad


@pytest.mark.parametrize("cls", [GradWritingSGD, GradKeepingSGD])
def test_optimizer_writing_or_keeping_the_gradient_stays_pure(cls):
    """The probe sees an optimizer write p.grad and hands it copies; a state tensor that is
    the caller's gradient itself is copied; results equal the live optimizer's."""
    params = _params(SHAPES, 5)
    grads = _grads(params, 3, 5)
    ref_p, ref_s = _torch_run(cls, dict(lr=1e-2), params, grads)
    p, s = _dsfn_run(from_torch(cls, lr=1e-2), params, grads)   # asserts no input is written
    for k in params:
        assert torch.equal(p[k], ref_p[k])
    _assert_state_matches(s, ref_s)
    tx = from_torch(cls, lr=1e-2)
    g = grads[0]
    _, s1 = tx.apply(g, tx.init(params), params)
    for k in s1.tensors.get("last_grad", {}):
        kept = s1.tensors["last_grad"][k]
        assert torch.equal(kept, g[k]) and kept.untyped_storage().data_ptr() != g[k].untyped_storage().data_ptr()


def test_state_leaves_mirror_parameters():
    """Every tensor-state leaf's path ends with its parameter's path (`<tensors>.<key>.<param
    path>`, the rule by which ZeRO shards, offload moves and checkpoints reshard it); the
    scalars (step), count and lr are single 0-dim leaves that mirror nothing."""
    from dsfn.state.layout import mirrored_param
    params = {"layers.0.weight": torch.randn(3, 2), "layers.0.bias": torch.randn(3)}
    s = from_torch(torch.optim.RMSprop, lr=1e-2, momentum=0.5).init(params)
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    mirrors = {path: mirrored_param(path, tuple(x.shape), shapes)
               for path, x in tree.leaves_with_path({"opt_state": s})}
    tensor_leaves = {f"{key}.{name}": t for key, sub in s.tensors.items() for name, t in sub.items()}
    assert len(tensor_leaves) == 4 and len(mirrors) == 4 + 3       # + count, step, lr
    for path, owner in mirrors.items():
        hit = [k for k in tensor_leaves if path.endswith("." + k)]
        if hit:
            assert owner == hit[0].split(".", 1)[1], (path, owner)
        else:
            assert owner is None, (path, owner)
    assert s.scalars["step"].dim() == 0 and s.scalars["step"].device.type == "cpu"


# ----------------------------------------------------------------------------------------------
# properties
# ----------------------------------------------------------------------------------------------

_shape = st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(case=st.sampled_from(["Adam-amsgrad-maximize", "RMSprop-centered", "Adagrad", "NAdam"]),
       shapes=st.lists(_shape, min_size=1, max_size=4), seed=st.integers(0, 2**16), steps=st.integers(1, 4))
def test_property_equals_torch(case, shapes, seed, steps):
    cls, hyper = CASES[case]
    params = _params(shapes, seed)
    grads = _grads(params, steps, seed)
    ref_p, ref_s = _torch_run(cls, hyper, params, grads)
    p, s = _dsfn_run(from_torch(cls, **hyper), params, grads)
    for k in params:
        assert torch.equal(p[k], ref_p[k])
    _assert_state_matches(s, ref_s)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(case=st.sampled_from(["AdamW", "RMSprop-centered", "Adamax", "RAdam"]),
       numel=st.integers(2, 40), cut=st.floats(0.05, 0.95), seed=st.integers(0, 2**16))
def test_property_flat_pieces_equal_the_whole(case, numel, cut, seed):
    """What ZeRO relies on: a parameter updated as two flat pieces (two separate updates, as
    two ranks) is bitwise the whole parameter updated at once."""
    cls, hyper = CASES[case]
    tx = from_torch(cls, **hyper)
    whole = _params([(numel,)], seed)
    grads = _grads(whole, 3, seed)
    k = max(1, min(numel - 1, int(numel * cut)))
    piece = lambda t, sl: {"p0": t["p0"][sl]}
    pw, sw = _dsfn_run(tx, whole, grads)
    pa, sa = _dsfn_run(tx, piece(whole, slice(0, k)), [piece(g, slice(0, k)) for g in grads])
    pb, sb = _dsfn_run(tx, piece(whole, slice(k, None)), [piece(g, slice(k, None)) for g in grads])
    assert torch.equal(torch.cat([pa["p0"], pb["p0"]]), pw["p0"])
    for key in sw.tensors:
        assert torch.equal(torch.cat([sa.tensors[key]["p0"], sb.tensors[key]["p0"]]), sw.tensors[key]["p0"])
    for key in sw.scalars:
        assert torch.equal(sa.scalars[key], sw.scalars[key]) and torch.equal(sb.scalars[key], sw.scalars[key])


# ----------------------------------------------------------------------------------------------
# refusals
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["LBFGS", "SparseAdam", "Adafactor", "Muon"])
def test_refuses_known_non_elementwise(name):
    cls = getattr(torch.optim, name, None)
    if cls is None:
        pytest.skip(f"torch.optim.{name} is not in this torch")
    with pytest.raises(ConfigError, match=rf"torch\.optim\.{name}.*flat pieces.*AdamW"):
        from_torch(cls, lr=1e-3)


class NormalizedSGD(_LrOnly):
    """Not elementwise: each parameter's step is its gradient divided by that gradient's norm."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad / (p.grad.norm() + 1e-12), alpha=-group["lr"])


class GlobalNormSGD(_LrOnly):
    """Not elementwise across parameters: every step is scaled by the norm over all gradients."""

    @torch.no_grad()
    def step(self, closure=None):
        ps = [p for g in self.param_groups for p in g["params"]]
        norm = torch.sqrt(sum((p.grad ** 2).sum() for p in ps))
        for p in ps:
            p.add_(p.grad / norm, alpha=-self.param_groups[0]["lr"])


class FactoredRMS(_LrOnly):
    """Adafactor-like: a matrix keeps row and column means of the squared gradient."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                g2 = p.grad ** 2 + 1e-30
                if p.dim() == 2:
                    st["row"] = g2.mean(1) if "row" not in st else 0.9 * st["row"] + 0.1 * g2.mean(1)
                    st["col"] = g2.mean(0) if "col" not in st else 0.9 * st["col"] + 0.1 * g2.mean(0)
                    v = torch.outer(st["row"], st["col"]) / st["row"].mean()
                else:
                    st["v"] = g2 if "v" not in st else 0.9 * st["v"] + 0.1 * g2
                    v = st["v"]
                p.add_(p.grad / v.sqrt(), alpha=-group["lr"])


class GroupCounterSGD(torch.optim.Optimizer):
    """Elementwise, but keeps its step count in param_groups (lost when rebuilt each step)."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr, k=0))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["k"] += 1
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] / group["k"])


@pytest.mark.parametrize("cls,pattern", [
    (NormalizedSGD, r"NormalizedSGD\) is not elementwise: its update of a parameter depends on elements other "
                    r"than its own.*flat pieces"),
    (GlobalNormSGD, r"GlobalNormSGD\) is not elementwise: its update of a parameter depends on elements other"),
    (FactoredRMS, r"FactoredRMS\) is not elementwise: its state 'col' of a parameter of shape \(6, 5\) has shape "
                  r"\(5,\)"),
    (GroupCounterSGD, r"GroupCounterSGD\): a fresh optimizer per step.*cannot carry.*\['k'\]"),
])
def test_probe_refuses(cls, pattern):
    with pytest.raises(ConfigError, match=pattern):
        from_torch(cls, lr=1e-2)


def test_refuses_bad_arguments():
    with pytest.raises(ConfigError, match="capturable"):
        from_torch(torch.optim.Adam, lr=1e-3, capturable=True)
    with pytest.raises(ConfigError, match="do not pass params"):
        from_torch(torch.optim.Adam, params=[torch.zeros(2)])
    with pytest.raises(ConfigError, match="instance"):
        from_torch(torch.optim.Adam([torch.zeros(2, requires_grad=True)]))
    with pytest.raises(ConfigError, match="Invalid beta"):
        from_torch(torch.optim.Adam, lr=1e-3, betas=(2.0, 0.9))
    with pytest.raises(ConfigError, match="unexpected keyword"):
        from_torch(torch.optim.SGD, lr=1e-3, betas=(0.9, 0.9))
    with pytest.raises(ConfigError, match="lr"):
        from_torch(torch.optim.SGD, lr=-1.0)


# ----------------------------------------------------------------------------------------------
# 2 ranks: ZeRO-3 + offload vs torch in one process; checkpoint across layouts
# ----------------------------------------------------------------------------------------------

SIZES = [5, 7, 3]                  # parameter counts 35, 7, 21, 3: every FlatShard pads at 2 ranks
RANK_CASES = {"Adagrad": (torch.optim.Adagrad, dict(lr=3e-2, lr_decay=1e-2, initial_accumulator_value=0.1)),
              "RMSprop": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.9, centered=True)),
              "NAdam": (torch.optim.NAdam, dict(lr=1e-2, weight_decay=1e-2))}
BATCHES = regression_batches(5, 8, 5, 3, seed=7)


def _torch_loop(cls, hyper, batches, seed=0):
    """The plain torch training loop: nn.Module, full batch, torch.optim."""
    model = make_mlp(SIZES, seed)
    opt = cls(model.parameters(), **hyper)
    losses = []
    for b in batches:
        loss = torch.nn.functional.mse_loss(model(b["x"]), b["y"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    named = dict(model.named_parameters())
    state = {}
    for k, p in named.items():
        for key, v in opt.state[p].items():
            state.setdefault(key, {})[k] = v
    return {k: p.detach() for k, p in named.items()}, state, losses


def _zero_offload_rank(names):
    init_mesh()
    out = {}
    for name in names:
        cls, hyper = RANK_CASES[name]
        apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
        off = offload("cpu")
        step = compose(shard_zero(3), off)(train_step_for(apply_fn))
        state = step.init_state(params, from_torch(cls, **hyper))
        s = state.opt_state
        tensors = tree.leaves_with_path(s.tensors, is_leaf=is_placed)
        assert len(tensors) == 4 * len(s.tensors) > 0
        for path, x in tensors:    # tensor state is ZeRO's shard, offloaded
            assert isinstance(x, Placed) and isinstance(x.layout, Offloaded), path
            assert isinstance(x.layout.inner, FlatShard), path
            assert x.data.numel() == math.ceil(math.prod(x.layout.inner.shape) / 2), path
        for x in [s.count, s.lr, *s.scalars.values()]:    # scalars stay replicated
            assert isinstance(x, torch.Tensor) and x.dim() == 0
        losses = []
        for b in BATCHES:
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        g = step.gather(state)
        off.close()
        out[name] = (g.params, g.opt_state, losses)
    return out


def test_zero3_offload_on_two_ranks_equals_torch():
    """Adagrad, RMSprop(centered, momentum), NAdam under compose(shard_zero(3), offload("cpu"))
    on 2 ranks: final params, state and losses equal torch.optim in one process at rtol 1e-5."""
    results = run_on_ranks(_zero_offload_rank, 2, list(RANK_CASES), timeout=180)
    for name, (cls, hyper) in RANK_CASES.items():
        ref_p, ref_s, ref_losses = _torch_loop(cls, hyper, BATCHES)
        for rank, res in enumerate(results):
            p, s, losses = res[name]
            assert torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7), \
                (name, rank, losses, ref_losses)
            assert_trees_close(p, ref_p, rtol=1e-5, atol=1e-7, msg=f"{name} rank {rank} params")
            _assert_state_matches(s, ref_s, exact=False, rtol=1e-5, atol=1e-7)


SAVE_AT = 3
CK_CLS, CK_HYPER = RANK_CASES["RMSprop"]


def _ckpt_save_rank(root):
    """ZeRO-3 on 2 ranks: train SAVE_AT steps, save, continue uninterrupted."""
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    step = compose(shard_zero(3))(train_step_for(apply_fn))
    state = step.init_state(params, from_torch(CK_CLS, **CK_HYPER))
    for b in BATCHES[:SAVE_AT]:
        state, _ = step(state, b)
    ck.save(root, state)
    saved = step.gather(state).replace(tx=None)
    for b in BATCHES[SAVE_AT:]:
        state, _ = step(state, b)
    return saved, step.gather(state).replace(tx=None)


def _ckpt_load_rank(root):
    """One process, no transforms: load the ZeRO-3 checkpoint and continue."""
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    step = compose()(train_step_for(apply_fn))
    loaded = ck.load(root, like=step.init_state(params, from_torch(CK_CLS, **CK_HYPER)))
    got = step.gather(loaded).replace(tx=None)
    state = loaded
    for b in BATCHES[SAVE_AT:]:
        state, _ = step(state, b)
    return got, step.gather(state).replace(tx=None)


def test_checkpoint_zero3_two_ranks_loads_single_process_and_continues(tmp_path):
    root = str(tmp_path / "ck")
    saved, uninterrupted = run_on_ranks(_ckpt_save_rank, 2, root, timeout=180)[0]
    loaded, resumed = run_on_ranks(_ckpt_load_rank, 1, root, timeout=180)[0]
    assert int(loaded.opt_state.count) == SAVE_AT and float(loaded.opt_state.scalars["step"]) == SAVE_AT
    for what in ("params", "opt_state"):      # the saved logical state, bitwise
        for (p, a), (q, b) in zip(tree.leaves_with_path(getattr(loaded, what)),
                                  tree.leaves_with_path(getattr(saved, what))):
            assert p == q and a.dtype == b.dtype and torch.equal(a, b), (what, p)
    # continuing in one process = continuing on the 2 ranks (another reduction order: rtol 1e-5)
    assert_trees_close(resumed.params, uninterrupted.params, rtol=1e-5, atol=1e-7)
    assert_trees_close(resumed.opt_state, uninterrupted.opt_state, rtol=1e-5, atol=1e-7)
    # = torch.optim run straight through in one process
    ref_p, ref_s, _ = _torch_loop(CK_CLS, CK_HYPER, BATCHES)
    assert_trees_close(resumed.params, ref_p, rtol=1e-5, atol=1e-7)
    _assert_state_matches(resumed.opt_state, ref_s, exact=False, rtol=1e-5, atol=1e-7)
