"""`zero_optimization.zenflow` -> `zenflow(topk_ratio, update_interval, select_interval,
full_warm_up_rounds, overlap=overlap_step)`."""
from __future__ import annotations

from typing import Any

from dsfn.migrate.ds_config.report import KeyReport
from dsfn.migrate.ds_config.values import build, flag, section


def read_zenflow(block: Any, report: KeyReport) -> list:
    """The `zenflow` transform (a list of none or one) from the `zero_optimization.zenflow` block."""
    from dsfn import transforms as T
    if not block:
        return []
    z = section("zero_optimization.zenflow", block)
    kw = {"topk_ratio": z.pop("topk_ratio", 0.1), "full_warm_up_rounds": z.pop("full_warm_up_rounds", 0),
          "overlap": flag("zero_optimization.zenflow.overlap_step", z.pop("overlap_step", False))}
    for key, arg in (("update_interval", "update_interval"), ("select_interval", "select_interval")):
        v = z.pop(key, "auto")
        if isinstance(v, str) and v == "auto":
            if key == "update_interval":
                report.refuse("zero_optimization.zenflow.update_interval", "'auto' (adaptive) is not supported; give "
                              "an int")
        else:
            kw[arg] = v
    kw.setdefault("update_interval", 4)
    strategy = z.pop("select_strategy", "auto")
    if not (isinstance(strategy, str) and strategy == "step"):
        report.refuse("zero_optimization.zenflow.select_strategy", f"{strategy!r}: dsfn re-selects every "
                      "select_interval updates (DeepSpeed's 'step'); set 'step'")
    z.pop("auto_ratio", None)
    if flag("zero_optimization.zenflow.offload", z.pop("offload", False)):
        report.refuse("zero_optimization.zenflow.offload", "the selected columns' moments stay on the device")
    if "pt_reserved_cores_perc" in z:
        z.pop("pt_reserved_cores_perc")
        report.ignore("zero_optimization.zenflow.pt_reserved_cores_perc", "core pinning")
    for k in z:
        report.refuse(f"zero_optimization.zenflow.{k}", "not a DeepSpeed 0.19 zenflow key")
    return [build("zero_optimization.zenflow", T.zenflow, **kw)]
