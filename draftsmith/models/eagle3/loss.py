"""EAGLE-3 training targets and loss, as pure functions.

Index alignment (see model.py): step i at drafter position t predicts x_{t+2+i}. The target's distribution over
that token is its logits at position p = t+1+i, so

    teacher(i, t) = target_logits[t + 1 + i]        valid(i, t) = loss_mask[t + 2 + i] and argmax in draft vocab

    t        0    1    2   ...
    step 0   p1   p2   p3       (predicts x2, x3, x4)
    step 1   p2   p3   p4       (predicts x3, x4, x5)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from draftsmith.kernels.chunked_loss import LossGrad, loss_chunk_rows, loss_grad_in_forward, sharded_by_deepspeed
from draftsmith.kernels.fused_head_loss import compute_dtype, head_loss_sum
from draftsmith.models.losses import shift_left, simulated_acceptance_length


@torch.no_grad()
def teacher_targets(last_hidden: torch.Tensor, lm_head: nn.Module, t2d: torch.Tensor, chunk_size: int = 1024,
                    draft_ids: torch.Tensor | None = None):
    """Target logits restricted to the draft vocab, and whether the full-vocab argmax lies inside it.

    last_hidden (B, S, H) is the final-normed target state. The full-vocabulary logits exist only one chunk of
    positions at a time, never for the whole batch. `draft_ids` (V_d,) are the draft vocabulary's target ids in
    ascending order (arange + d2t); given, they spare the host sync a boolean mask index costs.
    Returns draft_logits (B, S, V_d) float32 and in_draft (B, S) bool.
    """
    if draft_ids is None:
        draft_ids = t2d.nonzero().flatten()
    draft_logits, in_draft = [], []
    for start in range(0, last_hidden.shape[1], chunk_size):
        logits = lm_head(last_hidden[:, start:start + chunk_size]).float()  # (B, c, V)
        in_draft.append(t2d[logits.argmax(-1)])
        draft_logits.append(logits.index_select(-1, draft_ids))
    return torch.cat(draft_logits, 1), torch.cat(in_draft, 1)


def position_loss(logits, teacher_logits, kind: str = "soft_ce", lk_eta: float = 3.0):
    """Per-position loss (B, S) of drafter logits against teacher logits over the same (draft) vocabulary.

    soft_ce: -sum_x p(x) log q(x). lk: the hybrid LK loss (Samarin et al., arXiv 2602.23881), which optimises the
    acceptance rate alpha = sum_x min(p(x), q(x)) of speculative sampling directly:
        lambda * KL(p || q) + (1 - lambda) * (1 - alpha),   lambda = exp(-lk_eta * alpha), alpha not differentiated
    in lambda, so KL's strong gradient leads while the draft is far off and the acceptance term takes over as it
    nears the teacher.
    """
    log_q = torch.log_softmax(logits.float(), dim=-1)
    log_p = torch.log_softmax(teacher_logits.float(), dim=-1)
    p = log_p.exp()
    if kind == "soft_ce":
        return -(p * log_q).sum(-1)
    if kind != "lk":
        raise ValueError(f"unknown loss {kind!r}: expected soft_ce or lk")
    kl = (p * (log_p - log_q)).sum(-1)
    alpha = torch.minimum(p, log_q.exp()).sum(-1)
    weight = torch.exp(-lk_eta * alpha.detach())
    return weight * kl + (1.0 - weight) * (1.0 - alpha)


def step_valid(loss_mask, teacher_in_draft, i: int, mask_outside_draft_vocab: bool, doc_ids=None) -> torch.Tensor:
    """(B, S) bool: where TTT step i's prediction (of token t + 2 + i) counts. Its target is an assistant token,
    with `mask_outside_draft_vocab` one whose target argmax is in the draft vocabulary, and in a packed row one of
    the same sample (its inputs then are too)."""
    valid = shift_left(loss_mask.bool(), 2 + i, False)
    if mask_outside_draft_vocab:
        valid = valid & shift_left(teacher_in_draft, 1 + i, False)
    if doc_ids is not None:
        valid = valid & (shift_left(doc_ids, 2 + i, -1) == doc_ids)
    return valid


def _denominator(count: torch.Tensor, count_mean=None) -> torch.Tensor:
    """What a step's loss sum is divided by: its valid positions, or with `count_mean` (data-parallel training)
    their mean over the processes, so that the gradient the processes average is the one of the global batch."""
    if count_mean is None:
        return count.clamp(min=1)
    mean = count_mean(count)
    return torch.where(mean > 0, mean, torch.ones_like(mean))


def _record_step(metrics: dict, i: int, step_loss, correct, count) -> None:
    """Step i's metrics: its loss, top-1 accuracy over its valid positions, and their count (0-dim, no sync)."""
    metrics[f"loss_{i}"] = step_loss.detach()
    metrics[f"acc_{i}"] = correct.sum() / count.clamp(min=1)
    metrics[f"count_{i}"] = count


