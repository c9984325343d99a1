"""The model-FLOPs line of the training log, for model FLOP utilisation (MFU).

The trainer asks the method for its count (`TrainingMethod.flops_per_token(seq_len, loss_share)`, models/spec.py):
each method states its formula in its own folder (`<method>_flops_per_token` in models/<method>/training.py), on
the shared counts of models/flops.py (the target's forward pass and head; the counting conventions are written
there). The trainer passes the share of positions under the loss in its data (`loss_share`): DFlash and DSpark
anchor blocks and MTP and EAGLE-1 read their heads only there, so their counts per token follow it; EAGLE-3's
steps run at every position.
"""

from __future__ import annotations


def describe(terms: dict[str, float]) -> str:
    """'31.1 GFLOP/token = target_forward 14.5 + teacher_head 0.26 + ...' for the training log."""
    parts = " + ".join(f"{name} {value / 1e9:.3g}" for name, value in terms.items() if name != "total")
    return f"{terms['total'] / 1e9:.3g} GFLOP per token = {parts}"
