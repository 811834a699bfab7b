"""ZeRO's rounds of gradient buckets (`GradientRounds`) and the "micro_batch" events they hear.

A round is one micro-batch's share of the reduce-scatters. Micro-batches run one after
another (accumulate) close a round as the next forward begins; interleaved ones (a
pipeline's 1F1B: F1 before B0) switch rounds at the first gradient of another forward's
owner, closing the previous owner's first. The transform-level consequence (ZeRO-2/3 around
a pipeline equals the single process only with the interleaved rounds) is
tests/transforms/test_pipeline_parallel_zero.py; here the engine alone.
"""
from dsfn.engines.zero.shards import GradientRounds
from dsfn.functional import MicroBatch


class _Reducer:
    def __init__(self):
        self.rounds = 0

    def new_round(self):
        self.rounds += 1


def test_rounds_start_sequential_and_follow_an_interleaved_event():
    rounds = GradientRounds(_Reducer())
    assert not rounds.interleaved
    rounds.hear(MicroBatch(0, "forward", 2))                   # accumulate's: one after another
    assert not rounds.interleaved
    rounds.hear(MicroBatch(0, "forward", 2, interleaved=True))  # a pipeline's
    assert rounds.interleaved


def test_interleaved_rounds_switch_at_another_owners_first_gradient_and_close_the_previous():
    closed = []
    reducer = _Reducer()
    rounds = GradientRounds(reducer, close=closed.append)
    a, b = object(), object()
    rounds.enter(a)
    rounds.enter(a)                   # the same backward: no new round
    assert reducer.rounds == 1 and closed == []
    rounds.enter(b)                   # micro-batch b's backward: a's round is closed first
    assert reducer.rounds == 2 and closed == [a]
    rounds.enter(a)                   # a's weight gradients later (zero-bubble's W): a round again
    assert reducer.rounds == 3 and closed == [a, b]
