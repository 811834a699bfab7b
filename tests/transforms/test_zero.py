"""shard_zero(stage): equals the single-process reference for every stage and world size;
communicates and stores what the ZeRO paper says; stage 3 gathers units just in time.

Ψ below is the number of parameter elements *as sharded*: every tensor is padded to a
multiple of the dp size N (FlatShard), so Ψ_pad = Σ N·ceil(numel / N) and each rank
holds Ψ_pad / N = Σ ceil(numel / N) elements of every sharded tree.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

import dsfn
from dsfn import tree
from dsfn.errors import ConfigError, ShapeError, StackError
from dsfn.models.gpt import GPT, GPTConfig
from dsfn.runtime import collectives as C
from dsfn.runtime import counters, current_mesh, init_mesh
from dsfn.state.layout import FlatShard, Placed
from dsfn.testing import assert_trees_equal, run_on_ranks
from dsfn.testing.models import make_mlp, regression_batches, token_batches
from dsfn.testing.reference import assert_matches_reference, lm_loss, mse_loss, run_training
from dsfn.transforms import accumulate, clip_grad_norm, compose, data_parallel, mixed_precision, shard_zero
from dsfn.transforms.zero import ShardZero

FP32 = dict(rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

class Odd(nn.Module):
    """Awkward parameters: a 0-dim scale, a [1] offset, sizes not divisible by 2 or 4, a frozen
    layer (must stay out of the state) and a parameter the loss never touches."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.scale = nn.Parameter(torch.tensor(0.7))
        self.offset = nn.Parameter(torch.tensor([0.3]))
        self.blocks = nn.ModuleList([nn.Linear(5, 7), nn.Linear(7, 3)])   # 42 and 24 elements
        self.frozen = nn.Linear(5, 3)
        self.frozen.requires_grad_(False)
        self.unused = nn.Parameter(torch.randn(3))

    def forward(self, x):
        h = torch.tanh(self.blocks[0](x))
        return self.blocks[1](h) * self.scale + self.offset + 0.1 * self.frozen(x)


TRAINABLE_ODD = {"scale": (), "offset": (1,), "blocks.0.weight": (7, 5), "blocks.0.bias": (7,),
                 "blocks.1.weight": (3, 7), "blocks.1.bias": (3,), "unused": (3,)}


def tiny_gpt(**overrides):
    return GPT(GPTConfig.preset("tiny", **overrides))


def ce_loss(apply_fn, params, batch):
    logits = apply_fn(params, batch["input_ids"])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch["labels"].reshape(-1))


def make_step(apply_fn, transforms, loss_fn=mse_loss, capture=None):
    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(lambda p, b: loss_fn(apply_fn, p, b))(state.params, batch)
        if capture is not None:
            capture["grads"] = grads
        return state.apply_gradients(grads), {"loss": loss}
    return dsfn.compose(*transforms)(train_step)


def padded(numel: int, n: int) -> int:
    return n * math.ceil(numel / n)


def psi_pad(params, n: int) -> int:
    return sum(padded(p.numel(), n) for p in params.values())


def local_bytes(t) -> int:
    """Bytes of every local tensor in a (physical) tree: what this rank stores."""
    return sum(x.numel() * x.element_size() for x in tree.leaves(t))


def run_each_rank(make_transforms, make_model, make_tx, batches, world, loss_fn=mse_loss):
    def rank_fn():
        res = run_training(make_model, make_tx, batches, tuple(make_transforms()), loss_fn)
        res.state = res.state.replace(tx=None)
        return res
    return run_on_ranks(rank_fn, world, timeout=120)


# ----------------------------------------------------------------------------------------------
# 1. equality with the single-process reference
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@settings(deadline=None, max_examples=2, derandomize=True)
@given(seed=st.integers(0, 10_000), hidden=st.integers(1, 9), n_acc=st.sampled_from([1, 2]),
       clip=st.sampled_from([None, 0.05, 1e3]), bucket=st.sampled_from([3, 64, 50_000_000]))
