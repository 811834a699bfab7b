"""`export_state`: a live placed state of any layout -> the model's safetensors on one rank,
tensor by tensor. Every layout's rebuild path is exercised: ZeRO's flat shards (into one
reused buffer), offloaded flat shards (gathered on their compute device), tensor parallel's
row / column / packed (qkv) splits (one rank's piece at a time), ZeRO over tp (Nested), and
mixed precision (the fp32 masters are written). The file equals `step.gather(state)`."""
from __future__ import annotations

import torch

import dsfn
from dsfn.models.gpt import GPT, GPTConfig, tp_plan
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.models import token_batches
from dsfn.testing.reference import lm_loss, train_step_for
from dsfn.transforms import mixed_precision, offload, shard_zero, tensor_parallel

STACKS = {
    "zero3": ({}, lambda m: [shard_zero(3)]),
    "zero3+offload": ({}, lambda m: [shard_zero(3), offload("cpu", params=True, pin_memory=False)]),
    "tp4": (dict(tp=4), lambda m: [tensor_parallel(tp_plan(), model=m)]),
    "dp2xtp2+zero3": (dict(dp=2, tp=2), lambda m: [shard_zero(3), tensor_parallel(tp_plan(), model=m)]),
    "zero2+bf16": ({}, lambda m: [shard_zero(2), mixed_precision(torch.bfloat16)]),
}


def _export(kinds, out_root):
    import os
    from dsfn.checkpoint.export import export_state
    out = {}
    for kind in kinds:
        mesh, make = STACKS[kind]
        init_mesh(**mesh)
        torch.manual_seed(0)
        model = GPT(GPTConfig.preset("tiny", n_layer=2))
        apply_fn, params = dsfn.functionalize(model)
        step = dsfn.compose(*make(model))(train_step_for(apply_fn, lm_loss))
        state = step.init_state(params, dsfn.optim.sgd(lr=0.5, momentum=0.9))
        for b in token_batches(2, 8, 16, 256, seed=3):
            state, _ = step(state, b)
        path = export_state(state, os.path.join(out_root, kind))
        full = step.gather(state)
        masters = getattr(full.opt_state, "master", None)
        out[kind] = (path, {n: t.clone() for n, t in (masters or full.params).items()})
    return out


def test_export_state_writes_the_gathered_model_for_every_layout(tmp_path):
    from safetensors.torch import load_file
    kinds = list(STACKS)
    results = run_on_ranks(_export, 4, kinds, str(tmp_path), timeout=240)
    for kind in kinds:
        assert results[0][kind][0] is not None and all(r[kind][0] is None for r in results[1:]), kind
        written = load_file(results[0][kind][0])
        want = results[0][kind][1]
        assert set(written) == set(want), (kind, sorted(set(written) ^ set(want))[:5])
        for n, t in want.items():
            assert written[n].dtype == t.dtype and torch.equal(written[n], t), (kind, n)
        if kind == "zero2+bf16":         # the fp32 masters, not the bf16 parameters
            assert all(t.dtype == torch.float32 for t in written.values())
