"""The ds_config keys that only tune speed, memory or logging: accepted, named in one warning."""
from __future__ import annotations

# top-level keys, with why dsfn does not read them
IGNORED_TOP = {
    "steps_per_print": "logging", "wall_clock_breakdown": "logging", "memory_breakdown": "logging",
    "flops_profiler": "profiling", "tensorboard": "logging", "wandb": "logging", "csv_monitor": "logging",
    "comet": "logging", "comms_logger": "logging", "log_level": "logging", "dump_state": "logging",
    "timers": "logging", "dataloader_drop_last": "data loading is the caller's",
    "zero_allow_untested_optimizer": "dsfn runs any dsfn.optim optimizer under ZeRO",
    "zero_force_ds_cpu_optimizer": "offload runs the host AdamW kernel by itself", "aio": "NVMe I/O tuning",
    "prescale_gradients": "reduction tuning", "gradient_predivide_factor": "reduction tuning",
    "seq_parallel_communication_data_type": "sp all-to-alls travel in the compute dtype",
    "comms_config": "communication logging", "monitor_config": "logging",
    "cuda_visible_devices": "device selection is the launcher's (CUDA_VISIBLE_DEVICES)",
}
# zero_optimization's communication / memory tuning
ZERO_PERF = {"contiguous_gradients", "reduce_scatter", "overlap_comm", "use_multi_rank_bucket_allreduce",
             "allgather_partitions", "round_robin_gradients", "ignore_unused_parameters", "load_from_fp32_weights",
             "sub_group_size", "stage3_prefetch_bucket_size", "prefetch_bucket_size", "stage3_max_live_parameters",
             "stage3_max_reuse_distance", "stage3_model_persistence_threshold",
             "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
             "stage3_module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params",
             "stage3_allgather_sequential", "memory_efficient_linear", "override_module_apply", "elastic_checkpoint",
             "save_muon_momentum_buffer_in_memory", "compute_grad_norm", "parameter_alignment",
             "log_trace_cache_warnings",
             # DeepSpeed 0.19's field names of the stage3_ keys above (those are their aliases)
             "max_live_parameters", "max_reuse_distance", "model_persistence_threshold",
             "gather_16bit_weights_on_model_save", "module_granularity_threshold",
             "use_all_reduce_for_fetch_params", "allgather_sequential"}
# offload_optimizer's / offload_param's I/O tuning
OFFLOAD_PERF = {"buffer_count", "buffer_size", "max_in_cpu", "fast_init", "pipeline_read", "pipeline_write",
                "pipeline"}


def is_comment(key: str) -> bool:
    """A top-level key starting with "_" (`"_comment"`): a note in the file, which DeepSpeed
    does not read either."""
    return key.startswith("_")


def is_ignored_path(path: str) -> bool:
    """Whether the dotted key `path` is one dsfn accepts without reading its value (performance / logging tuning)."""
    parts = path.split(".")
    if parts[0] in IGNORED_TOP or is_comment(parts[0]):
        return True
    if parts[0] == "zero_optimization" and len(parts) == 2:
        return parts[1] in ZERO_PERF or parts[1] in ("stage3_gather_16bit_weights_on_model_save",)
    if parts[0] == "zero_optimization" and len(parts) == 3 and parts[1] in ("offload_optimizer", "offload_param"):
        return parts[2] in OFFLOAD_PERF
    return False