def test_zero_equals_single_process_reference(stage, world, seed, hidden, n_acc, clip, bucket):
    """Property: losses, final params and optimizer state equal the single process (fp32: rtol
    1e-5, atol 1e-6) for stages 0-3 x world 1/2/4, with and without accumulation and clipping
    (0.05 clips every step, 1e3 never does), with tiny buckets (many collectives) and uneven sizes
    (5*hidden, hidden, 3*hidden, 3 elements over 2 or 4 ranks). With clipping, the grad_norm
    metric equals the reference's on every rank."""
    sizes = [5, hidden, 3]
    batches = regression_batches(3, 4 * n_acc, 5, 3, seed=seed)     # 4*n_acc rows: any world, any n_acc

    def transforms():
        gather = {"allgather_bucket_size": bucket} if stage else {}     # stage 0 gathers nothing
        out = [shard_zero(stage, reduce_bucket_size=bucket, param_persistence_threshold=0, **gather)]
        if n_acc > 1:
            out.append(accumulate(n_acc))
        if clip is not None:
            out.append(clip_grad_norm(clip))
        return out

    ref, results = assert_matches_reference(
        transforms, lambda: make_mlp(sizes, seed), lambda: dsfn.optim.adamw(lr=1e-2), batches, world,
        seed=seed, make_reference_transforms=lambda: [clip_grad_norm(clip)] if clip is not None else [], **FP32)
    for res in results:
        assert int(res.state.step) == len(batches)
        if clip is not None:
            got = torch.tensor([m["grad_norm"] for m in res.metrics], dtype=torch.float64)
            want = torch.tensor([m["grad_norm"] for m in ref.metrics], dtype=torch.float64)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_uneven_scalar_frozen_and_unused_params_equal_reference(stage, world):
    """0-dim and [1] parameters, sizes not divisible by N, a frozen layer and a parameter outside
    the loss: all stages equal the reference (state shapes are the logical ones, so no padding
    leaks into the gathered state), with accumulation and clipping on top."""
    batches = regression_batches(3, 8, 5, 3, seed=stage)
    assert_matches_reference(
        lambda: [shard_zero(stage, param_persistence_threshold=0, reduce_bucket_size=5), accumulate(2),
                 clip_grad_norm(0.1)],
        Odd, lambda: dsfn.optim.adamw(lr=1e-2), batches, world,
        make_reference_transforms=lambda: [clip_grad_norm(0.1)], **FP32)


def _odd_layout_after_training(world):
    init_mesh()
    model = Odd()
    apply_fn, params = dsfn.functionalize(model)
    step = make_step(apply_fn, [shard_zero(3, param_persistence_threshold=0)])
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=1e-2)))
    for batch in regression_batches(2, 4, 5, 3, seed=1):
        state, _ = step(state, batch)
    n, r = world, current_mesh().local_rank("dp")
    out = {"param_names": sorted(state.params), "shards": {}, "pad_nonzero": [], "opt_paths": []}
    for path, x in tree.leaves_with_path((state.params, state.opt_state), is_leaf=lambda x: isinstance(x, Placed)):
        out["opt_paths"].append(path)
        if not isinstance(x, Placed):
            continue
        numel = math.prod(x.layout.shape)
        c = math.ceil(numel / n)
        out["shards"][path] = (tuple(x.data.shape), x.layout.shape, isinstance(x.layout, FlatShard))
        valid = max(0, min(c, numel - r * c))          # elements of this rank's piece that are real
        if bool((x.data[valid:] != 0).any()):
            out["pad_nonzero"].append(path)
    gathered = step.gather(state)
    out["gathered_shapes"] = {k: tuple(v.shape) for k, v in gathered.params.items()}
    return out


@pytest.mark.parametrize("world", [4])
def test_stage3_layout_pads_shards_and_keeps_frozen_params_out(world):
    """Stage 3 on 4 ranks: each sharded leaf (params and their optimizer mirrors) holds exactly
    ceil(numel/N) elements; the padding stays exactly zero after training (so it adds nothing
    to sums, norms or updates); frozen parameters are not in the state; gather restores the
    logical shapes (0-dim stays 0-dim)."""
    for rank, out in enumerate(run_on_ranks(_odd_layout_after_training, world, world, timeout=60)):
        assert out["param_names"] == sorted(TRAINABLE_ODD), out["param_names"]
        assert not any("frozen" in p for p in out["opt_paths"])
        assert out["gathered_shapes"] == TRAINABLE_ODD
        # params (7) + Adam mu and nu (7 each) are sharded; scalars (count, lr) are not
        assert len(out["shards"]) == 21, sorted(out["shards"])
        for path, (local, logical, flat) in out["shards"].items():
            assert flat and local == (math.ceil(math.prod(logical) / world),), (path, local, logical)
        assert out["pad_nonzero"] == [], f"rank {rank}: non-zero padding in {out['pad_nonzero']}"


