"""The one error a training run that cannot start as configured, or cannot go on, raises: one line saying what to
do. Its own module, below everything else in train/, so that every part can raise it."""


class TrainingError(ValueError):
    """A run that cannot start as configured, or cannot go on (one line saying what to do)."""


class SaturatedError(TrainingError):
    """The drafter saturated: a gradient norm of exactly 0 while the loss is not, first at `step` (the weights that
    gave it are those after step - 1's update)."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step
