"""Transforms: each module holds one; `compose` stacks them around a train step."""
from dsfn.transforms.compose import Step, compose
from dsfn.transforms.core import Transform, bind
from dsfn.transforms.data_parallel import data_parallel

__all__ = ["Step", "Transform", "bind", "compose", "data_parallel"]
