"""EAGLE-3 drafter: TTT attention and loss against slow references written here."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.section import default_aux_layer_ids
from draftsmith.models.eagle3.loss import teacher_targets, ttt_loss
from draftsmith.models.eagle3.model import Eagle3Drafter

H, V, VD = 32, 50, 20


ALL_FLAGS = dict(norm_before_fc=True, fc_norm=True, norm_before_residual=True, norm_output=True)
FLAG_SETS = [{}, ALL_FLAGS, dict(norm_before_fc=True, norm_before_residual=True, norm_output=True)]


def tiny_drafter(seed=0, **flags):
    torch.manual_seed(seed)
    config = Eagle3Config(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, vocab_size=V, draft_vocab_size=VD, target_hidden_size=H, num_target_layers=8,
                          aux_layer_ids=[2, 4, 5], **flags)
    drafter = Eagle3Drafter(config).float().eval()
    for p in drafter.parameters():  # RMSNorm weights start at 1; randomise so the test sees every weight
        nn.init.normal_(p, std=0.3)
    used = torch.randperm(V)[:VD].sort().values
    drafter.d2t.copy_(used - torch.arange(VD))
    drafter.t2d.zero_()
    drafter.t2d[used] = True
    return drafter


def test_default_aux_layer_ids_pinned():
    assert default_aux_layer_ids(32) == [2, 16, 29]
    assert default_aux_layer_ids(8) == [2, 4, 5]
    assert default_aux_layer_ids(36) == [2, 18, 33]


@pytest.mark.parametrize("flags", FLAG_SETS, ids=["reference", "all-flags", "speculators-defaults"])
@torch.no_grad()
def test_ttt_equals_unrolled_cached_inference(flags):
    """Step i of TTT at position t must compute exactly what the runtime computes when it drafts i+1 tokens from
    context x_0..x_{t+1}: same keys, same positions, same mask (and the same norms, for every forward variant)."""
    drafter = tiny_drafter(**flags)
    S, steps = 7, 3
    aux = torch.randn(1, S, 3 * H)
    token_embeds = torch.randn(1, S, H)
    ttt = drafter.forward_ttt(aux, token_embeds, num_steps=steps)
    fused = drafter.fuse(aux)
    for t in range(S - 1):
        cache = drafter.new_cache(1, 32, torch.float32, "cpu")
        # context pairs (embed(x_{j+1}), g_j) for j = 0..t
        hidden = drafter.step(token_embeds[:, 1:t + 2], fused[:, : t + 1], cache)[:, -1:]
        torch.testing.assert_close(drafter.logits(hidden)[:, 0], ttt[0][:, t], atol=1e-4, rtol=1e-4)
        for i in range(1, steps):
            if t + 1 + i >= S:
                break
            hidden = drafter.step(token_embeds[:, t + 1 + i: t + 2 + i], hidden, cache)
            torch.testing.assert_close(drafter.logits(hidden)[:, 0], ttt[i][:, t], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_ttt_attention_pattern_as_a_grid():
    """Which earlier step outputs can influence step 1 at position t: step-0 keys at positions <= t, and only the
    step-1 key at t itself. Perturbing a future position or another position's step-1 input changes nothing."""
    drafter = tiny_drafter(1)
    S = 5
    aux = torch.randn(1, S, 3 * H)
    emb = torch.randn(1, S, H)
    base = drafter.forward_ttt(aux, emb, num_steps=2)
    # allowed[t][u]: does aux at position u reach step-1 output at position t
    allowed = [[1, 0, 0, 0, 0],
               [1, 1, 0, 0, 0],
               [1, 1, 1, 0, 0],
               [1, 1, 1, 1, 0],
               [1, 1, 1, 1, 1]]
    for u in range(S):
        aux2 = aux.clone()
        aux2[:, u] += 1.0
        out = drafter.forward_ttt(aux2, emb, num_steps=2)
        for t in range(S):
            changed = not torch.allclose(out[1][:, t], base[1][:, t], atol=1e-6)
            assert changed == bool(allowed[t][u]), (t, u)


