"""The conformance matrix's optimizers: `OPTIMIZERS` (name -> `OptSpec`: how to build it, its
family, whether a clip normalises every update), with Adam's eps and weight decay chosen
so the state is comparable (`ADAM_EPS`, `ADAM_WD`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

import dsfn

# Adam's eps: well above the reduction-order noise of a gradient element, so dividing by the
# second moment does not turn last bits into visible differences. A gradient perturbation d
# moves an element by at most about lr * d / eps per step: with eps 1e-8 an element whose
# gradient is noise (a key bias, a bias feeding BatchNorm) moves by +-lr whatever its bits;
# 1e-5 still left 1e-6-level misses (BatchNorm's bias, Muon's Adam part on an embedding);
# 1e-4 keeps them ~10x under atol 1e-6. Adam stays scale-aware enough for the comparison, and
# its moments (compared too) are linear / quadratic in the gradient.
ADAM_EPS = 1e-4
# decoupled weight decay large enough that 3 steps of it are seen at rtol 1e-5
ADAM_WD = 0.1


@dataclasses.dataclass(frozen=True)
class OptSpec:
    make: Callable[[], Any]
    family: str                     # "sgd" (SGD-momentum and variants) | "adam" (Adam-like: AdamW, Muon)
    clipped: bool = False           # a clip below the gradient norm normalises every update (blind to its scale)
    atol: float = 1e-6              # the state comparison's absolute floor (compare.FP32_ATOL unless larger)


def _groups():
    label = lambda path, x: "decay" if x.dim() >= 2 else "no_decay"   # noqa: E731
    return dsfn.optim.partition({"decay": dsfn.optim.sgd(0.1, momentum=0.9, weight_decay=0.1),
                                 "no_decay": dsfn.optim.sgd(0.1, momentum=0.9)}, label)


def _adamw():
    return dsfn.optim.adamw(3e-3, eps=ADAM_EPS, weight_decay=ADAM_WD)


OPTIMIZERS: dict[str, OptSpec] = {
    "sgd": OptSpec(lambda: dsfn.optim.sgd(0.1, momentum=0.9), "sgd"),
    "clip+sgd": OptSpec(lambda: dsfn.optim.chain(dsfn.optim.clip_by_global_norm(0.05),
                                                 dsfn.optim.sgd(0.1, momentum=0.9)), "sgd", clipped=True),
    "groups": OptSpec(_groups, "sgd"),
    "adamw": OptSpec(_adamw, "adam"),
    "clip+adamw": OptSpec(lambda: dsfn.optim.chain(dsfn.optim.clip_by_global_norm(0.05), _adamw()), "adam",
                          clipped=True),
    # Newton-Schulz divides by the small singular values: a gradient's reduction-order bits in a
    # weak direction move its orthogonalised update by ~1e-6 (measured 1.1e-6 on an 8 x 8 shared
    # expert at dp2 x ep2 on one CPU model, bitwise on another), so its floor is 1e-5; a lost or
    # scaled update still moves each element by >= 1e-3
    "muon": OptSpec(lambda: dsfn.optim.muon(lr=0.02, adam_lr=3e-3, adam_eps=ADAM_EPS, weight_decay=ADAM_WD,
                                            allow_no_muon=True), "adam", atol=1e-5),
    "from_torch": OptSpec(lambda: dsfn.optim.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True),
                          "sgd"),
}
