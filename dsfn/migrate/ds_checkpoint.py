"""Read DeepSpeed checkpoints (ZeRO 0/1/2/3 directories and universal checkpoints) into dsfn.

    ds = read_deepspeed("ckpt/", trust_pickle=True)          # ckpt/latest -> ckpt/global_step300/
    state = load_deepspeed("ckpt/", like=dsfn.TrainState.create(params, tx), trust_pickle=True)
    state = step.place(state)                                 # any dsfn layout: world size, stage, offload
    dsfn ckpt convert --from-deepspeed ckpt/ --out dsfn_ckpt/ --trust-pickle   # a dsfn checkpoint

What is read (DeepSpeed 0.19's files; `deepspeed/utils/zero_to_fp32.py` is the reference):
- `mp_rank_00_model_states.pt` / `zero_pp_rank_R_mp_rank_00_model_states.pt`: `param_shapes`
  (a list per param group of name -> shape, in flattening order), `global_steps`,
  `skipped_steps`, `lr_scheduler` (`{"last_batch_iteration": L}`), `dp_world_size`.
- `[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`, one per dp rank:
  - ZeRO 1/2: per param group the rank's slice of one flat fp32 vector
    (`single_partition_of_fp32_groups`): the group's parameters concatenated in
    `param_shapes` order (plus `param_alignment_paddings` after each), padded at the end
    (`group_paddings`) and cut into dp equal parts; Adam's `exp_avg` / `exp_avg_sq` are
    flat the same way (`base_optimizer_state.state[group]`).
  - ZeRO 3: every parameter is cut on its own into ceil(numel / dp) pieces (the last
    zero-padded); rank R's `fp32_flat_groups` (one per sub-group) hold its piece of each
    parameter, in order; the moments likewise (`optimizer_state_dict.state[sub_group]`).
  - ZeRO 0 (no ZeRO; fp32 or with `bf16`/`fp16` wrappers): `mp_rank_00_model_states.pt`
    holds `module` and `optimizer` (a torch optimizer state_dict, or an fp16/bf16 wrapper's
    with `fp32_groups_flat` / `single_partition_of_fp32_groups`) — the module's weights
    and the torch state are read.
- a universal checkpoint (`ds_to_universal`): `zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`
  (a tensor, or `{"param": tensor, "cat_dim": ...}`), `step.pt` or the step in
  `zero/optimizer_state.pt`, and the model-states files copied beside `zero/`.

The fp32 master weights are the parameters (bf16/fp16 runs keep them in the optimizer
files; the 16-bit module weights are their rounding). Counts: Adam's `step` is the number
of updates applied; `global_steps - skipped_steps` too (fp16 overflow skips advance
neither); the lr schedule resumes at count = last_batch_iteration + 1 (see
`dsfn.optim.schedules`), the same number when no step was skipped.

DeepSpeed's files are Python pickles: reading one can run code from the file, so every
entry point needs `trust_pickle=True`. Classes from `deepspeed.*` inside them (ZeroStageEnum,
fragment addresses, loss scalers) are read into inert stand-ins, so DeepSpeed need not be
installed. Finding and unpickling the files is `dsfn.migrate.ds_files`; nothing else in dsfn
reads pickles. This module turns what they hold into logical tensors and dsfn states.
"""
from __future__ import annotations

import glob
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from dsfn import tree
from dsfn.errors import CheckpointError
from dsfn.migrate.ds_files import load_ds_file, model_states_file, optim_files, require_trust, resolve_checkpoint_dir

__all__ = ["DeepSpeedCheckpoint", "convert_deepspeed", "load_deepspeed", "read_deepspeed"]


@dataclass
class DeepSpeedCheckpoint:
    """A DeepSpeed checkpoint as logical (whole, unpadded) tensors keyed by parameter name.

    `params` are the fp32 master weights (shapes as in the model), `exp_avg` / `exp_avg_sq`
    Adam's moments (empty when the optimizer had none), `adam_step` Adam's update count.
    """
    path: str
    kind: str                       # "zero" or "universal"
    zero_stage: int
    dp_world_size: int
    params: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)
    adam_step: int | None = None
    global_steps: int = 0
    skipped_steps: int = 0
    lr_last_batch_iteration: int | None = None
    loss_scale: float | None = None
    param_groups: list[dict] = field(default_factory=list)
    ds_config: dict | None = None

    @property
    def updates(self) -> int:
        """Optimizer updates applied: dsfn's `state.step`."""
        if self.adam_step is not None:
            return self.adam_step
        return self.global_steps - self.skipped_steps