def test_persistence_threshold_mixes_replicated_and_sharded_params():
    """Stage 3 keeps parameters with <= threshold elements replicated (DeepSpeed's
    stage3_param_persistence_threshold): the mixed state still equals the reference, and the
    layout is as documented."""
    sizes = [6, 9, 4]           # weights 54, 36 elements; biases 9, 4

    def layout():
        init_mesh()
        apply_fn, params = dsfn.functionalize(make_mlp(sizes, 0))
        step = make_step(apply_fn, [shard_zero(3, param_persistence_threshold=20)])
        state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1)))
        return {k: isinstance(v, Placed) for k, v in state.params.items()}

    for lay in run_on_ranks(layout, 2, timeout=60):
        assert lay == {"layers.0.bias": False, "layers.0.weight": True, "layers.1.bias": False,
                       "layers.1.weight": True}
    assert_matches_reference(lambda: [shard_zero(3, param_persistence_threshold=20), clip_grad_norm(0.2)],
                             lambda: make_mlp(sizes, 0), lambda: dsfn.optim.adamw(lr=1e-2),
                             regression_batches(3, 4, 6, 4, seed=5), 4,
                             make_reference_transforms=lambda: [clip_grad_norm(0.2)], **FP32)


def test_stage3_with_default_persistence_threshold_equals_reference():
    """shard_zero(3) with its defaults (threshold 1e5 elements): every parameter of a small MLP
    stays replicated, gradients are all-reduced, and training equals the reference."""
    assert_matches_reference(lambda: [shard_zero(3)], lambda: make_mlp([4, 8, 2], 0),
                             lambda: dsfn.optim.sgd(lr=0.1), regression_batches(2, 4, 4, 2, seed=1), 2, **FP32)


def test_tiny_gpt_equals_reference_and_stages_agree_on_grad_norm():
    """The tiny GPT (lm_head tied to the token embedding) under stages 1, 2, 3 (every parameter
    sharded) equals the single process with clipping; the grad_norm metric of stages 1, 2 and 3
    equals each other's and the reference's (rtol 1e-5). SGD+momentum, not Adam: the key bias's
    gradient is exactly zero in exact arithmetic, and Adam would turn rounding noise into
    +-lr steps."""
    batches = token_batches(2, 4, 16, 256, seed=3)
    norms = {}
    ref = None
    for stage, world in [(1, 2), (2, 2), (3, 2), (3, 4)]:
        ref, results = assert_matches_reference(
            lambda: [shard_zero(stage, param_persistence_threshold=0, reduce_bucket_size=20_000),
                     clip_grad_norm(0.5)],
            tiny_gpt, lambda: dsfn.optim.sgd(lr=0.1, momentum=0.9), batches, world, loss_fn=lm_loss,
            make_reference_transforms=lambda: [clip_grad_norm(0.5)], **FP32)
        norms[(stage, world)] = [m["grad_norm"] for m in results[0].metrics]
        assert all(r.metrics == results[0].metrics for r in results), "ranks report different metrics"
    ref_norms = torch.tensor([m["grad_norm"] for m in ref.metrics], dtype=torch.float64)
    assert bool((ref_norms > 0.5).all()), "clipping must be active for this test to mean something"
    for key, got in norms.items():
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), ref_norms, rtol=1e-5, atol=0,
                                   msg=lambda m: f"{key}: {m}")


def _gpt_tie_layout():
    init_mesh()
    apply_fn, params = dsfn.functionalize(tiny_gpt())
    step = make_step(apply_fn, [shard_zero(3, param_persistence_threshold=0)], ce_loss)
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1)))
    return sorted(state.params), isinstance(state.params["tok_emb.weight"], Placed)


