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
    assert all(callable(getattr(training, name)) for name in ("build_drafter", "loss", "flops_per_token"))
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


def test_shared_code_imports_no_method_folder():
    """Adding a method is its folder plus its registry line: outside the method folders (those with a spec.py)
    only the registry imports them, and the quickstart, whose demo is an EAGLE-3 drafter by design."""
    folders = {f"draftsmith.models.{p.parent.name}" for p in (PACKAGE / "models").glob("*/spec.py")}
    assert {"draftsmith.models.eagle3", "draftsmith.models.dspark"} <= folders
    allowed = {"draftsmith.models.registry", "draftsmith.quickstart"}

    def in_folder(module: str) -> bool:
        return any(module == f or module.startswith(f + ".") for f in folders)

    arrows = sorted((a, b) for a, targets in import_graph().items() if not in_folder(a) and a not in allowed
                    for b in targets if in_folder(b))
    assert not arrows, f"shared modules importing a method folder: {arrows}"
