"""A candidate layout: the mesh, the stack of transforms that makes it, and the stack as code.

A `Layout` is data: mesh degrees, the ZeRO stage and its shard group, the pipeline's
schedule, remat, offload, the micro-batch. `stack(model)` builds the transforms `compose`
takes (in the canonical order, `dsfn.transforms`), `code()` prints the same stack as the
line a user pastes. The mesh axes are laid out pp, dp, ep, cp, sp, tp (outermost first:
`init_mesh(**layout.mesh)`), so tp, then sp, then cp take the fastest links, and pp the
slowest, as Megatron and torchtitan order them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

__all__ = ["Layout", "MESH_ORDER"]

MESH_ORDER = ("pp", "dp", "ep", "cp", "sp", "tp")


@dataclass(frozen=True)
class Layout:
    """One candidate. `micro_batch`: rows per micro-batch on a data rank; `accum`: micro-batches
    per step on a data rank (the pipeline's micro-batches when pp > 1, else `accumulate(n)`);
    `shard`: ZeRO's shard group, "flat" (all dp), "hsdp" (`shard_group="node"`) or "hpz"
    (`hpz="node"`); `remat`: every decoder layer checkpointed (`remat()`); `offload`: the
    optimizer state (and master weights) in host memory (`offload("cpu")`)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 1
    shard: str = "flat"
    schedule: str | None = None
    virtual: int | None = None
    micro_batch: int = 1
    accum: int = 1
    remat: bool = False
    offload: bool = False
    bf16: bool = True

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.sp * self.cp * self.ep

    @property
    def data(self) -> int:
        """Ranks that take different rows of the batch: dp x ep (expert parallel carries data)."""
        return self.dp * self.ep

    @property
    def mesh(self) -> dict[str, int]:
        """`init_mesh(**mesh)`: every axis in MESH_ORDER, size-1 ones left out (dp always named)."""
        sizes = {"pp": self.pp, "dp": self.dp, "ep": self.ep, "cp": self.cp, "sp": self.sp, "tp": self.tp}
        return {k: v for k, v in sizes.items() if v > 1 or k == "dp"}

    def with_(self, **kw: Any) -> "Layout":
        return replace(self, **kw)

    def family(self) -> str:
        """The layout's family: what changes it, not its sizes ("zero3-hsdp tp pp(1f1b) remat")."""
        parts = [f"zero{self.zero}" + ("" if self.shard == "flat" else f"-{self.shard}")]
        for ax in ("tp", "sp", "cp", "ep"):
            if getattr(self, ax) > 1:
                parts.append(ax)
        if self.pp > 1:
            parts.append(f"pp({self.schedule}{'' if not self.virtual else f' v{self.virtual}'})")
        parts += ["remat"] * self.remat + ["offload"] * self.offload
        return " ".join(parts)

    def describe(self) -> str:
        mesh = " x ".join(f"{k}{v}" for k, v in self.mesh.items() if v > 1) or "1 rank"
        return f"{mesh}  {self.family()}  mb {self.micro_batch} x {self.accum}"

    # --- the stack ---------------------------------------------------------------------------
    def _items(self) -> list[tuple[str, str, dict]]:
        """(factory, arguments as code, keyword arguments) per transform, outermost first."""
        out: list[tuple[str, str, dict]] = []
        if self.cp > 1:
            out.append(("context_parallel", "", {}))
        if self.sp > 1:
            out.append(("sequence_parallel", "", {}))
        zkw = {"shard_group": "node"} if self.shard == "hsdp" else {"hpz": "node"} if self.shard == "hpz" else {}
        zargs = ", ".join([str(self.zero)] + [f"{k}={v!r}" for k, v in zkw.items()])
        out.append(("shard_zero", zargs, {"stage": self.zero, **zkw}))
        inner: list[tuple[str, str, dict]] = []          # per stage, inside a pipeline
        if self.tp > 1:
            inner.append(("tensor_parallel", '"auto", model=model', {"plan": "auto", "model": None}))
        if self.ep > 1:
            inner.append(("expert_parallel", '"auto", model=model', {"plan": "auto", "model": None}))
        if self.remat:
            inner.append(("remat", "", {}))
        outer: list[tuple[str, str, dict]] = []
        if self.accum > 1 and self.pp == 1:
            outer.append(("accumulate", str(self.accum), {"n": self.accum}))
        if self.offload:
            outer.append(("offload", '"cpu"', {"device": "cpu"}))
        if self.bf16:
            outer.append(("mixed_precision", "", {}))
        if self.pp == 1:            # the canonical order: tp, ep, remat outside accumulate, offload, mixed precision
            return out + inner + outer
        pkw = {"schedule": self.schedule, "microbatches": self.accum, "model": None}
        if self.virtual:
            pkw["virtual"] = self.virtual
        args = f"{self.schedule!r}, microbatches={self.accum}, model=model" + \
            (f", virtual={self.virtual}" if self.virtual else "")
        # the pipeline sits inside every transform that handles the gradient; tp and remat run
        # inside each stage (compose refuses them outside it), expert parallel outside it (it
        # splits the rows before the pipeline cuts micro-batches; compose refuses it inside)
        experts = [x for x in inner if x[0] == "expert_parallel"]
        out += outer + experts + [("pipeline_parallel", args, pkw)] + [x for x in inner if x not in experts]
        return out

    def stack(self, model: Any) -> list[Any]:
        """The transforms, built (`model`: the nn.Module, meta is enough, for tp / ep / pp)."""
        import dsfn.transforms as T
        from dsfn.models.gpt import GPT, tp_plan
        built = []
        for name, _, kw in self._items():
            kw = {k: (model if k == "model" else v) for k, v in kw.items()}
            if name == "tensor_parallel" and isinstance(model, GPT):     # dsfn's GPT: its own plan
                kw["plan"] = tp_plan()
            built.append(getattr(T, name)(**kw))
        return built

    def code(self) -> str:
        """The stack as the code that builds it: `init_mesh(...)` and `dsfn.compose(...)`."""
        mesh = ", ".join(f"{k}={v}" for k, v in self.mesh.items())
        body = ", ".join(f"{name}({args})" for name, args, _ in self._items())
        return f"init_mesh({mesh}); step = dsfn.compose({body}, donate=True)(train_step)"
