"""`from_ds_config` on a corpus of real, published DeepSpeed configs (issue 40, part 5).

`tests/migrate/configs/` holds 39 ds_config files other projects ship (Hugging Face
transformers and accelerate, LLaMA-Factory, axolotl, DeepSpeedExamples), copied verbatim;
`SOURCES.md` there gives each one's repository, path and URL. Each file is converted as a
migrating user would: world size 1 (4 or 2 where `tensor_parallel.autotp_size` needs it;
the stack is only built, no ranks are spawned), `auto=hf_trainer_auto(...)` when the file
has "auto" entries, a client optimizer (`tx=torch.optim.AdamW`) when it has no optimizer
block, `micro_batch_size=` when it has no batch keys, and a tiny Hugging Face Llama as
`model=` (its hidden size fills the "auto" bucket sizes). EXPECTED says per file either

- ("trains", hand-written stack): the built transforms are exactly (repr: every option)
  the stack written by hand from docs/migration.md's table, and both train 2 steps on a
  tiny MLP, through the config's optimizer, with bitwise equal losses and final state; or
- ("builds", (hand-written stack, mesh)): the same for a config whose mesh needs several ranks
  (tensor parallel): the transforms and the mesh are compared, nothing is trained here;
- ("refused", keys): one ConfigError whose list names exactly those keys.

So a file that newly trains, newly fails, or maps to another stack fails its case.

Summary (checked by `test_corpus_summary_counts`): 29 train, 2 build (tensor parallel over
2 and 4 ranks), 8 refused. Refusals by key (a file can name several):

    zero_optimization.offload_param                   2  (parameter offload without optimizer offload)
    optimizer.params.bias_correction                  2  (BingBertSquad, bing_bert PLD: Adam without it)
    optimizer.type                                    1  (OnebitAdam)
    zero_optimization.zenflow.select_strategy         1  ('auto')
    progressive_layer_drop                            1
    sparse_attention                                  1
    data_efficiency                                   1

(DeepSpeed 0.19's unprefixed ZeRO-3 field names — max_live_parameters, max_reuse_distance,
gather_16bit_weights_on_model_save — and the keys DeepSpeed does not read — "_comment",
comms_config, monitor_config, cuda_visible_devices — were refusals when the corpus was
first collected; they are now accepted and named in the one warning.)
"""
import collections
import json
import pathlib
import warnings

import pytest
import torch

import dsfn
from dsfn.errors import ConfigError
from dsfn.migrate import from_ds_config, hf_trainer_auto
from dsfn.testing import assert_trees_equal
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import mse_loss_fp32, train_step_for
from dsfn.transforms import (accumulate, clip_grad_norm, loss_scale, mixed_precision, offload, shard_zero,
                             tensor_parallel)

CONFIGS = pathlib.Path(__file__).parent / "configs"
STEPS = 2
HIDDEN = 64                              # make_tiny_llama's hidden size: HF's "auto" bucket sizes
AUTO_REDUCE, AUTO_PERSIST = HIDDEN * HIDDEN, 10 * HIDDEN
M5, M2 = 500_000_000, 200_000_000        # DeepSpeed's default bucket size 5e8; the 2e8 many configs set


def _zero(stage, reduce=M5, gather=M5, persist=None):
    """shard_zero as the table maps `zero_optimization` (stage 0 keeps shard_zero's own allgather default)."""
    kw = {"reduce_bucket_size": reduce}
    if stage >= 1:
        kw["allgather_bucket_size"] = gather
    if stage == 3:
        kw["param_persistence_threshold"] = 100_000 if persist is None else persist
    return shard_zero(stage, **kw)


def _fp16():
    """`fp16.enabled` with DeepSpeed's dynamic-scale keys 0 / 1000 / 16 / 2 / 1."""
    return [mixed_precision(torch.float16), loss_scale(init_scale=2.0**16, window=1000, hysteresis=2, min_scale=1)]


