"""Run health: a non-finite loss, gradient norm or target feature stops the run; a stuck run gets a warning.

Host syncs. The loop makes none per step (a sync per step would stall the device queue every step). The flags
(is this micro-batch's loss finite, which rows' captured features are finite, is this step's gradient norm
finite) are computed on the device as the steps run and kept until a sync the loop makes anyway: every log step,
and before every evaluation and checkpoint save (the last one included). `FiniteWatch.first_problem` reads them there in
one transfer. A NaN at step 1 is therefore found at the first log step at the latest, named by the step (and
sample) where it appeared, and never reaches a checkpoint; the steps run in between are wasted, never saved.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

STUCK_WINDOW = 5  # logged steps whose loss does not move make a run "stuck"
STUCK_RTOL = 1e-6  # "does not move": the window's spread within this fraction of the loss (float32 noise)


class FeatureCheck:
    """Stands in for `target.capture`: the same states, plus `rows_ok`, (B,) bool on the device, True where
    every feature at a row's real (unpadded) positions is finite. The drafter methods call capture inside their
    loss, so this is where the trainer sees each batch's features without a second target forward."""

    def __init__(self, capture: Callable):
        self._capture = capture
        self.rows_ok: torch.Tensor | None = None

    def __call__(self, input_ids, attention_mask=None, aux_layer_ids=None, position_ids=None):
        states = self._capture(input_ids, attention_mask, aux_layer_ids, position_ids=position_ids)
        finite = torch.isfinite(states.aux_hidden).all(-1) & torch.isfinite(states.last_hidden).all(-1)  # (B, S)
        if attention_mask is not None:
            finite = finite | (attention_mask == 0)  # padding may hold anything
        if position_ids is not None and attention_mask is None:  # one packed row: a flag per sample, in order
            doc = (position_ids[0] == 0).cumsum(0) - 1  # samples start at position 0
            per_doc = torch.ones(doc.numel(), dtype=torch.int32, device=finite.device)  # (T,) >= samples (no sync)
            self.rows_ok = per_doc.scatter_reduce(0, doc, finite[0].int(), "amin").bool()  # CUDA: no bool scatter
        else:
            self.rows_ok = finite.all(-1)  # (B,)
        return states

    def replace(self, capture: Callable) -> None:
        """Check another capture from now on (a hidden-state cache that was written and is read now)."""
        self._capture = capture

    def take(self) -> torch.Tensor | None:
        rows_ok, self.rows_ok = self.rows_ok, None
        return rows_ok


class FiniteWatch:
    """Device-side finiteness flags since the last `check`, with the host-side step and sample ids they belong to.

    `describe(sample_id)` names a sample in the message (its index in the training set and its first words)."""

    def __init__(self, describe: Callable[[int], str]):
        self.describe = describe
        self._micro: list[tuple[int, list[int], torch.Tensor]] = []  # (step, sample ids, [rows_ok..., loss_ok])
        self._steps: list[tuple[int, torch.Tensor]] = []  # (step, grad norm finite)

    def observe_micro_batch(self, step: int, sample_ids: list[int], rows_ok: torch.Tensor | None,
                            loss: torch.Tensor) -> None:
        loss_ok = torch.isfinite(loss.detach()).reshape(1)
        rows = rows_ok[:len(sample_ids)] if rows_ok is not None else torch.ones(  # a packed row's flags: (T,)
            len(sample_ids), dtype=torch.bool, device=loss_ok.device)
        self._micro.append((step, list(sample_ids), torch.cat([rows.to(loss_ok.device), loss_ok])))

    def observe_step(self, step: int, grad_norm: torch.Tensor | float | None) -> None:
        if grad_norm is None:  # DeepSpeed clips inside its engine and returns no norm
            return
        ok = torch.isfinite(torch.as_tensor(grad_norm)).reshape(1)
        self._steps.append((step, ok))

    def first_problem(self) -> str | None:
        """The first non-finite value since the last call, as one line, else None (one device-to-host copy)."""
        micro, steps = self._micro, self._steps
        self._micro, self._steps = [], []
        if not micro and not steps:
            return None
        device = (micro[0][2] if micro else steps[0][1]).device
        flags = torch.cat([f for _, _, f in micro] + [ok.to(device) for _, ok in steps]).cpu().tolist()
        if all(flags):
            return None
        events = []  # (step, order within the step, message)
        at = 0
        for step, sample_ids, f in micro:
            n = len(sample_ids)
            rows, loss_ok = flags[at:at + n], flags[at + n]
            at += n + 1
            bad = [sample_ids[i] for i, ok in enumerate(rows) if not ok]
            if bad:
                more = f" and {len(bad) - 1} more in its batch" if len(bad) > 1 else ""
                events.append((step, 0, f"step {step}: the target's hidden states for {self.describe(bad[0])}{more} "
                                        "are not finite (NaN or inf): the target's weights hold a NaN, or it "
                                        "overflows in half precision (try model.dtype=float32)"))
            elif not loss_ok:
                events.append((step, 1, f"step {step}: the loss is not finite (NaN or inf) though the target's "
                                        "features are: the drafter diverged (lower training.lr) or the target's "
                                        "lm_head holds a NaN"))
        for step, _ in steps:
            if not flags[at]:
                events.append((step, 2, f"step {step}: the gradient norm is not finite (NaN or inf): the drafter "
                                        "diverged; lower training.lr or training.max_grad_norm"))
            at += 1
        return min(events)[2] if events else None


class StuckWatch:
    """Warns (once each) when a logged step's gradient norm is exactly 0, or the loss has not moved over
    STUCK_WINDOW logged steps: a run that cannot learn (e.g. a learning rate so high that the drafter saturated)."""

    def __init__(self, window: int = STUCK_WINDOW):
        self.window = window
        self.losses: list[tuple[int, float]] = []
        self.warned: set[str] = set()

    def observe(self, step: int, loss: float, grad_norm: float, lr: float) -> list[str]:
        warnings = []
        if grad_norm == 0.0 and "grad" not in self.warned:
            self.warned.add("grad")
            warnings.append(f"step {step}: the gradient norm is exactly 0, so the drafter is not learning "
                            f"(training.lr={lr:g} may have saturated it, or no position counts in the loss): stop "
                            "and lower training.lr")
        self.losses = [*self.losses[-(self.window - 1):], (step, loss)]
        values = [v for _, v in self.losses]
        if len(values) == self.window and "loss" not in self.warned:
            if max(values) - min(values) <= STUCK_RTOL * max(1.0, abs(sum(values) / len(values))):
                self.warned.add("loss")
                warnings.append(f"steps {self.losses[0][0]}..{step}: the loss has not moved from {loss:.6g} over "
                                f"{self.window} logged steps: the run is stuck (training.lr={lr:g} too high?)")
        return warnings
