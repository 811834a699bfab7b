"""`from_ds_config(config, tx=...)`: a config without an `optimizer` block takes the client's
optimizer, as `deepspeed.initialize(model, optimizer=...)` does (issue 40).

References are independent of dsfn's optimizer code: a plain torch loop with the same
`torch.optim` optimizer, its lr driven by DeepSpeed's own `WarmupLR` where the config has
that scheduler (tolerance: fp32 rtol 1e-6, SGD-momentum, one process), and torch's AdamW
with Hugging Face Trainer's decay groups for tx="hf". Bad input: both a client optimizer
and an `optimizer` block, neither, a dsfn optimizer under a scheduler block, a torch
optimizer whose param groups differ. A config without batch keys takes the caller's micro
batch (`micro_batch_size=`, the loader's) by DeepSpeed's rule.
"""
from __future__ import annotations

import functools

import pytest
import torch

import dsfn
from dsfn.errors import ConfigError
from dsfn.testing.models import make_mlp, regression_batches

SIZES = [5, 8, 3]
BATCHES = regression_batches(4, 6, SIZES[0], SIZES[-1], seed=1)
BASE = {"train_micro_batch_size_per_gpu": 6, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0},
        "gradient_clipping": 0}
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05, "warmup_num_steps": 3,
                                         "warmup_type": "linear"}}


def _dsfn_run(cfg: dict, tx, model=None) -> dict[str, torch.Tensor]:
    model = model or make_mlp(SIZES)
    ds = dsfn.from_ds_config(cfg, world_size=1, tx=tx)
    apply_fn, params = dsfn.functionalize(model)

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(
            lambda p, b: torch.nn.functional.mse_loss(apply_fn(p, b["x"]), b["y"]))(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    step = dsfn.compose(*ds.transforms)(train_step)
    state = step.place(dsfn.TrainState.create(params, tx=ds.tx))
    for b in BATCHES:
        state, _ = step(state, b)
    return {k: v.detach() for k, v in step.gather(state).params.items()}


def _torch_run(make_opt, scheduler=None) -> dict[str, torch.Tensor]:
    model = make_mlp(SIZES)
    opt = make_opt(model.parameters())
    sched = scheduler(opt) if scheduler else None
    for b in BATCHES:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(b["x"]), b["y"]).backward()
        opt.step()
        if sched is not None:
            sched.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def _close(got, ref):
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=1e-7, msg=k)


SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)


@pytest.mark.parametrize("form", ["instance", "factory", "class"])
def test_a_torch_client_optimizer_trains_as_the_torch_loop(form):
    tx = {"instance": SGD(make_mlp(SIZES).parameters()), "factory": SGD, "class": torch.optim.Adagrad}[form]
    ref = _torch_run(torch.optim.Adagrad if form == "class" else SGD)
    _close(_dsfn_run(BASE, tx), ref)


def test_the_configs_scheduler_drives_the_client_optimizers_lr_as_deepspeeds_warmuplr():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.lr_schedules import WarmupLR
    p = WARMUP["params"]
    ref = _torch_run(SGD, lambda opt: WarmupLR(opt, p["warmup_min_lr"], p["warmup_max_lr"], p["warmup_num_steps"],
                                               warmup_type=p["warmup_type"]))
    got = _dsfn_run({**BASE, "scheduler": WARMUP}, SGD)
    _close(got, ref)
    # negative control: the client's own fixed lr is another run
    fixed = _torch_run(SGD)
    assert any(not torch.allclose(got[k], fixed[k]) for k in got)


def test_a_dsfn_optimizer_is_taken_as_it_is():
    tx = dsfn.optim.sgd(0.05, momentum=0.9)
    assert dsfn.from_ds_config(BASE, world_size=1, tx=tx).tx is tx
    _close(_dsfn_run(BASE, tx), _torch_run(SGD))


