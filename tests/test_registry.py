"""The method registry (draftsmith/models/registry.py): every spec's entry points resolve, and every method in it
trains on a tiny random target, exports every format, reads each export back and generates losslessly, through the
same calls a user's commands make. A method added to the registry is walked here with no edit to this file."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch

from draftsmith.config import recipe_from_dict
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.spec_config import build_proposer, parse_spec_config
from draftsmith.models import registry
from draftsmith.models.checkpoint import load_checkpoint
from draftsmith.models.export import export_all
from draftsmith.models.export_base import FormatExport
from draftsmith.models.importer import detect_format, import_checkpoint
from draftsmith.models.spec import resolve
from draftsmith.models.target import TargetModel

# The smallest settings of each method's own section: the walk tests plumbing, not quality (the accepting drafters
# of tests/conftest.py test acceptance).
SMALL_SECTIONS = {"dflash": {"num_layers": 1, "block_size": 4, "anchors_per_sequence": 16},
                  "dspark": {"num_layers": 1, "block_size": 4, "anchors_per_sequence": 16, "markov_rank": 8},
                  "mtp": {"num_depths": 2}}
# Methods that draft for one target family only, proven end to end on it in their own test file instead of on the
# tiny Llama here: gemma4_mtp (a Gemma 4 assistant over a Gemma 4 target's cache) in tests/test_gemma4_mtp.py.
FAMILY_BOUND = {"gemma4_mtp": "tests/test_gemma4_mtp.py::test_fine_tune_raises_acceptance_export_serves_it"}
K = 3


@pytest.mark.parametrize("spec", registry.SPECS, ids=lambda s: s.method)
def test_every_entry_point_of_every_spec_resolves(spec):
    """A renamed class or function fails here, at once, not in the middle of a user's run."""
    training = resolve(spec.training)
    assert all(callable(getattr(training, name))
               for name in ("build_drafter", "apply_training_options", "loss", "flops_per_token"))
    assert callable(resolve(spec.proposer).from_config)
    spec.section()  # every key has a default
    assert spec.formats, f"{spec.method} exports nothing"
    for fmt in spec.formats:
        assert callable(resolve(fmt.export))
        for entry in (fmt.read, fmt.check, fmt.serve_commands):
            assert entry is None or callable(resolve(entry))
        assert (fmt.read is None) == (fmt.detect is None), f"{fmt.name}: a reader needs a detector and back"
    assert registry.get(spec.method) is spec
    assert all(registry.get(alias) is spec for alias in spec.engine_aliases)


def test_method_names_formats_and_aliases_are_unique():
    names = [s.method for s in registry.SPECS] + [a for s in registry.SPECS for a in s.engine_aliases]
    assert len(names) == len(set(names))
    formats = [f.name for s in registry.SPECS for f in s.formats]
    assert len(formats) == len(set(formats)) == len(registry.formats())


