"""Checkpoint errors."""
from __future__ import annotations

from dsfn.errors import DsfnError


class CheckpointError(DsfnError, RuntimeError):
    """A checkpoint that cannot be written or read: missing/uncommitted directory, a corrupt
    or missing file, a manifest of an unknown version, or a leaf that does not fit `like`."""
