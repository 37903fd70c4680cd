"""Rollout throughput of one GRPO batch: bare vLLM against grpo's rollout engine (GPU only, never run by CI).

The batch: --prompts random prompts of --prompt_len tokens (ids drawn with a fixed seed, the same in every run),
n = --k samples each at temperature 1, exactly --max_new new tokens per sample (EOS ignored), token ids in and out
(no detokenizing). Each case runs one warm-up generate, then --repeats timed ones (grpo's two calls take turns); tokens/s = generated tokens,
counted from the outputs, over wall seconds; the best repeat and the median are kept.

  --engine bare  vLLM's LLM as a user would start it (its own defaults: engine core in a worker process unless
                 VLLM_ENABLE_V1_MULTIPROCESSING=0), LLM.generate with logprobs=None and with logprobs=0.
  --engine grpo  grpo.rollout.vllm.VLLMRolloutEngine as the trainer starts it (one torch.distributed rank,
                 external_launcher, in-process engine, sleep mode enabled), then
                   engine.generate(SamplingSettings(logprobs=False / True))  the call the trainer makes, and
                   engine.llm.generate(...)                                   bare LLM.generate on the same engine,
                 so that (bare -> grpo's LLM) shows the cost of the engine's settings and (grpo's LLM ->
                 engine.generate) the cost of the wrapper. SamplingSettings has no ignore-EOS switch: this script
                 hands the engine a vllm stand-in whose SamplingParams always set ignore_eos=True (benchmark only).
                 Last, the whole rollout phase as a colocated training step runs it (wake, generate, decode the
                 ids to text, level-2 sleep; the weights then come back through load_weights, untimed, as the
                 trainer's sync brings them) against LLM.generate on the same engine, awake, the repeats taken in
                 pairs: the median of the per-pair ratios is what the phase adds, free of the host's drift.
  --phase_only      grpo: only that last pair of cases
  --kv_cache_gib G  give vLLM's KV cache G GiB (kv_cache_memory_bytes) instead of the --vllm_mem share (both engines);
                    auto: sized to the batch as a training run sizes it (--vllm_kv_cache_gib's colocated default)

Appends one JSON row per case to --json.

    python benchmarks/rollout_throughput.py --engine bare --model /tmp/llama068 --json rollout.jsonl
    python benchmarks/rollout_throughput.py --engine grpo --model /tmp/llama068 --json rollout.jsonl
    python benchmarks/rollout_throughput.py --engine grpo --model /tmp/llama068 --json rollout.jsonl --kv_cache_gib 4
"""
from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the grpo package


def timed(call, repeats: int) -> dict:
    """One warm-up call, then `repeats` timed ones; `call` returns the number of tokens it generated."""
    return timed_alternately({"call": call}, repeats)["call"]


def timed_alternately(calls: dict, repeats: int) -> dict:
    """Like `timed` for several calls on one engine, their timed repeats interleaved (in turn first and last), so
    that drift over the run (clocks, caches) does not favour the one measured later."""
    for call in calls.values():
        call()
    runs: dict = {name: [] for name in calls}
    for repeat in range(repeats):
        for name in (list(calls) if repeat % 2 == 0 else list(reversed(calls))):
            start = time.perf_counter()
            tokens = calls[name]()
            runs[name].append((tokens, time.perf_counter() - start))
    return {name: summary(rows) for name, rows in runs.items()}


def summary(runs: list) -> dict:
    """Best and median tokens/s of (tokens, seconds) runs."""
    repeats = len(runs)
    rates = [t / s for t, s in runs]
    best = max(range(repeats), key=lambda i: rates[i])
    return {"tokens": runs[best][0], "seconds": runs[best][1], "tok_s": rates[best],
            "tok_s_median": statistics.median(rates), "repeats": repeats}


class FixedLengthVLLM:
    """Stands in for the vllm module inside VLLMRolloutEngine: everything passes through, except that every
    SamplingParams it builds ignores EOS, so every sample has exactly max_tokens tokens, as in the bare runs."""

    def __init__(self, vllm):
        self._vllm = vllm

    def __getattr__(self, name):
        return getattr(self._vllm, name)

    def SamplingParams(self, **kwargs):  # noqa: N802 (the name the engine calls)
        return self._vllm.SamplingParams(**{**kwargs, "ignore_eos": True})


