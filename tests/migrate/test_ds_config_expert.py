"""AutoEP's `expert_parallel` section of a ds_config: `autoep_size` becomes an ep mesh axis
borrowed from the data-parallel ranks and `expert_parallel("auto")` in the stack; a run
built from the config trains equal to the single process; what dsfn does not reproduce is
a named ConfigError."""
from __future__ import annotations

import pytest
import torch

import dsfn
from dsfn.errors import ConfigError
from dsfn.migrate import from_ds_config
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import make_tiny_causal_lm
from dsfn.testing.reference import run_steps, train_step_for
from dsfn.transforms import compose

pytest.importorskip("transformers")


def _config(**ep):
    return {"train_batch_size": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}},
            "zero_optimization": {"stage": 2},
            "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "mixtral", **ep}}


def _loss(apply_fn, params, batch):
    return apply_fn(params, input_ids=batch["input_ids"], labels=batch["labels"]).loss


def _batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(3):
        ids = torch.randint(0, 101, (8, 16), generator=g)
        out.append({"input_ids": ids, "labels": ids.masked_fill(ids % 7 == 0, -100)})
    return out


def _train(from_config: bool):
    model = make_tiny_causal_lm("mixtral")
    apply_fn, params = dsfn.functionalize(model)
    if not from_config:
        step = compose()(train_step_for(apply_fn, _loss))
        return run_steps(step, step.init_state(params, dsfn.optim.sgd(0.5, momentum=0.9)), _batches())
    ds = from_ds_config(_config(), model=model, world_size=4)
    init_mesh(**ds.mesh)
    step = compose(*ds.transforms)(train_step_for(apply_fn, _loss))
    return run_steps(step, step.init_state(params, ds.tx), _batches()) + (ds.mesh, [t.name for t in ds.transforms])


def test_autoep_size_is_an_ep_axis_borrowed_from_dp_and_trains_equal_to_the_single_process():
    ref = _train(False)
    for losses, state, mesh, names in run_on_ranks(_train, 4, True, timeout=300):
        assert mesh["dp"] == 2 and mesh["ep"] == 2
        assert names == ["shard_zero", "expert_parallel"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=1e-5, atol=1e-6)
        assert_trees_close(state, ref[1], rtol=1e-5, atol=1e-6)


def test_a_disabled_section_adds_nothing():
    model = make_tiny_causal_lm("mixtral")
    ds = from_ds_config(_config(enabled=False, autoep_size=4), model=model, world_size=4)
    assert "ep" not in ds.mesh and [t.name for t in ds.transforms] == ["shard_zero"]


@pytest.mark.parametrize("ep,match", [
    (dict(autoep_size=3), "autoep_size=3 must divide the data-parallel ranks"),
    (dict(load_balance_coeff=1e-3), "load_balance_coeff: 0.001: expert_bias"),
    (dict(top_k=4), "expert_parallel.top_k: dsfn runs the model's own router \\(top-2\\)"),
    (dict(route_scale=2.5), "expert_parallel.route_scale"),
    (dict(expert_pattern="experts"), "expert_parallel.expert_pattern: custom MoE detection"),
    (dict(preset_model="gpt"), "preset_model='gpt'"),
])
def test_what_dsfn_does_not_reproduce_is_a_named_error(ep, match):
    with pytest.raises(ConfigError, match=match):
        from_ds_config(_config(**ep), model=make_tiny_causal_lm("mixtral"), world_size=4)


def test_expert_parallel_needs_the_model():
    with pytest.raises(ConfigError, match="needs the model"):
        from_ds_config(_config(), world_size=4)


def test_the_kernel_keys_are_ignored_with_a_warning():
    with pytest.warns(UserWarning, match="expert_parallel.use_grouped_mm"):
        ds = from_ds_config(_config(use_grouped_mm=True), model=make_tiny_causal_lm("mixtral"), world_size=4)
    assert ds.mesh["ep"] == 2


# -- DeepSpeed's classic MoE layer arguments ------------------------------------------------------

def test_ds_moe_layer_arguments_map_to_expert_parallel_options():
    from dsfn.migrate import from_ds_moe
    from dsfn.transforms.expert_parallel import ExpertParallel
    model = make_tiny_causal_lm("mixtral")
    out = from_ds_moe(ep_size=2, k=2, capacity_factor=1.25, min_capacity=4, use_rts=False,
                      top2_2nd_expert_sampling=False, model=model)
    assert out == {"ep": 2, "options": {"capacity_factor": 1.25, "min_capacity": 4}}
    t = ExpertParallel("auto", model=model, **out["options"])
    assert (t.capacity_factor, t.min_capacity) == (1.25, 4)
    assert from_ds_moe(k=2, drop_tokens=False, top2_2nd_expert_sampling=False)["options"] == {"capacity_factor": None}


def test_ds_moe_arguments_dsfn_does_not_reproduce_are_named():
    from dsfn.migrate import from_ds_moe
    with pytest.raises(ConfigError) as err:
        from_ds_moe(ep_size=2, k=2, noisy_gate_policy="RSample", use_residual=True, model=make_tiny_causal_lm("mixtral",
                                                                                            num_experts_per_tok=1))
    text = str(err.value)
    for needle in ("use_rts=True", "noisy_gate_policy='RSample'", "use_residual=True", "top2_2nd_expert_sampling",
                   "k=2: the model's router chooses top-1"):
        assert needle in text, needle
    with pytest.warns(UserWarning, match="eval_capacity_factor=2.0 is ignored"):
        from_ds_moe(k=1, use_rts=False, eval_capacity_factor=2.0)