@pytest.mark.parametrize("spec", registry.SPECS, ids=lambda s: s.method)
def test_every_exporter_fills_in_the_one_skeleton(spec):
    """A format states its key map, checks and card (models/export_base.py FormatExport); the read, check and write
    sequence is written once, so every exporter is a FormatExport's `write`, for the spec's method, taking the
    options the spec lists and checking with the check push runs."""
    for fmt in spec.formats:
        exporter = resolve(fmt.export)
        declared = getattr(exporter, "__self__", None)
        assert isinstance(declared, FormatExport), f"{fmt.name}: {fmt.export} is not a FormatExport's write"
        assert declared.method == spec.method and set(declared.options) == set(fmt.options)
        assert fmt.check is None or declared.check is resolve(fmt.check)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, fixture_target_dir):
    """A tiny random Llama with the fixture's tokenizer (its 16,000-token vocabulary), as a model folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-target")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16000, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(fixture_target_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    lines = [{"conversations": [{"role": "user", "content": f"Tell me about the number {i}."},
                                {"role": "assistant", "content": f"The number {i} comes after {i - 1} and before "
                                                                 f"{i + 1}; it is {'even' if i % 2 == 0 else 'odd'}."}]}
             for i in range(24)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("method", registry.methods())
def test_every_method_trains_exports_imports_and_generates_losslessly(method, tiny_target, chats, tmp_path):
    if method in FAMILY_BOUND:
        pytest.skip(f"{method} drafts for one target family: {FAMILY_BOUND[method]}")
    spec = registry.get(method)
    recipe = recipe_from_dict({
        "model": {"target": str(tiny_target), "method": method, "dtype": "float32"},
        "data": {"path": str(chats), "max_length": 128, "eval_samples": 0, "cache_dir": str(tmp_path / "cache")},
        "training": {"max_steps": 3, "batch_size": 4, "mixed_precision": "no", "log_every": 1000,
                     "eval_every": 100000, "save_every": 100000, **({"ttt_steps": 2} if method == "eagle3" else {})},
        method: SMALL_SECTIONS.get(method, {}),
        "output_dir": str(tmp_path / "run"),
    })
    from draftsmith.train import train

    checkpoint = train(recipe, log=lambda *a: None)
    config, state = load_checkpoint(checkpoint)
    assert config["method"] == method

    results, _ = export_all(checkpoint, tmp_path / "export", dtype=None)
    assert set(results) == {fmt.name for fmt in spec.formats}  # every format of the method, none skipped
    target = TargetModel.from_pretrained(tiny_target, dtype="float32", device="cpu")
    prompt = torch.tensor([[1, 300, 301, 302, 303, 304]])
    plain = SpeculativeGenerator(target, None, 0).generate(prompt, 12).token_ids
    for name, result in results.items():
        fmt = spec.format(name)
        if fmt.read is not None:  # read back: the same drafter as the training checkpoint
            assert detect_format(json.loads((result.out_dir / "config.json").read_text())) is fmt
            imported = import_checkpoint(result.out_dir, tmp_path / f"imported-{name}", target=str(tiny_target))
            again, tensors = load_checkpoint(imported.out_dir)
            assert again["method"] == method
            for key, value in state.items():
                if key in tensors:
                    assert torch.equal(tensors[key], value), f"{name}: {key} changed on the way back"
        model = str(result.out_dir if fmt.read is not None or method == "mtp" else checkpoint)
        config = parse_spec_config({"method": method, "model": model, "num_speculative_tokens": K}, "cpu")
        drafted = SpeculativeGenerator(target, build_proposer(config, target), K).generate(prompt, 12)
        assert drafted.token_ids == plain, f"{name}: speculative output differs from plain greedy decoding"
        assert drafted.metrics.num_drafts > 0


PACKAGE = Path(__file__).resolve().parents[1] / "draftsmith"


def import_graph() -> dict[str, set[str]]:
    """draftsmith's modules -> the draftsmith modules each imports, at module level or inside a function."""
    modules = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def test_the_package_has_no_import_circles():
    """No module imports (at module level or inside a function) a module that imports it back, directly or round
    a loop: a method folder reads shared code, never the other way round (the registry reaches methods only by
    their spec modules and lazy entry points)."""
    graph = import_graph()

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(graph[node])
        return False

    circles = sorted((a, b) for a in graph for b in graph[a] if reaches(b, a))
    assert not circles, f"import circles: {circles}"


# draftsmith's layers, bottom to top (docs/contributing.md, "Layout"): a module imports its own layer and those below
# it. A module is in the layer of the longest name here it equals or lies under.
LAYERS = (
    ("base", ("draftsmith", "draftsmith.device", "draftsmith.distributed")),  # the version; the accelerator; sharding
    ("kernels", ("draftsmith.kernels",)),  # attention and loss kernels, each with its plain-torch reference
    ("runtime", ("draftsmith.runtime",)),  # the proposer protocol, sampling, verification, trees, metrics
    ("models", ("draftsmith.models",)),  # targets; the method folders, whose proposers implement the protocol
    ("recipes and data", ("draftsmith.config", "draftsmith.data")),  # the schema reads the registry, the store a target
    ("inference", ("draftsmith.inference",)),  # generator, speculative configs, eval and report, generate/eval
    ("train", ("draftsmith.train",)),
    ("commands", ("draftsmith.cli", "draftsmith.quickstart", "draftsmith.hub", "draftsmith.collect",
                  "draftsmith.train.__main__")),  # the command line and its `python -m` launchers
)
# The imports that still run up, by importing module: two commands filed under data/ by their topic,
# `draftsmith regenerate` (it generates with inference's generator) and `draftsmith import-data` (it writes a store
# under the trainer's recipe header). Moving each up to the layer it uses would leave none. (Before issue 45 five
# arrows ran up: method proposers into the runtime core, then in inference/; method training.py into train/flops.py;
# kernels/block_attention.py into models/targets/llama.py; and these two.)
ARROWS_UP_LEFT = {"draftsmith.data.regenerate": "inference", "draftsmith.data.peer_store": "train"}


