"""DeepSpeed checkpoints written by a real DeepSpeed engine load into dsfn and continue its training.

A DeepSpeed 0.19 engine (CPU accelerator, 2 gloo ranks, fp32, torch AdamW) trains an MLP
for SAVE_AT steps under ZeRO 1, 2 or 3, saves, and trains CONTINUE more steps; its losses
and final fp32 parameters / Adam moments (`safe_get_full_*`) are the reference. A universal
checkpoint is made from the ZeRO-1 and ZeRO-3 ones with DeepSpeed's own `ds_to_universal`.
Each checkpoint is read by `dsfn.migrate` and placed into dsfn ZeRO 0/1/3 layouts at world 1
and 2, with the stack and optimizer `from_ds_config` builds from DeepSpeed's own config; the
continued dsfn training equals DeepSpeed's continuation (losses and final
parameters and moments, fp32 rtol 1e-5: the gradients are reduced in another order).
Negative controls: zeroed moments (a checkpoint read without its optimizer state) and an
unloaded state both miss the reference. The reader's parameters equal DeepSpeed's own
`zero_to_fp32` reconstruction bitwise.

Skipped, with the reason, when DeepSpeed is not installed (`pip install -e .[deepspeed]`
with `DS_BUILD_OPS=0`). DeepSpeed builds its CPU shm comm op on first use (about a minute,
cached in ~/.cache/torch_extensions); later runs take about 15 s per DeepSpeed run.
"""
import os
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e .[deepspeed] "
                                "with DS_BUILD_OPS=0); these tests read checkpoints a real DeepSpeed run writes")

import dsfn  # noqa: E402
from dsfn.errors import ConfigError  # noqa: E402
from dsfn.migrate import convert_deepspeed, from_ds_config, load_deepspeed, read_deepspeed  # noqa: E402
from dsfn.testing import assert_trees_close, run_on_ranks  # noqa: E402
from dsfn.testing.models import make_mlp, regression_batches  # noqa: E402
from dsfn.testing.reference import mse_loss_fp32, train_step_for  # noqa: E402

SIZES = [5, 7, 3]                    # 35 + 7 + 21 + 3 parameters: odd, so every ZeRO layout pads
SAVE_AT, CONTINUE = 3, 2
BATCHES = regression_batches(SAVE_AT + CONTINUE, 8, 5, 3, seed=1)   # global batches of 8 rows
LR, WD = 1e-2, 0.01
RTOL = 1e-5
TIMEOUT = 600                        # the first DeepSpeed run builds its CPU comm op


def _ds_config(stage: int, bf16: bool = False) -> dict:
    return {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0, "steps_per_print": 10**9,
            "bf16": {"enabled": bf16}}


def _deepspeed_run(stage: int, out: str, universal: bool, bf16: bool = False) -> dict:
    """One rank of DeepSpeed: SAVE_AT steps, save to `out`, CONTINUE steps; losses and final state."""
    import deepspeed as ds
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    ds.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = make_mlp(SIZES, seed=0)
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=_ds_config(stage, bf16))
    losses = []
    for i, b in enumerate(BATCHES):
        if i == SAVE_AT:
            engine.save_checkpoint(out, client_state={"universal_checkpoint_info": {}} if universal else {})
        rows = slice(rank * 4, (rank + 1) * 4)
        x = b["x"][rows].to(torch.bfloat16 if bf16 else torch.float32)
        loss = torch.nn.functional.mse_loss(engine(x).float(), b["y"][rows])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(float(mean) / world)
    names = [n for n, _ in engine.module.named_parameters()]
    full = {n: safe_get_full_fp32_param(p).clone() for n, p in zip(names, engine.module.parameters())}
    mom = {k: {n: safe_get_full_optimizer_state(p, k).clone() for n, p in zip(names, engine.module.parameters())}
           for k in ("exp_avg", "exp_avg_sq")}
    return {"losses": losses, "params": full, **mom}