def ttt_loss(step_logits, teacher_draft_logits, teacher_in_draft, loss_mask, decay: float = 0.8,
             kind: str = "soft_ce", lk_eta: float = 3.0, mask_outside_draft_vocab: bool = True, doc_ids=None,
             count_mean=None):
    """Weighted loss over the unrolled steps: sum_i decay**i * L_i (see `position_loss` for the kinds).

    step_logits: list of (B, S, V_d) drafter logits; teacher_draft_logits (B, S, V_d); teacher_in_draft (B, S) bool;
    loss_mask (B, S) with 1 on assistant tokens. L_i averages over its valid positions: assistant tokens, and with
    `mask_outside_draft_vocab` only those whose target argmax lies in the draft vocabulary (the EAGLE-3 reference).
    Returns (loss, metrics) where metrics holds 0-dim tensors (no host sync here): per-step loss and top-1 accuracy
    (draft argmax == target argmax; a non-finite logit never counts as correct) and the simulated chain acceptance
    length (1 + leading correct steps, teacher-forced tokens).
    """
    total = 0.0
    metrics: dict[str, torch.Tensor] = {}
    correct_steps, valid_steps = [], []
    for i, logits in enumerate(step_logits):
        teacher = shift_left(teacher_draft_logits, 1 + i)  # (B, S, V_d)
        valid = step_valid(loss_mask, teacher_in_draft, i, mask_outside_draft_vocab, doc_ids)  # (B, S)
        per_pos = position_loss(logits, teacher, kind, lk_eta)  # (B, S)
        count = valid.sum()
        step_loss = torch.where(valid, per_pos, 0.0).sum() / _denominator(count, count_mean)
        total = total + (decay ** i) * step_loss
        finite = torch.isfinite(logits).all(-1)
        correct = (logits.argmax(-1) == teacher.argmax(-1)) & valid & finite
        correct_steps.append(correct)
        valid_steps.append(valid)
        _record_step(metrics, i, step_loss, correct, count)
    metrics["sim_accept_len"] = simulated_acceptance_length(correct_steps, valid_steps[0])
    return total, metrics


def _chunk_loss(hidden, teacher, valid, logits_fn, kind: str, lk_eta: float):
    """Loss sum and correctness over one chunk of positions: hidden (c, H), teacher (c, V_d), valid (c,)."""
    logits = logits_fn(hidden)  # (c, V_d)
    per_pos = position_loss(logits, teacher, kind, lk_eta)  # (c,)
    with torch.no_grad():
        correct = (logits.argmax(-1) == teacher.argmax(-1)) & valid & torch.isfinite(logits).all(-1)
    return torch.where(valid, per_pos, 0.0).sum(), correct


