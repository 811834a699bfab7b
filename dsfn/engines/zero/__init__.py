"""ZeRO's machinery (`dsfn.transforms.zero` holds the policy), one module per job, as FSDP2's
`_fully_shard/`:

- `shards`: what every stage >= 1 does with flat shards (`ZeroShards`, `ZeroOptions`, the
  gradient rounds, the tied-copy sum);
- `stage12`: stages 1 and 2 (whole parameters; sharded optimizer state, and gradients);
- `stage3`: stage 3 (parameters sharded too: placement, reductions, the update);
- `units`: ZeRO-3's unit lifecycle (just-in-time gathers, releases, prefetch, re-gathers in
  backward, hpZ's secondary shards);
- `groups`: hybrid sharding's shard groups (HSDP / MiCS).
"""
