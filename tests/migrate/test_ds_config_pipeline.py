"""`from_ds_config`: DeepSpeed's `pipeline` section (DeepSpeed 0.19 semantics,
/work/shared/reference/scale_out.md section 6).

- `pipeline.stages: P` (> 1) -> `pipeline_parallel("1f1b", microbatches=gradient_accumulation_steps,
  model=model)` innermost, mesh pp = P outermost, dp = world / (pp x sp x tp), no `accumulate`
  (the pipeline's micro-batches are the accumulation); absent, "auto" or 1: no pipeline;
- `partition`: "uniform" / absent / "best" -> the even split, "parameters" -> `split=`
  balancing each stage's parameter count, "type:<regex>" -> `split=` balancing the matching
  layers;
- `pipe_partitioned` / `grad_partitioned` / `use_reentrant` / `seed_layers: true`: named in
  the warning; `activation_checkpoint_interval` > 1, fewer accumulation steps than stages: a
  ConfigError naming the key and the fix; ZeRO-2/3 (which DeepSpeed's pipeline engine refuses)
  map to shard_zero(2|3) around the pipeline, sp / tp to sequence_parallel outermost and
  tensor_parallel inside it, interval 1 and the activation_checkpointing options to remat.

A config with a pipeline section trains at pp 2 like the hand-written
`compose(pipeline_parallel("1f1b", 4, model=model))` stack.
"""
import warnings

import pytest
import torch

import dsfn
from dsfn.errors import ConfigError
from dsfn.migrate import from_ds_config
from dsfn.migrate.ds_config import balanced_split
from dsfn.runtime import init_mesh
from dsfn.testing import assert_trees_equal, run_on_ranks
from dsfn.testing.reference import lm_loss, train_step_for

pytest.importorskip("transformers", reason="the hf extra (transformers) gives the tiny Llama")
from dsfn.testing.models import make_tiny_causal_lm, token_batches  # noqa: E402
from dsfn.transforms import pipeline_parallel  # noqa: E402

BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "pipeline": {"stages": 2},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, "gradient_clipping": 0}
MODEL = make_tiny_causal_lm("llama", num_hidden_layers=4)


def _cfg(pipeline=None, world=4, model=MODEL, **top):
    cfg = {**BASE, **top}
    if pipeline is not None:
        cfg["pipeline"] = pipeline
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = from_ds_config(cfg, model=model, world_size=world)
    return got, " ".join(str(w.message) for w in caught)


def _pipe(got):
    (pp,) = [t for t in got.transforms if t.name == "pipeline_parallel"]
    return pp


def test_stages_map_to_pipeline_parallel_over_pp():
    got, _ = _cfg()
    assert [t.name for t in got.transforms] == ["shard_zero", "pipeline_parallel"]      # no accumulate
    pp = _pipe(got)
    assert (pp.schedule, pp.microbatches, pp.model, pp.split) == ("1f1b", 4, MODEL, None)
    assert got.mesh == {"pp": 2, "dp": 2, "sp": 1, "tp": 1}
    assert (got.train_batch_size, got.micro_batch_size, got.gradient_accumulation_steps) == (16, 2, 4)  # 2 x 4 x dp 2
    got, _ = _cfg(train_batch_size=16, train_micro_batch_size_per_gpu=None, world=8)            # any two give the third
    assert (got.mesh["dp"], got.micro_batch_size) == (4, 1)
    clipped, _ = _cfg(gradient_clipping=1.0, bf16={"enabled": True}, zero_optimization={"stage": 1})
    assert [t.name for t in clipped.transforms] == ["shard_zero", "mixed_precision", "clip_grad_norm",
                                                   "pipeline_parallel"]
    # sequence parallel outermost, tensor parallel inside the pipeline, remat for interval 1
    got, _ = _cfg({"stages": 2, "activation_checkpoint_interval": 1}, world=16, sequence_parallel_size=2,
                  tensor_parallel={"autotp_size": 2})
    assert [t.name for t in got.transforms] == ["sequence_parallel", "shard_zero", "remat", "pipeline_parallel",
                                                "tensor_parallel"]
    assert got.mesh == {"pp": 2, "dp": 2, "sp": 2, "tp": 2}
    got, _ = _cfg(activation_checkpointing={"cpu_checkpointing": True})        # DeepSpeed's options shape remat
    assert [(t.name, getattr(t, "offload", None)) for t in got.transforms if t.name == "remat"] == [("remat", "cpu")]
    for stage in (2, 3):        # DeepSpeed's pipeline engine refuses these; dsfn runs them
        zero, _ = _cfg(zero_optimization={"stage": stage})
        assert [(t.name, getattr(t, "stage", None)) for t in zero.transforms] == [("shard_zero", stage),
                                                                                 ("pipeline_parallel", None)]


@pytest.mark.parametrize("pipeline", [None, {}, {"stages": "auto"}, {"stages": 1}])
def test_no_stages_is_no_pipeline(pipeline):
    cfg = dict(BASE)
    cfg.pop("pipeline")
    if pipeline is not None:
        cfg["pipeline"] = pipeline
    got = from_ds_config(cfg, model=MODEL, world_size=4)
    assert [t.name for t in got.transforms] == ["shard_zero", "accumulate"]
    assert got.mesh == {"pp": 1, "dp": 4, "sp": 1, "tp": 1}


def test_pipeline_keys_without_stages_are_named_in_the_warning():
    got, warned = _cfg({"activation_checkpoint_interval": 2, "pipe_partitioned": True})
    assert "pipeline_parallel" not in [t.name for t in got.transforms] and "pipeline" in got.ignored
    assert "PipelineModule(num_stages=); set pipeline.stages" in warned


