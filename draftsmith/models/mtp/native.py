"""Native MTP weights inside a target checkpoint: find them, map them to draftsmith's names, write them back.

transformers drops these tensors when it loads the target, so they are read straight from the checkpoint's
safetensors (`model.safetensors` or a sharded `model.safetensors.index.json`), and only they are read.

Layouts (L = the target's num_hidden_layers, j = MTP module index):

    deepseek    DeepSeek-V3/R1, GLM-4.5 (vLLM deepseek_mtp / glm4_moe_mtp); config `num_nextn_predict_layers`
                model.layers.{L+j}.{enorm,hnorm,eh_proj,shared_head.norm}.weight
                model.layers.{L+j}.{self_attn,mlp,input_layernorm,post_attention_layernorm}.*   (the block)
                model.layers.{L+j}.{embed_tokens,shared_head.head}.weight   copies of the target's, which vLLM
                                                                            loads from here
    qwen3_next  Qwen3-Next / Qwen3.5 (vLLM qwen3_next_mtp): one fc and norm set shared by the mtp layers
                mtp.fc.weight  mtp.pre_fc_norm_embedding.weight  mtp.pre_fc_norm_hidden.weight  mtp.norm.weight
                mtp.layers.{j}.*   (the block); vLLM takes model.embed_tokens and lm_head from the same folder

    draftsmith                      deepseek                               qwen3_next
    layers.{j}.enorm.weight         model.layers.{L+j}.enorm.weight        mtp.pre_fc_norm_embedding.weight
    layers.{j}.hnorm.weight         model.layers.{L+j}.hnorm.weight        mtp.pre_fc_norm_hidden.weight
    layers.{j}.eh_proj.weight       model.layers.{L+j}.eh_proj.weight      mtp.fc.weight
    layers.{j}.shared_head.norm.*   model.layers.{L+j}.shared_head.norm.*  mtp.norm.weight
    layers.{j}.block.X              model.layers.{L+j}.X                   mtp.layers.{j}.X

Mixture-of-experts blocks: transformers 5 keeps experts fused in memory (`mlp.experts.gate_up_proj` (E, 2I, H),
`mlp.experts.down_proj` (E, H, I)); checkpoints store them per expert (`mlp.experts.{e}.gate_proj.weight`, ...).
The maps below split and stack them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from draftsmith.models.checkpoint import inside
from draftsmith.models.target_files import offline_folder

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEEPSEEK_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")  # module parts outside the block
DEEPSEEK_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # the target's, copied per module
QWEN3_NEXT_OWN = {  # native name -> draftsmith name (module 0; the set is shared by every mtp layer)
    "mtp.fc.weight": "eh_proj.weight",
    "mtp.pre_fc_norm_embedding.weight": "enorm.weight",
    "mtp.pre_fc_norm_hidden.weight": "hnorm.weight",
    "mtp.norm.weight": "shared_head.norm.weight",
}
QWEN3_NEXT_SHARED = ("model.embed_tokens.weight", "lm_head.weight")


class NativeMtpError(ValueError):
    """Native MTP weights that draftsmith cannot read or write."""


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a checkpoint folder (empty when it has no safetensors)."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = dict(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise NativeMtpError(f"{index}: not a safetensors index ({e})") from None
        return {name: inside(folder, file, f"{index}: weight_map[{name!r}]", NativeMtpError)
                for name, file in weight_map.items()}
    single = folder / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), "pt") as f:
            return {name: single for name in f.keys()}
    return {}


def read_tensors(files: dict[str, Path], names) -> dict[str, torch.Tensor]:
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    out = {}
    for file, file_names in by_file.items():
        with safe_open(str(file), "pt") as f:
            for name in file_names:
                out[name] = f.get_tensor(name)
    return out


# ---- mixture-of-experts tensors ----------------------------------------------------------------------------
_FUSED_GATE_UP = "experts.gate_up_proj"
_FUSED_DOWN = "experts.down_proj"


def split_experts(state: dict[str, torch.Tensor], hidden_size: int) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors -> per-expert checkpoint tensors; everything else unchanged."""
    out = {}
    for name, t in state.items():
        if name.endswith(_FUSED_GATE_UP) and t.dim() == 3:
            prefix = name[: -len("gate_up_proj")]
            rows = t if t.shape[-1] == hidden_size else t.transpose(1, 2)  # (E, 2I, H)
            inter = rows.shape[1] // 2
            for e in range(rows.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = rows[e, :inter].contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = rows[e, inter:].contiguous()
        elif name.endswith(_FUSED_DOWN) and t.dim() == 3:
            prefix = name[: -len("down_proj")]
            rows = t if t.shape[1] == hidden_size else t.transpose(1, 2)  # (E, H, I)
            for e in range(rows.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = rows[e].contiguous()
        else:
            out[name] = t
    return out


def stack_experts(state: dict[str, torch.Tensor], expected: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> the fused tensors `expected` (name -> shape) asks for; everything else unchanged."""
    out = dict(state)
    for name, shape in expected.items():
        if name in out or not (name.endswith(_FUSED_GATE_UP) or name.endswith(_FUSED_DOWN)) or len(shape) != 3:
            continue
        prefix, kind = name.rsplit(".", 1)
        num = shape[0]
        parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
        keys = [f"{prefix}.{e}.{p}.weight" for e in range(num) for p in parts]
        if not all(k in out for k in keys):
            continue  # reported as missing by the caller
        per_expert = [torch.cat([out.pop(f"{prefix}.{e}.{p}.weight") for p in parts], dim=0) for e in range(num)]
        fused = torch.stack(per_expert)  # (E, 2I, H) or (E, H, I)
        out[name] = fused if fused.shape == shape else fused.transpose(1, 2)
    return out


# ---- name maps ---------------------------------------------------------------------------------------------
def to_native(state: dict[str, torch.Tensor], layout: str, num_target_layers: int,
              hidden_size: int) -> dict[str, torch.Tensor]:
    """draftsmith state dict -> native names (shared embedding / head copies not included)."""
    out = {}
    for name, t in split_experts(state, hidden_size).items():
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if m is None:
            raise NativeMtpError(f"tensor {name!r} is not part of an MTP module")
        j, rest = int(m.group(1)), m.group(2)
        if layout == "deepseek":
            out[f"model.layers.{num_target_layers + j}.{rest.removeprefix('block.')}"] = t
        elif rest.startswith("block."):
            out[f"mtp.layers.{j}.{rest[len('block.'):]}"] = t
        else:
            native = {v: k for k, v in QWEN3_NEXT_OWN.items()}.get(rest)
            if native is None:
                raise NativeMtpError(f"tensor {name!r} has no qwen3_next name")
            if j > 0:
                raise NativeMtpError("the qwen3_next layout shares one fc and norm set across mtp layers; "
                                     "export it from a drafter with mtp.num_modules=1")
            out[native] = t
    return out


def from_native(native: dict[str, torch.Tensor], layout: str, num_target_layers: int,
                num_modules: int) -> dict[str, torch.Tensor]:
    """Native MTP tensors -> draftsmith names (per-expert tensors still split; see stack_experts)."""
    out = {}
    for name, t in native.items():
        if layout == "deepseek":
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
            j, rest = int(m.group(1)) - num_target_layers, m.group(2)
            if rest in DEEPSEEK_SHARED_COPIES:
                continue  # the target's embedding and head, shared at run time
            out[f"layers.{j}.{rest if rest.startswith(DEEPSEEK_OWN) else 'block.' + rest}"] = t
        elif name in QWEN3_NEXT_OWN:
            for j in range(num_modules):
                out[f"layers.{j}.{QWEN3_NEXT_OWN[name]}"] = t
        elif name.startswith("mtp.layers."):
            j, rest = name[len("mtp.layers."):].split(".", 1)
            out[f"layers.{j}.block.{rest}"] = t
    return out


@dataclass
class NativeMtp:
    """The native MTP tensors of one checkpoint folder."""

    layout: str  # "deepseek" | "qwen3_next"
    num_modules: int
    folder: Path
    files: dict[str, Path]  # native MTP tensor name -> safetensors file
    num_target_layers: int

    def read(self) -> dict[str, torch.Tensor]:
        return read_tensors(self.files, self.files)

    def drafter_state_dict(self, num_modules: int, drafter: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The drafter's state dict filled from these tensors; names that do not fit are an error."""
        if any(name.endswith("_scale_inv") or name.endswith(".weight_scale") for name in self.files):
            raise NativeMtpError(f"{self.folder}: the native MTP weights are FP8-quantized; convert the checkpoint "
                                 "to bfloat16 first, or set mtp.init_from_native=false")
        expected = {k: v.shape for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb.")}
        state = stack_experts(from_native(self.read(), self.layout, self.num_target_layers, num_modules), expected)
        missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        wrong = [f"{k} {tuple(state[k].shape)} != {tuple(expected[k])}" for k in sorted(set(expected) & set(state))
                 if state[k].shape != expected[k]]
        if missing or unexpected or wrong:
            raise NativeMtpError(
                f"{self.folder}: native {self.layout} MTP weights do not fit the MTP module built from its config "
                f"(missing {missing[:5]}, unexpected {unexpected[:5]}, shapes {wrong[:3]}); "
                "set mtp.init_from_native=false to train new modules"
            )
        return state


def find_native_mtp(name_or_path: str | Path, config) -> NativeMtp | None:
    """The native MTP weights of a target checkpoint (path or cached Hub id), or None when it has none."""
    folder = offline_folder(name_or_path)
    if folder is None:
        return None
    files = weight_files(folder)
    num_layers = config.num_hidden_layers
    deepseek: dict[str, Path] = {}
    for name, file in files.items():
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) >= num_layers:
            deepseek[name] = file
    qwen = {name: file for name, file in files.items() if name.startswith("mtp.")}
    if deepseek and qwen:
        raise NativeMtpError(f"{folder}: holds MTP tensors in two layouts (model.layers.{num_layers}+ and mtp.*)")
    if deepseek:
        ids = sorted({int(re.match(r"model\.layers\.(\d+)\.", n).group(1)) for n in deepseek})
        if ids != list(range(num_layers, num_layers + len(ids))):
            raise NativeMtpError(f"{folder}: MTP layers {ids} do not follow the {num_layers} decoder layers")
        declared = getattr(config, "num_nextn_predict_layers", None)
        if declared is not None and declared != len(ids):
            raise NativeMtpError(f"{folder}: config num_nextn_predict_layers is {declared} but the checkpoint holds "
                                 f"{len(ids)} MTP layer(s)")
        return NativeMtp("deepseek", len(ids), folder, deepseek, num_layers)
    if qwen:
        missing = sorted(set(QWEN3_NEXT_OWN) - set(qwen))
        if missing:
            raise NativeMtpError(f"{folder}: mtp.* tensors without {missing}")
        layers = {n.split(".")[2] for n in qwen if n.startswith("mtp.layers.")}
        if len(layers) != 1:
            raise NativeMtpError(f"{folder}: {len(layers)} mtp layers; draftsmith reads Qwen3-Next-style MTP with "
                                 "exactly one layer")
        return NativeMtp("qwen3_next", 1, folder, qwen, num_layers)
    return None


def target_embed_and_head(folder: Path) -> dict[str, torch.Tensor]:
    """The target's input embedding and output head from its checkpoint (the head is the embedding when tied)."""
    files = weight_files(folder)
    if "model.embed_tokens.weight" not in files:
        raise NativeMtpError(f"{folder}: no model.embed_tokens.weight in the target checkpoint")
    names = ["model.embed_tokens.weight"] + (["lm_head.weight"] if "lm_head.weight" in files else [])
    tensors = read_tensors(files, names)
    tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])
    return tensors


def native_export_tensors(state: dict[str, torch.Tensor], layout: str, num_target_layers: int, hidden_size: int,
                          num_modules: int, embed: torch.Tensor, head: torch.Tensor) -> dict[str, torch.Tensor]:
    """Everything vLLM's `mtp` method loads from the folder: MTP tensors plus the shared embedding and head."""
    out = to_native(state, layout, num_target_layers, hidden_size)
    # clone: safetensors refuses tensors that share memory (a tied head, or the same copy for every module)
    if layout == "deepseek":
        for j in range(num_modules):
            out[f"model.layers.{num_target_layers + j}.embed_tokens.weight"] = embed.clone()
            out[f"model.layers.{num_target_layers + j}.shared_head.head.weight"] = head.clone()
    else:
        out["model.embed_tokens.weight"] = embed.clone()
        out["lm_head.weight"] = head.clone()
    return out
