"""`optimizer` + `scheduler` -> dsfn's tx (the schedule as its lr), and `gradient_clipping`.

`optimizer` Adam / AdamW / Lamb / Muon / SGD / other `torch.optim` types are `adamw` (Adam
with `adam_w_mode` true, DeepSpeed's default) / `adam` / `lamb` (FusedLamb) / `muon` / `sgd`
/ `from_torch`;
`scheduler` is `dsfn.optim.schedules.from_config` as the lr. DeepSpeed's defaults: the
optimizer's weight decay 0 (FusedAdam / CPU Adam; torch's 0.01 with `torch_adam: true`
for AdamW), gradient clipping 1.0.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from dsfn.errors import ConfigError
from dsfn.migrate.ds_config.client_optimizer import client_optimizer
from dsfn.migrate.ds_config.report import KeyReport
from dsfn.migrate.ds_config.values import beta_pair, build, flag, number, section

_UNSUPPORTED_TYPES = ("OneBitAdam", "OneBitLamb", "ZeroOneAdam", "Lion", "MuAdam", "MuAdamW", "MuSGD",
                      "Adagrad", "CPUAdagrad")


def read_gradient_clipping(cfg: dict) -> float:
    """`gradient_clipping` (popped; DeepSpeed's default 1.0, 0 disables), a max norm >= 0."""
    clip = cfg.pop("gradient_clipping", 1.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip < 0:
        raise ConfigError(f"ds_config gradient_clipping={clip!r}: a max norm >= 0 (0 disables; DeepSpeed's "
                          "default is 1.0)")
    return clip


def _adam(kind: str, p: dict, lr_of: Callable, report: KeyReport) -> Any:
    """DeepSpeed's Adam / AdamW: `adamw` (Adam with adam_w_mode, its default) or `adam`."""
    from dsfn import optim
    low = kind.lower()
    torch_adam = flag("optimizer.params.torch_adam", p.pop("torch_adam", False))
    w_mode = low == "adamw" or flag("optimizer.params.adam_w_mode", p.pop("adam_w_mode", True))
    p.pop("adam_w_mode", None)
    p.pop("fp32_optimizer_states", None)
    p.pop("foreach", None)
    if not flag("optimizer.params.bias_correction", p.pop("bias_correction", True)):
        report.refuse("optimizer.params.bias_correction", "false: dsfn's Adam / AdamW follow torch.optim, which "
                      "always corrects the bias (only the first steps differ: by 1/(1 - beta^t)); remove the key "
                      "(dsfn.optim.lamb takes bias_correction=False)")
    lr = number("optimizer.params.lr", p.pop("lr", 1e-3))
    wd = number("optimizer.params.weight_decay", p.pop("weight_decay", 0.01 if (torch_adam and w_mode) else 0.0))
    kw = dict(betas=beta_pair("optimizer.params.betas", p.pop("betas", (0.9, 0.999))),
              eps=number("optimizer.params.eps", p.pop("eps", 1e-8)), weight_decay=wd,
              amsgrad=flag("optimizer.params.amsgrad", p.pop("amsgrad", False)))
    for k in p:
        report.refuse(f"optimizer.params.{k}", f"not a parameter of DeepSpeed's {kind}")
    return build("optimizer", optim.adamw if w_mode else optim.adam, lr_of(lr), **kw)


def _muon(p: dict, lr_of: Callable, scheduled: bool, model: Any, report: KeyReport) -> Any:
    """DeepSpeed's Muon: `muon` (per_head_muon reads the heads from the model's config)."""
    from dsfn import optim
    p.pop("adam_w_mode", None)
    lr = p.pop("lr", None)
    kw: dict = {}
    for src, dst in (("momentum", "momentum"), ("weight_decay", "weight_decay"), ("ns_method", "ns_method"),
                     ("betas", "adam_betas"), ("eps", "adam_eps")):
        if src in p:
            v = p.pop(src)
            key = f"optimizer.params.{src}"
            kw[dst] = beta_pair(key, v) if src == "betas" else v if src == "ns_method" else number(key, v)
    for k in ("muon_lr", "adam_lr"):
        if k in p:
            kw[k] = lr_of(number(f"optimizer.params.{k}", p.pop(k)))
    if flag("optimizer.params.per_head_muon", p.pop("per_head_muon", False)):
        conf = getattr(model, "config", None)
        heads = getattr(conf, "num_attention_heads", None)
        if heads is None:
            report.refuse("optimizer.params.per_head_muon", "needs from_ds_config(..., model=a Hugging Face model) "
                          "to read num_attention_heads")
        else:
            kw["num_heads"] = heads
            kw["num_kv_heads"] = getattr(conf, "num_key_value_heads", None) or heads
    for k in p:
        report.refuse(f"optimizer.params.{k}", "not a parameter of DeepSpeed's Muon")
    lr = number("optimizer.params.lr", lr) if lr is not None else None
    return build("optimizer", optim.muon, lr_of(lr) if lr is not None else (lr_of(0.02) if scheduled else None), **kw)


def _sgd(p: dict, lr_of: Callable, report: KeyReport) -> Any:
    """SGD: `sgd` with torch.optim.SGD's parameters."""
    from dsfn import optim
    lr = number("optimizer.params.lr", p.pop("lr", 1e-3))
    kw = {k: (flag if k == "nesterov" else number)(f"optimizer.params.{k}", p.pop(k))
          for k in ("momentum", "dampening", "nesterov", "weight_decay") if k in p}
    for k in p:
        report.refuse(f"optimizer.params.{k}", "not a parameter of torch.optim.SGD")
    return build("optimizer", optim.sgd, lr_of(lr), **kw)


def _lamb(p: dict, lr_of: Callable, report: KeyReport) -> Any:
    """DeepSpeed's Lamb (FusedLamb): `lamb`, with FusedLamb's parameters and defaults."""
    from dsfn import optim
    if flag("optimizer.params.amsgrad", p.pop("amsgrad", False)):
        report.refuse("optimizer.params.amsgrad", "true: DeepSpeed's FusedLamb does not support amsgrad either")
    lr = number("optimizer.params.lr", p.pop("lr", 1e-3))
    kw = dict(betas=beta_pair("optimizer.params.betas", p.pop("betas", (0.9, 0.999))),
              eps=number("optimizer.params.eps", p.pop("eps", 1e-8)),
              weight_decay=number("optimizer.params.weight_decay", p.pop("weight_decay", 0.0)),
              bias_correction=flag("optimizer.params.bias_correction", p.pop("bias_correction", True)),
              eps_inside_sqrt=flag("optimizer.params.eps_inside_sqrt", p.pop("eps_inside_sqrt", False)),
              max_coeff=number("optimizer.params.max_coeff", p.pop("max_coeff", 10.0)),
              min_coeff=number("optimizer.params.min_coeff", p.pop("min_coeff", 0.01)))
    for k in p:
        report.refuse(f"optimizer.params.{k}", "not a parameter of DeepSpeed's FusedLamb")
    return build("optimizer", optim.lamb, lr_of(lr), **kw)


def read_optimizer(block: Any, sched: Any, model: Any, report: KeyReport, client: Any = None,
                   auto: Any = None) -> Any:
    """dsfn's tx for the `optimizer` block, or for the client optimizer `client` (`tx=`:
    `client_optimizer`), its lr the `scheduler` block's schedule when one is given."""
    from dsfn import optim
    from dsfn.optim.schedules import from_config
    lr_of = lambda base: build("scheduler", from_config, sched, optimizer_lr=base) if sched else base  # noqa: E731
    if client is not None:
        if block is not None:
            raise ConfigError("from_ds_config(tx=...) with a ds_config 'optimizer' block: one optimizer, please. "
                              "DeepSpeed would silently use the client's (deepspeed.initialize: 'This overrides any "
                              "optimizer definition in the DeepSpeed json config') and accelerate refuses the pair "
                              "('You cannot specify an optimizer in the config file and in the code at the same "
                              "time'); drop the 'optimizer' block or the tx= argument")
        return client_optimizer(client, sched, lr_of, model, auto)
    if block is None:
        raise ConfigError("ds_config has no 'optimizer' block: the optimizer is the client's, as in "
                          "deepspeed.initialize(model, optimizer=...). Pass it: from_ds_config(config, tx=...) with a "
                          "dsfn optimizer, a torch.optim class, instance or factory, or tx='hf' for Hugging Face "
                          "Trainer's AdamW (with auto=hf_trainer_auto(args)); or add an 'optimizer' block")
    block = section("optimizer", block)
    kind = block.get("type", "")
    if not isinstance(kind, str):
        raise ConfigError(f"ds_config optimizer.type={kind!r}: a name such as 'AdamW'")
    p = section("optimizer.params", block.get("params"))
    if "max_grad_norm" in p:
        raise ConfigError("ds_config optimizer.params.max_grad_norm is not supported (DeepSpeed rejects it too): "
                          "use the top-level gradient_clipping")
    low = kind.lower()
    if low in ("adam", "adamw"):
        return _adam(kind, p, lr_of, report)
    if low == "muon":
        return _muon(p, lr_of, bool(sched), model, report)
    if low == "sgd":
        return _sgd(p, lr_of, report)
    if low == "lamb":
        return _lamb(p, lr_of, report)
    if low in ("onebitadam", "onebitlamb", "zerooneadam"):
        report.refuse("optimizer.type", f"{kind!r}: 1-bit Adam / 0/1 Adam / 1-bit Lamb compress the gradient "
                      "all-reduce (signs with error feedback, after a warm-up); dsfn has no compressed gradient "
                      "communication yet, so there is no equivalent: use 'AdamW' ('Lamb' for 1-bit Lamb), the same "
                      "update with full-precision reductions")
        return optim.adamw(1e-3)         # placeholder; the ConfigError listing follows
    if kind in _UNSUPPORTED_TYPES or not hasattr(torch.optim, kind):
        report.refuse("optimizer.type", f"{kind!r}: dsfn has AdamW, Adam, Lamb, Muon, SGD and elementwise "
                      "torch.optim optimizers (from_torch)")
        return optim.adamw(1e-3)         # placeholder; the ConfigError listing follows
    lr = number("optimizer.params.lr", p.pop("lr", 1e-3))
    return build("optimizer", optim.from_torch, getattr(torch.optim, kind), lr=lr_of(lr), **p)
