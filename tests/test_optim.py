"""Optimizers, the schedule and the plan a time budget makes; token-budget micro-batches."""

import json
import math

import pytest
import torch

from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.model import Eagle3Drafter
from draftsmith.train import train
from draftsmith.train import budget as budget_mod
from draftsmith.train import loop as loop_mod
from draftsmith.train.optim import build_optimizers, fixed_plan, muon_groups, plan_for_budget, probe_plan, replan
from draftsmith.train.batching import epoch_batches
from test_train import tiny_recipe, write_conversations  # shared helpers, same folder


def test_fixed_plan_is_warmup_then_cosine_to_zero():
    plan = fixed_plan(100, 0.05)
    assert plan.warmup == 5 and plan.hold == 0
    assert [plan.factor(s) for s in range(5)] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert plan.factor(5) == 1.0
    assert plan.factor(5 + 95 // 2) == pytest.approx(0.5 * (1 + math.cos(math.pi * 47 / 95)))
    assert plan.factor(100) == pytest.approx(0.0, abs=1e-12)
    linear = fixed_plan(100, 0.05, "linear")
    assert linear.factor(5 + 19) == pytest.approx(1 - 19 / 95)


def test_constant_and_wsd_plans_hold_the_rate_and_wsd_decays_at_the_end():
    constant = fixed_plan(100, 0.05, "constant")
    assert constant.factor(2) == pytest.approx(0.6) and constant.factor(50) == constant.factor(99) == 1.0
    wsd = fixed_plan(105, 0.05, "wsd", decay_ratio=0.2)  # 5 warmup steps, then 100: 80 stable, 20 decaying
    assert wsd.warmup == 5
    assert wsd.factor(5 + 80) == 1.0
    assert wsd.factor(5 + 90) == pytest.approx(0.5)
    assert wsd.factor(105) == pytest.approx(0.0, abs=1e-12)
    resumed = type(wsd).from_dict(json.loads(json.dumps(wsd.to_dict())))  # the plan a checkpoint keeps
    assert resumed.factor(5 + 95) == pytest.approx(wsd.factor(5 + 95))


def test_budget_plan_fits_steps_and_evaluations_into_the_time_left():
    """61 s left at 0.1 s a step, 3% kept free (59.17 s usable), a 2 s evaluation every 100 steps and one at the
    end: 490 steps end on the step-500 evaluation, 49.0 s plus 5 evaluations = 59.0 s; 491 steps would take
    49.1 s plus 6 (the final one no longer coincides with a periodic one) = 61.1 s."""
    plan = plan_for_budget(10, 0.1, 61.0, 0.03, eval_every=100, eval_seconds=2.0)
    assert (plan.hold, plan.total, plan.warmup) == (10, 500, 14)
    assert [plan.factor(s) for s in range(10)] == [0.0] * 10  # the probe ran at lr 0
    assert plan.factor(10) == pytest.approx(1 / 14) and plan.factor(23) == 1.0
    assert plan.factor(500) == pytest.approx(0.0, abs=1e-12)  # the schedule ends where the budget does
    assert "490 steps" in plan.note and "5 evaluations" in plan.note
    assert plan_for_budget(10, 0.1, 61.0, 0.03).total == 10 + 591  # no evaluations: 59.17 s / 0.1 s
    capped = plan_for_budget(10, 0.1, 60.0, 0.03, max_steps=200)
    assert capped.total == 200 and "capped by max_steps 200" in capped.note
    assert probe_plan(10, None).factor(9) == 0.0


def test_replan_refits_the_decay_to_the_deadline_and_keeps_the_warmup():
    """The probe saw 0.2 s steps (first shapes, warm-up), the steady steps run at 0.1 s: at the end of warmup the
    plan is re-fitted so the schedule still ends at the deadline, with twice the steps it first planned."""
    first = plan_for_budget(10, 0.2, 61.0, 0.1)  # floor(61 x 0.97 / 0.2) = 295 steps, warmup 29
    assert (first.total, first.warmup, first.replan_step) == (10 + 295, 29, 10 + 29)  # max(warmup, 295 // 10)
    # at step 39 the steady steps took 29 x 0.1 s and 57.1 s are left -> floor(57.1 x 0.97 / 0.1) = 553
    second = replan(first, 39, 0.1, 57.1)
    assert (second.total, second.warmup, second.hold, second.replans) == (39 + 553, 29, 10, 1)
    assert second.replan_step == 39 + 553 // 2  # once more, halfway through what is left
    assert [second.factor(s) for s in range(39)] == [first.factor(s) for s in range(39)]  # the past is kept
    assert second.factor(39) == pytest.approx(1.0, abs=1e-4) and second.factor(second.total) == pytest.approx(0.0)
    assert "re-planned at step 39" in second.note
    third = replan(second, second.replan_step, 0.1, 27.7)
    assert third.replan_step is None and third.replans == 2  # no more than two re-fits
    assert plan_for_budget(10, 0.2, 5.0, 0.1).replan_step is None  # too short a run to re-time


class FakeClock:
    """time.time() for the trainer: it stands still except while the drafter computes a loss, which takes
    `step_seconds` for a training micro-batch and `eval_batch_seconds` for an evaluation batch (`timed_loss`). The
    probe's step time and every plan then follow from those figures and the budget alone."""

    def __init__(self, step_seconds: float, eval_batch_seconds: float, seconds_of=None):
        self.now = 1_000_000.0
        self.step_seconds, self.eval_batch_seconds = step_seconds, eval_batch_seconds
        self.seconds_of = seconds_of or (lambda micro_batch: step_seconds)  # the n-th training micro-batch's (1-based)
        self.micro_batches = 0

    def time(self):
        return self.now

    def timed_loss(self, real_loss):
        def loss(method, drafter, batch, features):
            if drafter.training:
                self.micro_batches += 1
                self.now += self.seconds_of(self.micro_batches)
            else:
                self.now += self.eval_batch_seconds
            return real_loss(method, drafter, batch, features)

        return loss


def test_time_budget_plans_the_schedule_and_ends_it_at_the_deadline(tmp_path, fixture_target_dir, monkeypatch):
    """Every plan (the probe's, then two re-fits) ends where the fake clock says the budget B runs out: at 1.5 s a
    step and 1 s an evaluation (two batches), a plan made at step k has B - 1.5 k - 1 seconds left (the probe's
    evaluation is spent) and fits the most steps n with 1.5 n + 1 (the final evaluation) <= 97% of that. A probe
    that misjudged the step time would plan another first total."""
    from draftsmith.models.eagle3.training import Eagle3Method
    from draftsmith.train.optim import SAFETY_MARGIN
    from test_train import tiny_random_target

    clock = FakeClock(step_seconds=1.5, eval_batch_seconds=0.5)
    monkeypatch.setattr(budget_mod, "time", clock)  # the budget's clock, and the evaluations' the loop times
    monkeypatch.setattr(loop_mod, "time", clock)
    monkeypatch.setattr(Eagle3Method, "loss", clock.timed_loss(Eagle3Method.loss))
    target = tiny_random_target(tmp_path / "target", fixture_target_dir)
    data = write_conversations(tmp_path / "conv.jsonl")
    lines = []
    recipe = tiny_recipe(target, data, tmp_path, max_steps=None, epochs=1000, max_minutes=2.0, time_probe_steps=4,
                         grad_accum_steps=1, eval_every=1000, save_every=1000, warmup_ratio=0.1)
    budget = recipe.training.max_minutes * 60
    eval_seconds = math.ceil(recipe.data.eval_samples / recipe.training.batch_size) * clock.eval_batch_seconds
    started = clock.now
    train(recipe, log=lines.append)
    step_ms = f"{clock.step_seconds * 1000:.1f} ms/step"

    def planned_total(step: int) -> int:
        """Where a plan made at `step` ends: every step and one evaluation spent, the final one still due."""
        seconds_left = budget - step * clock.step_seconds - eval_seconds
        return step + math.floor((seconds_left * (1 - SAFETY_MARGIN) - eval_seconds) / clock.step_seconds)

    first = next(line for line in lines if line.startswith("time budget 2.0 min:"))
    assert f"{step_ms} (median of probe steps 3..4)" in first  # the probe measured the clock's step time
    assert f"cosine schedule to step {planned_total(4)}," in first
    replans = [line for line in lines if line.startswith("time budget: re-planned at step")]
    assert len(replans) == 2  # re-fitted twice, each to the same deadline
    replan_steps = [int(line.split("re-planned at step ")[1].split(":")[0]) for line in replans]
    for line, step in zip(replans, replan_steps):
        assert line.endswith(f": {step_ms}, cosine schedule to step {planned_total(step)}"), line

    run = tmp_path / "run"
    state = json.loads((run / (run / "latest").read_text().strip() / "trainer_state.json").read_text())
    plan = state["plan"]
    assert plan["hold"] == 4 and plan["total"] == planned_total(replan_steps[-1])
    assert state["step"] == plan["total"]  # the run ended on its plan, not cut off by the deadline
    assert clock.now - started <= budget  # and inside the budget, the final evaluation included
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lr = {r["step"]: r["lr"] for r in rows if "lr" in r}
    assert all(lr[s] == 0.0 for s in range(1, 4)) and lr[5] > 0
    assert lr[plan["total"]] == pytest.approx(0.0, abs=1e-12)


def budget_run(tmp_path, fixture_target_dir, monkeypatch, clock, **training):
    """A tiny EAGLE-3 run under a time budget on `clock`; (its log lines, its last trainer_state.json)."""
    from draftsmith.models.eagle3.training import Eagle3Method
    from test_train import tiny_random_target

    monkeypatch.setattr(budget_mod, "time", clock)
    monkeypatch.setattr(loop_mod, "time", clock)
    monkeypatch.setattr(Eagle3Method, "loss", clock.timed_loss(Eagle3Method.loss))
    target = tiny_random_target(tmp_path / "target", fixture_target_dir)
    data = write_conversations(tmp_path / "conv.jsonl")
    lines = []
    recipe = tiny_recipe(target, data, tmp_path, max_steps=None, epochs=1000, grad_accum_steps=1, eval_every=10**6,
                         save_every=10**6, warmup_ratio=0.1, **training)
    recipe.data.eval_samples = 0
    train(recipe, log=lines.append)
    run = tmp_path / "run"
    return lines, json.loads((run / (run / "latest").read_text().strip() / "trainer_state.json").read_text())


def test_a_probe_whose_first_steps_compile_plans_from_its_steady_steps(tmp_path, fixture_target_dir, monkeypatch):
    """Issue 47 item 15 on a fake clock: the first three steps take 35 s (compilation), the rest 126 ms, a 3.2 min
    budget and a 10-step probe. The plan is made from the steady 126 ms (the median of probe steps 6..10), the 105 s
    to the first steady step are printed, and the run fills the budget (the old mean over probe steps 2..9 said
    4,984 ms and cut the run to 17 steps)."""
    from draftsmith.train.optim import SAFETY_MARGIN

    clock = FakeClock(0.126, 0.0, seconds_of=lambda n: 35.0 if n <= 3 else 0.126)
    lines, state = budget_run(tmp_path, fixture_target_dir, monkeypatch, clock, max_minutes=3.2, time_probe_steps=10)
    first = next(line for line in lines if line.startswith("time budget 3.2 min:"))
    assert "126.0 ms/step (median of probe steps 6..10)" in first, first
    assert first.endswith("; steady from step 4, 105.0 s after the first step began (compilation, warm-up)"), first
    seconds_left = 3.2 * 60 - 3 * 35.0 - 7 * 0.126
    planned = 10 + math.floor(seconds_left * (1 - SAFETY_MARGIN) / 0.126)
    assert f"cosine schedule to step {planned}," in first, first
    assert state["step"] == state["plan"]["total"] >= planned - 5  # re-fits keep it at the deadline


def test_a_step_time_that_drops_after_the_probe_is_re_planned_at_once(tmp_path, fixture_target_dir, monkeypatch):
    """Compilation that outlasts the probe: every probe step takes 2 s (each a new shape), the steps after it 1 s.
    Five steps after the probe the step time is checked and the plan re-fitted to the budget at once, instead of
    ending at half the steps that fit (a plan that short has no later re-fit)."""
    from draftsmith.train.budget import EARLY_CHECK_STEPS
    from draftsmith.train.optim import SAFETY_MARGIN

    clock = FakeClock(1.0, 0.0, seconds_of=lambda n: 2.0 if n <= 4 else 1.0)
    lines, state = budget_run(tmp_path, fixture_target_dir, monkeypatch, clock, max_minutes=1.0, time_probe_steps=4)
    first = next(line for line in lines if line.startswith("time budget 1.0 min:"))
    probe_plan = 4 + math.floor((60 - 4 * 2.0) * (1 - SAFETY_MARGIN) / 2.0)
    assert "2000.0 ms/step" in first and first.endswith(f"cosine schedule to step {probe_plan}"), first
    assert "re-planned at step" not in first  # too short a plan for a later re-fit
    check = 4 + EARLY_CHECK_STEPS
    early = next(line for line in lines if "not the probe's" in line)
    assert early.startswith(f"time budget: 1000.0 ms/step over steps 5..{check}, not the probe's 2000.0: "
                            f"re-planned at step {check}"), early
    seconds_left = 60 - 4 * 2.0 - EARLY_CHECK_STEPS * 1.0
    planned = check + math.floor(seconds_left * (1 - SAFETY_MARGIN) / 1.0)
    assert early.endswith(f"schedule to step {planned}"), early
    assert state["step"] == state["plan"]["total"] and abs(state["step"] - planned) <= 1  # a later re-fit may move it


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    config = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, vocab_size=50, draft_vocab_size=20, target_hidden_size=32, num_target_layers=8,
                          aux_layer_ids=[2, 4, 5], norm_before_fc=True)
    drafter = Eagle3Drafter(config)
    muon, adamw = muon_groups(drafter)
    names = {id(p): n for n, p in drafter.named_parameters()}
    assert sorted(names[id(p)] for p in muon) == sorted([
        "fc.weight", *(f"midlayer.self_attn.{x}_proj.weight" for x in "qkvo"),
        *(f"midlayer.mlp.{x}_proj.weight" for x in ("gate", "up", "down"))])
    assert "lm_head.weight" in {names[id(p)] for p in adamw} and "input_norm.weight" in {names[id(p)] for p in adamw}

    class Cfg:
        optimizer, lr, muon_lr, weight_decay, adam_betas = "muon", 1e-3, 2e-3, 0.0, (0.9, 0.95)

    opts = build_optimizers(drafter, Cfg)
    assert [type(o).__name__ for o in opts] == ["Muon", "AdamW"]
    assert opts[0].param_groups[0]["lr"] == 2e-3 and opts[1].param_groups[0]["lr"] == 1e-3