def test_auto_stages_is_filled_by_auto():
    got = from_ds_config({**BASE, "pipeline": {"stages": "auto"}}, model=MODEL, world_size=4,
                         auto={"pipeline.stages": 2})
    assert got.mesh["pp"] == 2 and _pipe(got).microbatches == 4


@pytest.mark.parametrize("partition, split", [
    ("uniform", None), ("best", None), ("parameters", [2, 2]), ("type:decoderlayer", [2, 2])])
def test_partition_maps_to_the_split(partition, split):
    assert _pipe(_cfg({"stages": 2, "partition": partition})[0]).split == (tuple(split) if split else None)


def test_parameters_partition_counts_the_embedding_on_the_first_stage():
    """A tied embedding + head is counted once, on the first stage: a large one leaves that stage
    one layer; untied, the head (as large) sits on the last stage and the balance is even again."""
    for tied, split in ((True, (1, 3)), (False, (2, 2))):
        big = make_tiny_causal_lm("llama", num_hidden_layers=4, vocab_size=4000, tie_word_embeddings=tied)
        assert big.model.embed_tokens.weight.numel() > 4 * sum(p.numel() for p in big.model.layers[0].parameters())
        assert _pipe(_cfg({"stages": 2, "partition": "parameters"}, model=big)[0]).split == split
    assert balanced_split([10] * 4, 2, first=25) == [1, 3]
    assert balanced_split([10] * 4, 2, first=25, last=25) == [2, 2]
    assert balanced_split([1] * 5, 2) == [3, 2] and balanced_split([1] * 4, 3) == [2, 1, 1]   # dsfn's even split
    assert balanced_split([0, 1, 0, 1, 0], 2) == [3, 2]          # ties: the earlier stages take more layers
    assert balanced_split([1, 1, 1, 9], 2) == [3, 1]
    with pytest.raises(ConfigError, match="fewer than the stages"):
        balanced_split([1], 2)


def test_communication_and_seed_keys_are_named_in_the_warning():
    got, warned = _cfg({"stages": 2, "pipe_partitioned": True, "grad_partitioned": False, "seed_layers": True,
                        "use_reentrant": True, "activation_checkpoint_interval": 0})
    assert set(got.ignored) == {"pipeline.pipe_partitioned", "pipeline.grad_partitioned", "pipeline.seed_layers",
                                "pipeline.use_reentrant"}
    assert "communication only" in warned and "parameters the model already holds" in warned
    got, _ = _cfg({"stages": 2, "seed_layers": False})
    assert got.ignored == ()


@pytest.mark.parametrize("cfg, match", [
    ({"pipeline": {"stages": 2, "activation_checkpoint_interval": 2}},
     r"pipeline.activation_checkpoint_interval: 2: DeepSpeed checkpoints groups of 2 layers.*set 1"),
    ({"gradient_accumulation_steps": 1}, r"gradient_accumulation_steps: 1 with pipeline.stages 2: .*set it >= 2"),
    ({"pipeline": {"stages": 2, "partition": "profile"}}, r"pipeline.partition: 'profile': .*'uniform'"),
    ({"pipeline": {"stages": 2, "partition": "type:Mlp"}},
     r"pipeline.partition='type:Mlp': no layer .*LlamaDecoderLayer.*use 'uniform'"),
    ({"pipeline": {"stages": 2, "layers": 4}}, r"pipeline.layers: not a DeepSpeed 0.19 pipeline key"),
    ({"pipeline": {"stages": 0}}, r"pipeline.stages=0: the number of pipeline stages"),
    ({"pipeline": {"stages": "2"}}, r"pipeline.stages='2': expected a whole number"),
    ({"pipeline": {"stages": 2, "pipe_partitioned": "yes"}}, r"pipeline.pipe_partitioned='yes': expected true"),
    ({"pipeline": {"stages": 3}}, r"world size 4 is not divisible by pipeline.stages \(3\)"),
    ({"pipeline": {"stages": 4}, "gradient_accumulation_steps": 4, "train_batch_size": 16},
     r"pipeline.stages x sequence_parallel_size x autotp_size"),
])
def test_refusals_are_config_errors_naming_the_key_and_the_fix(cfg, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(**cfg) if "pipeline" not in cfg else _cfg(cfg.pop("pipeline"), **cfg)


def test_a_pipeline_needs_the_model():
    with pytest.raises(ConfigError, match=r"pipeline.stages > 1 needs the model.*model=model"):
        from_ds_config(BASE, world_size=2)


def _train(how):
    model = make_tiny_causal_lm("llama", num_hidden_layers=4)
    apply_fn, params = dsfn.functionalize(model)
    if how == "config":
        got = from_ds_config(BASE, model=model)
        got.init_mesh()
        step, tx = got.compose(train_step_for(apply_fn, lm_loss), donate=False), got.tx
    else:
        init_mesh(pp=2)
        step = dsfn.compose(pipeline_parallel("1f1b", 4, model=model))(train_step_for(apply_fn, lm_loss))
        tx = dsfn.optim.sgd(0.1, momentum=0.9)
    state = step.init_state(params, tx)
    losses = []
    for b in token_batches(3, 8, 12, 101, seed=1):
        state, metrics = step(state, b)
        losses.append(metrics["loss"])
    g = step.gather(state)
    return {"losses": torch.stack(losses), "params": g.params, "opt_state": g.opt_state}


def _both():
    return {how: _train(how) for how in ("config", "hand")}


def test_a_pipeline_config_trains_like_the_hand_written_stack():
    for runs in run_on_ranks(_both, 2, timeout=180):
        assert_trees_equal(runs["config"], runs["hand"])
