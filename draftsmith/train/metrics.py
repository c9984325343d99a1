"""What a run logs: the rows of metrics.jsonl (and the trackers), the window of steps a log row sums up (tokens/s,
model FLOPs and MFU, peak memory), and the held-out evaluation."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from draftsmith import device as dev
from draftsmith.train.flops import describe as describe_flops
from draftsmith.train.errors import TrainingError


def log_row(accelerator, path: Path, row: dict) -> None:
    """One metrics row: to the trackers, and (main process) as a line of metrics.jsonl."""
    accelerator.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])
    if accelerator.is_main_process:
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def flat(d: dict, prefix: str = "") -> dict:
    """A nested recipe dict as the flat {"a.b": value} the trackers take."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat(v, key + "."))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


class FlopCounter:
    """Model FLOP per trained token at a sequence length (the method's `flops_per_token`, cached per length) and the
    matrix rate in TFLOP/s that MFU is measured against (training.peak_tflops or the device's datasheet; None:
    unknown). A store's run does not count the target's forward, which it does not run."""

    def __init__(self, method, cfg, device, target_runs: bool = True, loss_share: float = 1.0):
        self.method, self.target_runs, self.loss_share = method, target_runs, loss_share
        self.cache: dict[int, float] = {}
        self.peak_tflops = cfg.peak_tflops or dev.peak_matrix_tflops(device)
        self.source = "training.peak_tflops" if cfg.peak_tflops else f"the datasheet of {dev.device_name(device)}"

    def terms(self, seq_len: int) -> dict[str, float]:
        terms = dict(self.method.flops_per_token(seq_len, self.loss_share))
        if not self.target_runs:  # read from a hidden-state store: the target's layers do not run
            terms.pop("target_forward")
            terms["total"] = sum(v for k, v in terms.items() if k != "total")
        return terms

    def __call__(self, seq_len: int) -> float:
        if seq_len not in self.cache:
            self.cache[seq_len] = self.terms(seq_len)["total"]
        return self.cache[seq_len]

    def describe(self, lengths: list[int]) -> str:
        """The count at the median sample length, term by term, and the rate MFU is measured against."""
        typical = sorted(lengths)[len(lengths) // 2]
        peak = self.peak_tflops
        return (f"model FLOPs at {typical} tokens: {describe_flops(self.terms(typical))}; MFU against "
                + (f"{peak:g} TFLOP/s ({self.source})" if peak else "no known matrix rate (set training.peak_tflops)"))


class LogWindow:
    """The steps since the last log row: their tokens, model FLOPs and micro-batch losses (kept on the device: the
    loop makes no sync per step)."""

    def __init__(self, flops: FlopCounter, accelerator, packing: bool):
        self.flops, self.accelerator, self.packing = flops, accelerator, packing
        self.reset()

    def reset(self) -> None:
        self.tokens, self.model_flops, self.loss, self.micro = 0, 0.0, 0.0, 0
        self.start = time.time()

    def observe(self, batch, samples, loss: torch.Tensor) -> int:
        """A micro-batch; returns its tokens over all processes (from the host: no sync)."""
        world = self.accelerator.num_processes
        tokens = sum(len(sample.input_ids) for sample in samples) * world
        self.tokens += tokens
        self.loss = self.loss + loss.detach()
        self.micro += 1
        seq = tokens // world // len(samples) if self.packing else batch["input_ids"].shape[1]  # a packed row's
        self.model_flops += self.flops(seq) * tokens  # attention spans its samples, not the row
        return tokens

    def row(self, step: int, epoch: int, lr: float, grad_norm, metrics: dict) -> dict:
        """The log row of the window ending at `step` (the mean micro-batch loss of all processes); starts the next."""
        acc = self.accelerator
        seconds = max(time.time() - self.start, 1e-9)
        loss = self.loss
        if acc.num_processes > 1:  # every process logs at the same steps: the mean loss of the global batch
            loss = acc.reduce(torch.as_tensor(loss, device=acc.device).clone(), reduction="mean")
        row = {"step": step, "epoch": epoch, "lr": lr, "loss": float(loss) / self.micro,
               "grad_norm": float(grad_norm), "tokens_per_s": self.tokens / seconds,
               **self._utilisation(self.model_flops / seconds),
               **{f"train/{k}": float(v) for k, v in metrics.items() if not k.startswith("count_")}}
        self.reset()
        return row

    def _utilisation(self, flops_per_s: float) -> dict:
        """The row's TFLOP/s, MFU (per device, against the peak) and peak allocated memory of this device."""
        row = {"tflops_per_s": flops_per_s / 1e12}
        if self.flops.peak_tflops:
            row["mfu"] = flops_per_s / 1e12 / self.accelerator.num_processes / self.flops.peak_tflops
        acc = self.accelerator
        peak_bytes = dev.max_memory_allocated(acc.device)
        if peak_bytes:  # this device's; with several processes each one's too (sharding splits them)
            row["peak_memory_gib"] = peak_bytes / 2**30
            if acc.num_processes > 1:
                each = acc.gather(torch.tensor([peak_bytes], dtype=torch.float64, device=acc.device))
                row["peak_memory_gib_per_process"] = [round(b / 2**30, 3) for b in each.tolist()]
        return row


def progress_postfix(row: dict) -> dict[str, str]:
    """What the progress bar shows of a log row."""
    postfix = dict(loss=f"{row['loss']:.3f}", acc0=f"{row.get('train/acc_0', 0):.2f}",
                   tau=f"{row['train/sim_accept_len']:.2f}")
    if "peak_memory_gib" in row:
        postfix["mem"] = f"{row['peak_memory_gib']:.1f}G"
    if "mfu" in row:
        postfix["mfu"] = f"{row['mfu']:.0%}"
    return postfix


@torch.no_grad()
def evaluate(method, drafter, samples, batch_size: int, pad_id: int, device, features) -> dict[str, float]:
    """Held-out loss, per-step top-1 accuracy and simulated acceptance length, weighted by valid positions.
    `features` (the run's FeatureSource) reads eval sample j as store sample len(train) + j, and a non-finite
    feature of an eval sample stops the run."""
    from draftsmith.train.batching import collate

    if not samples:
        return {}
    drafter.eval()
    sums: dict[str, float] = {}
    weight_total = 0.0
    for i in range(0, len(samples), batch_size):
        batch = collate(samples[i:i + batch_size], pad_id, device)
        features.select_eval(i, samples[i:i + batch_size])
        loss, metrics = method.loss(drafter, batch, features)
        rows_ok = features.take()
        if rows_ok is not None and not bool(rows_ok.all()):  # evaluation syncs per batch anyway
            bad = i + int((~rows_ok).nonzero()[0, 0])
            raise TrainingError(f"evaluation: the target's hidden states for eval sample {bad} are not finite (NaN "
                                "or inf): the target's weights hold a NaN, or it overflows in half precision (try "
                                "model.dtype=float32)")
        weight = float(metrics["count_0"])
        weight_total += weight
        for key in ["sim_accept_len", *[k for k in metrics if k.startswith(("acc_", "loss_"))]]:
            sums[key] = sums.get(key, 0.0) + float(metrics[key]) * weight
        sums["loss"] = sums.get("loss", 0.0) + float(loss) * weight
    drafter.train()
    return {f"eval/{k}": v / max(weight_total, 1.0) for k, v in sums.items()}
