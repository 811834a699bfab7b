"""copy_to_host: host tensors pass through untouched (no copy, nothing to wait for)."""
import torch

from dsfn.runtime.host import copy_to_host


def test_host_tensor_is_returned_as_it_is():
    t = torch.arange(6.0).view(2, 3)
    for non_blocking in (False, True):
        out, ready = copy_to_host(t, non_blocking=non_blocking)
        assert out is t and ready is None