def test_tied_weight_is_one_sharded_leaf():
    """The tied lm_head/embedding weight is stored once (under the first name), sharded."""
    for names, sharded in run_on_ranks(_gpt_tie_layout, 2, timeout=60):
        assert "tok_emb.weight" in names and "lm_head.weight" not in names
        assert sharded


class TiedAcrossUnits(nn.Module):
    """Three layers, the last tied to the first: the weight belongs to two stage-3 units."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)])
        self.layers[2].weight = self.layers[0].weight

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize("case", ["layers_tied_across_units", "gpt_embedding_in_its_own_unit"])
def test_stage3_weight_tied_across_units_equals_reference(case):
    """A weight tied between two units (layer 0 and layer 2; or the GPT embedding as a unit of its
    own, with lm_head in the root) must be gathered whenever either unit runs."""
    if case == "layers_tied_across_units":
        assert_matches_reference(lambda: [shard_zero(3, param_persistence_threshold=0)], TiedAcrossUnits,
                                 lambda: dsfn.optim.sgd(lr=0.1), regression_batches(2, 4, 4, 4, seed=1), 2, **FP32)
    else:
        assert_matches_reference(
            lambda: [shard_zero(3, param_persistence_threshold=0, units=["tok_emb", "blocks.*"])],
            lambda: tiny_gpt(n_layer=2), lambda: dsfn.optim.sgd(lr=0.1), token_batches(1, 2, 8, 256, seed=3), 2,
            loss_fn=lm_loss, **FP32)


def test_stage3_with_a_block_shared_by_two_positions_equals_reference():
    """ALBERT-style sharing: the same module object appears twice in the ModuleList."""
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            blk = nn.Linear(4, 4)
            self.layers = nn.ModuleList([blk, nn.Linear(4, 4), blk])

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x

    for prefetch in (0, 2):
        assert_matches_reference(lambda: [shard_zero(3, param_persistence_threshold=0, prefetch=prefetch)], Shared,
                                 lambda: dsfn.optim.sgd(lr=0.1), regression_batches(2, 4, 4, 4, seed=1), 2, **FP32)


def test_two_forwards_per_step_equal_reference():
    """A loss that calls apply_fn twice (stage 3 gathers twice, gradients from both are summed)."""
    def two(apply_fn, p, b):
        return F.mse_loss(apply_fn(p, b["x"]), b["y"]) + 0.5 * F.mse_loss(apply_fn(p, 2 * b["x"]), b["y"])
    for stage in (2, 3):
        assert_matches_reference(lambda: [shard_zero(stage, param_persistence_threshold=0)],
                                 lambda: make_mlp([4, 6, 4], 0), lambda: dsfn.optim.adamw(lr=1e-2),
                                 regression_batches(2, 4, 4, 4, seed=2), 2, loss_fn=two, **FP32)


# ----------------------------------------------------------------------------------------------
# 3. communication volume per step
# ----------------------------------------------------------------------------------------------

METRIC_BYTES = 8   # the loss metric travels as one float64 all-reduce (lr is the same everywhere: not reduced)


def _comm_per_step(make_model, loss_fn, batch, configs):
    """For each (stage, transforms kwargs, extra transforms): counters of the 2nd step."""
    init_mesh()
    n = current_mesh().size("dp")
    out = {}
    for key, stage, kw, extra in configs:
        apply_fn, params = dsfn.functionalize(make_model())
        step = make_step(apply_fn, [shard_zero(stage, **kw), *extra()], loss_fn)
        state = step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=1e-3)))
        state, _ = step(state, batch)                # warm-up step
        counters.reset()
        state, _ = step(state, batch)
        out[key] = {f"{op}": (counters.calls("dp", op), counters.bytes("dp", op))
                    for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")}
        out[key]["psi"] = sum(p.numel() for p in params.values())
        out[key]["psi_pad"] = psi_pad(params, n)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_communication_volume_stages_0_1_2(world):
    """Per step, counted by the runtime: stage 0 all-reduces the gradient bytes; stages 1 and 2
    reduce-scatter the padded gradient bytes and all-gather the padded parameter bytes, i.e.
    2·Ψ_pad·(N-1)/N bytes moved per rank by a ring (same as data parallel), whatever the bucket
    size. Deviation from the theory: one float64 all-reduce of the 2 metrics (16 bytes) per step,
    and the padding of each tensor to a multiple of N. bf16 halves every byte count."""
    sizes = [5, 7, 3]     # 35, 7, 21, 3 elements: every tensor is padded under N = 2 and 4
    bf16 = lambda: [mixed_precision(torch.bfloat16)]
    none = lambda: []
    configs = [("s0", 0, {}, none), ("s1", 1, {}, none), ("s2", 2, {}, none),
               ("s2_small_buckets", 2, {"reduce_bucket_size": 8, "allgather_bucket_size": 8}, none),
               ("s1_bf16", 1, {}, bf16), ("s2_bf16", 2, {}, bf16)]
    batch = regression_batches(1, 8, 5, 3)[0]
    for counts in run_on_ranks(_comm_per_step, world, lambda: make_mlp(sizes, 0), mse_loss, batch, configs,
                               timeout=60):
        psi, pad = counts["s0"]["psi"], counts["s0"]["psi_pad"]
        assert pad > psi          # the test exercises padding
        assert counts["s0"]["all_reduce"] == (2, 4 * psi + METRIC_BYTES)   # one grad bucket + metrics
        assert counts["s0"]["reduce_scatter"] == counts["s0"]["all_gather"] == (0, 0)
        for key, width in [("s1", 4), ("s2", 4), ("s2_small_buckets", 4), ("s1_bf16", 2), ("s2_bf16", 2)]:
            c = counts[key]
            assert c["reduce_scatter"][1] == width * pad, (key, c)
            assert c["all_gather"][1] == width * pad, (key, c)
            assert c["all_reduce"] == (1, METRIC_BYTES), (key, c)
            assert c["broadcast"] == c["all_to_all"] == (0, 0), (key, c)
            moved = (c["reduce_scatter"][1] + c["all_gather"][1]) * (world - 1) / world
            assert moved == 2 * width * pad * (world - 1) / world
        assert counts["s1"]["reduce_scatter"][0] == counts["s1"]["all_gather"][0] == 1
        assert counts["s2_small_buckets"]["reduce_scatter"][0] > 1     # many buckets, same bytes
        assert counts["s2_small_buckets"]["all_gather"][0] > 1


@pytest.mark.parametrize("world", [2, 4])
def test_communication_volume_stage3(world):
    """Stage 3 on the tiny GPT (every parameter sharded): parameters are all-gathered twice (each
    unit in forward, and again for backward) and gradients reduce-scattered once: 3·Ψ_pad·(N-1)/N
    bytes moved per rank, 1.5x stages 1-2. One all-gather per unit per pass (root + 4 blocks).
    Deviation: the 16-byte metrics all-reduce. (A unit whose weights backward does not need —
    e.g. a first Linear whose input needs no grad — is not re-gathered, so models like an MLP
    gather less than 2Ψ; every GPT unit feeds a LayerNorm or matmul that needs it.)"""
    configs = [("s3", 3, {"param_persistence_threshold": 0}, lambda: []),
               ("s3_bf16", 3, {"param_persistence_threshold": 0}, lambda: [mixed_precision(torch.bfloat16)])]
    batch = token_batches(1, 4, 16, 256, seed=0)[0]
    for counts in run_on_ranks(_comm_per_step, world, lambda: tiny_gpt(n_layer=4), ce_loss, batch, configs,
                               timeout=60):
        for key, width in [("s3", 4), ("s3_bf16", 2)]:
            c, pad = counts[key], counts[key]["psi_pad"]
            assert c["all_gather"] == (2 * 5, 2 * width * pad), (key, c)
            assert c["reduce_scatter"][1] == width * pad, (key, c)
            assert c["all_reduce"] == (1, METRIC_BYTES), (key, c)
            moved = (c["all_gather"][1] + c["reduce_scatter"][1]) * (world - 1) / world
            assert moved == 3 * width * pad * (world - 1) / world


# ----------------------------------------------------------------------------------------------
# 4. memory: bytes of the state each rank stores
# ----------------------------------------------------------------------------------------------

def _state_bytes(bucket):
    init_mesh()
    n = current_mesh().size("dp")
    out = {}
    model = tiny_gpt()
    for key, stage, mp in [("s0", 0, False), ("s1", 1, False), ("s2", 2, False), ("s1_bf16", 1, True),
                           ("s3_bf16", 3, True)]:
        apply_fn, params = dsfn.functionalize(model)
        capture = {}
        extra = [mixed_precision(torch.bfloat16)] if mp else []
        step = make_step(apply_fn, [shard_zero(stage, param_persistence_threshold=0, reduce_bucket_size=bucket),
                                    *extra], ce_loss, capture)
        state = step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=1e-3)))
        state, _ = step(state, token_batches(1, 4, 16, 256, seed=0)[0])
        per_rank = sum(math.ceil(p.numel() / n) for p in params.values())
        unit = max(sum(p.numel() for p in blk.parameters()) for blk in model.blocks)
        out[key] = dict(params=local_bytes(state.params), opt=local_bytes(state.opt_state),
                        grads=local_bytes(capture["grads"]), per_rank=per_rank,
                        psi=sum(p.numel() for p in params.values()), unit=unit, n_tensors=len(params),
                        opt_dtypes=sorted({str(x.dtype) for x in tree.leaves(state.opt_state) if x.dim()}))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_model_state_bytes_per_rank(world):
    """Counted from the placed state's storages (and the gradient tree the step received):
    stage 3 + bf16 + Adam stores 2 (bf16 param shard) + 2 (bf16 grad shard) + 12 (fp32 master,
    m, v shards) bytes per element of Ψ_pad/N — exactly, plus two 8-byte scalars (Adam's count
    and lr) — which is within (2+2+12)Ψ/N + one unit's gathered bf16 params + one reduce bucket.
    Stage 1/2 optimizer state is 1/N of stage 0's (up to padding and the scalars)."""
    bucket = 4096
    for m in run_on_ranks(_state_bytes, world, bucket, timeout=90):
        s3 = m["s3_bf16"]
        k, psi = s3["per_rank"], s3["psi"]
        assert s3["params"] == 2 * k and s3["grads"] == 2 * k
        assert s3["opt"] == 12 * k + 16
        total = s3["params"] + s3["grads"] + s3["opt"]
        assert total <= 16 * psi / world + 2 * s3["unit"] + 2 * bucket, (total, psi, world)
        # stage 1/2: optimizer state sharded 1/N, params and (full) grads replicated
        assert m["s0"]["opt"] == 8 * psi + 16
        for key in ("s1", "s2"):
            assert m[key]["opt"] == 8 * k + 16, (key, m[key])
            # 1/N of stage 0's moments, plus at most N-1 padding elements per tensor, plus the scalars
            assert m[key]["opt"] <= (m["s0"]["opt"] - 16) / world + 8 * (world - 1) * m[key]["n_tensors"] + 16
            assert m[key]["params"] == 4 * psi
            assert m[key]["grads"] == 4 * k          # the step only ever receives its gradient shard
        assert m["s1_bf16"]["params"] == 2 * psi and m["s1_bf16"]["opt"] == 12 * k + 16
        assert m["s1_bf16"]["opt_dtypes"] == ["torch.float32"]


