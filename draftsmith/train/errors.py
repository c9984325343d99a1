"""The one error a training run that cannot start as configured, or cannot go on, raises: one line saying what to
do. Its own module, below everything else in train/, so that every part can raise it."""


class TrainingError(ValueError):
    """A run that cannot start as configured, or cannot go on (one line saying what to do)."""
