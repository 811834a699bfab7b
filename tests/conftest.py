"""Session-wide test settings.

TRITON_INTERPRET=1 before anything imports Triton: `triton.jit` decides at decoration
time whether a kernel is interpreted, so the kernels in `dsfn/ops/` run on CPU through
the Triton interpreter and the tests compare them against their torch references.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
