"""What a run says about its length and, at its end, what it changed: the first against the last eval (or, without
eval, the first against the last window of training steps) for the key figures, the time taken and where the outputs
are."""
from __future__ import annotations

import os
from typing import Optional

from grpo.train.plots import eval_datasets


def plural(count: int, noun: str) -> str:
    """'1 step', '2 steps'."""
    return f"{count} {noun}" + ("" if count == 1 else "s")


def steps_phrase(start_step: int, total_steps: int, each: str) -> str:
    """The run's length as the start-of-run line says it ('14 steps of <each>'); after a resume it adds what is left:
    '14 steps of <each>; 3 steps left (resumed at step 11)'."""
    phrase = f"{plural(total_steps, 'step')} of {each}"
    if start_step == 0:
        return phrase
    return f"{phrase}; {plural(total_steps - start_step, 'step')} left (resumed at step {start_step})"


def duration(seconds: float) -> str:
    """'42s', '3m 05s', '2h 01m'."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"


def _figures(prefix: str, rows: list[dict]) -> list[tuple[str, str]]:
    """(label, metric key) of the key figures the rows hold, for train (prefix '') or eval (prefix 'eval/'):
    reward, each reward function (accuracy, format...), completion length and, with tools, tool use."""
    keys = {k for r in rows for k in r}
    out = [("reward", f"{prefix}reward/mean")]
    out += [(k[len(prefix) + len("rewards/"):], k) for k in sorted(keys) if k.startswith(f"{prefix}rewards/")]
    out += [("episodes with a tool call", f"{prefix}episodes/called_a_tool"),
            ("tool calls per episode", f"{prefix}episodes/tool_calls"),
            ("failed tool calls", f"{prefix}failed_tool_calls"),
            ("completion length", f"{prefix}completion/length_mean")]
    if prefix == "eval/" and len(eval_datasets(rows)) > 1:  # with one dataset its figures are the totals
        out += [(f"reward [{name}]", f"eval/{name}/reward/mean") for name in eval_datasets(rows)]
    return [(label, key) for label, key in out if key in keys or key.endswith("failed_tool_calls")]


def _failed_share(row: dict, prefix: str) -> Optional[float]:
    """Share of tool calls that failed (error or timeout): per-episode means, so their ratio is the share."""
    calls = row.get(f"{prefix}episodes/tool_calls")
    if not calls:
        return None
    return (row.get(f"{prefix}episodes/tool_errors", 0.0) + row.get(f"{prefix}episodes/tool_timeouts", 0.0)) / calls


def _mean(rows: list[dict], key: str, prefix: str) -> Optional[float]:
    if key.endswith("failed_tool_calls"):
        values = [_failed_share(r, prefix) for r in rows]
    else:
        values = [r.get(key) for r in rows]
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def comparison(rows: list[dict]) -> tuple[str, str, list[tuple[str, Optional[float], Optional[float]]]]:
    """(first column's name, last column's name, [(figure, first, last)]): the first and last eval when the run
    evaluated, else the mean of the first and last few training steps (a quarter of them, at most 10)."""
    evals = [r for r in rows if "eval/reward/mean" in r]
    if evals:
        first, last, prefix = [evals[0]], [evals[-1]], "eval/"
        names = (f"eval at step {evals[0]['step']}", f"eval at step {evals[-1]['step']}")
    else:
        train = [r for r in rows if "reward/mean" in r]
        window = max(1, min(10, len(train) // 4))
        first, last, prefix = train[:window], train[-window:], ""
        names = tuple(f"train step {w[0]['step']}" + (f"-{w[-1]['step']}" if len(w) > 1 else "") for w in (first, last))
    figures = _figures(prefix, rows)
    table = [(label, _mean(first, key, prefix), _mean(last, key, prefix)) for label, key in figures]
    return names[0], names[1], [row for row in table if row[1] is not None or row[2] is not None]


def _cell(value: Optional[float], signed: bool, decimals: int) -> str:
    if value is None:
        return "-"
    return f"{value:{'+' if signed else ''}.{decimals}f}"


def run_summary(rows: list[dict], output_dir: str, seconds: float, steps_run: int, saved: Optional[dict] = None) -> str:
    """The end-of-run summary: a small first -> last table, the time taken and where the outputs are."""
    lines = []
    if rows:
        first_name, last_name, table = comparison(rows)
        width = max([len(label) for label, _, _ in table] + [6])
        same = first_name == last_name
        lines.append(f"  {'':<{width}}  {first_name:>18}" + ("" if same else f"  {last_name:>18}  {'change':>8}"))
        for label, first, last in table:
            # rewards and shares with 3 decimals; lengths (tens of tokens and more) with 1, the row through
            places = 1 if max(abs(v) for v in (first, last) if v is not None) >= 10 else 3
            change = "" if same or first is None or last is None else f"  {_cell(last - first, True, places):>8}"
            lines.append(f"  {label:<{width}}  {_cell(first, False, places):>18}"
                         + ("" if same else f"  {_cell(last, False, places):>18}") + change)
    per_step = f" ({seconds / steps_run:.1f}s a step, evals and saves included)" if steps_run else ""
    lines.append(f"  time: {duration(seconds)} for {plural(steps_run, 'step')}{per_step}")
    lines.append(f"  outputs in {output_dir}/:")
    outputs = _outputs(output_dir, saved or {})
    what_width = max(len(what) for what, _ in outputs) if outputs else 0
    for what, path in outputs:
        lines.append(f"    {what:<{what_width}}  {path}")
    return "run summary\n" + "\n".join(lines)


def _outputs(output_dir: str, saved: dict) -> list[tuple[str, str]]:
    """(what, path relative to output_dir) of the run's outputs that exist."""
    out = [(f"final {kind.replace('_', ' ')}", os.path.relpath(path, output_dir)) for kind, path in saved.items()]
    for what, name in (("metrics", "metrics.jsonl"), ("curves", "training_curves.png"), ("eval samples", "eval"),
                       ("rollout samples", "completions"), ("log", "train.log")):
        if os.path.exists(os.path.join(output_dir, name)):
            out.append((what, name + ("/" if os.path.isdir(os.path.join(output_dir, name)) else "")))
    return out
