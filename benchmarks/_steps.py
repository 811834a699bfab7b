"""Shared by the parallelism benchmarks: timed steps, one step's collectives split into
forward and backward, and the DDP / FSDP2 baseline.

`mark` is a dict the benchmark's loss function writes to: when `mark["on"]` it stores
`mark["fwd"] = collectives.counters.snapshot()` at the end of the forward, so the
collectives counted up to there are the forward's.
"""
from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from dsfn.runtime import collectives as C


def timed_steps(step: Any, state: Any, batches: list, warmup: int) -> tuple[Any, list, list, list]:
    """Run every batch (a barrier before each); returns (state, wall s, process CPU s of the
    steps after `warmup`, every step's loss)."""
    times, cpu, losses = [], [], []
    for i, b in enumerate(batches):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        state, m = step(state, b)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        losses.append(float(m["loss"]))
    return state, times, cpu, losses


def explained_step(step: Any, state: Any, batch: Any, mark: dict) -> tuple[Any, dict]:
    """`step.explain` of one more (dropped) step and its collectives per "axis/op":
    {"calls", "bytes", "fwd_calls", "fwd_bytes"}."""
    before = C.counters.snapshot()
    mark["on"] = True
    ex = step.explain(state, batch)
    mark["on"] = False
    fwd = {k: (v.calls - (before[k].calls if k in before else 0), v.bytes - (before[k].bytes if k in before else 0))
           for k, v in mark.get("fwd", {}).items()}
    comm = {}
    for (axis, op), (calls, nbytes) in ex.collectives.items():
        fc, fb = fwd.get((axis, op), (0, 0))
        comm[f"{axis}/{op}"] = {"calls": calls, "bytes": nbytes, "fwd_calls": fc, "fwd_bytes": fb}
    return ex, comm


MODEL_KEYS = ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")


def add_llama_args(ap: Any) -> None:
    """The small HF Llama's shape flags (shared by the parallelism benchmarks)."""
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=None, help="default: 8/3 * hidden, rounded up to 16 (688)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)


def finish_llama_args(a: Any) -> None:
    if a.intermediate is None:
        a.intermediate = -(-int(8 * a.hidden / 3) // 16) * 16


def llama_config(a: dict, seq: int) -> Any:
    """A LlamaConfig from the flags in `a` (a dict), long enough for `seq` tokens."""
    import transformers
    return transformers.LlamaConfig(vocab_size=a["vocab"], hidden_size=a["hidden"],
                                    intermediate_size=a["intermediate"], num_hidden_layers=a["layers"],
                                    num_attention_heads=a["heads"], num_key_value_heads=a["kv_heads"],
                                    max_position_embeddings=max(2048, seq))


def peer(name: str, model: Any, hp: dict) -> tuple[Any, Any]:
    """The peer baseline of the GPT benchmarks: (`model` wrapped by DDP (name "ddp") or by
    FSDP2 (`fully_shard` on each block, then the root; "fsdp2"), torch.optim.AdamW(**hp))."""
    import torch
    if name == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        net = fully_shard(model)
    return net, torch.optim.AdamW(net.parameters(), **hp)


def global_mean(loss: Any) -> float:
    """The mean of the ranks' losses (the global-batch loss, as dsfn reports it)."""
    mean = loss.detach().clone()
    dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    return float(mean)