@torch.no_grad()
def test_ttt_attention_pattern_per_step_keys(monkeypatch):
    """Which keys a TTT step-2 query sees, key by key: perturb the key of one step at one position (nothing else)
    and watch step 2's outputs. Step-0 keys are seen causally, the keys of steps 1 and 2 only at the query's own
    position (the diagonal). A pattern that were causal over later steps' keys, or diagonal only, fails here."""
    drafter = tiny_drafter(3)
    S, steps = 6, 3
    aux, emb = torch.randn(1, S, 3 * H), torch.randn(1, S, H)
    attn = drafter.midlayer.self_attn
    real_qkv = attn.qkv
    plan = {}  # (step, position) whose key gets a bump

    def qkv(x, cos, sin):
        q, k, v = real_qkv(x, cos, sin)
        step = qkv.calls
        qkv.calls += 1
        if plan.get("step") == step:
            k = k.clone()
            k[:, :, plan["position"]] += 3.0
        return q, k, v

    monkeypatch.setattr(attn, "qkv", qkv)
    qkv.calls = 0
    base = drafter.forward_ttt(aux, emb, num_steps=steps)[2]
    for step in range(steps):
        for u in range(S):
            plan.update(step=step, position=u)
            qkv.calls = 0
            out = drafter.forward_ttt(aux, emb, num_steps=steps)[2]
            for t in range(S):
                changed = not torch.allclose(out[:, t], base[:, t], atol=1e-6)
                expected = t >= u if step == 0 else t == u
                assert changed == expected, (step, u, t)


def slow_ttt_loss(step_logits, teacher_logits_full, t2d, loss_mask, decay):
    """Per position, per step, written out with the alignment of DESIGN.md: step i at t -> target logits t+1+i."""
    S = loss_mask.shape[1]
    total, counts = 0.0, []
    for i, logits in enumerate(step_logits):
        acc, n = 0.0, 0
        for t in range(S):
            p_pos, tok_pos = t + 1 + i, t + 2 + i
            if tok_pos >= S or not loss_mask[0, tok_pos]:
                continue
            full = teacher_logits_full[0, p_pos]
            if not t2d[full.argmax()]:
                continue
            p = torch.softmax(full[t2d], -1)
            acc += -(p * torch.log_softmax(logits[0, t], -1)).sum().item()
            n += 1
        total += decay ** i * (acc / max(n, 1))
        counts.append(n)
    return total, counts


def test_ttt_loss_matches_slow_reference():
    torch.manual_seed(3)
    S, steps = 9, 3
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V)[:VD]] = True
    teacher_full = torch.randn(1, S, V) * 3
    teacher_full[..., t2d] += 6  # argmaxes mostly in the draft vocab,
    teacher_full[0, 4, ~t2d] += 50  # but one position's outside it
    step_logits = [torch.randn(1, S, VD) for _ in range(steps)]
    for i, t in [(0, 1), (1, 1), (0, 2), (0, 3), (1, 3), (2, 3)]:  # some right drafts: runs of 0 to 3 steps
        step_logits[i][0, t] = teacher_full[0, t + 1 + i][t2d] * 10
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 1, 1]])
    in_draft = t2d[teacher_full.argmax(-1)]
    loss, metrics = ttt_loss(step_logits, teacher_full[..., t2d], in_draft, loss_mask, decay=0.8)
    expected, counts = slow_ttt_loss(step_logits, teacher_full, t2d, loss_mask, 0.8)
    assert math.isclose(loss.item(), expected, rel_tol=1e-5)
    assert [metrics[f"count_{i}"].item() for i in range(steps)] == counts
    assert 0 < counts[0] <= 5  # at most the 5 masked tokens that have a step-0 predictor
    # simulated acceptance length, written out: per position with a valid step 0, 1 + the leading correct steps
    runs = []
    for t in range(S):
        def ok(i):
            p_pos, tok_pos = t + 1 + i, t + 2 + i
            return (tok_pos < S and bool(loss_mask[0, tok_pos]) and bool(t2d[teacher_full[0, p_pos].argmax()])
                    and step_logits[i][0, t].argmax() == teacher_full[0, p_pos][t2d].argmax())
        if t + 2 < S and loss_mask[0, t + 2] and t2d[teacher_full[0, t + 1].argmax()]:
            run = 0
            while run < steps and ok(run):
                run += 1
            runs.append(run)
    assert sum(runs) > 0 and metrics["sim_accept_len"].item() == pytest.approx(1 + sum(runs) / len(runs))


