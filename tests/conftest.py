"""Session-wide test settings.

TRITON_INTERPRET=1 before anything imports Triton: `triton.jit` decides at decoration
time whether a kernel is interpreted, so the kernels in `dsfn/ops/` run on CPU through
the Triton interpreter and the tests compare them against their torch references.

Compiled ops (dsfn's host AdamW; DeepSpeed's CPU comm op when its tests are collected)
are built once after collection, before any timed test (`dsfn.testing.prebuild`): on a
fresh machine a first-use build must not land inside a test's timeout.

DSFN_MUTATION=name (`conformance.mutations`, the repository's test machinery): the whole run with that bug injected, to
see which tests catch it (`benchmarks/mutations.py` prints the table).
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    if os.environ.get("DSFN_MUTATION"):
        from conformance.mutations import activate_from_env
        activate_from_env()


def pytest_collection_finish(session):
    from dsfn.testing.prebuild import prebuild
    names = ["cpu_adam"]
    if any("tests/migrate/test_ds_checkpoint" in str(item.fspath).replace(os.sep, "/") for item in session.items):
        names.append("deepspeed_shm")
    lines = prebuild(names, missing_only=True)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for line in lines:
        if reporter is not None:
            reporter.write_line(line)
