"""Mutable buffers are state (BatchNorm statistics): updated functionally by the step, synced
over data parallel by DDP's rule (rank 0's values), saved and restored by checkpoints;
non-persistent buffers stay constants."""
import warnings

import pytest
import torch
from torch import nn

import dsfn
from dsfn import checkpoint as ck
from dsfn.errors import ConfigError
from dsfn.runtime import collectives as C
from dsfn.runtime import init_mesh
from dsfn.state.layout import Placed
from dsfn.testing import run_on_ranks
from dsfn.transforms import data_parallel, mixed_precision, shard_zero
from dsfn.transforms.core import Transform

STEPS = 3
LR, MOMENTUM = 0.1, 0.9


class Block(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.fc = nn.Linear(n, n)
        self.bn = nn.BatchNorm1d(n)

    def forward(self, x):
        return torch.relu(self.bn(self.fc(x)))


class Net(nn.Module):
    """Linear+BatchNorm blocks in a ModuleList (ZeRO-3 gathers them unit by unit), and a
    constant (non-persistent) buffer."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block(8), Block(8)])
        self.out = nn.Linear(8, 2)
        self.register_buffer("mask", torch.tensor([1.0, 0.5]), persistent=False)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h) * self.mask


BUFFER_NAMES = {f"blocks.{i}.bn.{k}" for i in range(2) for k in ("running_mean", "running_var", "num_batches_tracked")}


def batches(world=2, rows=4, seed=1):
    """Global batches of world*rows rows; rank r's rows have mean r*2 (their statistics differ)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        x = torch.cat([torch.randn(rows, 4, generator=g) * (1 + r) + 2.0 * r for r in range(world)])
        out.append({"x": x, "y": torch.randn(world * rows, 2, generator=g)})
    return out


def train_step_for(apply_fn):
    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(
            lambda p, b: nn.functional.mse_loss(apply_fn(p, b["x"]), b["y"]))(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    return train_step


def sgd():
    return dsfn.optim.sgd(lr=LR, momentum=MOMENTUM)


def close(a, b, rtol=1e-6, atol=1e-7):
    return torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol)


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# -- (1) one process: equals plain PyTorch; the input state is untouched -----------------------
def test_compose_equals_plain_pytorch_in_params_and_running_stats():
    model, ref = Net(), Net()
    apply_fn, params = dsfn.functionalize(model)
    assert set(apply_fn.buffers) == BUFFER_NAMES
    step = dsfn.compose()(train_step_for(apply_fn))
    state = step.place(dsfn.TrainState.create(params, sgd(), buffers=apply_fn.buffers))
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    initial = {k: v.clone() for k, v in apply_fn.buffers.items()}
    for b in batches(world=1, rows=8):
        before = state
        held = {k: v.clone() for k, v in before.buffers.items()}
        state, _ = step(state, b)
        # the input state's buffers are unchanged (values and the very tensors)
        assert all(torch.equal(before.buffers[k], held[k]) for k in held)
        assert not any(state.buffers[k] is before.buffers[k] for k in ("blocks.0.bn.running_mean",))
        opt.zero_grad()
        nn.functional.mse_loss(ref(b["x"]), b["y"]).backward()
        opt.step()
    sd = ref.state_dict()
    for k, v in state.params.items():
        assert close(v, sd[k]), k
    for k, v in state.buffers.items():
        assert v.dtype == sd[k].dtype and close(v, sd[k]), k
    assert int(state.buffers["blocks.0.bn.num_batches_tracked"]) == STEPS
    # the stats moved (so the comparison means something), and the module's own were never touched
    assert max_diff(state.buffers, initial) > 1e-2
    assert all(torch.equal(model.get_buffer(k), initial[k]) for k in initial)


def test_user_replaced_buffers_are_kept_and_other_names_are_rejected():
    apply_fn, params = dsfn.functionalize(Net())
    b = batches(world=1, rows=8)[0]
    inner = train_step_for(apply_fn)
    pinned = torch.full((8,), 7.0)

    def own(state, batch):
        new, m = inner(state, batch)
        return new.replace(buffers={**new.buffers, "blocks.0.bn.running_mean": pinned}), m
    state = dsfn.TrainState.create(params, sgd(), buffers=apply_fn.buffers)
    new, _ = dsfn.compose()(own)(state, b)
    assert new.buffers["blocks.0.bn.running_mean"] is pinned          # the user's entry wins
    assert not torch.equal(new.buffers["blocks.1.bn.running_mean"], state.buffers["blocks.1.bn.running_mean"])

    def drop(state, batch):
        new, m = inner(state, batch)
        return new.replace(buffers={}), m
    with pytest.raises(dsfn.errors.StackError, match="buffers have other names"):
        dsfn.compose()(drop)(state, b)


# -- (2) two gloo ranks: equals torch DDP (broadcast_buffers=True) ------------------------------
class NoSync(Transform):
    """Negative control: buffers are not synced (each rank keeps its own)."""
    name = "no_sync"

    def handle_sync_buffers(self, call_next, buffers):
        return buffers


class AverageBuffers(Transform):
    """Negative control: the averaging rule instead of rank 0's."""
    name = "average_buffers"

    def handle_sync_buffers(self, call_next, buffers):
        return {k: (C.all_reduce(v.double(), "dp", "avg").to(v.dtype) if v.is_floating_point() else v)
                for k, v in buffers.items()}


def _dp_vs_ddp():
    init_mesh()
    rank = torch.distributed.get_rank()
    data = batches()
    out = {}
    variants = {"dp": lambda: [data_parallel()], "zero3": lambda: [shard_zero(3)],
                "no_sync": lambda: [NoSync(), data_parallel()], "average": lambda: [AverageBuffers(), data_parallel()]}
    for name, make in variants.items():
        apply_fn, params = dsfn.functionalize(Net())
        step = dsfn.compose(*make())(train_step_for(apply_fn))
        state = step.init_state(params, sgd(), buffers=apply_fn.buffers)
        for b in data:
            state, _ = step(state, b)
        full = step.gather(state)
        out[name] = ({k: v.clone() for k, v in full.params.items()}, {k: v.clone() for k, v in full.buffers.items()})
    # torch DDP, same per-rank rows
    ref = Net()
    # DDP's default buffer rule: broadcast_buffers=True (named forward_sync_buffers from torch 2.13 on)
    ddp = torch.nn.parallel.DistributedDataParallel(ref)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    for b in data:
        rows = b["x"].shape[0] // 2
        opt.zero_grad()
        mine = slice(rank * rows, (rank + 1) * rows)
        nn.functional.mse_loss(ddp(b["x"][mine]), b["y"][mine]).backward()
        opt.step()
    sd = {k: v.clone() for k, v in ref.state_dict().items()}
    # what DDP's next forward reads on this rank (it broadcasts rank 0's buffers first)
    seen = {}
    hook = ref.register_forward_pre_hook(lambda m, a: seen.update({k: v.clone() for k, v in m.named_buffers()}))
    ddp(data[0]["x"][:2])
    hook.remove()
    return out, sd, {k: v for k, v in seen.items() if k in BUFFER_NAMES}


def test_data_parallel_and_zero3_buffers_equal_ddp_broadcast_buffers():
    results = run_on_ranks(_dp_vs_ddp, 2, timeout=120)
    ddp0 = results[0][1]
    ddp0_bufs = {k: ddp0[k] for k in BUFFER_NAMES}
    for rank, (out, sd, next_forward) in enumerate(results):
        for variant in ("dp", "zero3"):
            params, bufs = out[variant]
            for k, v in params.items():
                assert close(v, sd[k]), (rank, variant, k)
            # every rank holds DDP rank 0's buffers: what every DDP rank's next forward reads
            for k in BUFFER_NAMES:
                assert close(bufs[k], ddp0[k]), (rank, variant, k)
                assert close(bufs[k], next_forward[k]), (rank, variant, k)
        # negative controls: averaging differs everywhere; no sync differs on rank 1
        assert max_diff(out["average"][1], ddp0_bufs) > 1e-2, rank
        if rank == 1:
            assert max_diff(out["no_sync"][1], ddp0_bufs) > 1e-2
            assert max_diff({k: sd[k] for k in BUFFER_NAMES}, ddp0_bufs) > 1e-2   # DDP's rank 1 before its next forward
    # the replicas agree
    assert max_diff(results[0][0]["dp"][1], results[1][0]["dp"][1]) == 0.0


# -- (3) checkpoints: save on 2 ranks, load at world 1 ------------------------------------------
X_EVAL = torch.randn(6, 4, generator=torch.Generator().manual_seed(5)) + 1.0


def _train_and_save(path):
    init_mesh()
    model = Net()
    apply_fn, params = dsfn.functionalize(model)
    step = dsfn.compose(data_parallel())(train_step_for(apply_fn))
    state = step.place(dsfn.TrainState.create(params, sgd(), buffers=apply_fn.buffers))
    for b in batches():
        state, _ = step(state, b)
    ck.save(path, state)
    model.eval()
    with torch.no_grad():
        return apply_fn.with_buffers(state.buffers)(state.params, X_EVAL)


def _load(path):
    init_mesh()
    model = Net(seed=123)                       # a fresh model with other weights and initial stats
    apply_fn, params = dsfn.functionalize(model)
    like = dsfn.TrainState.create(params, sgd(), buffers=apply_fn.buffers)
    state = ck.load(path, like=like, restore_rng=False)
    model.eval()
    with torch.no_grad():
        restored = apply_fn.with_buffers(state.buffers)(state.params, X_EVAL)
        without = apply_fn(state.params, X_EVAL)          # the old behaviour: the module's initial stats
    return restored, without, sorted(ck.read_manifest(path).leaves)


def test_checkpoint_round_trip_restores_buffers(tmp_path):
    path = str(tmp_path / "ckpt")
    trained = run_on_ranks(_train_and_save, 2, path, timeout=120)
    assert torch.equal(trained[0], trained[1])
    [(restored, without, leaves)] = run_on_ranks(_load, 1, path, timeout=120)
    assert close(restored, trained[0])
    assert (without - trained[0]).abs().max() > 1e-2          # negative control: stats not restored
    assert {f"buffers.{k}" for k in BUFFER_NAMES} <= set(leaves)
    assert not any("mask" in leaf for leaf in leaves)          # the constant is not saved
    # export writes the model's whole state dict: params and persistent buffers
    from safetensors.torch import load_file
    sd = load_file(ck.export(path, str(tmp_path / "hf")))
    fresh = Net(seed=7)
    fresh.load_state_dict(sd, strict=True)
    fresh.eval()
    with torch.no_grad():
        assert close(fresh(X_EVAL), trained[0])


# -- (4) constants stay constants; mutations that would be lost are errors ----------------------
def test_non_persistent_buffer_stays_a_constant_out_of_the_state():
    apply_fn, params = dsfn.functionalize(Net())
    assert "mask" in apply_fn.constants and "mask" not in apply_fn.buffers
    state = dsfn.TrainState.create(params, sgd(), buffers=apply_fn.buffers)
    assert set(state.buffers) == BUFFER_NAMES
    new, _ = dsfn.compose()(train_step_for(apply_fn))(state, batches(world=1, rows=8)[0])
    assert set(new.buffers) == BUFFER_NAMES and "mask" not in dsfn.tree.structure(new).__repr__()


class Counter(nn.Module):
    def __init__(self, persistent):
        super().__init__()
        self.fc = nn.Linear(3, 1)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64), persistent=persistent)

    def forward(self, x):
        self.calls += 1
        return self.fc(x)


