"""EAGLE-3 training memory: blocked TTT attention and the fused chunked loss equal their references (values,
gradients, metrics) and keep no S x S scores and no whole-step (B, S, V_d) logits for the backward pass."""

from __future__ import annotations

import pytest
import torch

from draftsmith.kernels.ttt_attention import ttt_attention, ttt_attention_reference
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.loss import teacher_targets, ttt_loss
from draftsmith.models.eagle3.model import Eagle3Drafter


def attention_inputs(b=2, h=4, s=37, hd=8, steps=3, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)

    def t():
        return torch.randn(b, h, s, hd, generator=g).to(dtype).requires_grad_()

    return t(), t(), t(), [t() for _ in range(steps)], [t() for _ in range(steps)]


@pytest.mark.parametrize("block", [1, 8, 16, 36, 37, 64])
def test_blocked_ttt_attention_equals_the_reference_in_values_and_gradients(block):
    q, k0, v0, dks, dvs = attention_inputs()
    scale = 8 ** -0.5
    expected = ttt_attention_reference(q, k0, v0, dks, dvs, scale)
    leaves = [q, k0, v0, *dks, *dvs]
    weights = torch.randn_like(expected)
    want = torch.autograd.grad((expected * weights).sum(), leaves)
    got_out = ttt_attention(q, k0, v0, dks, dvs, scale, query_block=block)
    got = torch.autograd.grad((got_out * weights).sum(), leaves)
    torch.testing.assert_close(got_out, expected, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_blocked_ttt_attention_in_bf16_stays_within_bf16_tolerance():
    q, k0, v0, dks, dvs = attention_inputs(dtype=torch.bfloat16)
    expected = ttt_attention_reference(q, k0, v0, dks, dvs, 0.35).float()
    got = ttt_attention(q, k0, v0, dks, dvs, 0.35, query_block=8).float()
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


def saved_shapes(fn):
    """Shapes of every tensor autograd saves for the backward pass while `fn` runs."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, shapes


def test_blocked_ttt_attention_keeps_no_s_by_s_scores_for_the_backward_pass():
    s = 64
    q, k0, v0, dks, dvs = attention_inputs(s=s)
    _, reference = saved_shapes(lambda: ttt_attention_reference(q, k0, v0, dks, dvs, 0.3))
    _, blocked = saved_shapes(lambda: ttt_attention(q, k0, v0, dks, dvs, 0.3, query_block=16))
    assert any(shape[-2:] == (s, s + 3) for shape in reference)  # the reference keeps its (S, S + steps) probs
    assert max((torch.Size(x).numel() for x in blocked), default=0) <= 2 * 4 * s * 8  # inputs (B, h, S, hd) only


def tiny_drafter(seed=0, vocab=50, draft_vocab=24, head_dim=8, **flags):
    config = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=head_dim, vocab_size=vocab, draft_vocab_size=draft_vocab, target_hidden_size=32,
                          num_target_layers=4, aux_layer_ids=[0, 1, 2], max_position_embeddings=256, **flags)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(config)
    for p in drafter.parameters():  # away from init so every path carries signal
        p.data.add_(0.02 * torch.randn_like(p))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values] = True
    d2t = t2d.nonzero().flatten() - torch.arange(draft_vocab)
    drafter.set_draft_vocab(d2t, t2d)
    return drafter


def ttt_batch(b=3, s=29, seed=1):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(b, s, 96, generator=g)
    embeds = torch.randn(b, s, 32, generator=g)
    last_hidden = torch.randn(b, s, 32, generator=g)
    head = torch.nn.Linear(32, 50, bias=False)
    torch.nn.init.normal_(head.weight, generator=g)
    loss_mask = torch.ones(b, s, dtype=torch.long)
    loss_mask[0, :5] = 0  # a prompt
    loss_mask[1, 20:] = 0  # right padding
    loss_mask[2, :] = 0
    loss_mask[2, 10:15] = 1
    return aux, embeds, last_hidden, head, loss_mask


@pytest.mark.parametrize("loss_grad", ["in_forward", "recompute"])
@pytest.mark.parametrize("kind, mask_outside, chunk, norm_output", [
    ("soft_ce", True, 7, True), ("soft_ce", False, 1000, True), ("lk", True, 13, True), ("soft_ce", True, 1, True),
    ("lk", True, 20, False)])  # norm_output False: the head's final norm trains inside the loss
def test_fused_loss_equals_the_loss_of_whole_step_logits(kind, mask_outside, chunk, norm_output, loss_grad):
    """Every parameter's gradient, the loss and its metrics, whichever way each chunk's gradient is taken."""
    drafter = tiny_drafter(norm_before_fc=True, norm_output=norm_output)
    aux, embeds, last_hidden, head, loss_mask = ttt_batch()
    teacher, in_draft = teacher_targets(last_hidden, head, drafter.t2d)
    options = dict(decay=0.7, kind=kind, lk_eta=2.0, mask_outside_draft_vocab=mask_outside)

    logits = drafter.forward_ttt(aux, embeds, 4)
    with torch.no_grad():  # the teacher agrees with the drafter's first step at every other position
        agree = torch.zeros_like(teacher)
        agree[:, 1:] = 30.0 * torch.nn.functional.one_hot(logits[0][:, :-1].argmax(-1), teacher.shape[-1])
        agree[:, ::2] = 0.0
        teacher = teacher + agree
        in_draft = in_draft | (agree.amax(-1) > 0)
    want_loss, want_metrics = ttt_loss(logits, teacher, in_draft, loss_mask, **options)
    want_grads = torch.autograd.grad(want_loss, list(drafter.parameters()))

    got_loss, got_metrics = drafter(aux, embeds, 4, loss_targets=dict(
        teacher_draft_logits=teacher, teacher_in_draft=in_draft, loss_mask=loss_mask, chunk_size=chunk,
        loss_grad=loss_grad, **options))
    got_grads = torch.autograd.grad(got_loss, list(drafter.parameters()))

    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    assert got_metrics.keys() == want_metrics.keys()
    for key in want_metrics:
        torch.testing.assert_close(got_metrics[key].float(), want_metrics[key].float(), rtol=1e-5, atol=1e-6)
    assert want_metrics["acc_0"] > 0  # the comparison covers correct positions, not only wrong ones
    for name, a, b in zip([n for n, _ in drafter.named_parameters()], got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


def test_training_forward_keeps_no_whole_step_logits_and_no_s_by_s_scores():
    from draftsmith.models.eagle3.training import TTTOptions, apply_training_options

    drafter = apply_training_options(tiny_drafter(), TTTOptions(query_block=8))
    aux, embeds, last_hidden, head, loss_mask = ttt_batch(s=40)
    teacher, in_draft = teacher_targets(last_hidden, head, drafter.t2d)
    targets = dict(teacher_draft_logits=teacher, teacher_in_draft=in_draft, loss_mask=loss_mask, chunk_size=16)
    (loss, _), shapes = saved_shapes(lambda: drafter(aux, embeds, 3, loss_targets=targets))
    loss.backward()
    assert not any(len(shape) >= 2 and (shape[-2:] == (40, 40) or shape[-1] == 40 + 2) for shape in shapes)  # no (S, S [+ steps]) probs
    head_t = tuple(drafter.lm_head.weight.t().shape)  # the head's weight, which the chunk's product keeps
    assert not any(shape and shape[-1] == 24 and torch.Size(shape).numel() > 16 * 24 and shape != head_t
                   for shape in shapes)  # logits: a chunk
    assert all(p.grad is not None for p in drafter.parameters() if p.requires_grad)


def fused_loss_and_grads(drafter, steps=4):
    aux, embeds, last_hidden, head, loss_mask = ttt_batch(s=40)
    teacher, in_draft = teacher_targets(last_hidden, head, drafter.t2d)
    targets = dict(teacher_draft_logits=teacher, teacher_in_draft=in_draft, loss_mask=loss_mask, chunk_size=16)
    (loss, _), shapes = saved_shapes(lambda: drafter(aux, embeds, steps, loss_targets=targets))
    grads = torch.autograd.grad(loss, [p for p in drafter.parameters() if p.requires_grad])
    return loss, grads, shapes


def test_checkpointed_ttt_steps_give_the_same_loss_and_gradients_and_keep_less():
    from draftsmith.models.eagle3.training import TTTOptions, apply_training_options

    drafter = apply_training_options(tiny_drafter(norm_before_fc=True, norm_output=True), TTTOptions(query_block=16))
    plain_loss, plain_grads, plain_saved = fused_loss_and_grads(drafter)
    apply_training_options(drafter, TTTOptions(query_block=16, recompute=True))
    loss, grads, saved = fused_loss_and_grads(drafter)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-7)
    for a, b in zip(grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    mlp_width = drafter.config.intermediate_size  # the gated MLP's (B, S, I) activations are no longer kept
    assert any(shape and shape[-1] == mlp_width for shape in plain_saved)
    assert not any(shape and shape[-1] == mlp_width for shape in saved)


def test_compiled_ttt_steps_give_the_same_loss_and_gradients():
    from draftsmith.models.eagle3.training import TTTOptions, apply_training_options

    drafter = apply_training_options(tiny_drafter(norm_before_fc=True, norm_output=True), TTTOptions(query_block=16))
    plain_loss, plain_grads, _ = fused_loss_and_grads(drafter, steps=2)
    # the graph capture and autograd; inductor runs on the device
    apply_training_options(drafter, TTTOptions(query_block=16, compile=True, compile_backend="aot_eager"))
    loss, grads, _ = fused_loss_and_grads(drafter, steps=2)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_unset_blocks_are_chosen_by_size_and_change_nothing(monkeypatch):
    """training.ttt_query_block and loss_chunk_size left at None: one attention block while all TTT steps'
    steps*B*h*S*S scores (every step's are alive until the backward pass) fit DENSE_SCORES_LIMIT, blocks of 1024
    beyond it; loss chunks of LOSS_CHUNK_ELEMENTS logits. Whichever is chosen, the loss and gradients are those of
    whole-step logits."""
    import draftsmith.kernels.chunked_loss as chunked_loss
    import draftsmith.kernels.ttt_attention as attention
    import draftsmith.models.eagle3.loss as eagle3_loss
    from draftsmith.config import TrainingConfig

    assert TrainingConfig().ttt_query_block is None and TrainingConfig().loss_chunk_size is None
    assert attention.query_block_for(4, 6, 2048, 1, None) == 2048  # the fixture's 8,192 tokens, one step: one block
    assert attention.query_block_for(4, 6, 2048, 7, None) == 1024  # TTT 7: seven steps' scores, blocked
    assert attention.query_block_for(2, 6, 4096, 7, None) == 1024  # issue 28's 11.4 GB step: blocked
    assert attention.query_block_for(4, 6, 1024, 7, None) == 1024  # 4 x 1,024 tokens, TTT 7: one block
    assert attention.query_block_for(4, 6, 1536, 7, None) == 1024  # 4 x 1,536, TTT 7: past 2^28 scores, blocked
    assert attention.query_block_for(4, 32, 2048, 1, None) == 1024  # an 8B shape's (32 heads): blocked
    assert attention.query_block_for(4, 6, 2048, 7, 512) == 512  # a value set in the recipe stands
    assert chunked_loss.loss_chunk_rows(12_000, None) == 11_184
    assert chunked_loss.loss_chunk_rows(32_000, None) == 4_194
    assert chunked_loss.loss_chunk_rows(12_000, 100) == 100

    drafter = tiny_drafter()
    aux, embeds, last_hidden, head, loss_mask = ttt_batch(s=40)
    teacher, in_draft = teacher_targets(last_hidden, head, drafter.t2d)
    targets = dict(teacher_draft_logits=teacher, teacher_in_draft=in_draft, loss_mask=loss_mask,
                   loss_grad="recompute")  # chunks counted by their checkpoints
    want_loss, _ = ttt_loss(drafter.forward_ttt(aux, embeds, 3), teacher, in_draft, loss_mask)
    want = torch.autograd.grad(want_loss, list(drafter.parameters()))

    def run():
        calls = []
        real = attention.checkpoint

        def counted(fn, *args, **kwargs):
            calls.append(fn.__name__)
            return real(fn, *args, **kwargs)

        monkeypatch.setattr(attention, "checkpoint", counted)
        monkeypatch.setattr(eagle3_loss, "checkpoint", counted)
        loss, _ = drafter(aux, embeds, 3, loss_targets=targets)
        grads = torch.autograd.grad(loss, list(drafter.parameters()))
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
        for a, b in zip(grads, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        return calls.count("_attend"), calls.count("_chunk_loss")

    assert run() == (0, 3)  # small: one attention block (nothing recomputed), one loss chunk per TTT step
    monkeypatch.setattr(attention, "DEFAULT_QUERY_BLOCK", 16)
    monkeypatch.setattr(attention, "DENSE_SCORES_LIMIT", 3 * 3 * 4 * 40 * 40)
    assert run() == (0, 3)  # the 3 steps' scores fit: one block
    monkeypatch.setattr(attention, "DENSE_SCORES_LIMIT", 3 * 4 * 40 * 40)  # one step's scores fit, three do not
    monkeypatch.setattr(chunked_loss, "LOSS_CHUNK_ELEMENTS", 24 * 50)  # 1,024 rows: the floor of a chunk
    assert run() == (3 * 3, 3)  # past the limit: 3 blocks of 16 queries per step, recomputed
    monkeypatch.setattr(eagle3_loss, "loss_chunk_rows", lambda vocab, size: 50)
    assert run() == (3 * 3, 3 * 3)  # 3 x 40 rows in chunks of 50: 3 per step


def test_mtp_and_dflash_losses_take_chunks_chosen_by_the_heads_size(monkeypatch):
    """MTP's soft CE and DFlash's CE read the target's whole head in row chunks: left at None, as many rows as
    LOSS_CHUNK_ELEMENTS allows (here all in one), the same values and gradients as small explicit chunks, whether
    each chunk's gradient is taken in the forward pass (the frozen head) or recomputed (a head that trains)."""
    import draftsmith.kernels.chunked_loss as chunked_loss
    from draftsmith.models.dflash.loss import head_cross_entropy
    from draftsmith.models.losses import soft_ce_positions

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 40, bias=False)
    torch.nn.init.normal_(head.weight, generator=g)
    hidden = torch.randn(3, 11, 16, generator=g, requires_grad=True)
    teacher = torch.randn(3, 11, 16, generator=g)
    valid = torch.rand(3, 11, generator=g) > 0.3
    labels = torch.randint(0, 40, (int(valid.sum()),), generator=g)
    calls = []
    real = chunked_loss.checkpoint
    monkeypatch.setattr(chunked_loss, "checkpoint", lambda fn, *a, **k: calls.append(fn) or real(fn, *a, **k))

    def run(loss_fn, chunk):
        calls.clear()
        loss = loss_fn(chunk)
        return loss, torch.autograd.grad(loss, hidden)[0], len(calls)

    def mtp(chunk):
        return soft_ce_positions(hidden, teacher, valid, head, chunk)[0].sum()

    def dflash(chunk):
        return head_cross_entropy(hidden[valid], labels, head.weight, chunk)[0].sum()

    rows = int(valid.sum())
    for frozen in (False, True):
        head.weight.requires_grad_(not frozen)
        for loss_fn in (mtp, dflash):
            chosen, explicit = run(loss_fn, None), run(loss_fn, 4)
            # a head that trains is recomputed chunk by chunk; the frozen one takes its gradient in the forward
            assert (chosen[2], explicit[2]) == ((0, 0) if frozen else (1, -(-rows // 4)))
            torch.testing.assert_close(chosen[0], explicit[0])
            torch.testing.assert_close(chosen[1], explicit[1])
    assert chunked_loss.loss_chunk_rows(128_256, None) == 1_046  # a Llama-3 head: about a GB of logits a chunk


@pytest.mark.parametrize("soft", [False, True])
def test_frozen_head_losses_take_the_same_gradient_in_the_forward_pass(soft):
    """DFlash's (hard or soft) CE and MTP's soft CE over the target's frozen head: `loss_grad: in_forward` gives
    the values and the gradient of the plain, recomputed path under any weighting of the rows after it (the
    decayed slot weights of DFlash), in chunks that do not divide the rows."""
    from draftsmith.models.dflash.loss import head_cross_entropy
    from draftsmith.models.losses import soft_ce_positions

    g = torch.Generator().manual_seed(1)
    weight = torch.randn(50, 16, generator=g)  # frozen: requires no gradient
    head = torch.nn.Linear(16, 50, bias=False).requires_grad_(False)
    head.weight.copy_(weight)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    teacher = torch.randn(37, 16, generator=g)
    labels = torch.randint(0, 50, (37,), generator=g)
    row_weight = torch.rand(37, generator=g)

    def dflash(loss_grad):
        ce, pred = head_cross_entropy(hidden, labels, weight, 8, teacher if soft else None, loss_grad=loss_grad)
        return (ce * row_weight).sum(), pred

    def mtp(loss_grad):
        valid = torch.ones(1, 37, dtype=torch.bool)
        per_pos, agree = soft_ce_positions(hidden[None], teacher[None], valid, head, 8, loss_grad)
        return (per_pos[0] * row_weight).sum(), agree

    for fn in (dflash, mtp):
        (want, want_pred), (got, got_pred) = fn("recompute"), fn("in_forward")
        torch.testing.assert_close(got, want)
        assert torch.equal(got_pred, want_pred)
        want_grad, = torch.autograd.grad(want, hidden)
        got_grad, = torch.autograd.grad(got, hidden)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)


def test_the_loss_chunk_key_reaches_every_method(fixture_target_dir, monkeypatch):
    """training.loss_chunk_size, set or left at null, is the chunk each method's loss reads its head with, and
    training.loss_grad how it takes the chunk's gradient."""
    import draftsmith.models.dflash.training as dflash_training
    import draftsmith.models.mtp.training as mtp_training
    from draftsmith.config import recipe_from_dict
    from draftsmith.models.eagle3.training import Eagle3Method
    from draftsmith.models.target import TargetModel

    target = TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cpu")
    for chunk, loss_grad in ((None, "in_forward"), (64, "recompute")):
        def recipe(method):
            return recipe_from_dict({"model": {"target": str(fixture_target_dir), "method": method},
                                     "data": {"path": "x.jsonl"}, "output_dir": "unused",
                                     "training": {"loss_chunk_size": chunk, "loss_grad": loss_grad},
                                     "dflash": {"num_layers": 1}})

        options = Eagle3Method(recipe("eagle3"), target).loss_options
        assert (options["chunk_size"], options["loss_grad"]) == (chunk, loss_grad)
        seen = {}
        monkeypatch.setattr(mtp_training, "mtp_loss", lambda *a, **k: seen.setdefault("mtp", (a[-1], k)))
        monkeypatch.setattr(dflash_training, "dflash_loss", lambda *a, **k: seen.setdefault("dflash", (a[-1], k)))
        batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10]]), "attention_mask": torch.ones(1, 6, dtype=torch.long),
                 "loss_mask": torch.tensor([[0, 0, 1, 1, 1, 1]])}
        for method_cls, name in ((mtp_training.MtpMethod, "mtp"), (dflash_training.DflashMethod, "dflash")):
            method = method_cls(recipe(name), target)
            method.loss(method.build_drafter(None, None), batch, target.capture)
        keys = {"loss_grad": loss_grad, "loss_kernel": "reference"}  # kernels/fused_head_loss: auto on the CPU
        assert seen == {"mtp": (chunk, keys), "dflash": (chunk, keys)}