# ----------------------------------------------------------------------------------------------
# 5. stage 3 peak: live units during forward
# ----------------------------------------------------------------------------------------------

def _live_units(prefetches):
    init_mesh()
    out = {}
    for pf in prefetches:
        model = tiny_gpt(n_layer=4)
        apply_fn, params = dsfn.functionalize(model)
        launched_minus_freed = []
        # an independent count: all-gathers launched so far (one per unit: root first) minus the
        # blocks already finished, read while each block computes (its ln1 runs inside the unit)
        for i, blk in enumerate(model.blocks):
            blk.ln1.register_forward_hook(
                lambda m, a, o, i=i: launched_minus_freed.append(counters.calls("dp", "all_gather") - 1 - i))
        step = make_step(apply_fn, [shard_zero(3, param_persistence_threshold=0, prefetch=pf)], ce_loss)
        state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1)))
        C.reset_gauges()
        counters.reset()
        state, metrics = step(state, token_batches(1, 4, 16, 256, seed=0)[0])
        out[pf] = dict(max=C.gauge_max.get("zero3.live_units"), after=C.gauges.get("zero3.live_units"),
                       independent=max(launched_minus_freed), loss=float(metrics["loss"]),
                       params=step.gather(state).params)
    return out


def test_stage3_live_units_bounded_by_prefetch_depth():
    """During forward at most prefetch + 1 blocks are gathered at once (the root unit — embeddings,
    final norm, tied head — is live for the whole forward and excluded, as zero.py documents);
    the bound is reached, every unit is freed at the end, and prefetch never changes the math."""
    for res in run_on_ranks(_live_units, 2, (0, 1, 2), timeout=60):
        for pf, r in res.items():
            assert r["max"] == pf + 1, (pf, r["max"])
            assert r["independent"] == pf + 1, (pf, r["independent"])
            assert r["after"] == 0
        assert res[0]["loss"] == res[1]["loss"] == res[2]["loss"]
        assert_trees_equal(res[1]["params"], res[0]["params"])
        assert_trees_equal(res[2]["params"], res[0]["params"])


