"""The layout planner: `dsfn.plan(model, cluster, global_batch=, seq_len=)` ranks the layouts
dsfn can run by predicted step time, from dsfn's own memory estimate (`estimate_memory` of
each candidate's stack), communication accounting (`dsfn.comm_model`, `dsfn.runtime.links`)
and pipeline schedule simulator (`dsfn.engines.pipeline.simulate`), with a FLOPs count of the
model (`ModelFacts`).

    result = dsfn.plan("llama3-70b", dsfn.Cluster.h100(nodes=16), global_batch=1024, seq_len=8192)
    print(result.table())            # the top candidates, and why each rejected family was rejected
    result.best.layout.code()        # the stack as code: init_mesh(...); dsfn.compose(...)

Modules: `model` (what is read off a model), `layout` (a candidate and its stack), `predict`
(memory, time, communication of one candidate), `search` (the space and the ranking),
`presets` (published model configs). `dsfn.testing.planner` runs a candidate on this
machine's ranks: what the predictions are checked against.
"""
from dsfn.comm_model import Cluster
from dsfn.planner.layout import Layout
from dsfn.planner.model import ModelFacts
from dsfn.planner.predict import Prediction, predict
from dsfn.planner.search import Constraints, PlanError, PlanResult, plan

__all__ = ["Cluster", "Constraints", "Layout", "ModelFacts", "PlanError", "PlanResult", "Prediction", "plan",
           "predict"]
