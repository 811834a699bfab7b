"""Functional models and gradients.

`functionalize(module) -> (apply_fn, params)`:
- `params` is a `dict[str, Tensor]` of the *trainable* parameters, keyed by their
  dotted names. Tied parameters (e.g. HF `tie_word_embeddings`) appear once, under the
  first name `named_parameters()` gives; `apply_fn` feeds that tensor to every tied
  place. The tensors share storage with the module's (no copy).
- Frozen parameters (`requires_grad=False`) and buffers are *constants*: they stay out
  of `params` (and so out of the optimizer) and are held by `apply_fn.constants`
  (dict name -> tensor), which `apply_fn` passes to the module on every call.
- `apply_fn(params, *args, **kwargs)` runs the module's forward with those tensors; the
  module's own tensors are not used, so it is pure as long as forward is.

`value_and_grad(fn, has_aux=False)` is a primitive (see dsfn.transforms.core): by default
it runs torch.autograd on this process; transforms such as data parallel or ZeRO
change how gradients are computed and reduced.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from dsfn import tree
from dsfn.errors import LeafTypeError
from dsfn.effects import bind


class ApplyFn:
    """`apply_fn(params, *args, **kwargs)` for a functionalized module."""

    def __init__(self, module: nn.Module, constants: dict[str, torch.Tensor], param_names: tuple[str, ...]):
        self.module = module
        self.constants = constants
        self.param_names = param_names

    def __call__(self, params: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        """A primitive ("apply_module"): ZeRO-3 gathers sharded parameters unit by unit."""
        if not isinstance(params, dict):
            raise LeafTypeError(f"apply_fn expects the params dict from functionalize, got {type(params).__name__}")
        missing = [n for n in self.param_names if n not in params]
        if missing:
            raise LeafTypeError(f"apply_fn: params lack {missing[:5]}{'...' if len(missing) > 5 else ''}; pass the "
                                "dict returned by functionalize (or a tree of the same structure)")
        return bind("apply_module", call_module, self, params, args, kwargs)


def call_module(apply_fn: ApplyFn, params: dict[str, torch.Tensor], args: tuple, kwargs: dict) -> Any:
    """The default meaning of "apply_module": the module's forward with these tensors."""
    for name, x in params.items():
        if not isinstance(x, torch.Tensor):
            raise LeafTypeError(f"apply_fn: params[{name!r}] is a {type(x).__name__}, not a tensor. Sharded "
                                "parameters (Placed) can only be used inside the Step whose transforms placed them")
    return torch.func.functional_call(apply_fn.module, {**apply_fn.constants, **params}, args, kwargs,
                                      tie_weights=True, strict=False)


def functionalize(module: nn.Module, release: bool = False) -> tuple[ApplyFn, dict[str, torch.Tensor]]:
    """Split `module` into a pure `apply_fn` and its trainable `params` (see module docstring).

    `release=True` empties the module's own trainable parameters (`p.data` becomes a
    0-element tensor; the returned `params` keep the storage), so the module holds no
    second copy once the first update makes new tensors. The module then only works
    through `apply_fn`.
    """
    if not isinstance(module, nn.Module):
        raise LeafTypeError(f"functionalize expects a torch.nn.Module, got {type(module).__name__}")
    params, constants = {}, {}
    for name, p in module.named_parameters(remove_duplicate=True):
        (params if p.requires_grad else constants)[name] = p.detach()
    for name, b in module.named_buffers(remove_duplicate=True):
        constants[name] = b.detach()
    if release:
        for p in module.parameters():
            if p.requires_grad:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return ApplyFn(module, constants, tuple(params)), params


def value_and_grad(fn: Callable[..., Any], has_aux: bool = False) -> Callable[..., Any]:
    """`value_and_grad(fn)(params, *args, **kwargs) -> (value, grads)`.

    `fn(params, ...)` returns a 0-dim floating tensor (or `(value, aux)` with `has_aux`);
    `grads` has the structure of `params` (zeros where a leaf did not affect the value).
    The value (and aux tensors) come back detached.
    """
    def wrapped(params: Any, *args: Any, **kwargs: Any):
        return bind("value_and_grad", autograd_value_and_grad, fn, params, args, kwargs, has_aux)
    wrapped.__name__ = f"value_and_grad({getattr(fn, '__name__', 'fn')})"
    return wrapped


def autograd_value_and_grad(fn: Callable[..., Any], params: Any, args: tuple, kwargs: dict,
                            has_aux: bool) -> tuple[Any, Any]:
    """The default meaning of the value_and_grad primitive: torch.autograd on this process."""
    leaves, spec = tree.flatten(params)
    for (path, x) in tree.leaves_with_path(params):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            kind = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise LeafTypeError(f"value_and_grad differentiates floating-point tensor leaves; params leaf "
                                f"{path or '<root>'!r} is {kind}. Keep integer tensors and constants out of "
                                "the differentiated argument")
    with torch.enable_grad():
        inputs = [x.detach().requires_grad_(True) for x in leaves]
        out = fn(tree.unflatten(spec, inputs), *args, **kwargs)
        value, aux = out if has_aux else (out, None)
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
            raise LeafTypeError("the function given to value_and_grad must return a scalar floating tensor"
                                f"{' as the first element of (value, aux)' if has_aux else ''}; got "
                                f"{type(value).__name__}{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}")
        grads = torch.autograd.grad(value.reshape(()), inputs, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]
    value = value.detach().reshape(())
    if has_aux:
        aux = tree.map(lambda a: a.detach() if isinstance(a, torch.Tensor) else a, aux)
        return (value, aux), tree.unflatten(spec, grads)
    return value, tree.unflatten(spec, grads)
