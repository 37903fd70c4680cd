"""How often a model calls its tools before any training: sample episodes of a tool dataset exactly as the trainer
renders and runs them (the registry entry, its tools in the prompt, the episode runner, the "tools" environment) and
count, per episode, a tool call that ran, an attempt that could not run (a malformed call, or text that looks like
one but is not read as a call), and the boxed answer's accuracy. CPU is enough for the embedded model.

    python benchmarks/tool_calls.py                                          # arith_calc, 16 prompts x 4 samples
    python benchmarks/tool_calls.py --dataset_config my_config.json --dataset prices --print_prompt
    python benchmarks/tool_calls.py --print_episodes 4                       # a few episodes as the model wrote them
    python benchmarks/tool_calls.py --python_calls 80 --threads 8            # the python tool's calls/s (no model)
    python benchmarks/tool_calls.py --parse_cost                             # reading hostile messages (no model)

A dataset whose starting model never calls its tools gives GRPO nothing to learn tool use from: raise the call rate
here (the system prompt, a small reward for a well-formed call) before spending GPU time.
"""
import argparse
import json
import os
import re
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# text that shows the model meant to call a tool, whether or not it can be read as a call
_ATTEMPT = re.compile(r"tool_call|<tools?>|\"name\"\s*:|\bcalculator\s*\(|\"(?:arguments|parameters)\"", re.I)


def episode_counts(episode, answer: str) -> dict:
    """What one episode did: a call ran, a call or call-like text that did not run, the boxed answer right."""
    from grpo.rewards import boxed_accuracy
    from grpo.tools.calls import parse_tool_calls

    turns = [m["content"] for m in episode.messages if m["role"] == "assistant"]
    calls = [c for text in turns for c in parse_tool_calls(text)]
    ran = episode.tool_calls - episode.tool_errors - episode.tool_timeouts
    bad = any(c.error for c in calls) or episode.tool_errors > 0 or any(
        _ATTEMPT.search(text) and not parse_tool_calls(text) for text in turns)
    return {"called": ran > 0, "malformed": bool(bad),
            "correct": boxed_accuracy([episode.final_text], [answer])[0] == 1.0,
            "turns": episode.turns}


def python_call_rate(calls: int, threads: int) -> dict:
    """The python tool's cost per call, as the episode runner pays it (execute_call, its sandbox and limits): the
    latency of one call alone, and calls/s with `threads` calls at once (the runner's environment_workers)."""
    from concurrent.futures import ThreadPoolExecutor

    from grpo.tools import ToolCall, execute_call
    from grpo.tools.sandbox import sandbox_problem

    call = ToolCall("python", {"code": "print(sum(range(1000)))"})

    def one(_=None):
        result = execute_call(call)
        if result.status != "ok":
            sys.exit(f"the python tool failed: {result.message['content']}")

    for _ in range(3):  # the sandbox check and the interpreter's files in the page cache
        one()
    serial = 10
    start = time.perf_counter()
    for _ in range(serial):
        one()
    latency = (time.perf_counter() - start) / serial
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(calls)))
    seconds = time.perf_counter() - start
    return {"mode": "sandbox" if sandbox_problem(sys.executable) is None else "unsandboxed",
            "user": "root" if os.geteuid() == 0 else "normal", "ms_per_call_alone": round(latency * 1000, 1),
            "threads": threads, "calls": calls, "calls_per_s": round(calls / seconds, 1)}