def bare_cases(args, prompts) -> list[dict]:
    import vllm

    llm = vllm.LLM(model=args.model, dtype="bfloat16", gpu_memory_utilization=args.vllm_mem,
                   max_model_len=args.prompt_len + args.max_new, seed=0, enforce_eager=args.enforce_eager,
                   kv_cache_memory_bytes=kv_bytes(args))
    requests = [vllm.TokensPrompt(prompt_token_ids=p) for p in prompts]
    rows = []
    for logprobs in (None, 0):
        params = vllm.SamplingParams(n=args.k, max_tokens=args.max_new, temperature=1.0, logprobs=logprobs,
                                     ignore_eos=True, detokenize=False)

        def call():
            outs = llm.generate(requests, params, use_tqdm=False)
            return sum(len(o.token_ids) for r in outs for o in r.outputs)

        rows.append({"engine": "bare vLLM", "call": "LLM.generate", "logprobs": logprobs is not None,
                     **timed(call, args.repeats)})
    return rows


def grpo_cases(args, prompts) -> list[dict]:
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
        os.environ.setdefault(key, value)
    from grpo.runtime import distributed as dist_utils
    from grpo.rollout.engine import SamplingSettings
    from grpo.rollout.vllm import VLLMRolloutEngine

    dist_utils.init_distributed()  # the engine joins this world (external_launcher)
    engine = VLLMRolloutEngine(args.model, gpu_memory_utilization=args.vllm_mem,
                               max_model_len=args.prompt_len + args.max_new, seed=0,
                               enable_sleep=True, enforce_eager=args.enforce_eager,
                               kv_cache_bytes=kv_bytes(args))
    engine._vllm = FixedLengthVLLM(engine._vllm)  # the module the engine builds its SamplingParams from
    import vllm

    requests = [vllm.TokensPrompt(prompt_token_ids=p) for p in prompts]
    rows = []
    for logprobs in () if args.phase_only else (False, True):
        sampling = SamplingSettings(n=args.k, max_new_tokens=args.max_new, temperature=1.0, logprobs=logprobs)
        params = vllm.SamplingParams(n=args.k, max_tokens=args.max_new, temperature=1.0,
                                     logprobs=0 if logprobs else None, ignore_eos=True, detokenize=False)

        def wrapped():
            return sum(len(c.token_ids) for c in engine.generate(prompts, sampling))

        def raw():
            outs = engine.llm.generate(requests, params, use_tqdm=False)
            return sum(len(o.token_ids) for r in outs for o in r.outputs)

        timings = timed_alternately({"wrapped": wrapped, "raw": raw}, args.repeats)
        rows.append({"engine": "grpo", "call": "VLLMRolloutEngine.generate", "logprobs": logprobs,
                     "ignore_eos": True, **timings["wrapped"]})
        rows.append({"engine": "grpo's LLM", "call": "LLM.generate", "logprobs": logprobs, **timings["raw"]})
    return rows + phase_cases(args, engine, prompts, requests)


def phase_cases(args, engine, prompts, requests) -> list[dict]:
    """The rollout phase of a colocated step against LLM.generate on the same engine, in pairs (module docstring).
    Each call returns (tokens, timed seconds, seconds per part); `gc` is the time the collector ran inside."""
    import vllm
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from grpo.rollout.engine import SamplingSettings

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    weights = {}
    for path in sorted(glob.glob(os.path.join(args.model, "*.safetensors"))):
        weights.update(load_file(path, device="cuda"))
    sampling = SamplingSettings(n=args.k, max_new_tokens=args.max_new, temperature=1.0, logprobs=False)
    params = vllm.SamplingParams(n=args.k, max_tokens=args.max_new, temperature=1.0, ignore_eos=True,
                                 detokenize=False)
    collector = GCTimer()

    def phase():
        collector.seconds = 0.0
        marks = [time.perf_counter()]
        engine.wake()
        marks.append(time.perf_counter())
        completions = engine.generate(prompts, sampling)
        marks.append(time.perf_counter())
        tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        marks.append(time.perf_counter())
        engine.sleep()
        marks.append(time.perf_counter())
        parts = dict(zip(("wake", "generate", "decode", "sleep"), (b - a for a, b in zip(marks, marks[1:]))))
        parts["gc"] = collector.seconds
        engine.load_weights(weights.items())  # the trainer's sync, untimed
        return sum(len(c.token_ids) for c in completions), marks[-1] - marks[0], parts

    def raw():
        engine.wake()
        collector.seconds = 0.0
        start = time.perf_counter()
        outs = engine.llm.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        engine.sleep()
        engine.load_weights(weights.items())
        return sum(len(o.token_ids) for r in outs for o in r.outputs), seconds, {"gc": collector.seconds}

    gc.callbacks.append(collector)
    runs = {"phase": [], "raw": []}
    phase(), raw()  # warm-up
    for repeat in range(args.repeats):
        for name in (["phase", "raw"] if repeat % 2 == 0 else ["raw", "phase"]):
            runs[name].append((phase if name == "phase" else raw)())
    gc.callbacks.remove(collector)
    pair_ratios = [(p[0] / p[1]) / (r[0] / r[1]) for p, r in zip(runs["phase"], runs["raw"])]
    part_medians = lambda rows: {k: statistics.median(row[2][k] for row in rows) for k in rows[0][2]}  # noqa: E731
    return [{"engine": "grpo", "call": "rollout phase", "logprobs": False, "ignore_eos": True,
             **summary([(t, s) for t, s, _ in runs["phase"]]), "parts_s_median": part_medians(runs["phase"]),
             "paired_ratio_median": statistics.median(pair_ratios), "paired_ratios": pair_ratios},
            {"engine": "grpo's LLM", "call": "LLM.generate (paired)", "logprobs": False,
             **summary([(t, s) for t, s, _ in runs["raw"]]), "parts_s_median": part_medians(runs["raw"])}]


