"""The top-level keys no section reader takes: tuning and logging (ignored), off switches, or listed as unsupported."""
from __future__ import annotations

from typing import Mapping

from dsfn.migrate.ds_config.report import KeyReport
from dsfn.migrate.ds_config.tuning_keys import IGNORED_TOP, is_comment
from dsfn.migrate.ds_config.values import is_disabled


# top-level DeepSpeed features dsfn does not reproduce: why, and what to do instead
REFUSED_TOP = {
    "progressive_layer_drop": "DeepSpeed's engine hands the model a per-step layer-keep probability (PLD); dsfn does "
                              "not drive the model's forward, so there is no equivalent: drop layers in the model "
                              "itself if you need it, or remove the section",
    "sparse_attention": "DeepSpeed's block-sparse attention kernels (CUDA-only) replace the model's attention; no dsfn "
                        "equivalent: use the model's own attention (SDPA / flash) and remove the section",
    "data_efficiency": "curriculum learning and random-LTD belong to DeepSpeed's data pipeline and engine; in dsfn "
                       "the batches are the caller's (order or sample them in your loader); random-LTD's token "
                       "dropping has no equivalent",
    "curriculum_learning": "DeepSpeed's data pipeline orders samples by difficulty; in dsfn the batches are the "
                           "caller's: order them in your loader",
    "elasticity": "DeepSpeed's elastic batch sizing; dsfn's batch sizes are fixed by the config and world size",
}


def sort_remaining_keys(cfg: dict, report: KeyReport) -> None:
    """Pop every key left in `cfg` into `report`: ignored, accepted (an off value), or refused."""
    for k in list(cfg):
        v = cfg.pop(k)
        if k in IGNORED_TOP:
            report.ignore(k, IGNORED_TOP[k])
        elif is_comment(k):
            report.ignore(k, "a comment")
        elif k == "gradient_allreduce_op" and v in ("mean", "avg"):
            continue
        elif k == "gradient_allreduce_op":
            report.refuse(k, f"{v!r}: dsfn averages gradients over data parallel (DeepSpeed's 'mean')")
        elif k == "managed_gradient_accumulation" and v is not False:
            continue
        elif k == "managed_gradient_accumulation":
            report.refuse(k, "false (the caller steps at the boundary): dsfn's step takes the whole global batch; "
                          "use accumulate(n)")
        elif k == "data_types" and not isinstance(v, (Mapping, type(None))):
            report.refuse(k, f"{v!r}: expected an object such as {{'grad_accum_dtype': 'fp32'}}")
        elif k == "data_types" and not any((v or {}).values()):
            continue
        elif k == "data_types":
            report.refuse(k, "grad_accum_dtype / param_dtype: dsfn accumulates in the gradient dtype; use "
                          "mixed_precision's reduce_dtype for reductions")
        elif k == "compile" and not isinstance(v, (Mapping, type(None))):
            report.refuse(k, f"{v!r}: expected an object; dsfn does not run DeepSpeed's compile passes")
        elif k == "compile" and not (v or {}).get("deepcompile", False) and not (v or {}).get("passes"):
            continue
        elif isinstance(v, Mapping) and is_disabled(v):
            continue
        elif k in ("amp", "torch_autocast"):
            report.refuse(k, "use bf16/fp16 (dsfn's mixed_precision) instead")
        elif k in REFUSED_TOP:
            report.refuse(k, REFUSED_TOP[k])
        else:
            report.refuse(k, "not supported by dsfn (or not a DeepSpeed 0.19 key)")
