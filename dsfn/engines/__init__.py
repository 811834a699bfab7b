"""Engines: the machinery below the transforms.

A transform (`dsfn/transforms/`) holds policy: how it lays out the state and which
primitives it handles. What does the work — collectives in autograd Functions, a unit's
gather/release lifecycle, host pipelines — lives here, gets every input passed in (a
dtype, an axis, a sink for its results) and never imports a transform, so two transforms
share an engine instead of reaching into each other.
"""
