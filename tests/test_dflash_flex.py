"""DFlash's and DSpark's training attention through FlexAttention (kernels/block_attention.py) against the dense-mask
SDPA reference.

On the CPU, FlexAttention runs eagerly and without a backward pass: its values are checked here (anchor layouts
with padding blocks, block sizes, context lengths off the 128-key tiles, grouped-query heads, rows anchored
differently), the mask_mod against the dense mask, and the whole training step's loss and gradients (DFlash and
DSpark under bf16 autocast) with a plain-torch stand-in for the kernel that reads the block mask's own mask_mod. The
compiled kernel's values and gradients, and the whole training step with it, are checked on the GPU (tests marked
`gpu`), in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import flex_attention as flex

from draftsmith import device as dev
from draftsmith.kernels import ttt_attention
from draftsmith.kernels.block_attention import (
    block_attention_flex,
    block_attention_mask,
    block_attention_reference,
    block_mask_mod,
    flex_block_mask,
)
from draftsmith.models.dflash.loss import sample_anchors
from test_dflash import BLOCK_MASK_GRID
from test_ttt_flex import compiles, relative_error, values_and_grads  # noqa: F401 - compiles is a fixture

# eager FlexAttention on the CPU says it materializes the scores: the CPU tests mean it to
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def loss_masks(b, s, seed=0):
    """(B, S) loss masks of chat-like rows: a prompt, then an answer ending before the row's padding; rows differ."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, s, dtype=torch.long)
    for row in range(b):
        start = int(torch.randint(1, s // 2, (1,), generator=g))
        end = s - int(torch.randint(0, s // 4, (1,), generator=g)) * (row % 2)  # odd rows padded at the end
        mask[row, start:end] = 1
    return mask


def anchor_layout(b, s, n, seed=0):
    """(B, N) anchors as training samples them (sorted, padding blocks at anchor 0 where a row has too few)."""
    torch.manual_seed(seed)
    mask = loss_masks(b, s, seed)
    mask[-1, : s - 3] = 0  # the last row has two candidates: the rest of it is padding blocks
    anchors, _ = sample_anchors(mask, n)
    return anchors


def inputs(anchors, s, bk, h=4, kv=2, hd=16, seed=0, dtype=torch.float32, device="cpu", grad=False):
    """q (B, h, N*B_k, hd); keys and values (B, kv, S + N*B_k, hd)."""
    g = torch.Generator().manual_seed(seed)
    b, n = anchors.shape

    def t(heads, length):
        return torch.randn(b, heads, length, hd, generator=g).to(device, dtype).requires_grad_(grad)

    return t(h, n * bk), t(kv, s + n * bk), t(kv, s + n * bk)


def dense_flex_with_lse(q, k, v, block_mask, scale):
    """What FlexAttention computes, in plain torch with autograd, over the block mask's own mask_mod: (out,
    log-sum-exp)."""
    b, h, q_len, _ = q.shape
    visible = flex.create_mask(block_mask.mask_mod, b, 1, q_len, k.shape[2], q.device)  # (B, 1, Q, K)
    k, v = ttt_attention._repeat_kv(k, h), ttt_attention._repeat_kv(v, h)
    scores = ((q @ k.transpose(-1, -2)) * scale).float().masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, -1).to(q.dtype) @ v, torch.logsumexp(scores, -1)


def reference(q, k, v, anchors, s, bk, scale):
    return block_attention_reference(q, k, v, scale, block_attention_mask(anchors, s, bk).unsqueeze(1))


# ---- the rule ------------------------------------------------------------------------------------------------
def test_the_mask_mod_written_as_a_grid():
    """Context of 5 positions, blocks of 3 at anchors 2 and 4, plus a padding block (anchor 0): the grid of
    tests/test_dflash.py's dense mask, from the mask_mod."""
    got = flex.create_mask(block_mask_mod(torch.tensor([[2, 4, 0]]), 5, 3), 1, 1, 9, 14, "cpu")[0, 0].int()
    assert got.tolist() == BLOCK_MASK_GRID


@pytest.mark.parametrize("b, s, n, bk", [(3, 37, 5, 4), (2, 200, 20, 7), (3, 130, 16, 16), (2, 300, 9, 16),
                                         (1, 12, 1, 2)])
def test_the_mask_mod_and_the_block_mask_are_the_dense_mask(b, s, n, bk):
    """Every (query, key) of the mask_mod, and every 128 x 128 tile of the block mask (partial or full where any key
    is seen, empty elsewhere), agree with the dense mask the reference takes."""
    anchors = anchor_layout(b, s, n, seed=s)
    dense = block_attention_mask(anchors, s, bk)  # (B, Q, K)
    assert torch.equal(flex.create_mask(block_mask_mod(anchors, s, bk), b, 1, n * bk, s + n * bk, "cpu")[:, 0], dense)
    tiles = flex_block_mask(anchors, s, bk).to_dense()[:, 0].bool()  # (B, Q tiles, K tiles)
    padded = torch.zeros(b, tiles.shape[1] * 128, tiles.shape[2] * 128, dtype=torch.bool)
    padded[:, : n * bk, : s + n * bk] = dense
    assert torch.equal(tiles, padded.unflatten(1, (-1, 128)).unflatten(3, (-1, 128)).any(dim=(2, 4)))


def test_the_compiled_block_mask_shares_graphs_across_lengths():
    """Training compiles create_block_mask: the mask_mod reads S through tensors, not as a Python constant, so new
    context lengths and anchor counts reuse the compiled graphs (dynamic shapes) instead of each compiling anew
    (and, past torch's recompile limit, falling back to materialising the whole mask)."""
    torch._dynamo.reset()
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    create = torch.compile(flex.create_block_mask, backend=count)
    shapes = [(37, 3), (45, 5), (53, 4), (61, 7), (200, 20), (300, 40), (500, 33), (257, 9), (130, 2)]
    for s, n in shapes:
        anchors = anchor_layout(2, s, n, seed=s)
        got = create(block_mask_mod(anchors, s, 4), 2, None, n * 4, s + n * 4, device="cpu")
        assert torch.equal(got.to_dense(), flex_block_mask(anchors, s, 4).to_dense())
    assert len(graphs) <= len(shapes) // 2, f"{len(graphs)} graphs for {len(shapes)} lengths"


# ---- FlexAttention's values on the CPU (eager, no backward there) -------------------------------------------------
@pytest.mark.parametrize("b, s, n, bk", [(3, 37, 5, 4), (2, 200, 20, 7), (3, 130, 16, 16), (2, 127, 9, 16)],
                         ids=["small", "block-7-2-tiles", "256-queries", "context-127"])
@pytest.mark.parametrize("heads, kv", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_flex_attention_equals_the_reference_on_the_cpu(b, s, n, bk, heads, kv):
    anchors = anchor_layout(b, s, n, seed=s)
    q, k, v = inputs(anchors, s, bk, heads, kv)
    want = reference(q, k, v, anchors, s, bk, 0.3)
    got = block_attention_flex(q, k, v, 0.3, flex_block_mask(anchors, s, bk))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("checkpoint_layers", [False, True])
def test_the_drafter_gives_the_same_blocks_with_either_backend(checkpoint_layers):
    """DflashDrafter.forward with attention "flex" (eager on the CPU, no gradient) gives the reference's hidden
    states, rows anchored differently, padding blocks included."""
    from draftsmith.models.dflash.training import BlockOptions, apply_training_options
    from test_dflash import H, tiny_config, tiny_drafter

    drafter = apply_training_options(tiny_drafter(tiny_config(block_size=4)), BlockOptions(recompute=checkpoint_layers))
    g = torch.Generator().manual_seed(1)
    anchors = anchor_layout(3, 45, 6, seed=2)
    aux = torch.randn(3, 45, 3 * H, generator=g)
    anchor_embeds = torch.randn(3, 6, H, generator=g)
    with torch.no_grad():
        want = drafter(aux, anchor_embeds, anchors)
        apply_training_options(drafter, BlockOptions(attention="flex", recompute=checkpoint_layers))
        got = drafter(aux, anchor_embeds, anchors)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- selection -----------------------------------------------------------------------------------------------
def recipe(target_dir, method, **training):
    from draftsmith.config import recipe_from_dict

    return recipe_from_dict({"model": {"target": str(target_dir), "method": method}, "data": {"path": "x.jsonl"},
                             "output_dir": "unused", "training": training,
                             method: {"num_layers": 1, "mask_token_id": 3, "anchors_per_sequence": 8}})


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_the_training_key_reaches_the_drafter(method, fixture_target_dir, monkeypatch):
    """training.block_attention: auto by default, which takes FlexAttention where it runs and the reference on the
    CPU; flex is refused where it cannot run, reference keeps the reference anywhere; ttt_attention does not
    reach it."""
    from draftsmith.models.target import TargetModel
    from draftsmith.train.setup import method_class

    target = TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cpu")
    cls = method_class(method)

    def drafter_attention(**training):
        m = cls(recipe(fixture_target_dir, method, **training), target)
        drafter = m.build_drafter(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.bool))
        m.apply_training_options(drafter)
        return drafter.block_kernels.options.attention

    assert drafter_attention() == drafter_attention(block_attention="auto") == "reference"  # the CPU
    with pytest.raises(ValueError, match="block_attention=flex needs a CUDA or ROCm GPU.*block_attention=auto"):
        drafter_attention(block_attention="flex")
    monkeypatch.setattr(dev, "compiled_flex_attention", lambda device: True)  # as on CUDA with Triton
    assert drafter_attention() == drafter_attention(block_attention="flex") == "flex"
    assert drafter_attention(block_attention="reference") == "reference"
    assert drafter_attention(block_attention="reference", ttt_attention="flex") == "reference"


# ---- the training step: loss and every gradient ----------------------------------------------------------------
def training_step(method_name, target_dir, device, backend, seed=0):
    """(loss, {name: grad}) of one training step, `method_name`'s own loss (target capture, anchors, the drafter,
    the chunked head loss) under bf16 autocast, as training runs it, with the block attention `backend`."""
    from draftsmith.models.target import TargetModel
    from draftsmith.models.dflash.training import BlockOptions, apply_training_options
    from draftsmith.train.setup import method_class

    target = TargetModel.from_pretrained(target_dir, dtype="float32", device=device)
    method = method_class(method_name)(recipe(target_dir, method_name), target)
    torch.manual_seed(seed)
    drafter = method.build_drafter(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.bool))
    apply_training_options(drafter, BlockOptions(attention=backend))
    b, s = 3, 150
    input_ids = torch.randint(4, target.vocab_size, (b, s), generator=torch.Generator().manual_seed(seed))
    loss_mask = loss_masks(b, s, seed)
    attention_mask = torch.ones(b, s, dtype=torch.long)
    attention_mask[1, 130:] = 0  # a padded row
    loss_mask[1, 130:] = 0
    batch = {k: t.to(device) for k, t in
             dict(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask).items()}
    torch.manual_seed(seed)  # the same anchors for either backend
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        loss, _ = method.loss(drafter, batch, target.capture)
    loss.backward()
    grads = {name: p.grad for name, p in drafter.named_parameters() if p.grad is not None}
    assert grads, "no gradient reached the drafter"
    return loss.detach().float(), grads


def assert_same_step(got, want):
    (got_loss, got_grads), (ref_loss, ref_grads) = got, want
    torch.testing.assert_close(got_loss, ref_loss, rtol=2e-2, atol=2e-2)
    assert got_grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert (got_grads[name] - ref).norm() <= 5e-2 * ref.norm() + 1e-6, name


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_the_training_step_has_the_reference_gradients_through_a_stand_in(method, fixture_target_dir, monkeypatch):
    """The whole step with attention "flex" and a plain-torch stand-in for the kernel (eager FlexAttention has no
    backward on the CPU) that reads the block mask's own mask_mod: the loss and every parameter's gradient equal
    the reference's, under bf16 autocast (the stand-in also sees the kernel's dtype cast)."""
    monkeypatch.setattr(ttt_attention, "_flex_with_lse", dense_flex_with_lse)
    want = training_step(method, fixture_target_dir, "cpu", "reference")
    got = training_step(method, fixture_target_dir, "cpu", "flex")
    assert_same_step(got, want)


# ---- the compiled kernel on the GPU ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("b, s, n, bk, h, kv, hd, dtype", [
    (3, 300, 20, 16, 8, 2, 64, torch.float32),  # GQA, context and queries across tile edges, a padded row
    (3, 300, 20, 16, 8, 2, 64, torch.bfloat16),
    (2, 1000, 60, 7, 6, 6, 64, torch.float32),  # DSpark's blocks of 7: blocks straddle tiles
    (2, 1000, 60, 7, 6, 6, 64, torch.bfloat16),
    (2, 2048, 512, 16, 32, 8, 128, torch.bfloat16),  # the 8B shape's drafter: 512 anchors x 16 slots
    (3, 129, 4, 16, 4, 2, 16, torch.bfloat16),  # few anchors, the narrowest head
], ids=["gqa-300-fp32", "gqa-300-bf16", "block7-1000-fp32", "block7-1000-bf16", "8b-2048-bf16", "129-hd16-bf16"])
def test_compiled_flex_attention_equals_the_reference_on_gpu(b, s, n, bk, h, kv, hd, dtype, compiles):
    """Values and gradients of q, keys and values. float32: within 5e-3 of the reference (relative norm). bfloat16:
    no further from the float32 reference than the bf16 reference itself is (times 2, plus 1e-2)."""
    device = dev.get_device("cuda")
    anchors = anchor_layout(b, s, n, seed=s).to(device)
    leaves = list(inputs(anchors, s, bk, h, kv, hd, seed=1, dtype=dtype, device=device, grad=True))
    weights = torch.randn(b, h, n * bk, hd, generator=torch.Generator().manual_seed(3)).to(device)
    scale = hd ** -0.5
    mask = flex_block_mask(anchors, s, bk)
    got = values_and_grads(lambda: block_attention_flex(*leaves, scale, mask), leaves, weights)
    ref = values_and_grads(lambda: reference(*leaves, anchors, s, bk, scale), leaves, weights)
    names = ["out", "q", "keys", "values"]
    if dtype == torch.float32:
        for name, a, r in zip(names, got, ref):
            assert relative_error(a, r) < 5e-3, name
        return
    exact_leaves = [x.detach().float().requires_grad_() for x in leaves]
    exact = values_and_grads(lambda: reference(*exact_leaves, anchors, s, bk, scale), exact_leaves, weights)
    for name, a, r, e in zip(names, got, ref, exact):
        assert relative_error(a, e) <= 2 * relative_error(r, e) + 1e-2, name


