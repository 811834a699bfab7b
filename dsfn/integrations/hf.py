"""Hugging Face transformers integration: Ulysses attention for HF models.

`ulysses_attention(model, axis)` is a context: while it is active the model's attention
implementation (`config._attn_implementation`) is "dsfn_ulysses", registered with
transformers' `AttentionInterface` (and a mask function that builds no mask: the causal
mask is over the whole sequence, which no rank's slice can describe; "dsfn_ulysses"
builds it after the all-to-all, over all T, with the layer's sliding window if any). "dsfn_ulysses"
turns q, k, v [B, H, T/sp, d] into [B, H/sp, T, d] (all-to-all over `axis`), calls the
model's own implementation — sdpa (causal flag), eager (an explicit causal mask; keeps
e.g. Gemma2's logit soft-capping), flash_attention_2/3 when installed — and turns the
output back. `dsfn.transforms.sequence_parallel` enters it around every forward, so an
HF model trains under sequence parallelism unchanged.

Supported inside "dsfn_ulysses": grouped-query attention whose key/value heads sp does
not divide (they are repeated by `kv_replication`'s factor in `repeat_kv`'s order, and the
module's `num_key_value_groups` is lowered to match while its own implementation runs);
sliding windows; packed rows (position_ids restarting at each document: all-gathered
once per forward, a block-diagonal causal mask over the whole sequence for eager/sdpa,
the whole position_ids for flash attention). Refused (ConfigError): a window or packed
documents with an implementation other than eager, sdpa or flash attention; query heads
sp does not divide (MeshError).

Also the model's own answers to the other transforms, reached through `HuggingFaceAdapter`
(`dsfn.adapters`): its causal-LM loss as the whole batch's token mean under data parallel
and accumulation (`token_mean_over`) and under sequence parallel (`own_loss`,
`sequence_loss`), its router balance over the whole batch (`global_router_balance`), and
its tensor-parallel plan (`tensor_parallel_plan`, for `tensor_parallel("auto")`).
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dsfn.adapters import SequenceSplit, micro_batch_counts, register_adapter
from dsfn.errors import ConfigError, ShapeError

NAME = "dsfn_ulysses"


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


def _causal_loss() -> Any:
    from transformers.loss.loss_utils import LOSS_MAPPING
    return LOSS_MAPPING["ForCausalLM"]


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, _ulysses_forward)
        AttentionMaskInterface.register(NAME, _no_mask)


def _no_mask(*args: Any, attention_mask: Any = None, **kwargs: Any) -> torch.Tensor | None:
    """The mask function of "dsfn_ulysses": no [T, T] mask (no rank's slice can describe the
    causal mask over the whole sequence; `_ulysses_forward` builds it after the all-to-all).
    When the batch has padding (the transform saw a 0 in the whole batch's attention_mask),
    this rank's slice of the 2-D padding mask [b, T/sp] is passed on for that."""
    ctx = _ACTIVE[-1] if _ACTIVE else None
    if ctx is None or not ctx.padded or not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        return None
    return attention_mask


def _inner_forward(module: nn.Module, impl: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    if impl in (None, "eager"):
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(impl, None)


class _Context:
    """One active `ulysses_attention`: the sp axis, the model's own implementation, the
    position_ids known to be consecutive (no documents: no all-gather needed), and the
    documents found per position_ids tensor this forward (one all-gather per tensor, kept
    for the recompute of a checkpointed layer)."""

    def __init__(self, axis: str, inner: str | None, consecutive: torch.Tensor | None, padded: bool = False):
        self.axis, self.inner, self.consecutive, self.padded = axis, inner, consecutive, padded
        self.documents: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = {}
        self.keys: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}      # padding masks gathered this forward


def _valid_keys(ctx: _Context, mask: torch.Tensor) -> torch.Tensor:
    """The whole sequence's padding mask [b, T] (True: a real token) from this rank's slice
    [b, T/sp], all-gathered over sp once per mask tensor (kept for a recompute)."""
    got = ctx.keys.get(id(mask))
    if got is not None and got[0] is mask:
        return got[1]
    from dsfn.runtime import collectives as C
    from dsfn.runtime.mesh import current_mesh
    n = current_mesh().size(ctx.axis)
    b, c = mask.shape
    full = C.all_gather(mask.to(torch.uint8).contiguous(), ctx.axis).reshape(n, b, c).permute(1, 0, 2)
    full = full.reshape(b, n * c).to(mask.device).bool()
    ctx.keys[id(mask)] = (mask, full)
    return full


_ACTIVE: list[_Context] = []   # innermost last


def _documents(ctx: _Context, position_ids: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the whole sequence's position_ids [b, T], document ids [b, T]) from this rank's slice
    [b, T/sp] (all-gathered over sp), or (None, None) when every row holds one document.
    A new document starts where a position is not its predecessor + 1 — HF's
    `find_packed_sequence_indices`, so packed rows (position_ids restarting at 0) are masked
    as the single-process model masks them."""
    if position_ids is None or position_ids is ctx.consecutive or position_ids.dim() not in (1, 2):
        return None, None
    got = ctx.documents.get(id(position_ids))
    if got is not None and got[0] is position_ids:
        return got[1], got[2]
    from dsfn.runtime import collectives as C
    from dsfn.runtime.mesh import current_mesh
    pos = position_ids if position_ids.dim() == 2 else position_ids[None]
    n = current_mesh().size(ctx.axis)
    b, c = pos.shape
    full = C.all_gather(pos.contiguous(), ctx.axis).reshape(n, b, c).permute(1, 0, 2).reshape(b, n * c)
    full = full.to(position_ids.device)
    diff = torch.diff(full, prepend=full[:, :1] - 1, dim=-1)
    docs = (diff != 1).cumsum(-1)
    if bool((docs[:, -1] == 0).all()):
        full, docs = None, None
    ctx.documents[id(position_ids)] = (position_ids, full, docs)
    return full, docs


def _ulysses_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF attention signature: q [B, H, T/sp, d], k/v [B, Hkv, T/sp, d] -> ([B, T/sp, H, d], None).

    Key/value heads fewer than sp (or not divisible by it) are first repeated by
    `kv_replication`'s factor f (in `repeat_kv`'s order), and the module's
    `num_key_value_groups` is H / (Hkv * f) while its own implementation runs."""
    from dsfn.runtime.mesh import current_mesh
    from dsfn.engines import ulysses
    ctx = _ACTIVE[-1]
    axis, impl = ctx.axis, ctx.inner
    n = current_mesh().size(axis)
    f = ulysses.kv_replication(query.shape[1], key.shape[1], n, type(module).__name__)
    key, value = ulysses.replicate_kv(key, f), ulysses.replicate_kv(value, f)
    full_positions, docs = _documents(ctx, kwargs.get("position_ids"))
    keys = (_valid_keys(ctx, attention_mask) if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
            else None)                                                       # [b, T]: padding (left, right, holes)
    q, k, v = (ulysses.seq_to_heads(t, axis) for t in (query, key, value))
    t = q.shape[2]
    mask = None
    window = kwargs.get("sliding_window")        # this layer's window (Mistral, Gemma2's sliding layers)
    windowed = window is not None and window < t
    flash = str(impl).startswith("flash_attention")
    if (windowed or docs is not None or keys is not None) and impl not in (None, "eager", "sdpa") and not flash:
        what = (f"a sliding window ({window})" if windowed else "packed documents (position_ids restarting)"
                if docs is not None else "padding (attention_mask with zeros)")
        raise ConfigError(f"sequence_parallel: {type(module).__name__} has {what} and attention implementation "
                          f"{impl!r}; dsfn's Ulysses attention builds that mask over the whole sequence for "
                          "'eager', 'sdpa' and flash attention only: load the model with one of those")
    if impl in (None, "eager") or (impl == "sdpa" and (windowed or docs is not None or keys is not None)):
        # the model's mask over the whole sequence: causal, within the window (HF's
        # sliding_window_overlay: kv > q - window) and within each document (HF's packed
        # sequence mask); eager adds it to the scores, sdpa takes it as a boolean mask.
        # (Flash attention gets sliding_window and the whole position_ids itself.)
        i = torch.arange(t, device=q.device)
        allowed = (i[None, :] <= i[:, None])[None]                                # [1, T, T]
        if windowed:
            allowed = allowed & (i[None, :] > i[:, None] - window)
        if docs is not None:
            allowed = allowed & (docs[:, :, None] == docs[:, None, :]).to(q.device)  # [b, T, T]
        if keys is not None:                     # HF's padding_mask_function: no query sees a pad key
            allowed = allowed & keys[:, None, :].to(q.device)
        if impl == "sdpa":
            mask = allowed[:, None]
        else:
            mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(
                ~allowed, torch.finfo(q.dtype).min)[:, None]
    drop = {"position_ids", "labels", "shift_labels", "num_items_in_batch"}
    if not flash:
        drop |= {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    kwargs = {k_: v_ for k_, v_ in kwargs.items() if k_ not in drop}
    if flash and docs is not None:
        kwargs["position_ids"] = full_positions          # flash attention's own varlen path, over all T
    if flash and keys is not None:
        mask = keys                                      # flash attention unpads by the 2-D mask itself
    groups = getattr(module, "num_key_value_groups", None)
    if f > 1 and isinstance(groups, int):
        module.num_key_value_groups = groups // f        # this rank's q heads per (replicated) kv head
    try:
        out, _ = _inner_forward(module, impl)(module, q, k, v, mask, **kwargs)  # [B, T, H/sp, d]
    finally:
        if f > 1 and isinstance(groups, int):
            module.num_key_value_groups = groups
    out = ulysses.heads_to_seq(out.transpose(1, 2).contiguous(), axis)                  # [B, H, T/sp, d]
    return out.transpose(1, 2), None


@contextlib.contextmanager
def ulysses_attention(model: nn.Module, axis: str, consecutive: torch.Tensor | None = None,
                      padded: bool = False) -> Iterator[None]:
    """Make `model` (and its sub-configs) use Ulysses attention over `axis` inside the context.
    `consecutive`: a position_ids tensor known to number every row's tokens consecutively
    (the transform's own), for which no documents are looked for. `padded`: the batch's
    attention_mask has zeros, so the model's padding mask is applied over the whole sequence."""
    _register()
    configs = [c for c in {id(m.config): m.config for m in model.modules()
                           if hasattr(getattr(m, "config", None), "_attn_implementation_internal")}.values()]
    chunked = [c for c in configs if getattr(c, "attention_chunk_size", None)
               and "chunked_attention" in (getattr(c, "layer_types", None) or ["chunked_attention"])]
    if chunked:
        raise ConfigError(f"sequence_parallel: {type(model).__name__} uses chunked attention "
                          f"(attention_chunk_size={chunked[0].attention_chunk_size}: tokens attend only within "
                          "their chunk), which dsfn's Ulysses attention does not build over the whole sequence; "
                          "it would attend across chunks. Train it without sequence_parallel (tensor_parallel and "
                          "ZeRO work)")
    saved = before = [c._attn_implementation_internal for c in configs]
    if _ACTIVE and all(s == NAME for s in saved):
        # Ulysses is installed already (an earlier forward of the same step, whose set-up lives
        # until backward: a pipeline's outstanding micro-batches): this forward's context wraps
        # what that one wraps, not Ulysses itself
        saved = [_ACTIVE[-1].inner] * len(configs)
    inner = {s if not isinstance(s, dict) else None for s in saved}
    if len(inner) != 1:
        raise ConfigError(f"sequence_parallel: the model's sub-configs use different attention implementations "
                          f"{saved}; Ulysses wraps one. Load the model with a single attn_implementation "
                          "(e.g. 'sdpa' for all parts)")
    _ACTIVE.append(_Context(axis, inner.pop(), consecutive, padded))
    try:
        for c in configs:
            c._attn_implementation_internal = NAME
        yield
    finally:
        for c, s in zip(configs, before):
            c._attn_implementation_internal = s
        _ACTIVE.pop()


def _labels_passed(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    if kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None:
        return True
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return bool(args)        # cannot tell: a positional argument may be the labels
    return bound.arguments.get("labels") is not None


class _WholeBatchLoss:
    """A model's `loss_function` while dsfn runs it: HF's `ForCausalLMLoss` divided by the
    valid targets of the whole batch — over the data-parallel `axes` (one all-reduce of a
    scalar) and, under accumulation, over every micro-batch (`dsfn.adapters.MicroBatchCounts`). Nested
    contexts add their axes to the one installed object."""

    def __init__(self, causal: Any, model: nn.Module):
        self.causal, self.model = causal, model
        self.axes: list[tuple[str, int]] = []
        self.calls = 0          # how often the model's forward called it (the proof it is the model's loss)

    def __call__(self, logits, labels=None, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                 shift_labels=None, **kw):
        self.calls += 1
        counts = micro_batch_counts()
        spread = [(a, size) for a, size in self.axes if size > 1]
        if num_items_in_batch is None and (labels is not None or shift_labels is not None) and (spread or counts):
            from dsfn.runtime import collectives as C

            def reduce(n):
                for a, _ in spread:
                    n = C.all_reduce(n, a, "sum")
                return n
            dp = 1
            for _, size in spread:
                dp *= size
            source = shift_labels if shift_labels is not None else labels
            target_of = (lambda t: t) if shift_labels is not None else (lambda t: t[..., 1:])
            if counts is not None:        # the whole batch's count, over every micro-batch
                num_items_in_batch = counts.num_items(source, target_of, ignore_index, reduce, dp, self.model)
            else:
                num_items_in_batch = reduce((target_of(source) != ignore_index).sum().to(torch.float64).reshape(1)) / dp
            num_items_in_batch = num_items_in_batch.reshape(()).to(logits.device, torch.float32)
        return self.causal(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                           ignore_index=ignore_index, shift_labels=shift_labels, **kw)


class _GlobalRouterBalance:
    """A mixture-of-experts model's `load_balancing_loss_func` (Switch Transformer's auxiliary
    loss, E * sum_i f_i * P_i: f_i the share of top-k assignments to expert i, P_i its mean
    router probability) over the *whole* batch while dsfn runs the model.

    HF's function computes f and P over the router logits it is given: under data or
    sequence parallelism, this rank's rows only. The loss is not linear in the rows, so the
    mean (dp) or sum (sp) of the ranks' losses is not the batch's: under sp it even counts
    the loss sp times. Here the assignment counts and row counts (no gradient) are summed
    over every axis in `sum_axes` (sp: the ranks' losses are summed) and `mean_axes` (dp:
    averaged), and this rank returns its share dp * E * sum_i f_i * (its probability sum_i /
    rows): summed over sp and averaged over dp that is the whole batch's loss, with the
    gradient of each rank's router probabilities. Same arithmetic as HF's (attention mask
    included). Under `accumulate` the loss of the whole batch would need every micro-batch's
    routing before the first backward: refused (ConfigError)."""

    def __init__(self, original: Any, model: nn.Module):
        self.original, self.model = original, model
        self.known = _switch_balance_loss(original)
        self.sum_axes: dict[str, int] = {}
        self.mean_axes: dict[str, int] = {}
        self.valid: torch.Tensor | None = None    # [T] positions that are tokens (sp's padding is not)

    def __call__(self, gate_logits, num_experts=None, top_k=2, attention_mask=None):
        if gate_logits is None or not isinstance(gate_logits, tuple) or not gate_logits:
            return self.original(gate_logits, num_experts, top_k, attention_mask)
        if micro_batch_counts() is not None:
            raise ConfigError(
                f"accumulate: {type(self.model).__name__} adds its router load-balancing loss "
                "(output_router_logits=True), which is not linear in the batch's rows: summed over "
                "micro-batches it is not the whole batch's loss, and the whole batch's routing is known only "
                "after every micro-batch ran. Use a larger batch per step without accumulate, or set "
                "output_router_logits=False and add an auxiliary loss of your own")
        axes = [(a, n) for a, n in {**self.sum_axes, **self.mean_axes}.items() if n > 1]
        if not axes:
            return self.original(gate_logits, num_experts, top_k, attention_mask)
        if not self.known:
            raise ConfigError(
                f"{type(self.model).__name__} adds a router load-balancing loss (output_router_logits=True) "
                f"computed by {type(self.model).__module__}.load_balancing_loss_func, whose arithmetic dsfn "
                f"does not know, over this rank's rows only: under {', '.join(a for a, _ in axes)} it would not be "
                "the whole batch's. Set output_router_logits=False (and add an auxiliary loss of your own), or "
                "train without data / sequence parallelism")
        from dsfn.runtime import collectives as C
        dev = gate_logits[0].device
        counts = torch.zeros(num_experts, dtype=torch.float32, device=dev)
        probs = torch.zeros(num_experts, dtype=torch.float32, device=dev)
        rows = torch.zeros((), dtype=torch.float32, device=dev)
        mask = attention_mask.reshape(-1).to(dev, torch.float32) if attention_mask is not None else None
        if mask is None and self.valid is not None:     # rows are [batch, T] row-major
            t = self.valid.numel()
            mask = self.valid.to(dev, torch.float32).expand(gate_logits[0].shape[0] // t, t).reshape(-1)
        for layer in gate_logits:
            weights = torch.nn.functional.softmax(layer.to(dev), dim=-1)
            _, chosen = torch.topk(weights, top_k, dim=-1)
            each = (mask.repeat_interleave(top_k) if mask is not None
                    else torch.ones(chosen.numel(), dtype=torch.float32, device=dev))
            counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen.reshape(-1), each)
            w = weights.float() if mask is None else weights.float() * mask.unsqueeze(-1)
            probs = probs + w.sum(dim=0)
            rows = rows + (mask.sum() if mask is not None else weights.shape[0])
        stats = torch.cat([counts, rows.reshape(1)]).detach()
        for a, _ in axes:
            stats = C.all_reduce(stats, a, "sum")
        dp = 1
        for n in self.mean_axes.values():
            dp *= n
        total = stats[-1]
        return torch.sum((stats[:-1] / total) * (probs / total)) * (num_experts * dp)


_KNOWN_BALANCE: dict[Any, bool] = {}


def _switch_balance_loss(fn: Any) -> bool:
    """Whether `fn` is HF's Mixtral-style `load_balancing_loss_func(gate_logits, num_experts,
    top_k, attention_mask)` (Mixtral, Qwen2/3-MoE, OLMoE, ... : softmax router, top-k
    assignment shares times mean probabilities), which `_GlobalRouterBalance` reproduces;
    other routers (product keys, Switch's router_probs) are not."""
    if fn not in _KNOWN_BALANCE:
        try:
            names = list(inspect.signature(fn).parameters)
            source = inspect.getsource(fn)
        except (TypeError, ValueError, OSError):
            names, source = [], ""
        _KNOWN_BALANCE[fn] = (names == ["gate_logits", "num_experts", "top_k", "attention_mask"]
                              and "tokens_per_expert" in source and "router_prob" in source
                              and "num_keys" not in source)
    return _KNOWN_BALANCE[fn]


@contextlib.contextmanager
def global_router_balance(model: nn.Module, sum_axes: list[str], mean_axes: list[str],
                          valid: torch.Tensor | None = None) -> Iterator[None]:
    """While the model runs: its module's `load_balancing_loss_func` (when it has one: Mixtral,
    Qwen2-MoE, ...) is the whole batch's over `sum_axes` (summed, sp) and `mean_axes`
    (averaged, dp); see `_GlobalRouterBalance`. Nested contexts add their axes. `valid`
    ([T] bool, this rank's positions): which are tokens, when the model gets no attention
    mask (sequence parallel's padding to a multiple of sp)."""
    from dsfn.runtime.mesh import current_mesh
    home = fn = None
    for m in loss_modules(model) or [model]:        # a wrapped model's (peft): the inner model's module
        home = sys.modules.get(type(m).__module__)
        fn = getattr(home, "load_balancing_loss_func", None)
        if callable(fn):
            model = m
            break
    if not callable(fn):
        yield
        return
    mesh = current_mesh()
    installed = fn if isinstance(fn, _GlobalRouterBalance) else _GlobalRouterBalance(fn, model)
    added = []
    for axes, into in ((sum_axes, installed.sum_axes), (mean_axes, installed.mean_axes)):
        for a in axes:
            if a not in into:
                into[a] = mesh.size(a)
                added.append((into, a))
    before = installed.valid
    if valid is not None:
        installed.valid = valid
    home.load_balancing_loss_func = installed
    try:
        yield
    finally:
        installed.valid = before
        for into, a in added:
            del into[a]
        if installed is not fn:
            home.load_balancing_loss_func = fn


@contextlib.contextmanager
def token_mean_over(model: nn.Module, axes: list[str], args: tuple, kwargs: dict) -> Iterator[None]:
    """`_token_mean_over`, and the router load-balancing loss of a mixture-of-experts model over
    the whole batch (`global_router_balance`, the axes averaged)."""
    with global_router_balance(model, [], axes), _token_mean_over(model, axes, args, kwargs):
        yield


@contextlib.contextmanager
def _token_mean_over(model: nn.Module, axes: list[str], args: tuple, kwargs: dict) -> Iterator[None]:
    """Data parallelism and accumulation for a Hugging Face causal LM's own loss (`labels=` /
    `shift_labels=`): while the model runs, the `loss_function` of the module that computes it
    (`loss_modules`: the model itself, or the HF model inside peft, torch.compile or a user's
    wrapper; never a wrapper's attribute the inner forward does not read) gets `num_items_in_batch` =
    the valid targets of the whole batch over the dp `axes` / dp (one all-reduce of a scalar),
    so this rank's loss is dp * (its sum) / (the global count) and the dp average of the
    gradients is the gradient of the global token mean — the single-process loss of the
    whole batch, whatever each rank's share of ignored labels (padding, prompts). Without it
    each rank takes its own mean and dp averages the means (DDP's result; HF Trainer's
    `average_tokens_across_devices` fixes the same). Under `accumulate` (`axes` may be
    empty) the count spans every micro-batch (`dsfn.adapters.MicroBatchCounts`). Nothing changes
    when the caller passes `num_items_in_batch`, when the model's loss is not HF's
    causal-LM loss, or when sequence parallel already normalises it. A model given labels whose
    forward then calls none of those `loss_function`s (or that has one and no module of its tree
    defines it) is refused (ConfigError): its loss would be a per-rank mean."""
    from dsfn.runtime.mesh import current_mesh
    spread = [(a, current_mesh().size(a)) for a in axes]
    labelled = _labels_passed(model, args, kwargs)
    mods = loss_modules(model)
    if not mods:
        if labelled and getattr(model, "loss_function", None) is not None:
            raise ConfigError(_unfound(model, "it has a loss_function but no module of its tree defines one"))
        yield
        return
    causal = _causal_loss()
    losses, new = [], []
    for m in mods:
        own = m.__dict__.get("_loss_function")
        if isinstance(own, _WholeBatchLoss):          # nested (accumulate and data parallel): one loss, all axes
            pass
        elif own is None and m.loss_function is causal:
            own = _WholeBatchLoss(causal, m)
            m._loss_function = own
            new.append(m)
        else:                                         # the user's own loss_function, or sequence parallel's
            continue
        own.axes.extend(spread)
        losses.append(own)
    before = sum(loss.calls for loss in losses)
    try:
        yield
        if labelled and losses:
            _check_called(model, mods, sum(loss.calls for loss in losses) - before)
    finally:
        for loss in losses:
            del loss.axes[len(loss.axes) - len(spread):]
        for m in new:
            del m._loss_function


def _unfound(model: nn.Module, why: str) -> str:
    return (f"{type(model).__name__} was given labels, and dsfn cannot find the module that computes its own "
            f"loss ({why}), so it cannot make that loss the whole batch's token mean: it would be each rank's "
            "(or micro-batch's) own mean. Compute the loss in the train step from the logits instead, or pass "
            "num_items_in_batch= (the whole batch's count of valid targets / the data-parallel size) yourself")


def _check_called(model: nn.Module, mods: list[nn.Module], calls: int) -> None:
    """The proof that the loss dsfn normalised is the model's: labels were given, so one of the
    modules that define it (`mods`) must have called its `loss_function`."""
    if not calls:
        names = ", ".join(type(m).__name__ for m in mods)
        raise ConfigError(_unfound(model, f"the forward did not call the loss_function of {names}"))


def sequence_loss(split: SequenceSplit, inner: Any, module: nn.Module) -> Any:
    """A model's `loss_function` while it runs under sp (`split`: what sequence_parallel tells
    of this step's batch): HF's ForCausalLMLoss (`inner`) given the labels shifted over the
    whole sequence (`shift_labels`, so it does not shift inside the slice) and
    `num_items_in_batch` = the valid targets of the whole sp x dp batch / dp, so this rank's
    loss is dp * (its sum) / (the global count): summed over sp and averaged over dp (by the
    data-parallel transforms inside) it is the global token mean. Under `accumulate` the count
    spans every micro-batch of the step (`dsfn.adapters.MicroBatchCounts`)."""
    from dsfn.runtime import collectives as C
    from dsfn.runtime.mesh import current_mesh
    axis = split.axis

    def loss(logits, labels=None, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
             shift_labels=None, **kw):
        given = shift_labels if shift_labels is not None else labels     # as the model got them
        labels = split.original(labels)
        shift_labels = split.original(shift_labels)
        c = logits.shape[1] if logits.dim() >= 2 else None
        if shift_labels is not None:
            if not split.batch_shifted:
                raise ConfigError(
                    f"sequence_parallel: {type(module).__name__} got shift_labels=, but the batch had none "
                    "before it was split over sp (sequence_parallel(shift_labels=False) and no "
                    "'shift_labels' key), so these labels were shifted inside this rank's slice and the "
                    "target of its last token is lost. Pass only labels= (the transform shifts them over the "
                    "whole sequence), or use sequence_parallel(shift_labels=True) and pass "
                    "shift_labels=batch['shift_labels']")
            target = shift_labels
        elif labels is not None:
            target = _shift_over_sp(split, labels, ignore_index, module)
        else:
            return inner(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                         ignore_index=ignore_index, shift_labels=shift_labels, **kw)
        if target.dim() != 2 or target.shape[1] != split.local_len or c != split.local_len:
            raise ShapeError(
                f"sequence_parallel: {type(module).__name__}'s loss got labels of shape {tuple(target.shape)} "
                f"and logits of shape {tuple(logits.shape)}; under sp both must cover this rank's slice "
                f"[batch, {split.local_len}] of the batch's sequences (pass the batch's labels, or tensors "
                "made from its slices; no logits_to_keep)")
        target = target.contiguous()

        def reduce(n):
            n = C.all_reduce(n.reshape(1), axis, "sum")
            for ax in split.dp_axes:
                n = C.all_reduce(n, ax, "sum")
            return n.reshape(())
        dp = 1
        for ax in split.dp_axes:
            dp *= current_mesh().size(ax)
        counts = micro_batch_counts()
        if num_items_in_batch is None and counts is not None:
            # under accumulate: the valid targets of the whole batch, every micro-batch's
            # (`dsfn.adapters.MicroBatchCounts`), / dp / the number of micro-batches
            shifted = shift_labels is not None
            items = counts.num_items(
                given if counts.whole_of.get(id(given)) is not None else (shift_labels if shifted else labels),
                (lambda t: t) if shifted else (lambda t: _shift_over_sp(split, t, ignore_index, module)),
                ignore_index, reduce, dp, module)
        elif num_items_in_batch is None:
            items = reduce((target != ignore_index).sum().to(torch.float64)) / dp
        else:       # the caller's count of the whole batch (e.g. over accumulated micro-batches)
            items = torch.as_tensor(num_items_in_batch, dtype=torch.float64) / dp
        items = items.to(logits.device, torch.float32)      # the loss stays fp32 (HF upcasts logits)
        if not split.in_grad:
            # outside a gradient (evaluation): the value of the whole sp group (averaged over dp
            # by the metrics of data-parallel transforms), not differentiable
            with torch.no_grad():
                part = inner(logits, None, vocab_size, num_items_in_batch=items,
                             ignore_index=ignore_index, shift_labels=target, **kw)
                return C.all_reduce(part.detach().reshape(1), axis, "sum").reshape(())
        split.normalised()
        return inner(logits, None, vocab_size, num_items_in_batch=items,
                     ignore_index=ignore_index, shift_labels=target, **kw)
    return loss


def _shift_over_sp(split: SequenceSplit, labels: torch.Tensor, ignore_index: int, module: nn.Module) -> torch.Tensor:
    """labels [B, T/sp] (this rank's slice) -> the next token's label of every position, over
    the whole sequence: the last one is the next rank's first (ignore_index on the last rank)."""
    from dsfn.runtime import collectives as C
    from dsfn.runtime.mesh import current_mesh
    if labels.dim() != 2 or labels.shape[1] != split.local_len:
        raise ShapeError(f"sequence_parallel: {type(module).__name__} got labels of shape {tuple(labels.shape)}; "
                         f"under sp they must be this rank's slice [batch, {split.local_len}] of the batch's "
                         "sequences, which the transform shifts over the whole sequence")
    mesh = current_mesh()
    n, r = mesh.size(split.axis), mesh.local_rank(split.axis)
    firsts = C.all_gather(labels[:, :1].contiguous(), split.axis).reshape(n, labels.shape[0], 1)
    nxt = firsts[r + 1] if r + 1 < n else labels.new_full((labels.shape[0], 1), ignore_index)
    out = torch.cat([labels[:, 1:], nxt.to(labels.device, labels.dtype)], dim=1)
    # targets in the padding (labels made from the padded input_ids) are not the batch's
    c = split.local_len
    pos = torch.arange(r * c + 1, (r + 1) * c + 1, device=out.device)
    return out.masked_fill((pos >= split.real_len)[None], ignore_index)


@contextlib.contextmanager
def own_loss(model: nn.Module, split: SequenceSplit, args: tuple, kwargs: dict) -> Iterator[None]:
    """While the model runs under sequence parallelism, the `loss_function` of each module that
    computes its loss (`loss_modules`: the model itself, or the HF model inside peft / a wrapper)
    is `sequence_loss(split, inner, module)` (labels shifted over the whole sequence, normalised
    over the group; `split`: what dsfn.transforms.sequence_parallel tells of this step's
    batch), where `inner` is HF's `ForCausalLMLoss`. A model
    given labels whose loss is anything else, that holds no such module, or that computes its
    loss without `loss_function`, is an error: its loss would be over this rank's slice only."""
    labelled = _labels_passed(model, args, kwargs)
    causal = _causal_loss()
    name = type(model).__name__
    mods = loss_modules(model)
    if labelled and not mods:
        raise ConfigError(f"sequence_parallel: {name} was given labels but no module of it defines a loss_function "
                          "(a Hugging Face model's), so dsfn cannot shift them over the whole sequence: its loss "
                          "would be over this rank's slice only. Compute the loss in the train step from the logits "
                          "instead (the transform weights it by token count)")
    targets = []
    for m in mods:
        current = getattr(m, "loss_function", None)
        if current is causal:
            targets.append(m)
        elif labelled:
            whose = "its" if m is model else f"the wrapped {type(m).__name__}'s"
            raise ConfigError(f"sequence_parallel: {name} was given labels and {whose} loss_function is "
                              f"{getattr(current, '__name__', current)!r}; under sequence "
                              "parallelism dsfn can make only HF's causal-LM loss (ForCausalLMLoss) exact over the "
                              "whole sequence. Compute the loss in the train step from the logits instead (the "
                              "transform weights it by token count)")
    calls = []

    def installed(m: nn.Module) -> Any:
        def loss(*a: Any, **k: Any) -> torch.Tensor:
            calls.append(1)
            return sequence_loss(split, causal, m)(*a, **k)
        return loss
    saved = [(m, "_loss_function" in m.__dict__, m.__dict__.get("_loss_function")) for m in targets]
    for m in targets:
        m._loss_function = installed(m)
    try:
        yield
    finally:
        for m, had, before in saved:
            if had:
                m._loss_function = before
            else:
                del m._loss_function
    if labelled and not calls:
        if kwargs.get("shift_labels") is not None and kwargs.get("labels") is None:
            # HF's causal LMs compute a loss only `if labels is not None`; shift_labels= alone is ignored
            raise ConfigError(f"sequence_parallel: {name} was given shift_labels= without labels=, and a Hugging "
                              "Face causal LM computes its loss only when labels= is given (its .loss is None). "
                              "Pass both: model(input_ids=..., labels=batch['labels'], "
                              "shift_labels=batch['shift_labels']) under sequence_parallel(shift_labels=True), "
                              "or labels= alone (the transform then shifts them over the whole sequence)")
        raise ConfigError(f"sequence_parallel: {name} was given labels but did not compute its loss with the "
                          f"loss_function of {', '.join(type(m).__name__ for m in mods)}, so dsfn cannot shift them "
                          "over the whole sequence: its loss would be over this rank's slice only. Compute the "
                          "loss in the train step from the logits instead")


def tensor_parallel_plan(module: nn.Module) -> dict[str, str]:
    """A Hugging Face model's full tp plan ({module pattern: HF style}), or {}: its `_tp_plan`,
    else its config's `base_model_tp_plan` under the base model's prefix."""
    plan = getattr(module, "_tp_plan", None) or {}
    if not plan:
        cfg = getattr(module, "config", None)
        plan = dict(getattr(cfg, "base_model_tp_plan", None) or {})
        prefix = getattr(module, "base_model_prefix", "")
        base = getattr(module, prefix, None) if prefix else None
        if plan and isinstance(base, nn.Module) and base is not module:
            plan = {f"{prefix}.{k}": v for k, v in plan.items()}
    return dict(plan)


class HuggingFaceAdapter:
    """Hugging Face's answers to the transforms (`dsfn.adapters.ModelAdapter`): the module
    functions above, looked up when called (so a test can replace one)."""

    def holds(self, module: Any) -> bool:
        return holds_hf_model(module)

    def token_mean_over(self, module, axes, args, kwargs):
        return token_mean_over(module, axes, args, kwargs)

    def own_loss(self, module, split, args, kwargs):
        return own_loss(module, split, args, kwargs)

    def global_router_balance(self, module, sum_axes, mean_axes, valid=None):
        return global_router_balance(module, sum_axes, mean_axes, valid)

    def sequence_attention(self, module, axis, consecutive=None, padded=False):
        return ulysses_attention(module, axis, consecutive, padded)

    def loss_modules(self, module):
        return loss_modules(module)

    def tensor_parallel_plan(self, module):
        return tensor_parallel_plan(module)


register_adapter(HuggingFaceAdapter())
