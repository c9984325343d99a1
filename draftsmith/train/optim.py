"""Optimizers and the learning-rate schedule, including the plan a time budget makes.

Muon (torch.optim.Muon) orthogonalises the update of a 2D weight matrix; it is meant for hidden matrices only, so
the head (a vocabulary readout), norms and biases stay with AdamW, as Muon's authors and the speculators package
do. `adjust_lr_fn="match_rms_adamw"` scales Muon's update to AdamW's RMS, so both groups can share one rate.

The schedule is a pure function of the optimizer step and a `SchedulePlan`. Without a time budget the plan is
fixed up front (max_steps, or epochs x steps per epoch). With `training.max_minutes` the first
`time_probe_steps` steps run at learning rate 0 (the optimizer still gathers its moment estimates) and are
timed; the plan then fits warmup and decay into the steps that fit before the deadline, so a time-limited run
ends its schedule at its deadline instead of inside warmup. The plan is saved with every checkpoint, so a resumed
run follows the same schedule.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

PROBING = "probing step time"  # the note of a plan still waiting for the probe
SAFETY_MARGIN = 0.03  # of the time left, kept free when planning steps into a budget


def muon_groups(drafter: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(Muon parameters, AdamW parameters) of the trainable parameters: 2D matrices of size > 1 in both dimensions
    go to Muon, but for those the drafter's class names in `adamw_only` (parts of parameter names): readouts over the
    vocabulary and vocabulary tables (EAGLE-3's head, DSpark's Markov W1 and W2), which Muon's orthogonalisation,
    meant for hidden matrices, does not suit."""
    adamw_only = getattr(drafter, "adamw_only", ())  # an optional class attribute of the drafter (nn.Module)
    muon, adamw = [], []
    for name, param in drafter.named_parameters():
        if not param.requires_grad:
            continue
        matrix = param.ndim == 2 and min(param.shape) > 1 and not any(part in name for part in adamw_only)
        (muon if matrix else adamw).append(param)
    return muon, adamw


def build_optimizers(drafter: torch.nn.Module, cfg) -> list[torch.optim.Optimizer]:
    """One AdamW, or [Muon, AdamW] (`training.optimizer`), over the drafter's trainable parameters."""
    if cfg.optimizer == "adamw":
        params = [p for p in drafter.parameters() if p.requires_grad]
        return [torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay)]
    muon, adamw = muon_groups(drafter)
    optimizers = []
    if muon:
        optimizers.append(torch.optim.Muon(muon, lr=cfg.muon_lr or cfg.lr, weight_decay=cfg.weight_decay,
                                           adjust_lr_fn="match_rms_adamw"))
    if adamw:
        optimizers.append(torch.optim.AdamW(adamw, lr=cfg.lr, betas=tuple(cfg.adam_betas),
                                            weight_decay=cfg.weight_decay))
    return optimizers


def build_schedulers(optimizers, factor: Callable[[int], float]) -> list[torch.optim.lr_scheduler.LambdaLR]:
    """One LambdaLR per optimizer over `factor(step)` (the time budget's current plan, budget.py). Not registered with
    accelerate, which would pickle them: a resumed run rebuilds them from its plan (`schedule_at`)."""
    return [torch.optim.lr_scheduler.LambdaLR(optimizer, factor) for optimizer in optimizers]


def schedule_at(schedulers, step: int) -> None:
    """Put the rebuilt schedulers of a resumed run at `step`: the rate is a pure function of the step and the plan
    (trainer_state.json), so no scheduler state is saved. step() recomputes each group's rate from its
    initial_lr, which the loaded optimizer state holds."""
    for scheduler in schedulers:
        scheduler.last_epoch = step - 1
        with warnings.catch_warnings():  # no optimizer step has run in this process yet: torch's order warning
            warnings.filterwarnings("ignore", message="Detected call of")
            scheduler.step()


@dataclass
class SchedulePlan:
    """Steps [0, hold) at lr 0 (the time probe), then linear warmup over `warmup` steps, then the `shape`: cosine or
    linear decay to 0 at step `total`; constant (no decay); or wsd (warmup-stable-decay): constant, then linear decay
    to 0 over the last `decay_ratio` of the steps after warmup."""

    total: int
    warmup: int
    hold: int = 0
    shape: str = "cosine"
    decay_ratio: float = 0.2  # wsd only
    note: str = ""
    replan_step: int | None = None  # re-fit `total` here from the steady step time (a time budget's plan)
    replans: int = 0  # re-fits done so far
    step_seconds: float | None = None  # the step time the plan was fitted to (a time budget's plan)

    def factor(self, step: int) -> float:
        """Multiplier of the base learning rate at optimizer step `step` (0-based)."""
        if step < self.hold:
            return 0.0
        step -= self.hold
        if step < self.warmup:
            return (step + 1) / self.warmup
        after_warmup = max(1, self.total - self.hold - self.warmup)
        progress = min(1.0, (step - self.warmup) / after_warmup)
        if self.shape == "constant":
            return 1.0
        if self.shape == "wsd":
            stable = 1.0 - self.decay_ratio
            return 1.0 if progress <= stable else max(0.0, (1.0 - progress) / max(self.decay_ratio, 1e-9))
        if self.shape == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    @property
    def probing(self) -> bool:
        return self.note == PROBING

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SchedulePlan":
        return cls(**d)


