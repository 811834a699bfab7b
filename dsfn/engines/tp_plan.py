"""Tensor parallel plans: the styles a plan names, how a plan's entries are read, and which
attentions' ranks share replicated key/value heads.

Plain values, no collectives: `dsfn.transforms.tensor_parallel` (the policy: which
parameters get which layout) and `dsfn.engines.tensor_parallel` (the forwards of the
planned modules) both read them. See dsfn.transforms.tensor_parallel for the styles.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from dsfn.errors import ConfigError, MeshError

__all__ = ["STYLES", "Packed", "SharedKV", "canonical_style", "check_heads", "matches", "packed"]


@dataclass(frozen=True)
class Packed:
    """A fused Linear split per part: `packed("colwise", 3)` (3 equal parts, e.g. qkv) or
    `packed("colwise", (q_out, kv_out, kv_out))` (part sizes along the output features)."""
    style: str
    parts: int | tuple[int, ...]

    def part_sizes(self, n_out: int) -> tuple[int, ...]:
        if isinstance(self.parts, int):
            if n_out % self.parts:
                raise ConfigError(f"packed({self.style!r}, {self.parts}): {n_out} output features do not split "
                                  f"into {self.parts} equal parts; give the part sizes instead")
            return (n_out // self.parts,) * self.parts
        if sum(self.parts) != n_out:
            raise ConfigError(f"packed({self.style!r}, {self.parts}): parts sum to {sum(self.parts)}, but the "
                              f"Linear has {n_out} output features")
        return tuple(self.parts)


def packed(style: str = "colwise", parts: int | tuple[int, ...] = 2) -> Packed:
    """A plan value for a fused Linear (see `Packed`). Only colwise styles can be packed."""
    if style not in ("colwise", "colwise_rep", "colwise_gather_output"):
        raise ConfigError(f"packed({style!r}, ...): only colwise styles split a fused output per part")
    if isinstance(parts, int):
        ok = parts >= 1
    else:
        parts = tuple(parts)
        ok = bool(parts) and all(isinstance(p, int) and p >= 1 for p in parts)
    if not ok:
        raise ConfigError(f"packed(..., parts={parts!r}): a number of equal parts >= 1 or a tuple of sizes >= 1")
    return Packed(style, parts)


@dataclass(frozen=True)
class SharedKV:
    """The style tensor_parallel gives a k/v projection of an attention with fewer key/value
    heads (`groups`) than tp: colwise over whole heads, the tp/groups ranks of a head holding
    replicas (GroupDimShard) whose gradients are summed; `q_per_rank` query heads per rank."""
    groups: int
    q_per_rank: int
    style: str = "colwise"


_ALIASES = {"colwise_gather_output": "colwise_rep", "rowwise_split_input": "rowwise_rep",
            "replicated_with_grad_allreduce": "replicated"}
STYLES = ("colwise", "colwise_rep", "colwise_gather_output", "rowwise", "rowwise_rep", "rowwise_split_input",
          "packed_colwise", "embedding_rowwise", "embedding_colwise", "replicated",
          "replicated_with_grad_allreduce", "replicate")


def canonical_style(value: Any, where: str) -> str | Packed:
    """A plan value as dsfn reads it: a style name (aliases resolved) or a `Packed`."""
    if isinstance(value, Packed):
        return Packed(_ALIASES.get(value.style, value.style), value.parts)
    if value == "packed_colwise":        # Hugging Face's fused gate_up: 2 equal parts
        return Packed("colwise", 2)
    if not isinstance(value, str) or value not in STYLES:
        raise ConfigError(f"tensor_parallel: {where} has style {value!r}, which dsfn does not support; supported "
                          f"styles: {list(STYLES)} and packed(style, parts)")
    return _ALIASES.get(value, value)


def matches(pattern: str, name: str) -> bool:
    """Whether the dotted module `name` matches `pattern` (`*`: one name segment)."""
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(a == "*" or a == b for a, b in zip(p, n))


_HEAD_ATTRS = ("num_attention_heads", "num_heads", "n_head")
_KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_head")
_ATTENTION_PROJ = {"q_proj", "k_proj", "v_proj", "qkv", "qkv_proj", "query_key_value", "c_attn", "query", "key",
                   "value", "Wqkv"}
_KV_PROJ = {"k_proj", "v_proj", "key", "value"}


def check_heads(module: nn.Module, styles: dict[str, Any], n: int) -> dict[str, SharedKV]:
    """tp must divide the query heads of every attention whose projections are split colwise
    (heads are whole per rank), and divide its key/value heads or be a multiple of them.
    Returns {k/v projection name: SharedKV} for the attentions with fewer key/value heads
    than tp (their ranks share replicated kv heads; see dsfn.transforms.tensor_parallel)."""
    if n == 1:
        return {}
    named = dict(module.named_modules())
    parents: dict[str, bool] = {}        # parent module -> has an attention-named projection
    for name, s in styles.items():
        if (s.style if isinstance(s, Packed) else s) == "colwise":
            parent, _, leaf = name.rpartition(".")
            parents[parent] = parents.get(parent, False) or leaf in _ATTENTION_PROJ
    cfg = getattr(module, "config", None)
    shared: dict[str, SharedKV] = {}
    for parent, attention in sorted(parents.items()):
        mod = named.get(parent)
        # configs speak for attentions only (an MLP's colwise layers have no heads, though HF's
        # MLPs hold the model's config too)
        sources = [mod] + ([getattr(mod, "config", None), cfg] if attention else [])
        heads = next((getattr(s, a) for s in sources for a in _HEAD_ATTRS
                      if s is not None and isinstance(getattr(s, a, None), int)), None)
        if heads is None:
            continue
        kv = next((getattr(s, a) for s in sources for a in _KV_ATTRS
                   if s is not None and isinstance(getattr(s, a, None), int)), heads)
        if heads % n == 0 and kv % n == 0:
            continue
        valid = [d for d in range(1, heads + 1) if heads % d == 0 and (kv % d == 0 or d % kv == 0)]
        if heads % n or kv < 1 or heads % kv or n % kv:
            raise MeshError(f"tensor_parallel: tp={n} does not fit the attention heads of {parent!r} ({heads} query "
                            f"heads, {kv} key/value heads); each rank holds whole query heads, so tp must divide "
                            "the query heads, and divide the key/value heads or be a multiple of them (ranks then "
                            f"share replicated key/value heads): valid tp degrees are {valid}")
        # fewer kv heads than tp: every rank's heads // n query heads use kv head r * kv // n
        children = {c: st for c, st in styles.items() if c.rpartition(".")[0] == parent}
        kv_proj = sorted(c for c, st in children.items() if c.rpartition(".")[2] in _KV_PROJ and st == "colwise")
        fused = sorted(c for c, st in children.items() if isinstance(st, Packed)
                       or c.rpartition(".")[2] in _ATTENTION_PROJ - _KV_PROJ - {"q_proj", "query"})
        why = ("its q/k/v projection is fused" if fused else
               "it has no separate colwise k and v projections (k_proj / v_proj)" if len(kv_proj) != 2 else
               "it has no integer `num_key_value_groups` (the query heads per key/value head that its attention "
               "reads)" if not isinstance(getattr(mod, "num_key_value_groups", None), int) else None)
        if why:
            raise MeshError(f"tensor_parallel: tp={n} is more than the {kv} key/value heads of {parent!r}, so ranks "
                            f"would share replicated key/value heads, which dsfn does for {parent!r} only with "
                            f"separate colwise k and v projections in an attention module with "
                            f"`num_key_value_groups` (Hugging Face's); {why}. Use a tp degree dividing the key/value "
                            f"heads: {[d for d in valid if kv % d == 0]}")
        for c in kv_proj:
            shared[c] = SharedKV(kv, heads // n)
    return shared