@pytest.mark.gpu
def test_new_lengths_reuse_the_compiled_kernels_on_gpu(monkeypatch):
    """Training batches change S and N from step to step: the block mask and the kernel (forward and backward) must
    not compile once per length (past the recompile limit torch would fall back to eager FlexAttention, S x S scores
    and all); here a failure at the limit, with room for a static and a dynamic graph and their specialisations."""
    import torch._dynamo.config as dynamo_config

    torch._dynamo.reset()
    monkeypatch.setattr(dynamo_config, "recompile_limit", 4)
    if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
        monkeypatch.setattr(dynamo_config, "fail_on_recompile_limit_hit", True)
    device = dev.get_device("cuda")
    for s, n in [(300, 20), (317, 22), (455, 30), (601, 41), (777, 50), (1000, 64), (1203, 70), (2048, 128)]:
        anchors = anchor_layout(2, s, n, seed=s).to(device)
        q, k, v = inputs(anchors, s, 16, 8, 2, 64, dtype=torch.bfloat16, device=device, grad=True)
        block_attention_flex(q, k, v, 0.125, flex_block_mask(anchors, s, 16)).float().square().sum().backward()
        assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_training_with_flex_attention_equals_the_reference_on_gpu(method, fixture_target_dir, compiles):
    """The whole training step (target capture, anchors, drafter, chunked head loss) under bf16 autocast, as
    training runs it: the loss and every parameter's gradient with the compiled kernel against the reference, within
    bf16 tolerance."""
    device = dev.get_device("cuda")
    want = training_step(method, fixture_target_dir, device, "reference")
    got = training_step(method, fixture_target_dir, device, "flex")
    assert_same_step(got, want)