def test_dsparks_markov_tables_stay_with_adamw_under_muon():
    from draftsmith.models.dspark.model import DsparkDrafter
    from test_dspark import tiny_config  # shared helper, same folder

    drafter = DsparkDrafter(tiny_config(markov_head="gated"))
    muon, adamw = muon_groups(drafter)
    muon_names = {n for n, p in drafter.named_parameters() if any(p is q for q in muon)}
    adamw_names = {n for n, p in drafter.named_parameters() if any(p is q for q in adamw)}
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"} <= adamw_names
    # the gate and the backbone's matrices are hidden matrices: Muon
    assert "markov_head.gate_proj.weight" in muon_names and "fc.weight" in muon_names
    assert "layers.0.self_attn.q_proj.weight" in muon_names


def test_token_budget_batches_cover_the_epoch_with_little_padding():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 500, (400,), generator=g).tolist()
    budget = 2048
    batches = epoch_batches(lengths, 1, seed=3, epoch=0, rank=0, world=1, tokens_per_step=budget)
    assert sorted(i for b in batches for i in b) == list(range(400))  # every sample once
    assert all(len(b) * max(lengths[i] for i in b) <= budget for b in batches)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert padded < 1.1 * sum(lengths)  # similar lengths share a batch
    random_batches = [list(range(i, i + 8)) for i in range(0, 400, 8)]
    assert sum(len(b) * max(lengths[i] for i in b) for b in random_batches) > 1.4 * sum(lengths)
    again = epoch_batches(lengths, 1, seed=3, epoch=0, rank=0, world=1, tokens_per_step=budget)
    assert again == batches  # a pure function of (seed, epoch): resume sees the same batches
    assert epoch_batches(lengths, 1, seed=3, epoch=1, rank=0, world=1, tokens_per_step=budget) != batches
    ranks = [epoch_batches(lengths, 1, 3, 0, r, 2, budget) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) and not set(map(tuple, ranks[0])) & set(map(tuple, ranks[1]))


def test_muon_and_token_budget_training_resumes_exactly(tmp_path, fixture_target_dir, monkeypatch):
    data = write_conversations(tmp_path / "conv.jsonl")
    options = dict(optimizer="muon", tokens_per_step=192, lr_schedule="linear", loss="lk")

    def losses(run_dir):
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    train(tiny_recipe(fixture_target_dir, data, tmp_path / "full", **options), log=lambda *a: None)
    expected = losses(tmp_path / "full" / "run")
    real_save = loop_mod.save_checkpoint

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(loop_mod, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_recipe(fixture_target_dir, data, tmp_path / "cut", **options), log=lambda *a: None)
    monkeypatch.setattr(loop_mod, "save_checkpoint", real_save)
    train(tiny_recipe(fixture_target_dir, data, tmp_path / "cut", **options), log=lambda *a: None)
    resumed = losses(tmp_path / "cut" / "run")
    assert sorted(resumed) == sorted(expected) == [1, 2, 3, 4, 5, 6]
    for step in expected:
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step