class _ProbeBlock(nn.Module):
    """A unit that records, while it runs, the hooks active around its forward."""

    seen: list = []

    def __init__(self, d: int):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        from torch.nn.modules import module as M
        _ProbeBlock.seen.append(dict(
            saved_tensor_hooks=torch._C._autograd._top_saved_tensors_default_hooks(False) is not None,
            global_hooks=len(M._global_forward_pre_hooks) + len(M._global_forward_hooks),
            leaf_hooks=sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in (self.a, self.b)),
            grad_hooks=torch.is_grad_enabled()))
        return x + self.b(torch.tanh(self.a(x)))


class _ProbeNet(nn.Module):
    def __init__(self, d: int = 8, n: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_ProbeBlock(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def _forward_hooks_probe():
    init_mesh(dp=2)
    model = _ProbeNet()
    apply_fn, params = dsfn.functionalize(model)

    def train_step(state, batch):
        loss = lambda p, b: ((apply_fn(p, b["x"]) - b["y"]) ** 2).mean()
        value, grads = dsfn.value_and_grad(loss)(state.params, batch)
        return state.apply_gradients(grads), {"loss": value}
    zero = shard_zero(3)
    step = compose(zero)(train_step)
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(0.1, momentum=0.9)))
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, 1, generator=g)}
    _ProbeBlock.seen.clear()
    for _ in range(2):
        state, _ = step(state, batch)
    freed = [s.untyped_storage().nbytes() for plan in zero._engine.plans.values() for u in plan.storages.values()
             for s in u.slabs]
    return dict(seen=list(_ProbeBlock.seen), freed=freed)


