"""`speculators train` (0.9.x) that also saves its drafter at given optimizer steps, for learning curves.

speculators saves once per epoch (or, with --checkpoint-freq < 1, again into the same epoch folder), so the points of
a learning curve would overwrite each other. This entry runs the unchanged trainer with one addition: after the
optimizer steps listed in SPEC_SAVE_STEPS (comma-separated global steps), and after its last, it writes the drafter as speculators'
checkpointer does (save_pretrained, bf16) to SAVE_PATH/step_<n>/ and appends {"step", "seconds"} to
SAVE_PATH/curve.jsonl, seconds counted from the first training step's start (what an equal-time comparison reads).

    SPEC_SAVE_STEPS=100,200,400 python -m benchmarks.speculators_curve --speculator-type eagle3 ... --save-path DIR
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def install(save_steps: set[int]) -> None:
    """Wrap speculators' Trainer.train_epoch so that it saves the drafter after each of `save_steps`."""
    from speculators.train import trainer as trainer_mod
    from speculators.train.checkpointer import convert_float_dtype

    original = trainer_mod.Trainer.train_epoch
    original_run = trainer_mod.Trainer.run_training
    started: list[float] = []
    saved: set[int] = set()

    def save(self, epoch, seconds: float) -> None:
        raw = getattr(self.model, "module", self.model)
        out = Path(self.config.save_path) / f"step_{self.global_step}"
        raw.save_pretrained(out, state_dict=convert_float_dtype(raw.state_dict(), self.config.hidden_states_dtype))
        saved.add(self.global_step)
        with (Path(self.config.save_path) / "curve.jsonl").open("a") as f:
            f.write(json.dumps({"step": self.global_step, "epoch": epoch, "seconds": round(seconds, 2),
                                "checkpoint": str(out)}) + "\n")

    def run_training(self):
        original_run(self)
        if started and self.global_step not in saved:  # the last step (its seconds include the validations)
            save(self, "end", time.perf_counter() - started[0])

    def train_epoch(self, epoch, *, step_callback=None):
        def after_step():
            if not started:  # the first step is done: its start is the loop's start (compilation included)
                started.append(self._first_step_started)
            if self.global_step in save_steps:
                save(self, epoch, time.perf_counter() - started[0])
            if step_callback is not None:
                step_callback()

        if not hasattr(self, "_first_step_started"):
            self._first_step_started = time.perf_counter()
        return original(self, epoch, step_callback=after_step)

    trainer_mod.Trainer.train_epoch = train_epoch
    trainer_mod.Trainer.run_training = run_training


def main(argv: list[str]) -> None:
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    install({int(s) for s in os.environ.get("SPEC_SAVE_STEPS", "").split(",") if s})
    train_main(TrainConfig.resolve(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
