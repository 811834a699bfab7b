"""The runtime: the one place with side effects (process groups, collectives, devices).

Transforms ask the runtime; they never call torch.distributed directly.
"""
from dsfn.runtime import collectives
from dsfn.runtime.collectives import counters
from dsfn.runtime.env import backend, device, force_cpu, init_distributed, is_distributed, rank, world_size
from dsfn.runtime.mesh import Mesh, current_mesh, init_mesh, reset_mesh

__all__ = ["Mesh", "backend", "collectives", "counters", "current_mesh", "device", "force_cpu",
           "init_distributed", "init_mesh", "is_distributed", "rank", "reset_mesh", "world_size"]
