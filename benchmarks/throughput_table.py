"""Tables and ratios of benchmarks/throughput.sh from what its runs left in one folder (no GPU needed).

Reads <dir>/env.json, <dir>/rollout.jsonl (benchmarks/rollout_throughput.py), <dir>/runs/<name>.json with
<dir>/runs/<name>/metrics.jsonl (train_grpo.py runs) and <dir>/trl.json (benchmarks/trl_step.py). Per training
run, the first step is left out (vLLM warm-up, CUDA graphs, allocator); a missing or failed run is shown as such.

    python benchmarks/throughput_table.py outputs/bench/throughput
"""
from __future__ import annotations

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grpo.train.reporting import read_metrics  # noqa: E402


def read_json(path: str, default=None):
    if not os.path.isfile(path):
        return default
    with open(path) as fh:
        return json.load(fh)


def ratio(a, b) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def num(x, fmt: str = ",.0f") -> str:
    return "-" if x is None else format(x, fmt)


def grpo_run(folder: str, name: str) -> dict:
    """A train_grpo.py run's step rows (step > 1) summarised: seconds per step and rollout tokens/s."""
    meta = read_json(os.path.join(folder, "runs", f"{name}.json"), {"name": name, "rc": None})
    rows = [r for r in read_metrics(os.path.join(folder, "runs", name, "metrics.jsonl"))
            if "time/step" in r and r.get("step", 0) > 1]
    out = dict(meta, measured_steps=len(rows))
    if not rows or "samples_per_step" not in meta:
        return out
    per_rank = meta["samples_per_step"] // meta["train_ranks"]  # completions each training rank gets
    tokens = sum(r["completion/length_mean"] * per_rank for r in rows)  # per training rank
    total = lambda key: sum(r.get(key, 0.0) for r in rows)  # noqa: E731
    out.update(s_per_step=total("time/step") / len(rows),
               length_mean=statistics.mean(r["completion/length_mean"] for r in rows),
               rollout_s=total("time/rollout") / len(rows), generate_s=total("time/rollout_generate") / len(rows),
               train_s=(total("time/logprobs") + total("time/train")) / len(rows),
               sync_s=total("time/sync") / len(rows),
               rollout_tok_s=tokens / total("time/rollout") if total("time/rollout") else None,
               generate_tok_s=tokens / total("time/rollout_generate") if total("time/rollout_generate") else None)
    # the median step too: one slow step (a busy host, a collection) moves the mean, as bare vLLM's best / median
    per_step = lambda key: statistics.median(  # noqa: E731
        r["completion/length_mean"] * per_rank / r[key] for r in rows if r.get(key))
    out.update(rollout_tok_s_median=per_step("time/rollout") if total("time/rollout") else None,
               generate_tok_s_median=per_step("time/rollout_generate") if total("time/rollout_generate") else None)
    if "async" in meta.get("mode", ""):  # its wait is only what training did not hide: no generation rate
        out["generate_tok_s"] = out["generate_tok_s_median"] = None
    out["rollout_parts"] = {key[len("time/rollout_"):]: total(key) / len(rows) for key in sorted(rows[0])
                            if key.startswith("time/rollout_")}  # wake, sleep, generate, decode, ... seconds
    out["samples_s"] = meta["samples_per_step"] / out["s_per_step"]
    out["tokens_s"] = out["samples_s"] * out["length_mean"]
    return out


def status(run: dict) -> str:
    if run.get("measured_steps"):
        return "ok" if run.get("rc") == 0 else f"rc={run.get('rc')}"
    return f"failed (rc={run.get('rc')}, see runs/{run['name']}.log)"


