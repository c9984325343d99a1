"""The run's schedule plan, and with training.max_minutes the time budget that makes it: probe, hold, re-plan.

Without a budget the plan is fixed up front (optim.py fixed_plan). With one, the first training.time_probe_steps
steps run at learning rate 0 and are timed one by one (the probe's plan holds the rate there); the step time is the
median over the probe's second half, so the first steps' compilation (torch.compile, FlexAttention, new batch
shapes: tens of seconds each on a GPU) does not count as step time, and the step it settles at is printed. At the
end of the probe one evaluation is timed too, and the plan is made for the steps that fit in what is left (optim.py
plan_for_budget). EARLY_CHECK_STEPS later the step time is taken again, and a plan that is off by more than a
quarter (compilation that outlasted the probe) is re-fitted at once; later it is re-fitted from the steady step
time (optim.py replan) at the steps the plan names. The schedulers read the current plan through `factor`, so a
new plan takes effect at the next step. The plan is saved with every checkpoint (trainer_state.json), so a resumed
run keeps its schedule and the time it has spent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from draftsmith import device as dev
from draftsmith.train.optim import SchedulePlan, fixed_plan, plan_for_budget, probe_plan, replan

EARLY_CHECK_STEPS = 5  # steps after the probe at which its step time is checked
EARLY_CHECK_TOLERANCE = 0.25  # a step time this far off the plan's re-fits it then
SETTLED = 1.5  # a step within this factor of the steady step time counts as steady


@dataclass
class ProbeTiming:
    """What the probe's per-step times say: `step_seconds` the steady step time (the median duration of the
    probe's second half, steps `median_from`..`median_to`); `steady_from` the first step after which every probe
    step ran within SETTLED of it, reached `to_steady` seconds after the clock started (compilation, warm-up)."""

    step_seconds: float
    median_from: int
    median_to: int
    steady_from: int
    to_steady: float


def probe_timing(times: dict[int, float], started: float, hold: int) -> ProbeTiming:
    """The probe's timing from `times` (step -> wall time at its end) and `started` (the clock before step 1). A
    resumed probe may miss some steps: those durations are left out."""
    import statistics

    ends = {0: started, **times}
    durations = {step: ends[step] - ends[step - 1] for step in range(1, hold + 1) if step in ends and step - 1 in ends}
    if not durations:
        return ProbeTiming((times.get(hold, started) - started) / hold, 1, hold, 1, 0.0)
    median_steps = [step for step in durations if step > hold // 2] or list(durations)
    steady = statistics.median(durations[step] for step in median_steps)
    slow = [step for step, d in durations.items() if d > SETTLED * steady]
    steady_from = max(slow) + 1 if slow else min(durations)
    to_steady = ends[steady_from - 1] - started if steady_from - 1 in ends else 0.0
    return ProbeTiming(steady, min(median_steps), max(median_steps), steady_from, to_steady)


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
        early_check = self._early_check_step(plan)
        if not (plan.probing or step in (plan.hold, plan.replan_step, early_check)):
            return False
        dev.synchronize(device)
        self.times[step] = time.time()
        if plan.probing and step == plan.hold:
            self.plan = self._plan_after_probe(timed_evaluation, log)
            self.times[step] = time.time()  # the steady steps are timed from after that evaluation
            self.eval_spent = 0.0
        elif step == early_check:
            steady = (self.times[step] - self.times[plan.hold] - self.eval_spent) / (step - plan.hold)
            if abs(steady / plan.step_seconds - 1) > EARLY_CHECK_TOLERANCE:
                self.plan = replan(plan, step, steady, self.cfg.max_minutes * 60 - self.seconds, self.max_steps,
                                   self.cfg.eval_every, self.eval_seconds)
                self.eval_spent = 0.0
                log(f"time budget: {steady * 1000:.1f} ms/step over steps {plan.hold + 1}..{step}, not the probe's "
                    f"{plan.step_seconds * 1000:.1f}: re-planned at step {step}, {self.plan.shape} schedule to step "
                    f"{self.plan.total}")
        elif step == plan.replan_step and len(self.times) > 1:
            since = max(s for s in self.times if s < step)  # the last timing point
            steady = (self.times[step] - self.times[since] - self.eval_spent) / (step - since)
            self.plan = replan(plan, step, steady, self.cfg.max_minutes * 60 - self.seconds, self.max_steps,
                               self.cfg.eval_every, self.eval_seconds)
            self.eval_spent = 0.0
            log(f"time budget: re-planned at step {step}: {steady * 1000:.1f} ms/step, {self.plan.shape} schedule "
                f"to step {self.plan.total}")
        return self.plan is not plan

    def _early_check_step(self, plan: SchedulePlan) -> int | None:
        """The step at which the probe's plan is checked: EARLY_CHECK_STEPS after it, on a plan that reaches it and
        has not been re-fitted (a resumed run's plan may predate the check: none)."""
        if plan.probing or plan.replans or plan.step_seconds is None or plan.hold not in self.times:
            return None
        step = plan.hold + EARLY_CHECK_STEPS
        return step if step < plan.total and step != plan.replan_step else None

    def _plan_after_probe(self, timed_evaluation: Callable[[], float], log) -> SchedulePlan:
        """The schedule for the steps that fit in what is left of training.max_minutes, from the probe's step time
        and one timed evaluation."""
        cfg = self.cfg
        hold = cfg.time_probe_steps
        timing = probe_timing(self.times, self.started, hold)
        self.eval_seconds = timed_evaluation()
        plan = plan_for_budget(hold, timing.step_seconds, cfg.max_minutes * 60 - self.seconds, cfg.warmup_ratio,
                               cfg.lr_schedule, max_steps=self.max_steps, eval_every=cfg.eval_every,
                               eval_seconds=self.eval_seconds, decay_ratio=cfg.lr_decay_ratio,
                               measured=f"median of probe steps {timing.median_from}..{timing.median_to}")
        log(f"time budget {cfg.max_minutes} min: {plan.note}; warmup {plan.warmup}, {plan.shape} schedule to step "
            f"{plan.total}" + (f", re-planned at step {plan.replan_step}" if plan.replan_step else "")
            + (f"; steady from step {timing.steady_from}, {timing.to_steady:.1f} s after the first step began "
               "(compilation, warm-up)" if timing.steady_from > 1 else ""))
        return plan
