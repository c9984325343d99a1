"""The `draftsmith` command: one entry point, one sub-command per stage of the pipeline.

Each sub-command lives with its stage (train/, models/export.py, inference/commands.py, quickstart.py); this file
only wires them up, importing each lazily so `draftsmith --help` stays fast. Errors that are the user's to fix
are printed as one line on stderr with exit code 2 (set DRAFTSMITH_DEBUG=1 for the traceback).
"""

from __future__ import annotations

import argparse
import os
import sys

from draftsmith import __version__


def _train(args: argparse.Namespace) -> int:
    from draftsmith.config import load_recipe
    from draftsmith.train import train

    recipe = load_recipe(args.recipe, args.overrides)
    train(recipe)
    return 0


def _add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe YAML (see recipes/)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. training.lr=1e-4")


def _collect(args: argparse.Namespace) -> int:
    from draftsmith.train.collect import collect
    from draftsmith.config import load_recipe

    collect(load_recipe(args.recipe, args.overrides))
    return 0


def _import_data_args(p):
    from draftsmith.data.peer_store import add_import_data_args

    add_import_data_args(p)


def _import_data(args):
    from draftsmith.data.peer_store import run_import_data

    return run_import_data(args)


def _export_args(p):
    from draftsmith.models.export import add_export_args

    add_export_args(p)


def _export(args):
    from draftsmith.models.export import run_export

    return run_export(args)


def _import_args(p):
    from draftsmith.models.importer import add_import_args

    add_import_args(p)


def _import(args):
    from draftsmith.models.importer import run_import

    return run_import(args)


def _push_args(p):
    from draftsmith.hub import add_push_args

    add_push_args(p)


def _push(args):
    from draftsmith.hub import run_push

    return run_push(args)


def _generate_args(p):
    from draftsmith.inference.commands import add_generate_args

    add_generate_args(p)


def _generate(args):
    from draftsmith.inference.commands import run_generate

    return run_generate(args)


def _eval_args(p):
    from draftsmith.inference.commands import add_eval_args

    add_eval_args(p)


def _eval(args):
    from draftsmith.inference.commands import run_eval_command

    return run_eval_command(args)


def _regenerate_args(p):
    from draftsmith.data.regenerate import add_regenerate_args

    add_regenerate_args(p)


def _regenerate(args):
    from draftsmith.data.regenerate import run_regenerate

    return run_regenerate(args)


def _quickstart_args(p):
    from draftsmith.quickstart import add_quickstart_args

    add_quickstart_args(p)


def _quickstart(args):
    from draftsmith.quickstart import run_quickstart

    return run_quickstart(args)


COMMANDS = {
    # name: (help, add_arguments, run)
    "train": ("train a drafter from a recipe", _add_train_args, _train),
    "regenerate": ("replace a dataset's assistant turns with the target's own answers (runtime or server)",
                   _regenerate_args, _regenerate),
    "collect": ("write the target's hidden states for a recipe's data into a store (data.hidden_states_path)",
                _add_train_args, _collect),
    "import-data": ("write the hidden-state store (data.hidden_states_path) from a peer's hidden states (speculators' "
                    "hs_{i}.safetensors folder) instead of running the target", _import_data_args, _import_data),
    "export": ("export a checkpoint for vLLM / SGLang", _export_args, _export),
    "import": ("convert a published drafter (native EAGLE-3, speculators) into a draftsmith checkpoint",
               _import_args, _import),
    "push": ("upload an export folder to the Hugging Face Hub in one commit", _push_args, _push),
    "generate": ("speculative generation with verification", _generate_args, _generate),
    "eval": ("acceptance and speed over a prompt set", _eval_args, _eval),
    "quickstart": ("train, export, generate and evaluate end to end on a small default", _quickstart_args,
                   _quickstart),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftsmith", description="Train and run speculative-decoding drafters.")
    parser.add_argument("--version", action="version", version=f"draftsmith {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (help_text, add_args, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:  # only the chosen command pays for importing its module
            add_args(p)
        p.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as e:  # the project's error types all derive from ValueError
        if os.environ.get("DRAFTSMITH_DEBUG"):
            raise
        print(f"draftsmith {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk in any command (collect's shards, regenerate's answers, eval's results)
        from draftsmith.models.checkpoint import is_disk_full, write_failure

        if not is_disk_full(e) or os.environ.get("DRAFTSMITH_DEBUG"):
            raise
        print(f"draftsmith {args.command}: error: {write_failure(e, 'a file')}: free space and rerun (collect and "
              "regenerate resume where they stopped)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"draftsmith {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