def _chunk_loss_fused(hidden, teacher, valid, head, kind: str, lk_eta: float, weight_compute):
    """`_chunk_loss` through the Triton kernel (kernels/fused_head_loss.py): head = (head_input, weight), the
    drafter's final norm (or identity) and its head; the loss sum differentiates to the hidden rows, the norm and
    the head like the reference's."""
    head_input, weight = head
    total, _, student_arg, teacher_arg = head_loss_sum(head_input(hidden), weight, valid, kind=kind,
                                                       teacher_logits=teacher, lk_eta=lk_eta,
                                                       weight_compute=weight_compute)
    return total, (student_arg == teacher_arg) & valid  # a non-finite row's argmax is -1: never correct


def _ttt_loss_and_grads(needs, params, flat_hidden, weights, step_chunks):
    """The body `fused_ttt_loss` runs in the forward pass (kernels/chunked_loss.loss_grad_in_forward): the weighted
    loss sum_i weights[i] * loss_sum_i, its gradients with respect to `params` then each step's hidden (where
    `needs` asks for them), and each step's loss sum and correctness (B*S,) as extras."""
    need_params, need_hidden = needs[:len(params)], needs[len(params):]
    param_grads = [torch.zeros_like(p, dtype=torch.float32) if need else None for p, need in zip(params, need_params)]
    trained = [p for p, need in zip(params, need_params) if need]
    accumulators = [g for g in param_grads if g is not None]  # one per tensor in `trained`
    total = flat_hidden[0].new_zeros((), dtype=torch.float32)
    sums, corrects, hidden_grads = [], [], []
    for i, hidden in enumerate(flat_hidden):
        hidden_grad = torch.zeros_like(hidden) if need_hidden[i] else None
        loss_sum = total.new_zeros(())
        correct = torch.zeros(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        base = hidden.detach().requires_grad_(need_hidden[i])
        for start, end, chunk_loss, args in step_chunks(i):
            with torch.enable_grad():
                part = base[start:end]  # a view, not a leaf (kernels/chunked_loss.py says why)
                part_loss, part_correct = chunk_loss(part, *args)
                wanted = ([part] if need_hidden[i] else []) + trained
                grads = list(torch.autograd.grad(part_loss * weights[i], wanted, allow_unused=True)) if wanted else []
            if need_hidden[i]:
                hidden_grad[start:end] = grads.pop(0)
            for acc, grad in zip(accumulators, grads):
                if grad is not None:
                    acc += grad
            loss_sum = loss_sum + part_loss.detach()
            correct[start:end] = part_correct
        total = total + weights[i] * loss_sum
        sums.append(loss_sum)
        corrects.append(correct)
        hidden_grads.append(hidden_grad)
    return total, param_grads + hidden_grads, (torch.stack(sums), torch.stack(corrects))


def fused_ttt_loss(logits_fn, step_hidden, teacher_draft_logits, teacher_in_draft, loss_mask, decay: float = 0.8,
                   kind: str = "soft_ce", lk_eta: float = 3.0, mask_outside_draft_vocab: bool = True,
                   chunk_size: int | None = None, doc_ids=None, count_mean=None, head_params=None,
                   loss_grad: LossGrad = "in_forward", loss_kernel: str = "reference", head=None):
    """`ttt_loss` of the logits `logits_fn(step_hidden[i])`, without ever holding a step's (B, S, V_d) logits.

    Positions are flattened to B*S rows and read `chunk_size` at a time (None: `loss_chunk_rows`). With
    `loss_grad` in_forward and `head_params`, every trainable tensor logits_fn reads (the head and its norm), each
    chunk's gradient is taken in the forward pass, weighted already by its step's decay and denominator (both known
    before the loss); with `recompute` (or no `head_params`, or a ZeRO-3 head) each chunk is recomputed in the
    backward pass (kernels/chunked_loss.py says why the first is cheaper). Step i's teacher for flattened row r is
    teacher row r + 1 + i: inside a sequence that is position t + 1 + i, and where it would cross into the next
    sequence the position is invalid anyway (loss_mask[t + 2 + i] lies past the end), so every chunk's teacher is a
    contiguous slice, never a copy. Same values, gradients and metrics as `ttt_loss` (tests/test_ttt_memory.py).
    `loss_kernel` "fused" (kernels/fused_head_loss.resolve_backend) computes each chunk with the Triton kernel, given
    `head` = (head_input, head weight) with logits_fn(h) = head_input(h) @ weight^T; the `recompute` path (and a
    ZeRO-3 head) stays on the plain-torch chunk (tests/test_fused_head_loss.py).
    """
    b, s, _ = step_hidden[0].shape
    rows = b * s
    teacher = teacher_draft_logits.reshape(rows, -1)  # (B*S, V_d), a view
    chunk_size = loss_chunk_rows(teacher.shape[-1], chunk_size)
    flat_hidden = [hidden.reshape(rows, -1) for hidden in step_hidden]
    valid = [step_valid(loss_mask, teacher_in_draft, i, mask_outside_draft_vocab, doc_ids)
             for i in range(len(step_hidden))]  # (B, S) each
    counts = [v.sum() for v in valid]
    denominators = [_denominator(count, count_mean) for count in counts]
    flat_valid = [v.reshape(rows) for v in valid]
    grad_needed = torch.is_grad_enabled() and any(h.requires_grad for h in flat_hidden)

    in_forward = bool(grad_needed and loss_grad == "in_forward" and head_params
                      and not sharded_by_deepspeed(head_params))
    fused = loss_kernel == "fused" and (in_forward or not grad_needed)
    if fused and head is None:
        raise ValueError("loss_kernel fused needs head=(head_input, head weight)")
    # the head in the product's dtype once, not at every chunk (autocast caches its cast of the weight as well)
    weight_compute = head[1].detach().to(compute_dtype(flat_hidden[0], head[1])) if fused else None

    def step_chunks(i):
        """(start, end, chunk function, its args) of step i: row r needs teacher row r + 1 + i < B*S."""
        for start in range(0, max(rows - 1 - i, 0), chunk_size):
            end = min(start + chunk_size, rows - 1 - i)
            part_teacher, part_valid = teacher[start + 1 + i:end + 1 + i], flat_valid[i][start:end]
            if fused:
                yield start, end, _chunk_loss_fused, (part_teacher, part_valid, head, kind, lk_eta, weight_compute)
            else:
                yield start, end, _chunk_loss, (part_teacher, part_valid, logits_fn, kind, lk_eta)

    if in_forward:
        params = [p for p in head_params if p.requires_grad]
        weights = [(decay ** i) / denominators[i] for i in range(len(flat_hidden))]
        total, step_sums, step_correct = loss_grad_in_forward(
            lambda needs: _ttt_loss_and_grads(needs, params, flat_hidden, weights, step_chunks), params + flat_hidden)
    else:
        total, sums, corrects = 0.0, [], []
        for i, hidden in enumerate(flat_hidden):
            loss_sum = hidden.new_zeros((), dtype=torch.float32)
            correct = torch.zeros(rows, dtype=torch.bool, device=hidden.device)
            for start, end, chunk_loss, args in step_chunks(i):
                if grad_needed:
                    part_loss, part_correct = checkpoint(chunk_loss, hidden[start:end], *args, use_reentrant=False)
                else:
                    part_loss, part_correct = chunk_loss(hidden[start:end], *args)
                loss_sum = loss_sum + part_loss
                correct[start:end] = part_correct
            total = total + (decay ** i) * loss_sum / denominators[i]
            sums.append(loss_sum)
            corrects.append(correct)
        step_sums, step_correct = sums, corrects
    metrics: dict[str, torch.Tensor] = {}
    correct_steps = []
    for i in range(len(flat_hidden)):
        correct = step_correct[i].view(b, s)
        correct_steps.append(correct)
        _record_step(metrics, i, step_sums[i] / denominators[i], correct, counts[i])
    metrics["sim_accept_len"] = simulated_acceptance_length(correct_steps, valid[0])
    return total, metrics
