"""DeepSpeed's published memory formulas, transcribed (`dsfn.estimate.MemoryEstimate.deepspeed`
puts them beside dsfn's own estimate; `tests/test_estimate.py` checks them against
DeepSpeed's functions when it is installed)."""
from __future__ import annotations

__all__ = ["deepspeed_zero2_estimate", "deepspeed_zero3_estimate"]


def deepspeed_zero2_estimate(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                             cpu_offload: bool = False, additional_buffer_factor: float = 1.5) -> dict[str, int]:
    """DeepSpeed's `estimate_zero2_model_states_mem_needs` (runtime/zero/stage_1_and_2.py, 0.19.8):
    {"gpu": bytes per GPU, "cpu": bytes per node}. Without offload 2Ψ + 18Ψ/N per GPU (16-bit
    params, then 16-bit and fp32 grads, fp32 params and Adam's two moments, sharded); with
    CPU offload 2Ψ per GPU and Ψ·max(4N, 16)·1.5 per node."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu = 2 * total_params + int(18 * total_params / total_gpus)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return {"gpu": int(gpu), "cpu": int(cpu)}


def deepspeed_zero3_estimate(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                             num_nodes: int = 1, cpu_offload: bool = False, cpu_offload_params: bool = False,
                             zero_init: bool = True, additional_buffer_factor: float = 1.5) -> dict[str, int]:
    """DeepSpeed's `estimate_zero3_model_states_mem_needs` (runtime/zero/stage3.py, 0.19.8):
    {"gpu": bytes per GPU, "cpu": bytes per node}; 4 bytes per element of the largest layer
    on the GPU, plus 18Ψ/N (no offload) or 2Ψ/N (optimizer offload) or nothing (both offloaded)."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu = largest
            cpu = total_params * (18 * gpus_factor if zero_init else max(4 * num_gpus_per_node, 18 * gpus_factor))
        else:
            gpu = largest + int(2 * total_params / total_gpus)
            cpu = total_params * (16 * gpus_factor if zero_init else max(4 * num_gpus_per_node, 16 * gpus_factor))
        cpu *= additional_buffer_factor
    else:
        gpu = largest + int(18 * total_params / total_gpus)
        cpu = (largest_layer_params if zero_init else total_params) * 4 * num_gpus_per_node * additional_buffer_factor
    return {"gpu": int(gpu), "cpu": int(cpu)}
