"""Run health: a non-finite loss, gradient norm or target feature stops the run, and so does a saturated drafter (a
gradient norm of exactly 0 while the loss is not); a stuck run gets a warning, and stops once it has been stuck for
training.stop_when_stuck_steps steps.

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

from draftsmith.train.errors import SaturatedError, TrainingError

STUCK_WINDOW = 5  # logged steps whose loss does not move make a run "stuck"
STUCK_RTOL = 1e-6  # "does not move": the window's spread within this fraction of the loss (float32 noise)


class FeatureCheck:
    """A capture (the target's, a store's or the first epoch's cache: features.py) read through a check: the same
    states, plus `rows_ok`, (B,) bool on the device, True where every feature at a row's real (unpadded) positions
    is finite. The drafter methods read their features inside their loss, so this is where the trainer sees each
    batch's features without a second target forward."""

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


def raise_if_unhealthy(watch: FiniteWatch, accelerator) -> None:
    """Stop on the first NaN or inf since the last call (`FiniteWatch.first_problem`), on every process at once:
    called where the loop syncs anyway."""
    problem = watch.first_problem()
    if accelerator.num_processes > 1:  # all processes stop together, or the others wait forever in a collective
        found = accelerator.reduce(torch.tensor([float(problem is not None)], device=accelerator.device), "sum")
        if problem is None and float(found) > 0:
            problem = "another process found NaN or inf values, or a saturated drafter (its message names the step)"
    if problem is not None and watch.saturated_at is not None:
        raise SaturatedError(problem, watch.saturated_at)
    if problem is not None:
        raise TrainingError(problem)


class Health:
    """A run's two watches (NaN and inf; not learning) and `check`, which the loop calls where it syncs anyway."""

    def __init__(self, accelerator, describe: Callable[[int], str], rate: str, stop_after: int | None):
        self.accelerator = accelerator
        self.finite = FiniteWatch(describe, rate)
        self.stuck = StuckWatch(rate, stop_after)

    def check(self) -> None:
        raise_if_unhealthy(self.finite, self.accelerator)


def describe_sample(tokenizer, samples, i: int) -> str:
    """A training sample as a message names it: its index in the training set and its first words."""
    text = " ".join(tokenizer.decode(samples[i].input_ids[:48], skip_special_tokens=True).split())
    return f"training sample {i} ({text[:60]!r})"


class FiniteWatch:
    """Device-side finiteness flags since the last `check`, with the host-side step and sample ids they belong to.

    `describe(sample_id)` names a sample in the message (its index in the training set and its first words)."""

    def __init__(self, describe: Callable[[int], str], rate: str = "training.lr"):
        self.describe = describe
        self.rate = rate  # the recipe's learning rate(s), as a saturation message names them
        self._micro: list[tuple[int, list[int], torch.Tensor]] = []  # (step, sample ids, [rows_ok..., loss_ok])
        self._steps: list[tuple[int, torch.Tensor]] = []  # (step, [grad norm finite, not saturated])
        self._last_loss: torch.Tensor | None = None  # the latest micro-batch's loss (device)
        self.saturated_at: int | None = None  # the step first_problem's message names, when it is a saturation

    def observe_micro_batch(self, step: int, sample_ids: list[int], rows_ok: torch.Tensor | None,
                            loss: torch.Tensor) -> None:
        loss_ok = torch.isfinite(loss.detach()).reshape(1)
        rows = rows_ok[:len(sample_ids)] if rows_ok is not None else torch.ones(  # a packed row's flags: (T,)
            len(sample_ids), dtype=torch.bool, device=loss_ok.device)
        self._micro.append((step, list(sample_ids), torch.cat([rows.to(loss_ok.device), loss_ok])))
        self._last_loss = loss.detach()

    def observe_step(self, step: int, grad_norm: torch.Tensor | float | None) -> None:
        """A step's gradient norm: finite, and not saturated. Saturated: exactly 0 while the loss is not (the
        learning rate pushed the drafter where no gradient flows; it never learns again, so the run stops at the
        next check, before any checkpoint holds it)."""
        if grad_norm is None:  # DeepSpeed clips inside its engine and returns no norm
            return
        norm = torch.as_tensor(grad_norm).reshape(1)
        live = norm != 0
        if self._last_loss is not None:
            live = live | (self._last_loss.reshape(1).to(norm.device) == 0)
        self._steps.append((step, torch.cat([torch.isfinite(norm), live])))

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
            elif not flags[at + 1]:
                events.append((step, 3, f"step {step}: the gradient norm is exactly 0 while the loss is not: "
                                        f"{self.rate} saturated the drafter, which can learn no more; lower it and "
                                        "train in a new output_dir"))
            at += 2
        if not events:
            return None
        step, kind, message = min(events)
        self.saturated_at = step if kind == 3 else None
        return message


class StuckWatch:
    """Watches the logged steps for a run that has stopped learning (e.g. a learning rate so high that the drafter
    saturated): a gradient norm of exactly 0, or a loss that has not moved (within STUCK_RTOL) over STUCK_WINDOW
    logged steps. Each is warned about once. With `stop_after`, a run stuck for that many optimizer steps is to
    stop (`stop_message`). `rate` names the recipe's learning rate(s) in the messages ("training.lr=0.0001"): the
    rate a step logs has been decayed by the schedule, and is 0 at the last step."""

    def __init__(self, rate: str, stop_after: int | None = None, window: int = STUCK_WINDOW):
        self.rate = rate
        self.stop_after = stop_after
        self.window = window
        self.flat: list[tuple[int, float]] = []  # the longest run of latest logged losses within STUCK_RTOL
        self.zero_since: int | None = None  # first logged step of the latest run of exactly-0 gradient norms
        self.warned: set[str] = set()

    @property
    def stuck_since(self) -> int | None:
        """The first step of the stretch that shows the run is not learning, None while it learns."""
        since = [s for s in (self.zero_since, self.flat[0][0] if len(self.flat) >= self.window else None)
                 if s is not None]
        return min(since) if since else None

    def observe(self, step: int, loss: float, grad_norm: float) -> list[str]:
        warnings = []
        if grad_norm == 0.0:
            self.zero_since = step if self.zero_since is None else self.zero_since
            if "grad" not in self.warned:
                self.warned.add("grad")
                warnings.append(f"step {step}: the gradient norm is exactly 0, so the drafter is not learning "
                                f"({self.rate} may have saturated it, or no position counts in the loss): stop and "
                                "lower it")
        else:
            self.zero_since = None
        # a stretch of stop_after steps has at most stop_after + 1 logged losses: older ones are not needed
        longest = self.window if self.stop_after is None else self.window + self.stop_after
        self.flat = self.flat[-(longest - 1):] + [(step, loss)]
        while len(self.flat) > 1 and not _within_noise([v for _, v in self.flat]):
            self.flat.pop(0)
        if len(self.flat) >= self.window and "loss" not in self.warned:
            self.warned.add("loss")
            warnings.append(f"steps {self.flat[0][0]}..{step}: the loss has not moved from {loss:.6g} over "
                            f"{len(self.flat)} logged steps: the run is stuck ({self.rate} too high?)")
        return warnings

    def stopping_soon(self) -> bool:
        """Stuck now, with a stop configured: a checkpoint written now would hold weights that do not learn."""
        return self.stop_after is not None and self.stuck_since is not None

    def stop_message(self, step: int) -> str | None:
        """One line when the run has been stuck for `stop_after` steps by `step`, else None."""
        since = self.stuck_since
        if self.stop_after is None or since is None or step - since < self.stop_after:
            return None
        zero = self.zero_since is not None
        why = "its gradient norm is exactly 0" if zero else f"its loss has stayed at {self.flat[-1][1]:.6g}"
        fix = (f"{self.rate} is probably too high; lower it" if zero else
               f"{self.rate} is too high or too low, or the data too uniform; change it")
        return (f"steps {since}..{step}: the drafter has not learned for {step - since} steps ({why}), so the run "
                f"stops (training.stop_when_stuck_steps={self.stop_after}): {fix} and train in a new output_dir")


def _within_noise(values: list[float]) -> bool:
    """The values' spread is float32 noise: within STUCK_RTOL of their mean (or of 1, for losses near 0)."""
    return max(values) - min(values) <= STUCK_RTOL * max(1.0, abs(sum(values) / len(values)))
