"""`checkpoint`, `datastates_ckpt`, `nebula` -> checkpoint settings, and `async_checkpoint(dir, every, ...)`.

`datastates_ckpt.host_cache_size` (GB) and `checkpoint.writer.decoupled` are
`async_checkpoint(dir, every, host_cache_size=bytes)` when `checkpoint_dir=` is given
(else they are `DsConfig.checkpoint`).
"""
from __future__ import annotations

from typing import Any

from dsfn.errors import ConfigError
from dsfn.migrate.ds_config.report import KeyReport
from dsfn.migrate.ds_config.values import build, flag, is_disabled, number, section


def _checkpoint_block(cfg: dict, out: dict, report: KeyReport) -> None:
    """`checkpoint` (popped): its writer's engine into `out`; the rest ignored or listed."""
    block = section("checkpoint", cfg.pop("checkpoint", None))
    for k in ("tag_validation", "load_universal", "use_node_local_storage", "checkpoint_serialization",
              "parallel_write"):
        if k in block:
            block.pop(k)
            report.ignore(f"checkpoint.{k}", "dsfn checkpoints are universal, tag-free, pickle-free")
    writer = block.pop("writer", None)
    if writer:
        writer = section("checkpoint.writer", writer)
        out["engine"] = "async" if flag("checkpoint.writer.decoupled", writer.get("decoupled", False)) else "sync"
        report.ignore("checkpoint.writer", "I/O tuning (decoupled -> the async engine)")
    for k in block:
        report.refuse(f"checkpoint.{k}", "not a DeepSpeed 0.19 checkpoint key")


def _datastates_block(cfg: dict, out: dict, report: KeyReport) -> None:
    """`datastates_ckpt` (popped): the async engine and its host cache size (GB -> bytes) into `out`."""
    ds = cfg.pop("datastates_ckpt", None)
    if ds is not None:
        ds = section("datastates_ckpt", ds)
        size = ds.pop("host_cache_size", None)
        out["engine"] = "async"
        if size is not None:
            out["host_cache_size"] = int(number("datastates_ckpt.host_cache_size", size) * 2**30)
        for k in ds:
            report.refuse(f"datastates_ckpt.{k}", "only host_cache_size is read")


def read_checkpointing(cfg: dict, report: KeyReport, directory: Any, every: Any) -> tuple[dict, list]:
    """(checkpoint settings, [async_checkpoint] when `directory` is given and settings exist, else [])."""
    from dsfn import transforms as T
    out: dict = {}
    _checkpoint_block(cfg, out, report)
    _datastates_block(cfg, out, report)
    if cfg.get("nebula") is not None and not is_disabled(cfg.get("nebula")):
        report.refuse("nebula", "Azure Nebula: use async_checkpoint (host cache + background writer)")
    cfg.pop("nebula", None)
    if directory is None or not out:
        return out, []
    if every is None:
        raise ConfigError("from_ds_config(checkpoint_dir=...) needs save_every= (save every N steps)")
    kw = {"engine": out["engine"]}
    if out["engine"] == "async" and "host_cache_size" in out:
        kw["host_cache_size"] = out["host_cache_size"]
    return out, [build("checkpoint", T.async_checkpoint, directory, every, **kw)]
