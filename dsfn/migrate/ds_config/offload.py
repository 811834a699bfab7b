"""`zero_optimization.offload_optimizer` / `offload_param` -> `offload(device, params=, path=, ...)`.

The offload devices (cpu / nvme, parameters on the optimizer state's device at stage 3),
`nvme_path`, `pin_memory`, `super_offload` (-> `overlap=`) and `cpuadam_cores_perc` (-> `cores=`).
"""
from __future__ import annotations

from dsfn.errors import ConfigError
from dsfn.migrate.ds_config.report import KeyReport
from dsfn.migrate.ds_config.tuning_keys import OFFLOAD_PERF
from dsfn.migrate.ds_config.values import build, flag, number, section


def _offload_blocks(zero: dict) -> tuple[dict, dict]:
    """(offload_optimizer, offload_param) popped from `zero`, the deprecated cpu_offload aliases included."""
    opt = zero.pop("offload_optimizer", None)
    par = zero.pop("offload_param", None)
    if zero.pop("cpu_offload", False):                    # deprecated alias
        opt = opt or {"device": "cpu"}
    if zero.pop("cpu_offload_param", False):
        par = par or {"device": "cpu"}
    return section("zero_optimization.offload_optimizer", opt), section("zero_optimization.offload_param", par)


def _check_param_offload(stage: int, dev: str, pdev: str, path: str | None, ppath: str | None,
                         report: KeyReport) -> None:
    """Parameter offload as dsfn runs it: at stage 3, to the optimizer state's device and nvme_path."""
    if pdev != "none":
        if stage != 3:
            report.refuse("zero_optimization.offload_param", "parameter offload needs ZeRO stage 3 (as in DeepSpeed)")
        elif pdev != dev:
            report.refuse("zero_optimization.offload_param", f"dsfn offloads parameters to where the optimizer "
                          f"state lives; set offload_optimizer.device to {pdev!r} too")
        elif pdev == "nvme" and ppath not in (None, path):
            report.refuse("zero_optimization.offload_param.nvme_path", "one nvme_path for parameters and optimizer "
                          "state")


def read_offload(zero: dict, stage: int, report: KeyReport) -> list:
    """The `offload` transform (a list of none or one) from the offload keys popped from `zero`."""
    from dsfn import transforms as T
    opt, par = _offload_blocks(zero)
    dev = opt.pop("device", "none") or "none"
    pdev = par.pop("device", "none") or "none"
    for key, d in (("offload_optimizer", dev), ("offload_param", pdev)):
        if not (isinstance(d, str) and d in ("none", "cpu", "nvme")):
            raise ConfigError(f"ds_config zero_optimization.{key}.device={d!r}: use none, cpu or nvme")
    for k in (OFFLOAD_PERF & set(opt)):
        opt.pop(k)
        report.ignore(f"zero_optimization.offload_optimizer.{k}", "I/O tuning")
    for k in (OFFLOAD_PERF & set(par)):
        par.pop(k)
        report.ignore(f"zero_optimization.offload_param.{k}", "I/O tuning")
    if dev not in ("none", "cpu", "nvme"):
        raise ConfigError(f"ds_config zero_optimization.offload_optimizer.device={dev!r}: use none, cpu or nvme")
    ratio = opt.pop("ratio", 1.0)
    if ratio != 1.0:
        report.refuse("zero_optimization.offload_optimizer.ratio", "partial (Twin-Flow) offload: dsfn offloads all "
                      "of the optimizer state; use 1.0")
    super_offload = flag("zero_optimization.offload_optimizer.super_offload", opt.pop("super_offload", False))
    cores = opt.pop("cpuadam_cores_perc", None)
    if cores is not None:
        cores = number("zero_optimization.offload_optimizer.cpuadam_cores_perc", cores, above=True)
    path = opt.pop("nvme_path", None)
    pin = flag("zero_optimization.offload_optimizer.pin_memory", opt.pop("pin_memory", True))
    if path is not None and not isinstance(path, str):
        raise ConfigError(f"ds_config zero_optimization.offload_optimizer.nvme_path={path!r}: a directory path")
    ppath = par.pop("nvme_path", None)
    par.pop("pin_memory", None)
    for k in opt:
        report.refuse(f"zero_optimization.offload_optimizer.{k}", "not a DeepSpeed 0.19 offload_optimizer key")
    for k in par:
        report.refuse(f"zero_optimization.offload_param.{k}", "not a DeepSpeed 0.19 offload_param key")
    _check_param_offload(stage, dev, pdev, path, ppath, report)
    if dev == "none":
        return []
    if dev == "nvme" and not path:
        raise ConfigError("ds_config offload_optimizer.device='nvme' needs offload_optimizer.nvme_path "
                          "(a directory on a fast local disk)")
    return [build("zero_optimization.offload_optimizer", T.offload, dev, params=pdev == dev and stage == 3,
                  path=path if dev == "nvme" else None, pin_memory=pin, overlap=super_offload, cores=cores)]