@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory):
    """{stage: (checkpoint root, DeepSpeed's continuation)} for ZeRO 1, 2, 3, and universal copies."""
    root = tmp_path_factory.mktemp("deepspeed")
    runs = {}
    for stage in (1, 2, 3):
        out = str(root / f"zero{stage}")
        res = run_on_ranks(_deepspeed_run, 2, stage, out, stage != 2, timeout=TIMEOUT)
        runs[stage] = (out, res[0])
    for stage in (2, 3):       # bf16 compute, fp32 masters in bf16_zero_pp_rank_* files
        out = str(root / f"bf16-zero{stage}")
        runs[f"bf16-{stage}"] = (out, run_on_ranks(_deepspeed_run, 2, stage, out, False, True, timeout=TIMEOUT)[0])
    for stage in (1, 3):
        src = os.path.join(runs[stage][0], f"global_step{SAVE_AT}")
        dst = str(root / f"universal{stage}")
        proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", src,
                               "--output_folder", dst], capture_output=True, text=True, timeout=TIMEOUT,
                              env={**os.environ, "DS_ACCELERATOR": "cpu"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[f"universal{stage}"] = (dst, runs[stage][1])
    return runs


def _continue(ckpt: str, stage: int, zero_moments: bool = False, load: bool = True, bf16: bool = False) -> dict:
    """dsfn: the checkpoint placed under ZeRO `stage` on this world, CONTINUE steps. The stack and
    optimizer are `from_ds_config` of DeepSpeed's own config with the stage changed (at world 1
    the rule train_batch = micro x accumulation x dp gives accumulate(2))."""
    model = make_mlp(SIZES, seed=5)                      # other initial values: the checkpoint must set them
    apply_fn, params = dsfn.functionalize(model)
    cfg = from_ds_config(_ds_config(stage, bf16), world_size=torch.distributed.get_world_size())
    assert [t.name for t in cfg.transforms] == (["shard_zero"] + (["accumulate"] if cfg.world_size == 1 else [])
                                                + (["mixed_precision"] if bf16 else []))
    like = dsfn.TrainState.create(params, cfg.tx)
    state = load_deepspeed(ckpt, like, trust_pickle=True) if load else like
    if zero_moments:
        state = state.replace(opt_state=dsfn.tree.map(torch.zeros_like, state.opt_state))
    step = cfg.compose(train_step_for(apply_fn, mse_loss_fp32))
    state = step.place(state)
    losses = []
    for b in BATCHES[SAVE_AT:]:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    full = step.gather(state)
    adam = full.opt_state[1]
    # (under mixed_precision, gather gives the fp32 masters as params)
    return {"losses": losses, "params": full.params, "exp_avg": adam.mu, "exp_avg_sq": adam.nu,
            "step": int(full.step)}


def _assert_continues(got: dict, ref: dict, rtol: float = RTOL, atol: float = 1e-9) -> None:
    assert got["step"] == SAVE_AT + CONTINUE
    assert_trees_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"][SAVE_AT:]), rtol=rtol, atol=0)
    for k in ("params", "exp_avg", "exp_avg_sq"):
        assert_trees_close(got[k], ref[k], rtol=rtol, atol=atol, msg=k)


@pytest.mark.parametrize("source", [1, 2, 3, "universal1", "universal3"])
def test_deepspeed_checkpoint_continues_in_dsfn(ds_runs, source):
    ckpt, ref = ds_runs[source]
    for world in (1, 2):
        results = run_on_ranks(lambda: [_continue(ckpt, s) for s in (0, 1, 3)], world, timeout=TIMEOUT)
        for got in results[0]:
            _assert_continues(got, ref)
    # negative controls: without the moments, or without the checkpoint, the continuation differs
    for bad in (run_on_ranks(_continue, 1, ckpt, 0, True)[0], run_on_ranks(_continue, 1, ckpt, 0, False, False)[0]):
        with pytest.raises(AssertionError):
            _assert_continues(bad, ref)


# bf16: forward and gradients in bf16, summed in another order over the ranks (one bf16 ulp is 0.4%);
# DeepSpeed reduces in bf16 too. Moments of near-zero gradients differ most in relative terms.
BF16_RTOL, BF16_ATOL = 2e-2, 1e-4


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_bf16_checkpoint_continues_in_dsfn(ds_runs, stage):
    """bf16 ZeRO-2/3: the fp32 masters are read (the model states' bf16 weights are their rounding)
    and continue under dsfn's mixed_precision(bf16) that from_ds_config builds."""
    from dsfn.migrate.ds_files import load_ds_file, model_states_file, resolve_checkpoint_dir
    ckpt, ref = ds_runs[f"bf16-{stage}"]
    ds = read_deepspeed(ckpt, trust_pickle=True)
    assert all(v.dtype == torch.float32 for v in ds.params.values())
    if stage == 2:       # ZeRO-3's model states hold empty partitions
        module = load_ds_file(model_states_file(resolve_checkpoint_dir(ckpt, None)[0]))["module"]
        assert all(torch.equal(module[k], v.bfloat16()) for k, v in ds.params.items())
        assert not all(torch.equal(module[k].float(), v) for k, v in ds.params.items())    # masters are finer
    for world in (1, 2):
        for got in run_on_ranks(lambda: [_continue(ckpt, s, bf16=True) for s in (0, 3)], world, timeout=TIMEOUT)[0]:
            _assert_continues(got, ref, BF16_RTOL, BF16_ATOL)
    bad = run_on_ranks(_continue, 1, ckpt, 3, True, True, True)[0]           # without the moments
    with pytest.raises(AssertionError):
        _assert_continues(bad, ref, BF16_RTOL, BF16_ATOL)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_reader_equals_zero_to_fp32(ds_runs, stage):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    ckpt, _ = ds_runs[stage]
    ds = read_deepspeed(ckpt, trust_pickle=True)
    assert (ds.kind, ds.zero_stage, ds.dp_world_size, ds.adam_step, ds.global_steps) == ("zero", stage, 2, 3, 3)
    theirs = {k: v.float() for k, v in get_fp32_state_dict_from_zero_checkpoint(ckpt).items()}
    assert sorted(theirs) == sorted(ds.params)
    for name, v in theirs.items():
        assert torch.equal(ds.params[name], v), name
    uni = read_deepspeed(ds_runs.get(f"universal{stage}", (ckpt,))[0], trust_pickle=True)
    for name, v in theirs.items():
        assert torch.equal(uni.params[name], v), name


def test_pickles_need_explicit_trust(ds_runs):
    ckpt, _ = ds_runs[1]
    with pytest.raises(ConfigError, match="trust_pickle=True"):
        read_deepspeed(ckpt)
    with pytest.raises(ConfigError, match="trust_pickle=True"):
        load_deepspeed(ckpt, like=None)


def test_convert_cli_writes_a_loadable_dsfn_checkpoint(ds_runs, tmp_path, capsys):
    from dsfn import checkpoint as ck
    from dsfn.cli import main
    ckpt, ref = ds_runs[3]
    out = str(tmp_path / "converted")
    assert main(["ckpt", "convert", "--from-deepspeed", ckpt, "--out", out]) == 2     # no --trust-pickle
    assert "trust" in capsys.readouterr().err
    assert main(["ckpt", "convert", "--from-deepspeed", ckpt, "--out", out, "--trust-pickle"]) == 0
    model = make_mlp(SIZES, seed=5)
    apply_fn, params = dsfn.functionalize(model)
    like = dsfn.TrainState.create(params, dsfn.optim.adamw(LR, weight_decay=WD))
    loaded = ck.load(out, like=like)
    direct = load_deepspeed(ckpt, like, trust_pickle=True)
    dsfn.testing.assert_trees_equal({"p": loaded.params, "o": loaded.opt_state, "s": loaded.step},
                                    {"p": direct.params, "o": direct.opt_state, "s": direct.step})
    assert convert_deepspeed(ckpt, str(tmp_path / "again"), trust_pickle=True).endswith(f"step_{SAVE_AT:08d}")