class GCTimer:
    """A gc.callbacks entry adding up the seconds the cyclic garbage collector runs."""

    def __init__(self):
        self.seconds, self._start = 0.0, None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self._start = None


def kv_bytes(args) -> int | None:
    """--kv_cache_gib in bytes; auto sizes it as a training run would for this batch (grpo/memory/kv_cache.py)."""
    if args.kv_cache_gib in (None, "share"):
        return None
    if args.kv_cache_gib == "auto":
        from transformers import AutoConfig

        from grpo.memory.kv_cache import auto_kv_cache_bytes, kv_bytes_per_token

        longest = args.prompt_len + args.max_new
        return auto_kv_cache_bytes(kv_bytes_per_token(AutoConfig.from_pretrained(args.model)),
                                   args.prompts * args.k, longest, longest)
    return int(float(args.kv_cache_gib) * 2**30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["bare", "grpo"], required=True)
    parser.add_argument("--model", required=True, help="HF model folder (benchmarks/random_model.py)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--max_new", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm_mem", type=float, default=0.3, help="gpu_memory_utilization")
    parser.add_argument("--kv_cache_gib", default=None,
                        help="KV cache size in GiB, auto (sized to the batch, as train_grpo.py's default) or share; "
                             "default: share, what --vllm_mem leaves after the weights")
    parser.add_argument("--phase_only", action="store_true", help="grpo: only the rollout phase against LLM.generate")
    parser.add_argument("--enforce_eager", action="store_true")
    parser.add_argument("--json", required=True, help="append the rows to this JSON-lines file")
    args = parser.parse_args()
    rng = random.Random(0)
    vocab = json.load(open(os.path.join(args.model, "config.json")))["vocab_size"]
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    rows = bare_cases(args, prompts) if args.engine == "bare" else grpo_cases(args, prompts)
    kv = kv_bytes(args)
    kv_gib = round(kv / 2**30, 3) if kv else None
    with open(args.json, "a") as fh:
        for row in rows:
            row.update(prompts=args.prompts, k=args.k, prompt_len=args.prompt_len, max_new=args.max_new,
                       kv_cache_gib=kv_gib, kv_cache_choice=args.kv_cache_gib,
                       v1_multiprocessing=os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "default"))
            fh.write(json.dumps(row) + "\n")
            print(f"{row['engine']:>10} {row['call']:<27} logprobs={row['logprobs']!s:<5} {row['tokens']} tokens "
                  f"in {row['seconds']:.3f} s: {row['tok_s']:,.0f} tok/s (median {row['tok_s_median']:,.0f})"
                  + ("; parts (median s): " + ", ".join(f"{k} {v:.4f}" for k, v in row["parts_s_median"].items())
                     if "parts_s_median" in row else "")
                  + (f"; phase / LLM.generate in pairs: {row['paired_ratio_median']:.3f} (median)"
                     if "paired_ratio_median" in row else ""), flush=True)
    if args.engine == "grpo":
        os._exit(0)  # skip the interpreter's teardown, where an in-process vLLM engine can hang


if __name__ == "__main__":
    main()
