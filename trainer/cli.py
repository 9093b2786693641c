"""`meshtrain` command line: a thin layer over the Python API."""
from __future__ import annotations

import argparse
import os
import sys

from trainer.errors import UserError

USAGE = """meshtrain train [CONFIG.yaml ...] [key=value ...]

Train a transformer on the (data, stage, model) mesh. Later YAML files and key=value
pairs override earlier ones; `mesh.preset=NAME` loads meshes/presets/NAME.yaml first.
With no arguments: the `small` model on the built-in corpus on all local devices.
"""


def _train(args: list[str]) -> int:
    from trainer.config import all_keys, load_config
    from trainer.loop import train
    if args and args[0] in ("-h", "--help"):
        print(USAGE + "\nkeys:\n  " + "\n  ".join(all_keys()))
        return 0
    cfg = load_config(args)
    train(cfg)
    return 0


COMMANDS = {"train": _train}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="meshtrain", description="Train transformers on a device mesh.")
    parser.add_argument("command", choices=sorted(COMMANDS), help="what to do")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="configs and key=value overrides")
    if not argv:
        argv = ["train"]
    ns = parser.parse_args(argv[:1])
    try:
        return COMMANDS[ns.command](argv[1:])
    except UserError as e:
        print(f"meshtrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("meshtrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
