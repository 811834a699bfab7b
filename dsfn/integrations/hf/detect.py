"""Which modules of a model are Hugging Face's: `is_hf_model` (a transformers model),
`loss_modules` (the modules whose forward computes the model's own loss, looked for through
wrappers: peft, torch.compile, a user's nn.Module; cached per model) and `holds_hf_model`
(whether the adapter answers for a module).
"""
from __future__ import annotations

import contextlib
import inspect
import weakref
from typing import Any

from torch import nn

# attention implementations dsfn registers that take a whole sequence (after another's
# all-to-all) and apply every mask themselves: Ulysses passes such an outer one q, k, v and
# no mask (2-D sequence parallelism; "dsfn_ring" adds itself)
MASKS_ITSELF: set[str] = set()


def is_hf_model(module: Any) -> bool:
    cfg = getattr(module, "config", None)
    return isinstance(module, nn.Module) and hasattr(cfg, "_attn_implementation_internal")


def _defines_loss(module: nn.Module) -> bool:
    """Whether `module`'s class itself defines `loss_function` (a Hugging Face PreTrainedModel),
    rather than forwarding the attribute to a module it wraps (peft's `__getattr__`)."""
    return inspect.getattr_static(type(module), "loss_function", None) is not None


_LOSS_MODULES: "weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref, ...]]" = weakref.WeakKeyDictionary()


def loss_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that compute `model`'s own loss: the outermost modules of its tree (`model`
    included) whose class defines `loss_function` — the Hugging Face models whose forward
    calls `self.loss_function(...)`.

    Wrappers are looked through at any depth: peft's `PeftModelForCausalLM` -> `LoraModel` ->
    `LlamaForCausalLM` (peft forwards `loss_function` to the inner model by `__getattr__`, so
    setting it on the top changes nothing the inner forward reads), torch.compile's
    `OptimizedModule` (`_orig_mod`), a user's nn.Module holding an HF model. Modules inside a
    found one (its `model.model` backbone) are not looked at. Cached per model (weakly)."""
    got = _LOSS_MODULES.get(model) if isinstance(model, nn.Module) else None
    if got is not None and all(r() is not None for r in got):
        return [r() for r in got]
    found, seen, todo = [], set(), [model] if isinstance(model, nn.Module) else []
    while todo:
        m = todo.pop(0)
        if id(m) in seen:
            continue
        seen.add(id(m))
        if _defines_loss(m):
            found.append(m)
        else:
            todo.extend(m.children())
    if isinstance(model, nn.Module):
        _LOSS_MODULES[model] = tuple(weakref.ref(m) for m in found)
    return found


def holds_hf_model(module: Any) -> bool:
    """Whether `module` is a Hugging Face model or wraps one (peft, torch.compile, a user's
    nn.Module), or claims a `loss_function`: its own loss, attention and router are then
    handled as HF's (or refused when its loss cannot be found)."""
    return isinstance(module, nn.Module) and (is_hf_model(module) or bool(loss_modules(module))
                                              or getattr(module, "loss_function", None) is not None)


def attention_configs(model: Any, who: str) -> list:
    """The model's configs (its own and its sub-configs') that name an attention
    implementation; a ConfigError for chunked attention (Llama4's attention_chunk_size: tokens
    attend only inside their chunk), which dsfn's sequence-splitting attention does not build."""
    from dsfn.errors import ConfigError
    configs = [c for c in {id(m.config): m.config for m in model.modules()
                           if hasattr(getattr(m, "config", None), "_attn_implementation_internal")}.values()]
    chunked = [c for c in configs if getattr(c, "attention_chunk_size", None)
               and "chunked_attention" in (getattr(c, "layer_types", None) or ["chunked_attention"])]
    if chunked:
        raise ConfigError(f"{who}: {type(model).__name__} uses chunked attention (attention_chunk_size="
                          f"{chunked[0].attention_chunk_size}: tokens attend only within their chunk), which dsfn's "
                          f"{who} attention does not build over the whole sequence. Train it without {who} "
                          "(tensor_parallel and ZeRO work)")
    return configs


@contextlib.contextmanager
def attention_implementation(configs: list, name: str):
    """Every config of `configs` names attention implementation `name` inside the context."""
    before = [c._attn_implementation_internal for c in configs]
    try:
        for c in configs:
            c._attn_implementation_internal = name
        yield
    finally:
        for c, s in zip(configs, before):
            c._attn_implementation_internal = s
