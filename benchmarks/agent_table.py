"""The calculator as an OpenAI-API agent against the trainer's own tool loop, on arith_products: held-out accuracy and
tool share at each evaluation, and where a model turn's time goes in each path.

    python benchmarks/agent_table.py outputs/bench/learning/*/

Reads the run folders benchmarks/learning.sh writes for ARITH_PRODUCTS (native: arith_products, the calculator as a
tool of the trainer's episode loop, evaluated on arith_products_eval) and ARITH_PRODUCTS_AGENT (agent:
arith_products_agent, examples/calculator_agent.py through the OpenAI-compatible endpoint, evaluated on
arith_products_agent_eval: the same 100 held-out questions, each played by the agent through the endpoint, greedy, as
the native eval plays each through the tool loop). Others are skipped.

- held-out accuracy: eval/rewards/boxed_accuracy; tool share: the held-out episodes in which the model wrote a tool
  call (native eval/episodes/called_a_tool, agent eval/agents/called_a_tool: every <tool_call> block, read or not).
- per model turn (a turn of a native episode; a call the agent made), the mean over the training steps of the loop's
  wall seconds, the seconds inside engine.generate and the rest (the loop's overhead: for the agent the HTTP
  round-trip, the chat template's rendering, decoding, the agent's code and the wait that gathers calls into a batch;
  for the native loop the tool environment and the tokenization of its turns), and engine.generate calls per step
  (episodes/turn_s, ... and agents/turn_s, ...: grpo.rollout.turn_timing).
- then, per seed both paths have: the agent's accuracy and tool share at the last evaluation against the native run's,
  and whether each is within 0.1.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grpo.train.reporting import read_metrics  # noqa: E402

PATHS = {"arith_products_eval": "native", "arith_products_agent_eval": "agent"}  # bench.json's dataset -> path
ACCURACY = "eval/rewards/boxed_accuracy"
TOOL_SHARE = {"native": "eval/episodes/called_a_tool", "agent": "eval/agents/called_a_tool"}
TIMING = {"native": "episodes", "agent": "agents"}  # the turn metrics' prefix
TURNS = {"native": "episodes/turns", "agent": "agents/calls"}  # model turns per episode
WITHIN = 0.1


def summarize(run_dir: str):
    bench_path = os.path.join(run_dir, "bench.json")
    if not os.path.isfile(bench_path):
        return None
    with open(bench_path) as fh:
        info = json.load(fh)
    path = PATHS.get(info.get("dataset"))
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if path is None or not os.path.isfile(metrics_path):
        return None
    rows = read_metrics(metrics_path)
    evals = {r["step"]: r for r in rows if ACCURACY in r}
    train = [r for r in rows if "loss" in r]
    prefix = TIMING[path]

    def mean(key):
        values = [r[key] for r in train if key in r]
        return sum(values) / len(values) if values else None

    return {**info, "path": path, "run": os.path.basename(os.path.normpath(run_dir)),
            "accuracy": {step: r[ACCURACY] for step, r in sorted(evals.items())},
            "tool_share": {step: r.get(TOOL_SHARE[path]) for step, r in sorted(evals.items())},
            "turns": mean(TURNS[path]), "turn_s": mean(f"{prefix}/turn_s"),
            "turn_engine_s": mean(f"{prefix}/turn_engine_s"), "turn_overhead_s": mean(f"{prefix}/turn_overhead_s"),
            "engine_calls": mean(f"{prefix}/engine_calls"), "steps": train[-1]["step"] if train else 0,
            "train_s": sum(r.get("time/step", 0.0) for r in train),
            "rollout_s": mean("time/rollout")}


def fmt(value, spec=".2f"):
    return "-" if value is None else format(value, spec)


def by_step(values: dict) -> str:
    return " / ".join(fmt(v) for v in values.values()) or "-"


def ms(value):
    return "-" if value is None else f"{1000 * value:.1f}"


def comparison(runs: list[dict]) -> list[str]:
    """Per seed with both paths: the last evaluation of each, and whether the agent is within 0.1 of the native."""
    lines = []
    native = {(r["strategy"], r["seed"]): r for r in runs if r["path"] == "native"}
    verdicts = []
    for agent in (r for r in runs if r["path"] == "agent"):
        other = native.get((agent["strategy"], agent["seed"]))
        if other is None or not agent["accuracy"] or not other["accuracy"]:
            continue
        parts, ok = [], True
        for label, key in (("held-out accuracy", "accuracy"), ("tool share", "tool_share")):
            a_step, a = list(agent[key].items())[-1]
            n_step, n = list(other[key].items())[-1]
            if a is None or n is None:
                parts.append(f"{label} -")
                ok = False
                continue
            close = abs(a - n) <= WITHIN + 1e-9
            ok = ok and close
            parts.append(f"{label} agent {a:.2f} (step {a_step}) vs native {n:.2f} (step {n_step}): "
                         f"{a - n:+.2f}{'' if close else ' (NOT within 0.1)'}")
        verdicts.append(ok)
        lines.append(f"{agent['strategy']} seed {agent['seed']}: " + "; ".join(parts))
    if verdicts:
        lines.append(f"agent within {WITHIN} of native on both measures: {sum(verdicts)} of {len(verdicts)} seed(s)")
    by_path = {p: [r for r in runs if r["path"] == p and r["turn_overhead_s"] is not None] for p in PATHS.values()}
    if all(by_path.values()):
        over = {p: sum(r["turn_overhead_s"] for r in rs) / len(rs) for p, rs in by_path.items()}
        turn = {p: sum(r["turn_s"] for r in rs) / len(rs) for p, rs in by_path.items()}
        lines.append(f"overhead per model turn (outside engine.generate), mean over runs: agent endpoint "
                     f"{ms(over['agent'])} ms vs native episode loop {ms(over['native'])} ms "
                     f"({over['agent'] - over['native']:+.4f} s per turn); whole turn {ms(turn['agent'])} ms vs "
                     f"{ms(turn['native'])} ms")
    return lines


def main(paths: list[str]) -> None:
    runs = [r for r in (summarize(p) for p in paths) if r is not None]
    runs.sort(key=lambda r: (r["strategy"], r["seed"], r["path"] != "native"))
    print("Held-out eval: native plays arith_products_eval through the trainer's tool loop; agent plays "
          "arith_products_agent_eval (the same questions) through examples/calculator_agent.py and the endpoint; "
          "one greedy episode per question in both.\n")
    print("| path | strategy | seed | steps | eval steps | held-out accuracy | tool share | model turns / episode "
          "| ms / turn | engine ms / turn | overhead ms / turn | engine calls / step | rollout s / step | train s "
          "| wall s | GPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['path']} | {r['strategy']} | {r['seed']} | {r['steps']} | "
              f"{' / '.join(str(s) for s in r['accuracy']) or '-'} | {by_step(r['accuracy'])} | "
              f"{by_step(r['tool_share'])} | {fmt(r['turns'])} | {ms(r['turn_s'])} | {ms(r['turn_engine_s'])} | "
              f"{ms(r['turn_overhead_s'])} | {fmt(r['engine_calls'], '.1f')} | {fmt(r['rollout_s'])} | "
              f"{r['train_s']:.0f} | {r.get('wall_s', 0):.0f} | {r.get('gpu', '-')} |")
    lines = comparison(runs)
    if lines:
        print()
        print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