def bf16_loss_and_grads(chunk_size, **loss_keys):
    """The 3-step TTT loss of a fresh tiny drafter (norm_before_fc, no norm_output) on ttt_batch() under CPU bf16
    autocast, the way GPUs train, and its gradient for every parameter; `loss_keys` pick the loss's path."""
    drafter = tiny_drafter(norm_before_fc=True, norm_output=False)
    aux, embeds, last_hidden, head, loss_mask = ttt_batch()
    teacher, in_draft = teacher_targets(last_hidden, head, drafter.t2d)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = drafter(aux, embeds, 3, loss_targets=dict(
            teacher_draft_logits=teacher, teacher_in_draft=in_draft, loss_mask=loss_mask, chunk_size=chunk_size,
            **loss_keys))
    return loss.detach(), torch.autograd.grad(loss, list(drafter.parameters()))


def test_the_gradient_taken_in_the_forward_pass_under_bf16_autocast():
    """Mixed precision (what GPUs train with): the chunk's head product runs in bf16 inside the forward pass as it
    does in the recomputed backward, so both ways agree within bf16 tolerance, and every parameter's gradient
    keeps its float32 dtype."""
    want, want_grads = bf16_loss_and_grads(chunk_size=11, loss_grad="recompute")
    got, got_grads = bf16_loss_and_grads(chunk_size=11, loss_grad="in_forward")
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    for a, b in zip(got_grads, want_grads):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-3)


