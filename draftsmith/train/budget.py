"""The run's schedule plan, and with training.max_minutes the time budget that makes it: probe, hold, re-plan.

Without a budget the plan is fixed up front (optim.py fixed_plan). With one, the first training.time_probe_steps
steps run at learning rate 0 and are timed (the probe's plan holds the rate there); at the end of the probe one
evaluation is timed too, and the plan is made for the steps that fit in what is left (optim.py plan_for_budget);
later it is re-fitted from the steady step time (optim.py replan) at the steps the plan names. The schedulers read
the current plan through `factor`, so a new plan takes effect at the next step. The plan is saved with every
checkpoint (trainer_state.json), so a resumed run keeps its schedule and the time it has spent.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from draftsmith import device as dev
from draftsmith.train.optim import MEASURE_SKIP, SchedulePlan, fixed_plan, plan_for_budget, probe_plan, replan


class TimeBudget:
    """The current `plan` (a SchedulePlan) and the wall clock it is fitted to."""

    def __init__(self, cfg, max_steps: int):
        self.cfg = cfg
        self.max_steps = max_steps  # training.max_steps, or epochs x steps per epoch
        if cfg.max_minutes is not None:  # the probe's plan; replaced once the step time is known
            self.plan = probe_plan(cfg.time_probe_steps, max_steps, cfg.lr_schedule, cfg.lr_decay_ratio)
        else:
            self.plan = fixed_plan(max_steps, cfg.warmup_ratio, cfg.lr_schedule, cfg.lr_decay_ratio)
        self.started = time.time()
        self.times: dict[int, float] = {}  # probe (and re-plan) step -> wall time at its end (device synchronised)
        self.eval_seconds = 0.0  # one evaluation's cost, timed at the end of the probe
        self.eval_spent = 0.0  # seconds evaluations took since the last timing point

    def resume(self, saved_plan: dict) -> None:
        """A resumed run follows its checkpoint's plan (trainer_state.json)."""
        self.plan = SchedulePlan.from_dict(saved_plan)

    def start(self, spent_seconds: float = 0.0) -> None:
        """The clock starts now, less the seconds a resumed run had already spent."""
        self.started = time.time() - spent_seconds

    def factor(self, step: int) -> float:
        """The learning-rate multiplier at optimizer step `step` (the schedulers' lambda)."""
        return self.plan.factor(step)

    @property
    def seconds(self) -> float:
        """Training seconds so far, a resumed run's earlier ones included."""
        return time.time() - self.started

    def out_of_time(self, seconds: float) -> bool:
        """`seconds` of training have used up training.max_minutes."""
        return self.cfg.max_minutes is not None and seconds / 60 >= self.cfg.max_minutes

    def evaluated(self, seconds: float) -> None:
        """An evaluation took `seconds` of the time the next re-plan measures: not step time."""
        self.eval_spent += seconds

    def after_step(self, step: int, device, timed_evaluation: Callable[[], float], log) -> bool:
        """Time `step` where the plan asks (the probe's steps, its end, a re-plan step) and plan or re-plan there;
        `timed_evaluation()` runs and logs the evaluation the plan accounts for and returns its seconds. True when
        the plan changed."""
        plan = self.plan
        if not (plan.probing or step in (plan.hold, plan.replan_step)):
            return False
        dev.synchronize(device)
        self.times[step] = time.time()
        if plan.probing and step == plan.hold:
            self.plan = self._plan_after_probe(timed_evaluation, log)
            self.times[step] = time.time()  # the steady steps are timed from after that evaluation
            self.eval_spent = 0.0
        elif step == plan.replan_step and len(self.times) > 1:
            since = max(s for s in self.times if s < step)  # the last timing point
            steady = (self.times[step] - self.times[since] - self.eval_spent) / (step - since)
            self.plan = replan(plan, step, steady, self.cfg.max_minutes * 60 - self.seconds, self.max_steps,
                               self.cfg.eval_every, self.eval_seconds)
            self.eval_spent = 0.0
            log(f"time budget: re-planned at step {step}: {steady * 1000:.1f} ms/step, {self.plan.shape} schedule "
                f"to step {self.plan.total}")
        return self.plan is not plan

    def _plan_after_probe(self, timed_evaluation: Callable[[], float], log) -> SchedulePlan:
        """The schedule for the steps that fit in what is left of training.max_minutes, from the probe's step time
        and one timed evaluation."""
        cfg = self.cfg
        hold = cfg.time_probe_steps
        timed = sorted((step, t) for step, t in self.times.items() if step >= MEASURE_SKIP)  # a resume may lose some
        if len(timed) >= 2:
            step_seconds = (timed[-1][1] - timed[0][1]) / (timed[-1][0] - timed[0][0])
        else:
            step_seconds = self.seconds / hold
        self.eval_seconds = timed_evaluation()
        plan = plan_for_budget(hold, step_seconds, cfg.max_minutes * 60 - self.seconds, cfg.warmup_ratio,
                               cfg.lr_schedule, max_steps=self.max_steps, eval_every=cfg.eval_every,
                               eval_seconds=self.eval_seconds, decay_ratio=cfg.lr_decay_ratio)
        log(f"time budget {cfg.max_minutes} min: {plan.note}; warmup {plan.warmup}, {plan.shape} schedule to step "
            f"{plan.total}" + (f", re-planned at step {plan.replan_step}" if plan.replan_step else ""))
        return plan