def parse_cost() -> list[dict]:
    """Seconds to read hostile messages: n unclosed tags, n closed calls, and a call nested 1,000 levels."""
    from grpo.tools import execute_calls, parse_tool_calls

    rows = []
    for n in (1024, 4096, 16384, 65536):
        for shape, text in (("unclosed", "<tool_call>" * n),
                            ("closed", '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}'
                                       "</tool_call>" * n)):
            start = time.perf_counter()
            calls = parse_tool_calls(text)
            execute_calls(calls, ["calculator"])
            rows.append({"tags": n, "shape": shape, "seconds": round(time.perf_counter() - start, 4)})
    deep = '<tool_call>{"name": "calculator", "arguments": ' + "[" * 1000 + "]" * 1000 + "}</tool_call>"
    start = time.perf_counter()
    execute_calls(parse_tool_calls(deep), ["calculator"])
    rows.append({"tags": 1, "shape": "nested 1000", "seconds": round(time.perf_counter() - start, 4)})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dataset_config", default="configs/dataset_config.json")
    parser.add_argument("--dataset", default="arith_calc")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4, help="episodes per prompt")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--greedy", action="store_true", help="argmax decoding (use with --samples 1)")
    parser.add_argument("--max_new_tokens", type=int, default=128, help="per model turn")
    parser.add_argument("--max_turns", type=int, default=3)
    parser.add_argument("--max_episode_tokens", type=int, default=320)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tool_module", default=None)
    parser.add_argument("--print_prompt", action="store_true", help="print the first rendered prompt")
    parser.add_argument("--print_episodes", type=int, default=0, help="print this many episodes' model turns")
    parser.add_argument("--python_calls", type=int, default=0,
                        help="measure the python tool instead: this many calls, --threads at once")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--parse_cost", action="store_true", help="measure reading hostile messages instead")
    args = parser.parse_args()
    if args.python_calls:
        print(json.dumps(python_call_rate(args.python_calls, args.threads)))
        return
    if args.parse_cost:
        for row in parse_cost():
            print(json.dumps(row))
        return

    import torch

    from grpo.data import load_dataset_registry, load_prompt_datasets, render_prompts
    from grpo.model.embedded import resolve_model_path
    from grpo.model.loading import load_base_model, load_tokenizer
    from grpo.rollout.engine import SamplingSettings
    from grpo.rollout.episodes import EpisodeLimits, EpisodePrompt, episode_metrics, run_episodes
    from grpo.rollout.hf import HFRolloutEngine
    from grpo.data.episode_datasets import check_episode_datasets, prompts_with_tools

    config = SimpleNamespace(tool_module=args.tool_module, dataset_config_path=args.dataset_config,
                             rollout_mode="colocate")
    registry = load_dataset_registry(args.dataset_config)
    episode_datasets = check_episode_datasets(config, registry, [args.dataset])
    if args.dataset not in episode_datasets:
        sys.exit(f"dataset '{args.dataset}' names no tools or environment in {args.dataset_config}")
    # the held-out split (the trainer's evaluation prompts), in file order
    _, rows = load_prompt_datasets(args.dataset_config, [args.dataset], 0.9, args.seed)
    rows = rows.select(range(min(args.prompts, len(rows))))
    model_path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(model_path)
    rows, tools_by_source = prompts_with_tools(rows, tokenizer, episode_datasets)
    rows = render_prompts(rows, tokenizer, 4096, tools_by_source=tools_by_source)
    if args.print_prompt:
        print(rows[0]["prompt_text"])
        print(f"--- {len(rows[0]['prompt_ids'])} prompt tokens")
    dataset = episode_datasets[args.dataset]
    prompts = [EpisodePrompt(list(r["prompt_ids"]), [dict(m) for m in r["messages"]],
                             {"tools": list(dataset.tools), "answer": r["answer"], "data_source": r["data_source"]},
                             environment=dataset.environment) for r in rows]

    torch.manual_seed(args.seed)
    model = load_base_model(model_path, torch.float32, torch.device("cpu"), False)
    engine = HFRolloutEngine(model, tokenizer)
    start = time.perf_counter()
    episodes = run_episodes(engine, tokenizer, prompts,
                            SamplingSettings(n=args.samples, max_new_tokens=args.max_new_tokens,
                                             temperature=args.temperature, greedy=args.greedy),
                            EpisodeLimits(max_turns=args.max_turns, max_episode_tokens=args.max_episode_tokens))
    seconds = time.perf_counter() - start
    counts = [episode_counts(e, rows[e.prompt_index]["answer"]) for e in episodes]
    for e in episodes[:args.print_episodes]:
        print(f"=== prompt {e.prompt_index} (answer {rows[e.prompt_index]['answer']}), {e.finish_reason}")
        for m in e.messages[len(prompts[e.prompt_index].messages):]:
            print(f"[{m['role']}] {m['content']}")
    n = len(counts)
    summary = {"dataset": args.dataset, "episodes": n, "seconds": round(seconds, 1),
               "called": sum(c["called"] for c in counts) / n, "malformed": sum(c["malformed"] for c in counts) / n,
               "accuracy": sum(c["correct"] for c in counts) / n,
               "accuracy_called": (sum(c["correct"] for c in counts if c["called"])
                                   / max(1, sum(c["called"] for c in counts))),
               **{k.split("/")[1]: round(v, 3) for k, v in episode_metrics(episodes).items()}}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