def layer_of(module: str) -> int:
    """The index in LAYERS of `module`'s layer."""
    return max((len(name), i) for i, (_, names) in enumerate(LAYERS) for name in names
               if module == name or module.startswith(name + "."))[1]


def arrows_up(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(lower layer, upper layer) -> the imports "module -> module" that run from the one up to the other."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for a, b in sorted((a, b) for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a)):
        arrows.setdefault((LAYERS[layer_of(a)][0], LAYERS[layer_of(b)][0]), []).append(f"{a} -> {b}")
    return arrows


def test_every_module_has_a_layer():
    """A new top-level module or package is placed in LAYERS, not taken for the base by default."""
    top = {".".join(m.split(".")[:2]) for m in import_graph()} - {"draftsmith"}
    named = {name for _, names in LAYERS for name in names}
    unplaced = sorted(m for m in top if m not in named)
    assert not unplaced, f"place these in LAYERS: {unplaced}"


def test_imports_run_down_the_layers():
    """At most 2 arrows run back up the layers (pairs of layers with an import from the lower to the upper), and
    only the two commands of ARROWS_UP_LEFT draw them: the runtime core sits below the models that implement
    proposers, the kernels below the models that call them."""
    arrows = arrows_up(import_graph())
    drawn = {(imp.split(" -> ")[0], up) for (_, up), imports in arrows.items() for imp in imports}
    listed = "\n".join(f"  {low} -> {high}: {', '.join(imports)}" for (low, high), imports in arrows.items())
    assert len(arrows) <= 2 and drawn <= set(ARROWS_UP_LEFT.items()), f"{len(arrows)} arrows up:\n{listed}"


def test_shared_code_imports_no_method_folder():
    """Adding a method is its folder plus its registry line: outside the method folders (those with a spec.py)
    only the registry imports them, and the quickstart, whose demo is an EAGLE-3 drafter by design. A method
    folder imports shared code and its own folder, and another method's folder only where its spec says it builds
    on that method (`builds_on`: DSpark on DFlash); what several methods share lives in models/ (losses.py,
    target_files.py, flops.py, export_base.py), not in one of their folders."""
    folders = {f"draftsmith.models.{p.parent.name}" for p in (PACKAGE / "models").glob("*/spec.py")}
    assert {"draftsmith.models.eagle3", "draftsmith.models.dspark"} <= folders
    allowed = {"draftsmith.models.registry", "draftsmith.quickstart"}

    def folder_of(module: str) -> str | None:
        return next((f for f in folders if module == f or module.startswith(f + ".")), None)

    arrows = sorted((a, b) for a, targets in import_graph().items() if folder_of(a) is None and a not in allowed
                    for b in targets if folder_of(b) is not None)
    assert not arrows, f"shared modules importing a method folder: {arrows}"

    builds_on = {f"draftsmith.models.{s.method}": f"draftsmith.models.{s.builds_on}"
                 for s in registry.SPECS if s.builds_on}
    assert set(builds_on.values()) <= folders
    across = sorted((a, b) for a, targets in import_graph().items() for b in targets
                    if folder_of(a) and folder_of(b) and folder_of(a) != folder_of(b)
                    and builds_on.get(folder_of(a)) != folder_of(b))
    assert not across, f"method folders importing another method's folder (move what they share to models/): {across}"