def _counter_step(apply_fn):
    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(lambda p: apply_fn(p, batch).pow(2).mean())(state.params)
        return state.apply_gradients(grads), {"loss": loss}
    return train_step


def test_forward_changing_a_constant_in_place_is_an_error():
    apply_fn, params = dsfn.functionalize(Counter(persistent=False))
    assert "calls" in apply_fn.constants
    state = dsfn.TrainState.create(params, sgd())
    with pytest.raises(ConfigError, match=r"changed constant\(s\) \['calls'\] in place.*persistent buffer"):
        dsfn.compose()(_counter_step(apply_fn))(state, torch.randn(2, 3))


def test_persistent_counter_is_state_and_a_state_without_it_is_an_error():
    apply_fn, params = dsfn.functionalize(Counter(persistent=True))
    step = dsfn.compose()(_counter_step(apply_fn))
    state = dsfn.TrainState.create(params, sgd(), buffers=apply_fn.buffers)
    for _ in range(3):
        state, _ = step(state, torch.randn(2, 3))
    assert int(state.buffers["calls"]) == 3 and int(apply_fn.buffers["calls"]) == 0
    with pytest.raises(ConfigError, match=r"buffer\(s\) \['calls'\].*buffers=apply_fn.buffers"):
        step(dsfn.TrainState.create(params, sgd()), torch.randn(2, 3))      # the state lacks its buffers