def test_stage3_forward_runs_without_saved_tensor_or_per_module_hooks():
    """ZeRO-3's forward at world 2 runs each unit with no saved-tensor hooks, no global module
    hooks and no hooks on the unit's submodules (only the unit's own pre/post hooks, O(1)
    per unit); backward re-gathers into the unit's storages, which hold no memory between
    steps (resized to 0 bytes)."""
    for r in run_on_ranks(_forward_hooks_probe, 2, timeout=60):
        assert len(r["seen"]) == 2 * 3
        for seen in r["seen"]:
            assert seen == dict(saved_tensor_hooks=False, global_hooks=0, leaf_hooks=0, grad_hooks=True), seen
        assert r["freed"] and all(n == 0 for n in r["freed"]), r["freed"]


# ----------------------------------------------------------------------------------------------
# 8. bad input
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [4, -1, True, False, "1", 1.5, None])
def test_stage_outside_0_to_3_is_a_config_error(stage):
    with pytest.raises(ConfigError, match="0, 1, 2 or 3"):
        shard_zero(stage)


@pytest.mark.parametrize("kwargs", [dict(reduce_bucket_size=0), dict(allgather_bucket_size=-5),
                                    dict(param_persistence_threshold=-1), dict(prefetch=-1),
                                    dict(bogus=1)])
def test_bad_options_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        shard_zero(2, **kwargs)