def test_simulated_acceptance_counts_leading_correct_steps():
    torch.manual_seed(0)
    S = 6
    teacher = torch.randn(1, S, VD)
    in_draft = torch.ones(1, S, dtype=torch.bool)
    loss_mask = torch.ones(1, S, dtype=torch.long)
    # a drafter that copies the teacher at every step is always right: positions 0..3 valid at step 0 and the
    # chain from t runs while t+2+i < S, so accepted drafts per position are (3, 3, 2, 1) -> 1 + 9/4.
    perfect = [torch.cat([teacher[:, 1 + i:], torch.zeros(1, 1 + i, VD)], 1) for i in range(3)]
    _, m = ttt_loss(perfect, teacher, in_draft, loss_mask)
    assert math.isclose(m["sim_accept_len"].item(), 1 + 9 / 4, rel_tol=1e-6)
    assert m["acc_0"].item() == 1.0


def test_teacher_targets_chunked_equals_full():
    torch.manual_seed(0)
    head = nn.Linear(H, V, bias=False)
    hidden = torch.randn(2, 11, H)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[::3] = True
    draft_logits, in_draft = teacher_targets(hidden, head, t2d, chunk_size=4)
    full = head(hidden)
    torch.testing.assert_close(draft_logits, full[..., t2d])
    assert torch.equal(in_draft, t2d[full.argmax(-1)])


@torch.no_grad()
def test_static_greedy_chain_equals_the_eager_chain():
    """The shape-static chain (what the CUDA graph records) drafts what the eager cached steps draft, with stale
    slots of an earlier, longer draft still in the cache."""
    from draftsmith.models.eagle3.proposer import Eagle3Proposer

    drafter = tiny_drafter(4)
    embed = nn.Embedding(V, H)
    proposer = Eagle3Proposer(drafter, embed)
    prompt = torch.randint(0, V, (1, 6))
    proposer.begin(prompt)
    proposer.extend(torch.randint(0, V, (1, 6)), torch.randn(1, 6, 3 * H))
    proposer.propose(5)  # leaves 4 stale speculative slots
    proposer.extend(torch.randint(0, V, (1, 2)), torch.randn(1, 2, 3 * H))
    committed = proposer.committed
    want = proposer.propose(4)
    start = torch.full((1, 1), committed, dtype=torch.long)
    proposer.cache.keys[0, :, :, committed:] = 1e4  # garbage past the context must stay unseen
    tokens, scores = drafter.chain_static(proposer.next_hidden, start, proposer.cache, embed, 4)
    assert torch.equal(tokens, want.token_ids)
    torch.testing.assert_close(scores, want.scores, atol=1e-5, rtol=1e-5)