def _int(x: Any) -> int:
    """An int from a number or a one-element tensor."""
    return int(x.item() if isinstance(x, torch.Tensor) else x)


def _loss_scale(obj: Any) -> float | None:
    """The fp16 loss scaler's current scale in an optimizer state, or None."""
    scaler = obj.get("loss_scaler") if isinstance(obj, dict) else None
    v = getattr(scaler, "cur_scale", None)
    return float(v) if v is not None else None


# -- reading ---------------------------------------------------------------------------------

def read_deepspeed(path: str | os.PathLike, *, trust_pickle: bool = False,
                   tag: str | None = None) -> DeepSpeedCheckpoint:
    """The logical tensors and counts of a DeepSpeed checkpoint (see the module docstring).

    `path`: a checkpoint root (the tag its `latest`, else `latest_universal`, names), a tag
    directory (`global_stepN`) or a universal checkpoint directory. Raises ConfigError
    without `trust_pickle=True`, CheckpointError for files that are missing or do not fit.
    """
    require_trust(trust_pickle)
    d, kind = resolve_checkpoint_dir(os.fspath(path), tag)
    experts = sorted(glob.glob(os.path.join(d, "*expert_*model_states.pt")))
    if experts:
        # DeepSpeed MoE keeps each expert's weights in files of their own (`layer_L_expert_E_mp_rank_M_
        # model_states.pt`), outside the flat ZeRO partitions this reader splits
        raise CheckpointError(f"{d} holds DeepSpeed MoE expert files ({os.path.basename(experts[0])}, "
                              f"{len(experts)} in all), which dsfn does not read: the experts would be missing "
                              "from the state. Convert the checkpoint with DeepSpeed's ds_to_universal and read "
                              "the universal checkpoint (one consolidated tensor per parameter), or load it with "
                              "DeepSpeed and save the model's state_dict")
    ms = load_ds_file(model_states_file(d))
    shapes_groups = ms.get("param_shapes")
    if isinstance(shapes_groups, dict):
        shapes_groups = [shapes_groups]
    if not shapes_groups:
        raise CheckpointError(f"{d}: the model states hold no `param_shapes` (not a DeepSpeed engine checkpoint?)")
    shapes_groups = [{k: tuple(v) for k, v in g.items()} for g in shapes_groups]
    sched = ms.get("lr_scheduler")
    out = DeepSpeedCheckpoint(
        path=d, kind=kind, zero_stage=0, dp_world_size=_int(ms.get("dp_world_size", 1)), params={},
        global_steps=_int(ms.get("global_steps", 0)), skipped_steps=_int(ms.get("skipped_steps", 0)),
        lr_last_batch_iteration=(_int(sched["last_batch_iteration"]) if isinstance(sched, dict)
                                 and "last_batch_iteration" in sched else None),
        ds_config=ms.get("ds_config"))
    if kind == "universal":
        _read_universal(d, shapes_groups, out)
    else:
        files = optim_files(d)
        if files:
            _read_zero(d, files, shapes_groups, out)
        else:
            _read_zero0(d, ms, shapes_groups, out)
    return out


