"""The top-level keys no section reader takes: tuning and logging (ignored), off switches, or listed as unsupported."""
from __future__ import annotations

from typing import Mapping

from dsfn.migrate.ds_config.report import KeyReport
from dsfn.migrate.ds_config.tuning_keys import IGNORED_TOP, is_comment
from dsfn.migrate.ds_config.values import is_disabled


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
        else:
            report.refuse(k, "not supported by dsfn (or not a DeepSpeed 0.19 key)")