def warmup_steps(steps: int, warmup_ratio: float) -> int:
    return max(1, int(steps * warmup_ratio)) if warmup_ratio > 0 else 0


def fixed_plan(total: int, warmup_ratio: float, shape: str = "cosine", decay_ratio: float = 0.2) -> SchedulePlan:
    """Today's schedule: warmup over `warmup_ratio` of `total` steps, then the shape's decay (to 0 at `total`)."""
    return SchedulePlan(total=total, warmup=warmup_steps(total, warmup_ratio), shape=shape, decay_ratio=decay_ratio)


def probe_plan(probe_steps: int, max_steps: int | None, shape: str = "cosine", decay_ratio: float = 0.2) -> SchedulePlan:
    """The plan while a time budget's probe runs: lr 0 until it is replaced by `plan_for_budget`."""
    total = max_steps if max_steps is not None else 10 ** 9
    return SchedulePlan(total=total, warmup=0, hold=probe_steps, shape=shape, note=PROBING, decay_ratio=decay_ratio)


MIN_REPLAN_STEPS = 20  # a re-plan times at least this many steady steps
MAX_REPLANS = 2  # at a tenth of the run (or the end of warmup, if later), then halfway through what is left


def steps_that_fit(start: int, step_seconds: float, seconds_left: float, eval_every: int | None = None,
                   eval_seconds: float = 0.0) -> tuple[int, int]:
    """(n, evaluations): the most steps after step `start` that fit in `seconds_left` less the safety margin, with
    the evaluations due on the way (every `eval_every` steps, and the one at the end) at `eval_seconds` each."""
    usable = max(0.0, seconds_left * (1.0 - SAFETY_MARGIN))

    def evals_in(n: int) -> int:  # evaluations due in steps start+1 .. start+n, and the final one
        if not eval_seconds:
            return 0
        due = (start + n) // eval_every - start // eval_every if eval_every else 0
        return due + (0 if eval_every and (start + n) % eval_every == 0 else 1)

    def fits(n: int) -> bool:
        return n * step_seconds + evals_in(n) * eval_seconds <= usable

    low, high = 0, int(usable / step_seconds) + 1 if step_seconds > 0 else 0  # fits(low), and high is the most
    while low < high:  # the largest n that fits: evaluations only grow with n
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low, evals_in(low)


def plan_for_budget(
    probe_steps: int, step_seconds: float, seconds_left: float, warmup_ratio: float, shape: str = "cosine",
    max_steps: int | None = None, eval_every: int | None = None, eval_seconds: float = 0.0, decay_ratio: float = 0.2,
    measured: str = "the probe",
) -> SchedulePlan:
    """The plan once the probe has run: as many steps as fit in `seconds_left` (less a safety margin and the
    evaluations due on the way, the one at the end included) at `step_seconds` each, capped by `max_steps`;
    warmup and decay span them. The first steps of a run are often slower than the rest (new shapes, warm-up of
    kernels and allocator), so the plan asks to be re-fitted from the steady step time later (`replan`)."""
    steps, evals = steps_that_fit(probe_steps, step_seconds, seconds_left, eval_every, eval_seconds)
    total = probe_steps + steps
    capped = max_steps is not None and total > max_steps
    if capped:
        total = max_steps
    steps = max(total - probe_steps, 1)
    total = probe_steps + steps
    warmup = warmup_steps(steps, warmup_ratio)
    replan_step = probe_steps + max(warmup, steps // 10, MIN_REPLAN_STEPS)
    note = (f"{step_seconds * 1000:.1f} ms/step ({measured}); "
            f"{seconds_left:.0f} s left -> {steps} steps"
            + (f" (capped by max_steps {max_steps})" if capped else "")
            + (f", {evals} evaluations of {eval_seconds:.1f} s on the way" if evals else ""))
    return SchedulePlan(total=total, warmup=warmup, hold=probe_steps, shape=shape, note=note, decay_ratio=decay_ratio,
                        replan_step=None if capped or replan_step >= total - MIN_REPLAN_STEPS else replan_step,
                        step_seconds=step_seconds)


def replan(plan: SchedulePlan, step: int, step_seconds: float, seconds_left: float, max_steps: int | None = None,
           eval_every: int | None = None, eval_seconds: float = 0.0) -> SchedulePlan:
    """`plan` with its end re-fitted at `step` from the steady step time since the last timing: warmup (over by
    then) is kept, the decay stretches or shrinks to end at the deadline (the learning rate moves by the few
    percent of the cosine the progress shifts). Asks for one more re-fit halfway through what is left."""
    steps, evals = steps_that_fit(step, step_seconds, seconds_left, eval_every, eval_seconds)
    total = max(step + max(steps, 1), plan.hold + plan.warmup + 1)
    if max_steps is not None:
        total = min(total, max_steps)
    replans = plan.replans + 1
    following = step + (total - step) // 2
    note = (f"{plan.note}; re-planned at step {step}: {step_seconds * 1000:.1f} ms/step, {seconds_left:.0f} s "
            f"left -> {total - step} more steps")
    return SchedulePlan(total=total, warmup=plan.warmup, hold=plan.hold, shape=plan.shape, note=note,
                        decay_ratio=plan.decay_ratio,
                        replan_step=following if replans < MAX_REPLANS and following - step >= MIN_REPLAN_STEPS
                        else None, replans=replans, step_seconds=step_seconds)