def _tp():
    """`tensor_parallel.autotp_size`: the model's own Hugging Face plan ("auto")."""
    from dsfn.testing.models import make_tiny_llama
    return tensor_parallel("auto", model=make_tiny_llama())


CLIP = clip_grad_norm(1.0)              # gradient_clipping: DeepSpeed's default 1.0, or HF's max_grad_norm 1.0


def _hf_z3(*middle):
    """accelerate / LLaMA-Factory ZeRO-3 with "auto" buckets (hidden^2, 10 x hidden)."""
    return [_zero(3, AUTO_REDUCE, M5, AUTO_PERSIST), *middle]


EXPECTED = {
    # Hugging Face transformers
    "transformers__tests_deepspeed_ds_config_zero2.json": (
        "trains", lambda: [_zero(2, M2, M2), offload("cpu"), CLIP]),          # fp16/bf16 "auto": HF's off
    "transformers__tests_deepspeed_ds_config_zero3.json": (
        "trains", lambda: [_zero(3, 1, M5, 0), offload("cpu", params=True), *_fp16(), CLIP]),   # bucket 0 -> 1
    # Hugging Face accelerate
    "accelerate__examples_deepspeed_config_templates_zero_stage1_config.json": (
        "trains", lambda: [_zero(1, AUTO_REDUCE, M2), *_fp16(), CLIP]),
    "accelerate__examples_deepspeed_config_templates_zero_stage2_config.json": (
        "trains", lambda: [_zero(2, AUTO_REDUCE, M2), *_fp16(), CLIP]),
    "accelerate__examples_deepspeed_config_templates_zero_stage2_offload_config.json": (
        "trains", lambda: [_zero(2, AUTO_REDUCE, M2), offload("cpu"), *_fp16(), CLIP]),
    "accelerate__examples_deepspeed_config_templates_zero_stage3_config.json": (
        "trains", lambda: _hf_z3(*_fp16(), CLIP)),
    "accelerate__examples_deepspeed_config_templates_zero_stage3_offload_config.json": (
        "trains", lambda: _hf_z3(offload("cpu", params=True), *_fp16(), CLIP)),
    "accelerate__tests_deepspeed_ds_config_zero2.json": (
        "trains", lambda: [_zero(2, AUTO_REDUCE, M2), offload("cpu"), CLIP]),
    "accelerate__tests_deepspeed_ds_config_zero2_model_only.json": (
        "trains", lambda: [_zero(2, AUTO_REDUCE, M2), offload("cpu"), CLIP]),
    "accelerate__tests_deepspeed_ds_config_zero3.json": (
        "trains", lambda: _hf_z3(offload("cpu", params=True), CLIP)),
    "accelerate__tests_deepspeed_ds_config_zero3_model_only.json": (
        "refused", ["zero_optimization.offload_param"]),            # offload_param without offload_optimizer
    # LLaMA-Factory
    "LLaMA-Factory__examples_deepspeed_ds_z0_config.json": ("trains", lambda: [_zero(0), CLIP]),
    "LLaMA-Factory__examples_deepspeed_ds_z2_config.json": ("trains", lambda: [_zero(2), CLIP]),
    "LLaMA-Factory__examples_deepspeed_ds_z2_offload_config.json": (
        "trains", lambda: [_zero(2), offload("cpu"), CLIP]),
    "LLaMA-Factory__examples_deepspeed_ds_z3_config.json": ("trains", lambda: _hf_z3(CLIP)),
    "LLaMA-Factory__examples_deepspeed_ds_z3_offload_config.json": (
        "trains", lambda: _hf_z3(offload("cpu", params=True), CLIP)),
    "LLaMA-Factory__examples_deepspeed_ds_z2_autotp_config.json": (
        "builds", (lambda: [_zero(2), _tp(), CLIP], {"pp": 1, "dp": 1, "sp": 1, "tp": 2})),
    "LLaMA-Factory__examples_deepspeed_ds_z3_fp8_config.json": (
        "trains", lambda: [_zero(3, 12845056, M5, 35840), offload("cpu", pin_memory=False), CLIP]),
    # axolotl
    "axolotl__deepspeed_configs_zero1.json": ("trains", lambda: [_zero(1), CLIP]),
    "axolotl__deepspeed_configs_zero1_torch_compile.json": ("trains", lambda: [_zero(1), CLIP]),
    "axolotl__deepspeed_configs_zero2.json": ("trains", lambda: [_zero(2), offload("cpu"), CLIP]),
    "axolotl__deepspeed_configs_zero2_torch_compile.json": ("trains", lambda: [_zero(2), offload("cpu"), CLIP]),
    "axolotl__deepspeed_configs_zero3.json": ("trains", lambda: _hf_z3(CLIP)),
    "axolotl__deepspeed_configs_zero3_bf16.json": ("trains", lambda: _hf_z3(mixed_precision(torch.bfloat16), CLIP)),
    "axolotl__deepspeed_configs_zero3_bf16_cpuoffload_all.json": (
        "trains", lambda: _hf_z3(offload("cpu", params=True, pin_memory=True), mixed_precision(torch.bfloat16), CLIP)),
    "axolotl__deepspeed_configs_zero3_bf16_cpuoffload_params.json": (
        "refused", ["zero_optimization.offload_param"]),
    # DeepSpeedExamples
    "DeepSpeedExamples__compression_cifar_config_ds_config.json": ("trains", lambda: [_zero(0), *_fp16(), CLIP]),
    "DeepSpeedExamples__training_autotuning_hf_dsconfigs_ds_config_fp16_z2.json": (
        "trains", lambda: [_zero(2), *_fp16(), CLIP]),
    "DeepSpeedExamples__training_autotuning_hf_dsconfigs_ds_config_z3.json": ("trains", lambda: [_zero(3), CLIP]),
    "DeepSpeedExamples__training_gan_gan_deepspeed_config.json": ("trains", lambda: [_zero(0), CLIP]),
    "DeepSpeedExamples__training_pipeline_parallelism_ds_config.json": (   # stages come from PipelineModule
        "trains", lambda: [_zero(0), accumulate(32), CLIP]),
    "DeepSpeedExamples__training_BingBertSquad_1-bit_adam_nccl_deepspeed_onebitadam_bsz96_config.json": (
        "refused", ["optimizer.type"]),
    "DeepSpeedExamples__training_BingBertSquad_deepspeed_bsz24_config.json": (
        "refused", ["optimizer.params.bias_correction"]),
    "DeepSpeedExamples__training_bing_bert_deepspeed_bsz4k_progressive_layer_drop_config_seq128.json": (
        "refused", ["optimizer.params.bias_correction", "progressive_layer_drop"]),
    "DeepSpeedExamples__training_bing_bert_deepspeed_bsz64k_lamb_config_seq128.json": (
        "refused", ["sparse_attention"]),
    "DeepSpeedExamples__training_data_efficiency_vit_finetuning_config_ds_config_cifar_random_ltd.json": (
        "refused", ["data_efficiency"]),
    "DeepSpeedExamples__training_imagenet_config_ds_config.json": ("trains", lambda: [_zero(0)]),
    "DeepSpeedExamples__training_DeepSpeed-ZenFlow_finetuning_zf_config.json": (
        "refused", ["zero_optimization.zenflow.select_strategy"]),
    "DeepSpeedExamples__training_tensor_parallel_hf_integration_configs_ds_config.json": (
        "builds", (lambda: [_zero(2), _tp(), CLIP], {"pp": 1, "dp": 1, "sp": 1, "tp": 4})),
}
SUMMARY = {"trains": 29, "builds": 2, "refused": 8, "keys": {
    "zero_optimization.offload_param": 2, "optimizer.params.bias_correction": 2, "optimizer.type": 1,
    "zero_optimization.zenflow.select_strategy": 1, "progressive_layer_drop": 1, "sparse_attention": 1,
    "data_efficiency": 1}}


