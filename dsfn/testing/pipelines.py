"""What the pipeline-parallel tests share: the optimizers they train with, the 4-layer models
(every schedule, interleaved and ZBV's 2 stages per rank included, runs at pp 2), and the
comparison of a pipelined run with the single process.

SGD-momentum state is compared whole at fp32 tolerance; Adam-like and Muon runs through the
losses and the parameters (their update turns reduction-order bits into visible differences
near eps)."""
from __future__ import annotations

from typing import Any

import torch

import dsfn
from dsfn.testing.asserts import assert_trees_close

__all__ = ["FP32", "PIPELINE_OPTS", "pipeline_model", "assert_runs_equal"]

FP32 = dict(rtol=1e-5, atol=1e-6)
PIPELINE_OPTS = {"sgd": lambda: dsfn.optim.sgd(0.1, momentum=0.9),
                 "adamw": lambda: dsfn.optim.adamw(3e-3, eps=1e-4, weight_decay=0.1),
                 "muon": lambda: dsfn.optim.muon(lr=0.02, adam_lr=3e-3, adam_eps=1e-4, weight_decay=0.1,
                                                 allow_no_muon=True)}


def pipeline_model(family: str, **gpt: Any) -> torch.nn.Module:
    """A 4-layer model: dsfn's GPT ("gpt", its tiny preset with `gpt` overrides) or a tiny
    Hugging Face causal LM of `family` ("llama": tied embedding and head, "qwen2", ...)."""
    if family == "gpt":
        from dsfn.models.gpt import GPT, GPTConfig
        return GPT(GPTConfig.preset("tiny", n_layer=4, **gpt))
    from dsfn.testing.models import make_tiny_causal_lm
    return make_tiny_causal_lm(family, num_hidden_layers=4)


def assert_runs_equal(results: list, ref: tuple, opt: str) -> None:
    """Each rank's `(losses, {"params", "opt_state"}, ...)` equals the single process's `ref`
    at fp32 tolerance: the losses, and the whole state (SGD) or the parameters (others)."""
    for losses, state, *_ in results:
        assert torch.allclose(torch.tensor(losses), torch.tensor(ref[0]), **FP32), (losses, ref[0])
        compared = state if opt == "sgd" else {"params": state["params"]}
        expected = ref[1] if opt == "sgd" else {"params": ref[1]["params"]}
        assert_trees_close(compared, expected, **FP32)