def test_outside_a_step_buffers_are_read_not_changed():
    model = Net()
    apply_fn, params = dsfn.functionalize(model)
    initial = {k: v.clone() for k, v in apply_fn.buffers.items()}
    with pytest.warns(UserWarning, match="update is discarded"):
        apply_fn(params, torch.randn(4, 4))                  # train mode: BatchNorm updates its stats
    assert all(torch.equal(apply_fn.buffers[k], initial[k]) for k in initial)
    trained = {k: (v + 1 if v.is_floating_point() else v) for k, v in initial.items()}
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = apply_fn.with_buffers(trained)(params, X_EVAL)
        b = apply_fn(params, X_EVAL)
    assert (a - b).abs().max() > 1e-3 and all(torch.equal(trained[k] - 1, initial[k]) for k in initial
                                               if initial[k].is_floating_point())
    with pytest.raises(ConfigError, match="not persistent buffers"):
        apply_fn.with_buffers({"mask": torch.ones(2)})


def test_mixed_precision_keeps_buffers_in_their_dtype_and_updates_them():
    model, ref = Net(), Net()
    apply_fn, params = dsfn.functionalize(model)
    step = dsfn.compose(mixed_precision())(train_step_for(apply_fn))
    state = step.place(dsfn.TrainState.create(params, sgd(), buffers=apply_fn.buffers))
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    for b in batches(world=1, rows=8):
        state, _ = step(state, b)
        opt.zero_grad()
        nn.functional.mse_loss(ref(b["x"]), b["y"]).backward()
        opt.step()
    sd = ref.state_dict()
    for k in BUFFER_NAMES:
        assert state.buffers[k].dtype == sd[k].dtype
        assert close(state.buffers[k], sd[k], rtol=3e-2, atol=3e-2), k     # bf16 compute
    assert max_diff(state.buffers, {k: Net().get_buffer(k) for k in BUFFER_NAMES}) > 1e-2