def _rms(x, weight, eps=1e-5):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def vllm_style_first_step(drafter, aux, embeds):
    """One draft step over a whole causal context, written out the way vLLM's llama_eagle3.py computes it:
    combine_hidden_states (input_norm / fc_norm, then fc), layer 0 with `_residual_norm`, then the fused
    `norm(hidden, residual)` that returns (normed, prenorm); logits from the normed state, and the hidden handed on
    is the normed one with norm_output, else the prenorm one."""
    cfg, layer, attn = drafter.config, drafter.midlayer, drafter.midlayer.self_attn
    x = aux
    if cfg.norm_before_fc:
        x = _rms(x, drafter.input_norm.weight)
    if cfg.fc_norm:
        x = torch.cat([_rms(c, n.weight) for n, c in zip(drafter.fc_norm, x.chunk(3, dim=-1))], dim=-1)
    h = x @ drafter.fc.weight.T
    normed_h = _rms(h, layer.hidden_norm.weight)
    residual = normed_h if cfg.norm_before_residual else h
    a_in = torch.cat([_rms(embeds, layer.input_layernorm.weight), normed_h], dim=-1)
    s = a_in.shape[1]
    cos, sin = drafter.rope(a_in, torch.arange(s)[None])
    q, k, v = attn.qkv(a_in, cos, sin)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, s, -1)
    residual = residual + o @ attn.o_proj.weight.T
    m = _rms(residual, layer.post_attention_layernorm.weight)
    mlp = layer.mlp
    out = residual + (F.silu(m @ mlp.gate_proj.weight.T) * (m @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    normed = _rms(out, drafter.norm.weight)
    return normed @ drafter.lm_head.weight.T, (normed if cfg.norm_output else out)


@pytest.mark.parametrize("flags", [{}, ALL_FLAGS, dict(norm_before_residual=True), dict(norm_output=True),
                                   dict(norm_before_fc=True), dict(fc_norm=True)],
                         ids=["none", "all", "norm_before_residual", "norm_output", "norm_before_fc", "fc_norm"])
@torch.no_grad()
def test_forward_variants_compute_what_vllm_computes(flags):
    """Each flag changes the output (so a drafter that ignored it would fail here), and the runtime step, the TTT
    step 0 and the handed-on hidden all equal the vLLM-style reference above."""
    drafter = tiny_drafter(5, **flags)
    S = 6
    aux, embeds = torch.randn(1, S, 3 * H) * 4, torch.randn(1, S, H)
    want_logits, want_hidden = vllm_style_first_step(drafter, aux, embeds)
    cache = drafter.new_cache(1, 16, torch.float32, "cpu")
    hidden = drafter.step(embeds, drafter.fuse(aux), cache)
    torch.testing.assert_close(hidden, want_hidden, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(drafter.logits(hidden), want_logits, atol=1e-4, rtol=1e-4)
    shifted = torch.cat([torch.zeros(1, 1, H), embeds], dim=1)  # TTT step 0 at t reads embed(x_{t+1})
    ttt0 = drafter.forward_ttt(torch.cat([aux, torch.zeros(1, 1, 3 * H)], dim=1), shifted, num_steps=1)[0]
    torch.testing.assert_close(ttt0[:, :S], want_logits, atol=1e-4, rtol=1e-4)
    if flags:
        plain = tiny_drafter(5)
        plain.load_state_dict(drafter.state_dict(), strict=False)
        plain_logits, plain_hidden = vllm_style_first_step(plain, aux, embeds)
        assert not (torch.allclose(plain_logits, want_logits, atol=1e-3)
                    and torch.allclose(plain_hidden, want_hidden, atol=1e-3))


def slow_lk(logits, teacher, eta):
    """The hybrid LK loss of one position, from the paper's definition: lambda * KL(p||q) + (1 - lambda) * TV with
    TV = 1 - sum_x min(p(x), q(x)) and lambda = exp(-eta * alpha), alpha held constant in lambda."""
    p, q = torch.softmax(teacher, -1), torch.softmax(logits, -1)
    alpha = sum(torch.minimum(p[x], q[x]) for x in range(p.shape[0]))
    kl = sum(p[x] * (torch.log(p[x]) - torch.log(q[x])) for x in range(p.shape[0]))
    lam = math.exp(-eta * float(alpha))
    return lam * kl + (1 - lam) * (1 - alpha)


def test_lk_loss_matches_the_definition_in_value_and_gradient():
    torch.manual_seed(7)
    S, steps, eta = 6, 2, 3.0
    teacher = torch.randn(1, S, VD) * 2
    in_draft = torch.ones(1, S, dtype=torch.bool)
    loss_mask = torch.tensor([[1, 1, 1, 1, 1, 1]])
    step_logits = [torch.randn(1, S, VD, requires_grad=True) for _ in range(steps)]
    loss, metrics = ttt_loss(step_logits, teacher, in_draft, loss_mask, decay=0.5, kind="lk", lk_eta=eta)
    loss.backward()
    ref_logits = [x.detach().clone().requires_grad_(True) for x in step_logits]
    expected = 0.0
    for i, logits in enumerate(ref_logits):
        terms = [slow_lk(logits[0, t], teacher[0, t + 1 + i], eta) for t in range(S - 2 - i)]  # x_{t+2+i} exists
        expected = expected + 0.5 ** i * sum(terms) / len(terms)
    expected.backward()
    assert math.isclose(loss.item(), expected.item(), rel_tol=1e-5)
    for ours, ref in zip(step_logits, ref_logits):
        torch.testing.assert_close(ours.grad, ref.grad, atol=1e-6, rtol=1e-4)
    # soft_ce and lk share masking and alignment, and differ in value: the kind is honoured
    soft, _ = ttt_loss([x.detach() for x in step_logits], teacher, in_draft, loss_mask, decay=0.5)
    assert not math.isclose(soft.item(), loss.item(), rel_tol=1e-3)


def test_keeping_positions_outside_the_draft_vocab_counts_them():
    torch.manual_seed(2)
    S = 8
    teacher = torch.randn(1, S, VD)
    in_draft = torch.ones(1, S, dtype=torch.bool)
    in_draft[0, 3] = False
    loss_mask = torch.ones(1, S, dtype=torch.long)
    logits = [torch.randn(1, S, VD)]
    _, masked = ttt_loss(logits, teacher, in_draft, loss_mask)
    _, kept = ttt_loss(logits, teacher, in_draft, loss_mask, mask_outside_draft_vocab=False)
    assert (masked["count_0"].item(), kept["count_0"].item()) == (S - 3, S - 2)


def test_a_non_finite_draft_never_counts_as_correct():
    teacher = torch.zeros(1, 4, VD)
    teacher[..., 0] = 5.0
    logits = torch.full((1, 4, VD), float("nan"))
    _, m = ttt_loss([logits], teacher, torch.ones(1, 4, dtype=torch.bool), torch.ones(1, 4, dtype=torch.long))
    assert m["acc_0"].item() == 0.0 and m["sim_accept_len"].item() == 1.0


def test_compiled_ttt_halves_compile_once_under_autocast():
    """Under bf16 autocast with fp32 weights (how the trainer runs), fc's bf16 output starts the unroll and every
    later step hands on an fp32 hidden: the unroll takes one dtype throughout, so each compiled step half compiles
    once, not once per dtype (a second compile cost ~10 s of EAGLE-3's first step on an H100)."""
    from torch._dynamo.testing import CompileCounter

    from draftsmith.models.eagle3.training import TTTOptions, apply_training_options

    torch._dynamo.reset()
    counter = CompileCounter()
    drafter = apply_training_options(tiny_drafter(**ALL_FLAGS).train(),
                                     TTTOptions(attention="reference", compile=True, compile_backend=counter))
    aux, token_embeds = torch.randn(2, 9, 3 * H), torch.randn(2, 9, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = tiny_drafter(**ALL_FLAGS).forward_ttt(aux, token_embeds, num_steps=4, return_hidden=True)
        hidden = drafter.forward_ttt(aux, token_embeds, num_steps=4, return_hidden=True)
    assert {h.dtype for h in hidden} == {torch.float32}
    assert counter.frame_count == 2  # step_qkv and step_finish, one graph each
    for got, want in zip(hidden, eager):
        torch.testing.assert_close(got, want)
    torch._dynamo.reset()