def _read_zero(d: str, files: list[str], shapes_groups: list[dict], out: DeepSpeedCheckpoint) -> None:
    """Fill `out` from ZeRO 1/2/3 optimizer-state files (one per dp rank): the fp32 masters, moments and counts."""
    sds = [load_ds_file(f)["optimizer_state_dict"] for f in files]
    first = sds[0]
    stage = _int(first.get("zero_stage", 0))
    world = len(sds)
    counts = first.get("partition_count")
    expected = counts if isinstance(counts, int) else (counts[0] if counts else world)
    if _int(expected) != world:
        raise CheckpointError(f"{d}: {world} optimizer-state files but the checkpoint was partitioned over "
                              f"{_int(expected)} ranks; a file is missing")
    out.zero_stage, out.dp_world_size, out.loss_scale = stage, world, _loss_scale(first)
    if stage == 3:
        inner = [sd["optimizer_state_dict"] for sd in sds]
        flat = [torch.cat([t.reshape(-1).float() for t in sd["fp32_flat_groups"]]) for sd in sds]
        moments = {k: [_cat_state(st, k) for st in inner] for k in ("exp_avg", "exp_avg_sq")}
        shapes = {k: v for g in shapes_groups for k, v in g.items()}
        out.params = _zero3_split(flat, shapes, d)
        for k, per_rank in moments.items():
            if all(x is not None for x in per_rank):
                getattr(out, k).update(_zero3_split(per_rank, shapes, d))
        out.adam_step = _state_step(inner[0])
        out.param_groups = _groups(inner[0])
        return
    # stages 1 and 2 (the same files)
    inner = [sd["base_optimizer_state"] for sd in sds]
    align = first.get("param_alignment_paddings")
    for g, shapes in enumerate(shapes_groups):
        pads = align[g] if align else None
        full = torch.cat([sd["single_partition_of_fp32_groups"][g].reshape(-1).float() for sd in sds])
        out.params.update(_flat_split(full, shapes, pads, d))
        for k in ("exp_avg", "exp_avg_sq"):
            parts = [st["state"].get(g, {}).get(k) if isinstance(st, dict) else None for st in inner]
            if all(p is not None for p in parts):
                getattr(out, k).update(_flat_split(torch.cat([p.reshape(-1) for p in parts]), shapes, pads, d))
    out.adam_step = _state_step(inner[0])
    out.param_groups = _groups(inner[0])


def _read_zero0(d: str, ms: dict, shapes_groups: list[dict], out: DeepSpeedCheckpoint) -> None:
    """Fill `out` from a ZeRO 0 model-states file: its fp32 masters (or the module's weights) and torch state."""
    module = ms.get("module") or {}
    names = [k for g in shapes_groups for k in g]
    opt = ms.get("optimizer") or {}
    masters = None
    for key in ("single_partition_of_fp32_groups", "fp32_groups_flat"):
        if key in opt:      # bf16 / fp16 wrappers keep fp32 masters flat per group
            masters = {}
            for g, shapes in enumerate(shapes_groups):
                masters.update(_flat_split(opt[key][g].reshape(-1).float(), shapes, None, d))
    out.loss_scale = _loss_scale(opt)
    out.params = masters or {n: module[n].float().clone() for n in names if n in module}
    base = opt.get("base_optimizer_state", opt.get("optimizer_state_dict", opt))
    state = base.get("state", {}) if isinstance(base, dict) else {}
    if masters is None and state:
        order = [i for g in (base.get("param_groups") or []) for i in g["params"]]
        for name, idx in zip(names, order):
            for k in ("exp_avg", "exp_avg_sq"):
                if k in state.get(idx, {}):
                    getattr(out, k)[name] = state[idx][k].float().reshape(out.params[name].shape).clone()
    elif masters is not None:
        for g, shapes in enumerate(shapes_groups):
            for k in ("exp_avg", "exp_avg_sq"):
                if k in state.get(g, {}):
                    getattr(out, k).update(_flat_split(state[g][k].reshape(-1).float(), shapes, None, d))
    out.adam_step = _state_step(base) if state else None
    out.param_groups = _groups(base) if isinstance(base, dict) else []


