"""Print the README's flag reference (markdown tables by group) from GRPOConfig, the one source of options."""
import os
import sys
from dataclasses import MISSING, fields

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grpo.config import FLAG_GROUPS, GRPOConfig  # noqa: E402

TITLES = {"model": "Model and tuning strategy", "data": "Data and rewards", "training": "Optimisation",
          "grpo": "GRPO algorithm", "rollout": "Rollout engine", "logging": "Eval, checkpoints, logging",
          "distributed": "Distributed"}


def default_of(f):
    value = f.default if f.default is not MISSING else f.default_factory()
    return " ".join(value) if isinstance(value, list) else value


def main():
    for group, title in TITLES.items():
        print(f"#### {title}\n\n| flag | default | meaning |\n|---|---|---|")
        for f in fields(GRPOConfig):
            if FLAG_GROUPS[f.name] == group:
                default = default_of(f)
                shown = f"`{default}`" if default != "" else "(none)"
                print(f"| `--{f.name}` | {shown} | {f.metadata['help']} |")
        print()


if __name__ == "__main__":
    main()