# -- tensor parallel: the planned forwards still read and update the state's buffers ------------
class TPNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)       # colwise, rowwise: BatchNorm sees whole rows
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.bn(self.down(torch.relu(self.up(x)))))


def _tp():
    from dsfn.transforms import tensor_parallel
    init_mesh(dp=1, tp=2)
    model = TPNet()
    apply_fn, params = dsfn.functionalize(model)
    step = dsfn.compose(tensor_parallel({"up": "colwise", "down": "rowwise"}, model=model))(train_step_for(apply_fn))
    state = step.place(dsfn.TrainState.create(params, sgd(), buffers=apply_fn.buffers))
    assert isinstance(state.params["up.weight"], Placed)                    # really split over tp
    for b in batches(world=1, rows=8):
        state, _ = step(state, b)
    full = step.gather(state)
    return {k: v.clone() for k, v in full.params.items()}, {k: v.clone() for k, v in full.buffers.items()}


def test_tensor_parallel_updates_buffers_like_plain_pytorch():
    ref = TPNet()
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    for b in batches(world=1, rows=8):
        opt.zero_grad()
        nn.functional.mse_loss(ref(b["x"]), b["y"]).backward()
        opt.step()
    sd = ref.state_dict()
    for params, bufs in run_on_ranks(_tp, 2, timeout=120):
        assert set(bufs) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
        for k, v in {**params, **bufs}.items():
            assert close(v, sd[k], rtol=1e-5, atol=1e-6), k
        assert max_diff(bufs, {k: TPNet().get_buffer(k) for k in bufs}) > 1e-2


def test_async_checkpoint_at_the_step_boundary_holds_the_updated_buffers(tmp_path):
    from dsfn.transforms import async_checkpoint
    apply_fn, params = dsfn.functionalize(Net())
    saver = async_checkpoint(str(tmp_path / "ck"), every=STEPS)
    step = dsfn.compose(saver)(train_step_for(apply_fn))
    state = step.place(dsfn.TrainState.create(params, sgd(), buffers=apply_fn.buffers))
    for b in batches(world=1, rows=8):
        state, _ = step(state, b)
    saver.wait()
    loaded = ck.load(str(tmp_path / "ck"), like=state)
    assert int(loaded.step) == STEPS
    for k in BUFFER_NAMES:
        assert torch.equal(loaded.buffers[k], state.buffers[k]), k
    assert max_diff(loaded.buffers, apply_fn.buffers) > 1e-2