def _read_universal(d: str, shapes_groups: list[dict], out: DeepSpeedCheckpoint) -> None:
    """Fill `out` from a universal checkpoint's `zero/<name>/*.pt` files and `zero/optimizer_state.pt`."""
    zero = os.path.join(d, "zero")
    common = os.path.join(zero, "optimizer_state.pt")
    opt = load_ds_file(common) if os.path.isfile(common) else {}
    stage = opt.get("zero_stage")
    out.zero_stage = _int(stage) if stage is not None else 0
    out.loss_scale = _loss_scale(opt)
    out.param_groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.get("param_groups") or []]
    steps = []
    for g in shapes_groups:
        for name, shape in g.items():
            folder = os.path.join(zero, name)
            if not os.path.isdir(folder):
                raise CheckpointError(f"universal checkpoint {d} has no folder zero/{name}")
            for key, target in (("fp32", out.params), ("exp_avg", out.exp_avg), ("exp_avg_sq", out.exp_avg_sq)):
                f = os.path.join(folder, f"{key}.pt")
                if os.path.isfile(f):
                    t = load_ds_file(f)
                    t = t["param"] if isinstance(t, dict) else t
                    if t.numel() != math.prod(shape):
                        raise CheckpointError(f"universal checkpoint {f}: {t.numel()} elements for a parameter "
                                              f"of shape {shape}")
                    target[name] = t.detach().float().reshape(shape).clone()
            f = os.path.join(folder, "step.pt")
            if os.path.isfile(f):
                steps.append(_int(load_ds_file(f)))
    if steps:
        out.adam_step = steps[0]
    else:
        inner = opt.get("optimizer_state_dict") or {}
        out.adam_step = _state_step(inner) if inner.get("state") else None
        if not out.param_groups:
            out.param_groups = _groups(inner)


def _cat_state(st: dict, key: str) -> torch.Tensor | None:
    """One rank's moment `key` of every sub-group, flat and concatenated (None when a sub-group lacks it)."""
    groups = st.get("state", {})
    parts = [groups[i].get(key) for i in sorted(groups)]
    if not parts or any(p is None for p in parts):
        return None
    return torch.cat([p.reshape(-1).float() for p in parts])


def _state_step(opt_sd: Any) -> int | None:
    """Adam's update count in a torch optimizer state_dict, or None."""
    state = opt_sd.get("state", {}) if isinstance(opt_sd, dict) else {}
    for s in state.values():
        if "step" in s:
            return _int(s["step"])
    return None


def _groups(opt_sd: Any) -> list[dict]:
    """The param groups' hyperparameters (without their `params`)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in (opt_sd.get("param_groups") or [])]


def _flat_split(full: torch.Tensor, shapes: dict, pads: list | None, where: str) -> dict[str, torch.Tensor]:
    """ZeRO 1/2's flat group cut back into its parameters (each followed by its alignment padding)."""
    out, offset = {}, 0
    for i, (name, shape) in enumerate(shapes.items()):
        n = math.prod(shape)
        if offset + n > full.numel():
            raise CheckpointError(f"{where}: the flat group holds {full.numel()} elements, too few for parameter "
                                  f"{name!r} at offset {offset} ({n} elements)")
        out[name] = full.detach().narrow(0, offset, n).reshape(shape).clone()
        offset += n + (int(pads[i]) if pads else 0)
    return out