def _has_auto(node):
    if isinstance(node, dict):
        return any(_has_auto(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_auto(v) for v in node)
    return node == "auto"


def _world(cfg):
    """1, or the tensor-parallel size the config asks for (the stack is only built there)."""
    tp = cfg.get("tensor_parallel", {}).get("autotp_size", 1)
    return tp if isinstance(tp, int) and tp > 1 else 1


def _convert(name):
    """from_ds_config on the file, with what a migrating user passes beside it."""
    pytest.importorskip("transformers", reason="the hf extra gives the tiny Llama passed as model=")
    from dsfn.testing.models import make_tiny_llama
    path = CONFIGS / name
    cfg = json.loads(path.read_text())
    kw = {}
    if _has_auto(cfg):
        kw["auto"] = hf_trainer_auto(max_steps=10)          # TrainingArguments' defaults, 10 steps
    if "optimizer" not in cfg:
        kw["tx"] = torch.optim.AdamW                         # the client optimizer
    if not any(k in cfg for k in ("train_batch_size", "train_micro_batch_size_per_gpu")):
        kw["micro_batch_size"] = 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)         # the performance keys' one warning
        return from_ds_config(path, model=make_tiny_llama(), world_size=_world(cfg), **kw)


def _train(transforms, tx, batch_rows):
    """Losses and final state of `transforms` + `tx` over STEPS steps of a tiny MLP regression."""
    apply_fn, params = dsfn.functionalize(make_mlp([6, 16, 3]))
    step = dsfn.compose(*transforms)(train_step_for(apply_fn, mse_loss_fp32))
    state = step.place(dsfn.TrainState.create(params, tx))
    losses = []
    for b in regression_batches(STEPS, batch_rows, 6, 3, seed=2):
        state, m = step(state, b)
        losses.append(m["loss"])
    full = step.gather(state)
    return {"losses": torch.stack(losses), "params": full.params, "opt_state": full.opt_state}