def scaled_loss_inputs(name, loss_grad):
    """(loss, the tensors its gradient flows to) for one of the chunked losses, in chunks that do not divide the
    rows: EAGLE-3's fused TTT loss (a head and norm that train inside it), MTP's soft CE and DFlash's hard and
    soft CE over a frozen head, DSpark's loss (its Markov and confidence heads train inside it)."""
    from draftsmith.models.dflash.loss import dflash_loss
    from draftsmith.models.mtp.loss import mtp_loss

    g = torch.Generator().manual_seed(2)
    if name == "eagle3":
        drafter = tiny_drafter(norm_before_fc=True, norm_output=False)
        aux, embeds, last_hidden, head, loss_mask = ttt_batch()
        teacher, in_draft = teacher_targets(last_hidden, head, drafter.t2d)
        loss, _ = drafter(aux, embeds, 3, loss_targets=dict(
            teacher_draft_logits=teacher, teacher_in_draft=in_draft, loss_mask=loss_mask, chunk_size=11,
            loss_grad=loss_grad))
        return loss, list(drafter.parameters())
    head = torch.nn.Linear(16, 40, bias=False).requires_grad_(False)
    torch.nn.init.normal_(head.weight, generator=g)
    if name == "mtp":
        depth_hidden = [torch.randn(2, 13, 16, generator=g, requires_grad=True) for _ in range(2)]
        loss_mask = (torch.rand(2, 13, generator=g) > 0.2).long()
        loss, _ = mtp_loss(depth_hidden, torch.randn(2, 13, 16, generator=g), loss_mask, head, chunk_size=7,
                           loss_grad=loss_grad)
        return loss, depth_hidden
    if name == "dspark":
        from draftsmith.models.dspark.loss import dspark_loss
        from test_dspark import tiny_config as dspark_config  # shared helpers, same folder
        from test_dspark import tiny_drafter as dspark_drafter

        config = dspark_config()
        drafter = dspark_drafter(config).train()
        vocab, hidden_size = config.vocab_size, config.hidden_size
        block_hidden = torch.randn(2, 2, config.block_size, hidden_size, generator=g, requires_grad=True)
        ids = torch.randint(0, vocab, (2, 2, config.block_size), generator=g)
        valid = torch.rand(2, 2, config.block_size, generator=g) > 0.3
        loss, _ = dspark_loss(block_hidden, torch.randn(vocab, hidden_size, generator=g), drafter.markov_head,
                              drafter.confidence_head, ids, ids.roll(1, -1), valid,
                              torch.randn(int(valid.sum()), hidden_size, generator=g), ce_weight=0.1, l1_weight=0.9,
                              confidence_weight=1.0, gamma=4.0, chunk_size=3, loss_grad=loss_grad)
        heads = [p for n, p in drafter.named_parameters() if n.startswith(("markov_head", "confidence_head"))]
        return loss, [block_hidden, *heads]
    block_hidden = torch.randn(2, 3, 4, 16, generator=g, requires_grad=True)  # (B, N, B_k, H)
    valid = torch.rand(2, 3, 3, generator=g) > 0.3
    labels = torch.randint(0, 40, (2, 3, 3), generator=g)
    teacher = torch.randn(int(valid.sum()), 16, generator=g) if name == "dflash_soft_ce" else None
    loss, _ = dflash_loss(block_hidden, head.weight, labels, valid, 2.0, teacher, chunk_size=5, loss_grad=loss_grad)
    return loss, [block_hidden]


@pytest.mark.parametrize("loss_grad", ["in_forward", "recompute"])
@pytest.mark.parametrize("name", ["eagle3", "mtp", "dflash_ce", "dflash_soft_ce", "dspark"])
def test_every_chunked_loss_scales_its_gradient_by_the_upstream_one(name, loss_grad):
    """d(c * loss) = c * d(loss): accelerate divides the loss by grad_accum_steps before its backward pass and fp16
    loss scaling multiplies it, so a gradient taken in the forward pass must still be scaled by the upstream one
    (a backward that dropped it would give a half-weighted loss a gradient twice too large)."""
    loss, inputs = scaled_loss_inputs(name, loss_grad)
    plain = torch.autograd.grad(loss, inputs, retain_graph=True, allow_unused=True)
    assert any(grad is not None and grad.abs().sum() > 0 for grad in plain)
    for scale in (0.5, 3.0):
        scaled = torch.autograd.grad(scale * loss, inputs, retain_graph=True, allow_unused=True)
        for want, got in zip(plain, scaled):
            if want is None:
                assert got is None
                continue
            torch.testing.assert_close(got, scale * want, rtol=1e-5, atol=1e-6)