def _zero3_split(per_rank: list[torch.Tensor], shapes: dict, where: str) -> dict[str, torch.Tensor]:
    """ZeRO 3's per-rank pieces of each parameter joined back into whole parameters."""
    world, out, offset = len(per_rank), {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        part = math.ceil(n / world)
        if offset + part > per_rank[0].numel():
            raise CheckpointError(f"{where}: rank partitions hold {per_rank[0].numel()} elements, too few for "
                                  f"parameter {name!r}")
        whole = torch.cat([r.detach().narrow(0, offset, part) for r in per_rank])[:n]
        out[name] = whole.reshape(shape).clone()
        offset += part
    return out


# -- into a dsfn state ------------------------------------------------------------------------

def load_deepspeed(path: str | os.PathLike, like: Any, *, trust_pickle: bool = False, tag: str | None = None,
                   names: dict[str, str] | None = None) -> Any:
    """`like` (a *logical* TrainState: `TrainState.create(params, tx)`) holding a DeepSpeed
    checkpoint's values; place it with `step.place(state)` into any layout.

    Filled: every parameter (the fp32 masters, cast to `like`'s dtype), every Adam-style
    state of `tx` (`dsfn.optim` states with `count`, `mu`, `nu`: adamw, adam, and those
    inside chains, masks and partitions) and its count, `state.step` (updates applied),
    and, when `like.extra` holds a loss-scale state, its scale. An lr schedule reads the
    count, so it resumes where DeepSpeed's scheduler was. `names` maps dsfn parameter
    names to DeepSpeed's where they differ (default: the same `named_parameters` names).
    Raises CheckpointError for a parameter the checkpoint lacks or whose shape differs.
    """
    ds = read_deepspeed(path, trust_pickle=trust_pickle, tag=tag)
    names = dict(names or {})
    ds_name = lambda n: names.get(n, n)

    def fill(source: dict[str, torch.Tensor], what: str):
        def f(path: str, x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            key = ds_name(path)
            if key not in source:
                raise CheckpointError(f"DeepSpeed checkpoint {ds.path} has no {what} for parameter {key!r} "
                                      f"(it has {sorted(source)[:6]}...); pass names={{dsfn_name: ds_name}}")
            v = source[key]
            if tuple(v.shape) != tuple(x.shape):
                raise CheckpointError(f"parameter {key!r}: shape {tuple(v.shape)} in the DeepSpeed checkpoint, "
                                      f"{tuple(x.shape)} in the target state")
            return v.to(dtype=x.dtype, device=x.device).clone()
        return f

    params = tree.map_with_path(fill(ds.params, "weights"), like.params)
    count = ds.updates

    def adam(s: Any) -> Any:
        if not _is_adam_state(s):
            return s
        changes = {"count": torch.full_like(s.count, count)}
        if ds.exp_avg and s.mu is not None:
            changes["mu"] = tree.map_with_path(fill(ds.exp_avg, "exp_avg"), s.mu)
        if ds.exp_avg_sq and s.nu is not None:
            changes["nu"] = tree.map_with_path(fill(ds.exp_avg_sq, "exp_avg_sq"), s.nu)
        return s._replace(**changes)

    opt_state = tree.map(adam, like.opt_state, is_leaf=_is_adam_state)
    # every other count of dsfn.optim (lr schedules, momentum stages) is a 0-dim int64 leaf
    opt_state = tree.map(lambda x: torch.full_like(x, count) if _is_count(x) else x, opt_state)
    extra = dict(like.extra)
    ls = extra.get("loss_scale")
    if ls is not None and ds.loss_scale is not None and hasattr(ls, "scale"):
        extra["loss_scale"] = tree.replace(ls, scale=torch.tensor(ds.loss_scale, dtype=ls.scale.dtype),
                                           cur_iter=torch.tensor(ds.global_steps, dtype=ls.cur_iter.dtype))
    return like.replace(params=params, opt_state=opt_state, extra=extra,
                        step=torch.tensor(count, dtype=like.step.dtype))


def _is_adam_state(x: Any) -> bool:
    """Whether `x` is an Adam-style optimizer state (count, mu, nu)."""
    return all(hasattr(x, k) for k in ("count", "mu", "nu")) and hasattr(x, "_replace")


def _is_count(x: Any) -> bool:
    """Whether `x` is a count leaf of dsfn.optim (a 0-dim int64 tensor)."""
    return isinstance(x, torch.Tensor) and x.dim() == 0 and x.dtype == torch.int64


def convert_deepspeed(path: str | os.PathLike, out: str | os.PathLike, *, trust_pickle: bool = False,
                      tag: str | None = None, lr: float | None = None) -> str:
    """Write a DeepSpeed checkpoint as a dsfn checkpoint (one process, world size 1).

    The state written is `TrainState.create(params, adamw(lr, betas, eps, weight_decay))`
    with DeepSpeed's values (hyperparameters from its first param group): load it with
    `dsfn.checkpoint.load(out, like=...)` into a state of that structure in any layout
    (for stacks that change the structure, e.g. mixed_precision: load the logical state,
    then `step.place`). Returns the step directory written.
    """
    from dsfn.checkpoint.writer import save
    from dsfn.optim import adamw
    from dsfn.state.train_state import TrainState
    ds = read_deepspeed(path, trust_pickle=trust_pickle, tag=tag)
    g = ds.param_groups[0] if ds.param_groups else {}
    tx = adamw(lr if lr is not None else float(g.get("lr", 1e-3)), betas=tuple(g.get("betas", (0.9, 0.999))),
               eps=float(g.get("eps", 1e-8)), weight_decay=float(g.get("weight_decay", 0.01)))
    like = TrainState.create({k: torch.zeros_like(v) for k, v in ds.params.items()}, tx)
    state = load_deepspeed(ds.path, like, trust_pickle=True)
    return save(os.fspath(out), state, step=int(state.step), rng_state=False)
