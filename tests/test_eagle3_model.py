"""EAGLE-3 drafter: TTT attention and loss against slow references written here."""

import math

import torch
from torch import nn

from draftsmith.models.eagle3.config import Eagle3Config, default_aux_layer_ids
from draftsmith.models.eagle3.loss import teacher_targets, ttt_loss
from draftsmith.models.eagle3.model import Eagle3Drafter

H, V, VD = 32, 50, 20


def tiny_drafter(seed=0):
    torch.manual_seed(seed)
    config = Eagle3Config(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, vocab_size=V, draft_vocab_size=VD, target_hidden_size=H, num_target_layers=8,
                          aux_layer_ids=[2, 4, 5])
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


@torch.no_grad()
def test_ttt_equals_unrolled_cached_inference():
    """Step i of TTT at position t must compute exactly what the runtime computes when it drafts i+1 tokens from
    context x_0..x_{t+1}: same keys, same positions, same mask."""
    drafter = tiny_drafter()
    S, steps = 7, 3
    aux = torch.randn(1, S, 3 * H)
    token_embeds = torch.randn(1, S, H)
    ttt = drafter.forward_ttt(aux, token_embeds, num_steps=steps)
    fused = drafter.fc(aux)
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
    teacher_full[0, 4, ~t2d] += 50  # one position whose target argmax is outside the draft vocab
    step_logits = [torch.randn(1, S, VD) for _ in range(steps)]
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 1, 1]])
    in_draft = t2d[teacher_full.argmax(-1)]
    loss, metrics = ttt_loss(step_logits, teacher_full[..., t2d], in_draft, loss_mask, decay=0.8)
    expected, counts = slow_ttt_loss(step_logits, teacher_full, t2d, loss_mask, 0.8)
    assert math.isclose(loss.item(), expected, rel_tol=1e-5)
    assert [metrics[f"count_{i}"].item() for i in range(steps)] == counts
    assert counts[0] > 0 and counts[0] <= 5  # at most the 5 masked tokens that have a step-0 predictor
    assert 1.0 <= metrics["sim_accept_len"].item() <= 1 + steps


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
