"""`from_ds_config(config, model=...)`: a DeepSpeed `ds_config.json` as a dsfn stack, optimizer and batch.

    cfg = dsfn.from_ds_config("ds_config.json", model=model)   # world size: the launcher's group
    cfg.init_mesh()                                   # pp x dp x sp x tp from the config and the world size
    step = cfg.compose(train_step)                    # dsfn.compose(*cfg.transforms, donate=True)(train_step)
    state = step.init_state(params, cfg.tx)
    for batch in loader(cfg.train_batch_size):        # the global batch: micro * accumulation * dp rows
        state, metrics = step(state, batch)

Keys and defaults are DeepSpeed 0.19's (`deepspeed/runtime/config.py`, `zero/config.py`,
`zero/offload_config.py`, `precision_config.py`, `zenflow/zenflow_config.py`;
/work/shared/reference/deepspeed_features.md). Mapping (stack in canonical order):

| ds_config | dsfn |
|---|---|
| `sequence_parallel_size: N` (> 1) | `sequence_parallel()`, mesh sp = N |
| `zero_optimization.stage` s (default 0) | `shard_zero(s, reduce_bucket_size, allgather_bucket_size (s >= 1), param_persistence_threshold (s = 3))` (DeepSpeed's defaults 5e8, 5e8, 1e5 for stage 3) |
| `zero_optimization.mics_shard_size: k` (> 0, stage 3) | `shard_zero(3, shard_group=k, cross_node=True)` (MiCS: state sharded over blocks of k ranks, replicated across them) |
| `zero_optimization.zero_hpz_partition_size: k` (> 1, stage 3) | `shard_zero(3, hpz=min(k, dp))` (ZeRO++ hpZ) |
| `zero_optimization.zero_quantized_weights: true` (stage 3) | `shard_zero(3, quantize_weights="int8")` (ZeRO++ qwZ; block-wise int8 weight gathers) |
| `zero_optimization.zero_quantized_gradients: true` (stage 3) | `shard_zero(3, quantize_grads="int4")` (ZeRO++ qgZ; int4 all-to-all reduction, inside the node then across) |
| `zero_optimization.zero_quantized_nontrainable_weights: true` (stage 3) | `shard_zero(3, quantize_frozen="int8")` (frozen weights' shards held in int8, gathered as codes) |
| `tensor_parallel.autotp_size: N` (> 1) | `tensor_parallel("auto", model=model)`, mesh tp = N (with a pipeline: inside it) |
| `activation_checkpointing.cpu_checkpointing` / `partition_activations` | `remat(offload="cpu")` / `remat(partition_activations=True)` |
| `gradient_accumulation_steps: n` (> 1) | `accumulate(n)` (without a pipeline) |
| `pipeline.stages: P` (> 1) | `pipeline_parallel("1f1b", microbatches=gradient_accumulation_steps, model=model)` innermost, mesh pp = P; no `accumulate` (the pipeline's micro-batches are the accumulation) |
| `pipeline.activation_checkpoint_interval: 1` | `remat()` (each layer of a stage checkpointed); > 1 is listed (dsfn does not checkpoint groups of layers) |
| `pipeline.partition` "uniform" / absent or "best" / "parameters" / "type:regex" | the even split by layer count / the same / `split=` balancing each stage's parameter count (embeddings counted on the first stage, final norm and head on the last) / `split=` balancing the layers whose class name matches |
| `offload_optimizer.device` cpu / nvme (+ `offload_param` on the same device) | `offload(device, params=, path=nvme_path, pin_memory=, overlap=super_offload, cores=cpuadam_cores_perc)` |
| `bf16.enabled` / `fp16.enabled` | `mixed_precision(torch.bfloat16 / torch.float16, reduce_dtype=communication_data_type)` |
| `communication_data_type` bf16 / fp16 without bf16/fp16 (fp32 training) | `mixed_precision(torch.float32, reduce_dtype=...)`: only the gradient reductions run in it |
| `fp16` loss_scale, initial_scale_power, loss_scale_window, hysteresis, consecutive_hysteresis, min_loss_scale | `loss_scale(init_scale=2**p, window, hysteresis, min_scale, static=loss_scale if > 0, consecutive_hysteresis)` |
| `gradient_clipping` (default **1.0**; 0 disables) | `clip_grad_norm(c)` |
| `zero_optimization.zenflow` | `zenflow(topk_ratio, update_interval, select_interval, full_warm_up_rounds, overlap=overlap_step)` |
| `datastates_ckpt.host_cache_size` (GB), `checkpoint.writer.decoupled` | `async_checkpoint(dir, every, host_cache_size=bytes)` when `checkpoint_dir=` is given (else `cfg.checkpoint`) |
| `optimizer` Adam / AdamW / Lamb / Muon / SGD / other `torch.optim` types | `adamw` (Adam with `adam_w_mode` true, DeepSpeed's default) / `adam` / `lamb` (FusedLamb's rule and defaults) / `muon` / `sgd` / `from_torch` |
| no `optimizer` block (the client's) | `from_ds_config(..., tx=)`: a dsfn optimizer, a torch.optim class / instance / factory, or "hf" (`client_optimizer`) |
| `scheduler` | `dsfn.optim.schedules.from_config` as the lr |

Batch sizes follow DeepSpeed's rule (`batch`); `"auto"` values (Hugging Face Trainer's
configs) are filled from `auto=` (`auto`; `hf_trainer_auto(training_args)` gives what HF
Trainer would fill); pipeline parallelism is read from the `"pipeline"` section
(`pipeline`). Every value is type-checked: a wrong one is a ConfigError naming its key.

Keys dsfn does not reproduce raise one `ConfigError` listing all of them;
keys that only tune performance or logging (bucket and prefetch tuning, aio, monitors, ...)
are named in one `UserWarning` (`cfg.ignored` lists them). Defaults that differ from
dsfn's own are DeepSpeed's here: gradient clipping 1.0, the optimizer's weight decay 0
(FusedAdam / CPU Adam; torch's 0.01 with `torch_adam: true` for AdamW), Adam meaning AdamW.

One module per section, read in this order by `convert.from_ds_config`: `parallel` (world
size, sequence / tensor parallel sizes and the mesh, `pipeline` for the stages), `batch`,
`zero` (with `offload` and `zenflow`), `precision`, `optimizer` (with the scheduler and
gradient clipping), `activation_checkpointing`, `checkpoint`, `top_level` (the keys no
section reads); `auto` fills "auto" values first, `stack` assembles the transforms, `result`
holds `DsConfig`; `values` (typed readers), `report` (the listed and ignored keys) and
`tuning_keys` are shared by the sections.
"""
from dsfn.migrate.ds_config.auto import hf_trainer_auto
from dsfn.migrate.ds_config.batch import batch_sizes
from dsfn.migrate.ds_config.convert import from_ds_config
from dsfn.migrate.ds_config.pipeline import balanced_split  # noqa: F401  (public: the stage balancing)
from dsfn.migrate.ds_config.result import DsConfig

__all__ = ["DsConfig", "batch_sizes", "from_ds_config", "hf_trainer_auto"]