def _files():
    return sorted(p.name for p in CONFIGS.glob("*.json"))


@pytest.mark.parametrize("name", _files())
def test_published_config(name):
    """The file builds the hand-written stack and trains like it bitwise, or is refused naming exactly its keys."""
    kind, want = EXPECTED[name]
    if kind == "refused":
        with pytest.raises(ConfigError) as e:
            _convert(name)
        msg = str(e.value)
        listed = [line[4:].split(":")[0] for line in msg.splitlines() if line.startswith("  - ")]
        assert sorted(listed) == sorted(want), msg
        assert f"has {len(want)} setting(s)" in msg, msg
        return
    got = _convert(name)
    if kind == "builds":
        hand, mesh = want
        assert [repr(t) for t in got.transforms] == [repr(t) for t in hand()] and got.mesh == mesh
        return
    hand = want()
    assert [repr(t) for t in got.transforms] == [repr(t) for t in hand]
    assert got.mesh == {"pp": 1, "dp": 1, "sp": 1, "tp": 1}
    rows = got.train_batch_size
    assert_trees_equal(_train(got.transforms, got.tx, rows), _train(hand, got.tx, rows), msg=name)


def test_corpus_summary_counts():
    """EXPECTED covers exactly the files in configs/ (each listed in SOURCES.md), and its counts are the docstring's."""
    assert sorted(EXPECTED) == _files()
    sources = (CONFIGS / "SOURCES.md").read_text()
    assert all(f"`{name}`" in sources for name in _files())
    kinds = collections.Counter(kind for kind, _ in EXPECTED.values())
    keys = collections.Counter(k for kind, ks in EXPECTED.values() if kind == "refused" for k in ks)
    assert {"trains": kinds["trains"], "builds": kinds["builds"], "refused": kinds["refused"],
            "keys": dict(keys)} == SUMMARY
    for key, n in SUMMARY["keys"].items():
        assert f"{key}  " in __doc__ and f" {n}  " in __doc__.split(key, 1)[1].splitlines()[0] + "  ", key
