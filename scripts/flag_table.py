"""Print the README's flag reference (markdown tables by group) from GRPOConfig, the one source of options.

    python scripts/flag_table.py              # print the tables
    python scripts/flag_table.py --write      # replace them in README.md (between "## Flags" and the next "## ")
"""
import os
import sys
from dataclasses import MISSING, fields

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grpo.config.options import FLAG_GROUPS, GRPOConfig  # noqa: E402

TITLES = {"model": "Model and tuning strategy", "data": "Data and rewards", "training": "Optimisation",
          "grpo": "GRPO algorithm", "rollout": "Rollout engine", "logging": "Eval, checkpoints, logging",
          "distributed": "Distributed"}


def default_of(f):
    value = f.default if f.default is not MISSING else f.default_factory()
    return " ".join(value) if isinstance(value, list) else value


def tables() -> str:
    out = []
    for group, title in TITLES.items():
        out.append(f"#### {title}\n\n| flag | default | meaning |\n|---|---|---|")
        for f in fields(GRPOConfig):
            if FLAG_GROUPS[f.name] == group:
                default = default_of(f)
                shown = f"`{default}`" if default != "" else "(none)"
                out.append(f"| `--{f.name}` | {shown} | {f.metadata['help']} |")
        out.append("")
    return "\n".join(out)


def write_readme(path: str) -> None:
    """Swap the tables under "## Flags" (from its first "#### " to the next "## ") for freshly generated ones."""
    with open(path) as fh:
        text = fh.read()
    start = text.index("#### ", text.index("## Flags"))
    end = text.index("\n## ", start) + 1
    with open(path, "w") as fh:
        fh.write(text[:start] + tables() + "\n" + text[end:])


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        write_readme(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md"))
    else:
        print(tables())
