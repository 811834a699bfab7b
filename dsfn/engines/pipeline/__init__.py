"""Pipeline parallel's machinery (`dsfn.transforms.pipeline_parallel` holds the policy), as
torch's `pipelining/`:

- `schedules`: pure, deterministic per-rank orders of work (GPipe, 1F1B, interleaved,
  zero-bubble), with their checker and simulator re-exported;
- `actions`: the schedules' vocabulary (`Kind`, `Action`, `Schedule`, `Slot`);
- `simulate`: a schedule's checker, simulator and timeline picture;
- `stages`: a model cut into stages, and one stage's forward inside the user's step;
- `runner`: one rank's part of a schedule, run with its sends and receives;
- `step`: one step's callbacks for the runner, its stages' hooks, the loss and tied gradients;
- `split_backward`: a stage's backward in two passes (zero-bubble's B and W).
"""
