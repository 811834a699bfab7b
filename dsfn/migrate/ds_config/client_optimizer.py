"""A client optimizer (`deepspeed.initialize(model, optimizer=...)`) as dsfn's tx:
`from_ds_config(config, tx=...)`, for the configs that leave the optimizer to the client
(every HF Trainer, accelerate, axolotl and LLaMA-Factory config has no `optimizer` block).

`tx` is one of:
- a dsfn optimizer (a `GradientTransformation`): used as it is. Its learning rate is fixed
  inside it, so a config `scheduler` block cannot drive it: that pair is refused, naming how
  to give the schedule (`dsfn.optim.schedules.from_config(config["scheduler"], ...)` as its lr);
- a `torch.optim.Optimizer` subclass, an instance (its hyper-parameters, one set for every
  param group), or a callable `f(params) -> Optimizer` (DeepSpeed's "client callable"):
  `dsfn.optim.from_torch` of its class and hyper-parameters (elementwise optimizers only),
  its learning rate the config's `scheduler` when there is one (DeepSpeed's schedulers set
  the client optimizer's lr; without one, the optimizer's own lr);
- `"hf"`: what Hugging Face Trainer builds when the config has no optimizer: torch's AdamW
  with TrainingArguments' lr, betas, eps and weight decay (the `auto=hf_trainer_auto(args)`
  values), no weight decay on biases and norms (`Trainer.get_decay_parameter_names`, which
  needs `model=`).

A config `optimizer` block together with `tx=` is refused: DeepSpeed would silently take
the client's ("This overrides any optimizer definition in the DeepSpeed json config") and
accelerate refuses the pair ("You cannot specify an optimizer in the config file and in the
code at the same time").
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

import torch

from dsfn.errors import ConfigError
from dsfn.migrate.ds_config.values import build

__all__ = ["client_optimizer"]

# an optimizer's defaults that say how torch runs it, not what it computes
_RUNTIME_KEYS = ("params", "foreach", "fused", "capturable", "differentiable", "initial_lr")


def client_optimizer(tx: Any, sched: Any, lr_of: Callable[[float], Any], model: Any,
                     auto: Mapping[str, Any] | None) -> Any:
    """dsfn's tx for the client optimizer `tx` (module docstring); `lr_of(base)` is the
    scheduler block's schedule for a base lr (the base itself without a scheduler)."""
    from dsfn import optim
    if isinstance(tx, optim.GradientTransformation):
        if sched:
            raise ConfigError("from_ds_config(tx=<a dsfn optimizer>) with a ds_config 'scheduler' block: the dsfn "
                              "optimizer's lr is fixed inside it, so the scheduler cannot drive it. Give the schedule "
                              "as its lr (tx=dsfn.optim.adamw(dsfn.optim.schedules.from_config(config['scheduler'], "
                              "optimizer_lr=3e-4), ...)) and drop the block, or pass tx as a torch.optim class, "
                              "instance or factory")
        return tx
    if isinstance(tx, str):
        if tx != "hf":
            raise ConfigError(f"from_ds_config(tx={tx!r}): the one named client optimizer is 'hf' (Hugging Face "
                              "Trainer's AdamW from auto=hf_trainer_auto(args)); else pass a dsfn optimizer or a "
                              "torch.optim class, instance or factory")
        return _hf_trainer_adamw(lr_of, model, auto)
    cls, hyper = _torch_optimizer(tx)
    lr = hyper.pop("lr", None)
    lr = float(lr) if lr is not None else _default_lr(cls)
    return build("client optimizer", optim.from_torch, cls, lr=lr_of(lr), **hyper)


def _torch_optimizer(tx: Any) -> tuple[type, dict]:
    """(the torch optimizer class, its hyper-parameters) of a class, an instance or a factory."""
    if isinstance(tx, type) and issubclass(tx, torch.optim.Optimizer):
        return tx, {}
    if not isinstance(tx, torch.optim.Optimizer):
        if not callable(tx):
            raise ConfigError(f"from_ds_config(tx={tx!r}): a dsfn optimizer, a torch.optim.Optimizer class or "
                              "instance, a factory f(params) -> Optimizer, or 'hf'")
        made = tx([torch.nn.Parameter(torch.zeros(1))])        # DeepSpeed calls it on the model's parameters
        if not isinstance(made, torch.optim.Optimizer):
            raise ConfigError(f"from_ds_config(tx=...): the factory returned a {type(made).__name__}, not a "
                              "torch.optim.Optimizer")
        tx = made
    groups = [{k: v for k, v in g.items() if k not in _RUNTIME_KEYS} for g in tx.param_groups]
    if any(g != groups[0] for g in groups[1:]):
        raise ConfigError(f"from_ds_config(tx=<{type(tx).__name__} with {len(groups)} param groups of different "
                          "settings>): dsfn's tx is one optimizer over the parameter tree; build the groups with "
                          "dsfn.optim.partition({label: optimizer}, labels) and pass that as tx")
    # what the class's constructor takes (a subclass's defaults may hold its base's extras:
    # AdamW's hold Adam's decoupled_weight_decay, which AdamW's __init__ does not take)
    cls = type(tx)
    accepted = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    hyper = {k: (float(v) if isinstance(v, torch.Tensor) and v.numel() == 1 else v) for k, v in groups[0].items()
             if takes_any or k in accepted}
    return cls, hyper


def _default_lr(cls: type) -> float:
    p = inspect.signature(cls.__init__).parameters.get("lr")
    default = p.default if p is not None else inspect.Parameter.empty
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return float(default)
    raise ConfigError(f"from_ds_config(tx={cls.__name__}): the class has no default lr; pass an instance or a "
                      f"factory with the lr set (functools.partial({cls.__name__}, lr=...))")


def _hf_trainer_adamw(lr_of: Callable[[float], Any], model: Any, auto: Mapping[str, Any] | None) -> Any:
    """Hugging Face Trainer's default optimizer (adamw_torch) over `model`'s parameters."""
    from dsfn import optim
    auto = dict(auto or {})
    if "optimizer.params.lr" not in auto:
        raise ConfigError("from_ds_config(tx='hf') takes the Trainer's AdamW settings from "
                          "auto=hf_trainer_auto(training_args); pass it")
    if model is None:
        raise ConfigError("from_ds_config(tx='hf') needs model=: the Trainer decays every weight but biases and "
                          "norms, which it finds on the model")
    from transformers import Trainer
    decay = set(Trainer.get_decay_parameter_names(None, model))
    lr = lr_of(float(auto["optimizer.params.lr"]))
    betas = tuple(auto.get("optimizer.params.betas", (0.9, 0.999)))
    eps, wd = float(auto.get("optimizer.params.eps", 1e-8)), float(auto.get("optimizer.params.weight_decay", 0.0))
    adamw = lambda w: build("client optimizer", optim.from_torch, torch.optim.AdamW, lr=lr,  # noqa: E731
                            betas=betas, eps=eps, weight_decay=w)
    if not wd or all(n in decay for n, _ in model.named_parameters()):
        return adamw(wd)
    return optim.partition({"decay": adamw(wd), "no_decay": adamw(0.0)},
                           lambda path, x: "decay" if path in decay else "no_decay")
