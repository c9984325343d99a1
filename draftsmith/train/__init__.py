"""Training, as setup, loop and checkpoint (torchtune's recipe shape):

    setup.py       setup(recipe) -> Run (a small dataclass): accelerate, data, target, method, feature source,
                   drafter (its training options applied from outside), optimizers, schedule, time budget, resume
    loop.py        train(recipe): setup, then the loop, which only steps, logs, evaluates and saves
    checkpoint.py  the run folder: writing, finding the latest, the same-run check, resuming
    errors.py      TrainingError
    features.py    FeatureSource: online capture, a hidden-state store or the first epoch's cache, handed to the
                   method's loss
    budget.py      TimeBudget: the schedule's plan, probed, held and re-planned under training.max_minutes
    batching.py    epoch_batches, collate, collate_packed
    metrics.py     metrics.jsonl rows, the log window (tokens/s, MFU), evaluation
    health.py      NaN/inf and stuck-run watches; optim.py optimizers and schedulers; state.py training_state/
                   files; flops.py the FLOPs log line; collect.py `draftsmith collect`

`python -m draftsmith.train RECIPE [key=value ...]` (and `accelerate launch -m draftsmith.train ...`) runs
`draftsmith train`.
"""

from draftsmith.train.errors import TrainingError
from draftsmith.train.loop import train
from draftsmith.train.setup import Run

__all__ = ["Run", "TrainingError", "train"]
