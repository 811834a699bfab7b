"""dsfn.estimate_memory for a 7B Llama (meta device, nothing allocated) beside DeepSpeed's formulas.

    .venv/bin/python benchmarks/estimate.py [--ranks 8 64] [--gpus-per-node 8]

For ZeRO-2 and ZeRO-3, each with and without CPU offload (bf16 compute, fp32 masters,
AdamW), at each rank count: dsfn's per-rank estimate (device peak of model states, the
state on the device, host bytes per rank) and DeepSpeed's published estimators
(`estimate_zero2_model_states_mem_needs` / `estimate_zero3_model_states_mem_needs`, per GPU
and per node of --gpus-per-node), and the ratio dsfn device peak / DeepSpeed per-GPU.
The ZeRO paper's (2 + 2 + 12)Ψ/N line is printed for reference. Needs transformers (the
`hf` extra); DeepSpeed itself is only used, when installed, to check the formulas.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

import dsfn
from dsfn.transforms import mixed_precision, offload, shard_zero

GiB = 2**30


def llama_7b() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    conf = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
                       tie_word_embeddings=False)
    with torch.device("meta"):
        return LlamaForCausalLM(conf)


def stacks():
    return {
        "ZeRO-2": [shard_zero(2), mixed_precision()],
        "ZeRO-2 + offload": [shard_zero(2), offload("cpu"), mixed_precision()],
        "ZeRO-3": [shard_zero(3), mixed_precision()],
        "ZeRO-3 + offload": [shard_zero(3), offload("cpu"), mixed_precision()],
        "ZeRO-3 + offload params": [shard_zero(3), offload("cpu", params=True), mixed_precision()],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--gpus-per-node", type=int, default=8)
    a = ap.parse_args()
    t0 = time.perf_counter()
    model = llama_7b()
    tx = dsfn.optim.adamw(3e-4, weight_decay=0.1)
    psi = sum(p.numel() for p in model.parameters())
    print(f"Llama 7B (meta): {psi / 1e9:.3f}B parameters; AdamW, bf16 compute, fp32 masters; GiB per rank")
    head = (f"{'stack':24s} {'ranks':>5s} | {'params':>7s} {'grads':>7s} {'optim':>7s} {'master':>7s} "
            f"{'unit':>6s} {'bucket':>7s} {'host':>7s} | {'dsfn dev':>8s} {'DS gpu':>8s} {'ratio':>6s} "
            f"{'DS cpu/node':>11s} {'dsfn host/node':>14s}")
    print(head)
    print("-" * len(head))
    for n in a.ranks:
        for name, stack in stacks().items():
            est = dsfn.estimate_memory(model, stack, n, tx=tx)
            ds = est.deepspeed(gpus_per_node=a.gpus_per_node)
            per_node = min(a.gpus_per_node, n)
            g = lambda b: f"{b / GiB:7.2f}"
            print(f"{name:24s} {n:5d} | {g(est.params)} {g(est.grads)} {g(est.optimizer)} {g(est.master)} "
                  f"{est.largest_unit / GiB:6.2f} {g(est.buckets)} {g(est.host)} | {est.device / GiB:8.2f} "
                  f"{ds['gpu'] / GiB:8.2f} {est.device / ds['gpu']:6.2f} {ds['cpu'] / GiB:11.1f} "
                  f"{est.host * per_node / GiB:14.1f}")
        print(f"{'ZeRO paper P_os+g+p':24s} {n:5d} | (2+2+12)Ψ/N = {16 * psi / n / GiB:.2f}; "
              f"P_os+g = 2Ψ + 14Ψ/N = {(2 * psi + 14 * psi / n) / GiB:.2f}")
    print(f"(estimated in {time.perf_counter() - t0:.1f} s; largest unit: one decoder layer, "
          f"{est.largest_layer / 1e6:.1f}M params, plus the root unit's embeddings/head/norm)")
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as z3
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as z2
        from dsfn.estimate import deepspeed_zero2_estimate, deepspeed_zero3_estimate
        ok = all(deepspeed_zero2_estimate(psi, 8, k, off) == dict(zip(("cpu", "gpu"), z2(psi, 8, k, off)))
                 for k in (1, 8) for off in (False, True))
        ok &= all(deepspeed_zero3_estimate(psi, est.largest_layer, 8, k, off, offp)
                  == dict(zip(("cpu", "gpu"), z3(psi, est.largest_layer, 8, k, off, offp)[:2]))
                  for k in (1, 8) for off in (False, True) for offp in (False, True))
        print(f"DeepSpeed's own estimator functions agree with the transcription: {ok}")
    except ImportError:
        print("(DeepSpeed not installed: formulas as transcribed in dsfn.estimate)")


if __name__ == "__main__":
    main()
