"""Session-wide test settings.

TRITON_INTERPRET=1 before anything imports Triton: `triton.jit` decides at decoration
time whether a kernel is interpreted, so the kernels in `dsfn/ops/` run on CPU through
the Triton interpreter and the tests compare them against their torch references.

DSFN_MUTATION=name (`dsfn.testing.mutations`): the whole run with that bug injected, to
see which tests catch it (`benchmarks/mutations.py` prints the table).
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    if os.environ.get("DSFN_MUTATION"):
        from dsfn.testing.mutations import activate_from_env
        activate_from_env()