@pytest.mark.parametrize("stage,key,value", [
    (0, "allgather_bucket_size", 1000),
    (0, "param_persistence_threshold", 10), (1, "param_persistence_threshold", 10),
    (2, "param_persistence_threshold", 10),
    (0, "units", ["blocks.*"]), (2, "units", ["blocks.*"]), (1, "prefetch", 0), (2, "prefetch", 2)])
def test_an_option_its_stage_never_reads_is_a_config_error(stage, key, value):
    """Issue 31: an option the stage never reads (stage 0 all-gathers nothing; stages 0-2 gather
    no units and keep every parameter whole) is refused, naming the option and the stage that
    reads it, rather than accepted and ignored. The default value (given or not) and every
    stage that reads the option are accepted."""
    with pytest.raises(ConfigError, match=rf"shard_zero\({stage}, {key}=.*read only at stage.*drop {key}"):
        shard_zero(stage, **{key: value})
    defaults = {"allgather_bucket_size": 50_000_000, "param_persistence_threshold": 0, "units": None, "prefetch": 1}
    shard_zero(stage, **{key: defaults[key]})
    for s in ((1, 2, 3) if key == "allgather_bucket_size" else (3,)):
        assert getattr(shard_zero(s, **{key: value}), key) == (tuple(value) if key == "units" else value)


def test_data_parallel_with_shard_zero_is_a_stack_error():
    for stack in [(shard_zero(1), data_parallel()), (data_parallel(), shard_zero(3))]:
        with pytest.raises(StackError, match="data_parallel"):
            compose(*stack)
    with pytest.raises(StackError, match="twice"):
        compose(shard_zero(1), shard_zero(2))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_size_one_dp_axis_is_identity_and_explain_says_so(stage):
    """In a single process the dp axis has size 1: shard_zero(stage) trains bitwise like no
    transform at all (3 rows: no divisibility needed) and explain_note says it is the identity."""
    init_mesh()
    batches = regression_batches(3, 3, 5, 3, seed=4)
    ref = run_training(lambda: make_mlp([5, 7, 3], 1), lambda: dsfn.optim.adamw(lr=1e-2), batches)
    got = run_training(lambda: make_mlp([5, 7, 3], 1), lambda: dsfn.optim.adamw(lr=1e-2), batches,
                       [shard_zero(stage, param_persistence_threshold=0)])
    assert got.losses == ref.losses
    assert_trees_equal({"p": got.state.params, "o": got.state.opt_state, "s": got.state.step},
                       {"p": ref.state.params, "o": ref.state.opt_state, "s": ref.state.step})
    note = shard_zero(stage).explain_note()
    assert "size 1" in note and "identity" in note, note


def _notes_and_indivisible():
    init_mesh()
    note = shard_zero(3).explain_note()
    apply_fn, params = dsfn.functionalize(make_mlp([5, 3], 0))
    step = make_step(apply_fn, [shard_zero(3, param_persistence_threshold=0)])
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1)))
    try:
        step(state, regression_batches(1, 3, 5, 3)[0])
        err = "no error"
    except ShapeError as e:
        err = str(e)
    units = make_step(apply_fn, [shard_zero(3, param_persistence_threshold=0, units=["nope.*"])])
    try:
        units(units.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1))), regression_batches(1, 2, 5, 3)[0])
        unit_err = "no error"
    except ConfigError as e:
        unit_err = str(e)
    return note, err, unit_err


def test_multi_rank_errors_and_explain():
    """On 2 ranks: explain_note names the real axis size (not identity); a batch of 3 rows is a
    ShapeError naming the leaf and the divisor; unit patterns that match nothing are a ConfigError."""
    for note, err, unit_err in run_on_ranks(_notes_and_indivisible, 2, timeout=60):
        assert "size 2" in note and "identity" not in note, note
        assert "'x'" in err and "divisible by 2" in err, err
        assert "nope.*" in unit_err and "matches no module" in unit_err, unit_err


def test_shard_zero_is_data_parallel_subclass_with_stage_attribute():
    t = shard_zero(2)
    assert isinstance(t, ShardZero) and t.stage == 2 and t.axis == "dp"
