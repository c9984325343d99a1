"""Training: `train(recipe)` runs the loop; `python -m draftsmith.train RECIPE [key=value ...]` launches it."""

from draftsmith.train.trainer import TrainingError, train

__all__ = ["TrainingError", "train"]