def rollout_section(folder: str) -> None:
    rows = read_metrics(os.path.join(folder, "rollout.jsonl"))
    print("## 1. Rollout throughput, one batch (bare vLLM vs grpo)\n")
    if rows:
        r0 = rows[0]
        print(f"{r0['prompts']} random prompts of {r0['prompt_len']} tokens x n={r0['k']}, {r0['max_new']} new "
              f"tokens each (EOS ignored), temperature 1; best of {r0['repeats']} after a warm-up.\n")
    bare = {r["logprobs"]: r["tok_s"] for r in rows if r["engine"] == "bare vLLM"}
    bare_median = next((r["tok_s_median"] for r in rows if r["engine"] == "bare vLLM" and not r["logprobs"]), None)
    median_ratio = lambda x: ratio(x, bare_median)  # noqa: E731  (the run's median step against bare's median call)
    print("| engine | call | logprobs | tokens | s | tok/s (best) | tok/s (median) | / bare |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        lp = "0" if r["logprobs"] else "None"
        core = "in-process" if r.get("v1_multiprocessing") == "0" else "engine-core process"
        print(f"| {r['engine']} ({core}) | {r['call']} | {lp} | {r['tokens']} | {r['seconds']:.3f} | "
              f"{r['tok_s']:,.0f} | {r['tok_s_median']:,.0f} | {ratio(r['tok_s'], bare.get(r['logprobs']))} |")
    run = grpo_run(folder, "colocate-1gpu-short")
    wrapped = {r["logprobs"]: r["tok_s"] for r in rows if r["call"] == "VLLMRolloutEngine.generate"}
    if run.get("measured_steps"):
        print(f"| grpo, train_grpo.py run | rollout phase: generate only | None* | "
              f"{run['length_mean'] * run['samples_per_step']:,.0f}/step | {run['generate_s']:.3f} | "
              f"{num(run['generate_tok_s'])} (mean) | {num(run['generate_tok_s_median'])} | "
              f"{ratio(run['generate_tok_s'], bare.get(False))} / {median_ratio(run['generate_tok_s_median'])} |")
        print(f"| grpo, train_grpo.py run | rollout phase: + wake, sleep, decode | None* | "
              f"{run['length_mean'] * run['samples_per_step']:,.0f}/step | {run['rollout_s']:.3f} | "
              f"{num(run['rollout_tok_s'])} (mean) | {num(run['rollout_tok_s_median'])} | "
              f"{ratio(run['rollout_tok_s'], bare.get(False))} / {median_ratio(run['rollout_tok_s_median'])} |")
        parts = ", ".join(f"{name} {seconds:.3f}" for name, seconds in run["rollout_parts"].items())
        print(f"| grpo, train_grpo.py run | rollout phase, s per step by part: {parts} | | | | | | |")
        print(f"\n*train run: `arith` prompts (chat template, about 50 tokens), {run['max_new']} new tokens at most "
              f"(mean {run['length_mean']:.1f}), mean and median step over steps 2-{run['measured_steps'] + 1} (/ bare: mean "
              f"against bare's best, median against bare's median); the engine is asked "
              f"for log-probs only on the steps of --logprob_check_steps (the first step here).")
    else:
        print(f"\ntrain_grpo.py run: {status(run)}")
    for r in rows:
        if "paired_ratio_median" in r:
            parts = ", ".join(f"{name} {seconds:.4f}" for name, seconds in r["parts_s_median"].items())
            kv = f"{r['kv_cache_gib']} GiB ({r.get('kv_cache_choice')})" if r.get("kv_cache_gib") \
                else "the memory share"
            print(f"\nrollout phase (wake, generate, decode, level-2 sleep; KV cache: {kv}) / LLM.generate on the "
                  f"same engine, repeats in pairs: {r['paired_ratio_median']:.3f} (median of {len(r['paired_ratios'])}"
                  f"); median seconds by part: {parts}")
    print(f"\ngrpo / bare vLLM tokens/s: VLLMRolloutEngine.generate {ratio(wrapped.get(False), bare.get(False))} "
          f"(logprobs None), {ratio(wrapped.get(True), bare.get(True))} (logprobs 0); train run's rollout phase "
          f"{ratio(run.get('generate_tok_s'), bare.get(False))} (generate only), "
          f"{ratio(run.get('rollout_tok_s'), bare.get(False))} (whole phase); median step vs bare's median: "
          f"{median_ratio(run.get('generate_tok_s_median'))} (generate only), "
          f"{median_ratio(run.get('rollout_tok_s_median'))} (whole phase)\n")


def trl_section(folder: str) -> None:
    print("## 2. Step time, grpo vs TRL GRPOTrainer (same model, prompts, LoRA, batch, vLLM colocate)\n")
    run = grpo_run(folder, "colocate-1gpu-short")
    trl = read_json(os.path.join(folder, "trl.json"))
    print("| trainer | s / step (mean, steps 2..N) | completion length | samples / s | status |")
    print("|---|---|---|---|---|")
    if run.get("measured_steps"):
        print(f"| grpo | {run['s_per_step']:.2f} | {run['length_mean']:.1f} | {run['samples_s']:.1f} | "
              f"{status(run)} |")
    else:
        print(f"| grpo | - | - | - | {status(run)} |")
    if trl and trl.get("s_per_step"):
        print(f"| TRL | {trl['s_per_step']:.2f} | {num(trl.get('completion_length_mean'), '.1f')} | "
              f"{trl['samples_per_step'] / trl['s_per_step']:.1f} | ok |")
    else:
        print("| TRL | - | - | - | not run or failed (see trl.log) |")
    if run.get("measured_steps") and trl and trl.get("s_per_step"):
        print(f"\ngrpo / TRL seconds per step: {ratio(run['s_per_step'], trl['s_per_step'])} "
              f"(TRL: {trl['micro_batch']} completions x {trl['grad_accum']} micro-batches, vLLM sleep "
              f"{trl['vllm_sleep']}, IS correction {trl['is_correction']}; grpo's time/step leaves out its "
              f"metrics logging, TRL's step-to-step time includes its own)")
    print()


def modes_section(folder: str) -> None:
    names = sorted(n[:-5] for n in os.listdir(os.path.join(folder, "runs")) if n.endswith(".json")) \
        if os.path.isdir(os.path.join(folder, "runs")) else []
    runs = [grpo_run(folder, n) for n in names]
    if len(runs) <= 1:
        return
    print("## 3. grpo modes (samples / s = completions per optimizer step / s per step)\n")
    print("| run | mode | GPUs | max new | samples / step | s / step | samples / s | tokens / s | rollout s | "
          "log-probs + train s | sync s | rollout generate tok/s per engine | status |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    order = lambda r: (r.get("max_new", 0), r.get("samples_per_step", 0), r.get("gpus", 0), r["name"])  # noqa: E731
    for r in sorted(runs, key=order):
        if r.get("measured_steps"):
            print(f"| {r['name']} | {r['mode']} | {r['gpus']} | {r['max_new']} | {r['samples_per_step']} | "
                  f"{r['s_per_step']:.2f} | {r['samples_s']:.1f} | {r['tokens_s']:,.0f} | {r['rollout_s']:.2f} | "
                  f"{r['train_s']:.2f} | {r['sync_s']:.2f} | {num(r['generate_tok_s'])} | {status(r)} |")
        else:
            print(f"| {r['name']} | {r.get('mode', '-')} | {r.get('gpus', '-')} | {r.get('max_new', '-')} | - | - | - "
                  f"| - | - | - | - | - | {status(r)} |")
    print("\nIn server mode `time/rollout` is the training rank's wait for the rollout rank (with --async_rollout "
          "only what generation did not overlap with training, so no generation rate is shown).\n")
    scaling_lines(runs)
    print()


def scaling_lines(runs: list[dict]) -> None:
    """Per "<prompts>:<new>" case of section 3 (runs named p<prompts>-n<new>-<mode>): samples/s ratios at equal
    prompts per step, 2-GPU colocate over 1-GPU colocate (strong scaling) and server modes over 2-GPU colocate."""
    by_name = {r["name"]: r for r in runs if r.get("measured_steps")}
    cases = sorted({tuple(r["name"].split("-")[:2]) for r in runs if r["name"].startswith("p") and
                    r["name"].count("-") == 2}, key=lambda c: (int(c[1][1:]), int(c[0][1:])))
    for prompts, new in cases:
        rate = lambda mode: by_name.get(f"{prompts}-{new}-{mode}", {}).get("samples_s")  # noqa: E731
        print(f"- {prompts[1:]} prompts x 8 per step, {new[1:]} new tokens: 2-GPU colocate / 1-GPU colocate "
              f"{ratio(rate('colocate2'), rate('colocate1'))}; server / 2-GPU colocate "
              f"{ratio(rate('server'), rate('colocate2'))}; server + async / 2-GPU colocate "
              f"{ratio(rate('async'), rate('colocate2'))}"
              + "".join(f"; stream K={k} / 2-GPU colocate {ratio(rate(f'stream{k}'), rate('colocate2'))}"
                        for k in (2, 4) if rate(f"stream{k}") is not None))


def main() -> None:
    folder = sys.argv[1] if len(sys.argv) > 1 else "outputs/bench/throughput"
    env = read_json(os.path.join(folder, "env.json"), {})
    print("# Throughput: " + ", ".join(f"{k} {v}" for k, v in env.items()) + "\n")
    rollout_section(folder)
    trl_section(folder)
    modes_section(folder)


if __name__ == "__main__":
    main()