def test_hf_trainers_adamw_decays_all_but_biases_and_norms():
    pytest.importorskip("transformers")
    from transformers import Trainer
    from dsfn.testing.models import make_tiny_llama, token_batches
    auto = dsfn.migrate.hf_trainer_auto(learning_rate=1e-2, weight_decay=0.1, adam_beta2=0.99)
    batches = token_batches(2, 2, 8, 128)
    model = make_tiny_llama()
    decay = set(Trainer.get_decay_parameter_names(None, model))
    assert decay and any(n not in decay for n, _ in model.named_parameters())    # both groups exist
    ds = dsfn.from_ds_config(BASE, world_size=1, tx="hf", model=model, auto=auto)
    apply_fn, params = dsfn.functionalize(model)

    def train_step(state, b):
        loss, grads = dsfn.value_and_grad(
            lambda p, bb: apply_fn(p, input_ids=bb["input_ids"], labels=bb["labels"]).loss)(state.params, b)
        return state.apply_gradients(grads), {"loss": loss}
    step = dsfn.compose(*ds.transforms)(train_step)
    state = step.place(dsfn.TrainState.create(params, tx=ds.tx))
    for b in batches:
        state, _ = step(state, b)
    got = {k: v.detach() for k, v in step.gather(state).params.items()}
    ref_model = make_tiny_llama()
    named = list(ref_model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
                             {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    for b in batches:
        opt.zero_grad()
        ref_model(input_ids=b["input_ids"], labels=b["labels"]).loss.backward()
        opt.step()
    ref = {n: p.detach() for n, p in named if n in got}
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)


def test_bad_client_optimizers_are_refused_by_name():
    with pytest.raises(ConfigError, match="one optimizer, please"):
        dsfn.from_ds_config({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, world_size=1,
                            tx=torch.optim.AdamW)
    with pytest.raises(ConfigError, match=r"no 'optimizer' block.*tx="):
        dsfn.from_ds_config(BASE, world_size=1)
    with pytest.raises(ConfigError, match="scheduler cannot drive it"):
        dsfn.from_ds_config({**BASE, "scheduler": WARMUP}, world_size=1, tx=dsfn.optim.adamw(1e-3))
    model = make_mlp(SIZES)
    two = torch.optim.SGD([{"params": [model.layers[0].weight], "lr": 0.1}, {"params": [model.layers[0].bias]}],
                          lr=0.01)
    with pytest.raises(ConfigError, match="param groups of different settings"):
        dsfn.from_ds_config(BASE, world_size=1, tx=two)
    with pytest.raises(ConfigError, match="needs model="):
        dsfn.from_ds_config(BASE, world_size=1, tx="hf", auto={"optimizer.params.lr": 1e-3})
    with pytest.raises(ConfigError, match="factory returned"):
        dsfn.from_ds_config(BASE, world_size=1, tx=lambda params: 3)


def test_a_config_without_batch_keys_takes_the_callers_micro_batch_by_deepspeeds_rule():
    cfg = {"zero_optimization": {"stage": 0}}
    sgd = dsfn.optim.sgd(0.1)
    with pytest.raises(ConfigError, match=r"neither train_batch_size.*micro_batch_size=N"):
        dsfn.from_ds_config(cfg, world_size=1, tx=sgd)
    got = dsfn.from_ds_config(cfg, world_size=4, tx=sgd, micro_batch_size=3)
    assert (got.train_batch_size, got.micro_batch_size, got.gradient_accumulation_steps) == (12, 3, 1)
    got = dsfn.from_ds_config({**cfg, "gradient_accumulation_steps": 2}, world_size=4, tx=sgd, micro_batch_size=3)
    assert (got.train_batch_size, got.micro_batch_size, got.gradient_accumulation_steps) == (24, 3, 2)
    # the config's own sizes: the caller's must agree with them
    own = {**cfg, "train_batch_size": 16, "gradient_accumulation_steps": 2}
    assert dsfn.from_ds_config(own, world_size=4, tx=sgd, micro_batch_size=2).micro_batch_size == 2
    with pytest.raises(ConfigError, match="disagrees with the config's batch sizes"):
        dsfn.from_ds_config(own, world_size=4, tx=sgd, micro_batch_size=3)
    with pytest.raises(ConfigError, match="an int >= 1"):
        dsfn.from_ds_config(cfg, world_size=1, tx=sgd, micro_batch_size=0)
