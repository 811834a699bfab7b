"""Universal checkpoints: a JSON manifest of logical tensors stored as slices in per-rank
safetensors files; any layout loads any checkpoint by reading the slices it needs.

    dsfn.checkpoint.save(dir, state, keep=3)          # collective when distributed
    state = dsfn.checkpoint.load(dir, like=step.init_state(params, tx))
"""
from dsfn.checkpoint.async_engine import AsyncSaver
from dsfn.checkpoint.host_cache import HostCache
from dsfn.checkpoint.export import convert, export, export_state
from dsfn.checkpoint.format import (
           FORMAT_VERSION,
           Manifest,
           latest_step,
           read_manifest,
           resolve,
)
from dsfn.checkpoint.reader import load, verify
from dsfn.checkpoint.writer import save
from dsfn.errors import CheckpointError

__all__ = ["FORMAT_VERSION", "AsyncSaver", "CheckpointError", "HostCache", "Manifest", "convert", "export", "export_state",
           "latest_step", "load", "read_manifest", "resolve", "save", "verify"]
