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

Appends one JSON row per case to --json.

    python benchmarks/rollout_throughput.py --engine bare --model /tmp/llama068 --json rollout.jsonl
    python benchmarks/rollout_throughput.py --engine grpo --model /tmp/llama068 --json rollout.jsonl
"""
from __future__ import annotations

import argparse
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
                   max_model_len=args.prompt_len + args.max_new, seed=0, enforce_eager=args.enforce_eager)
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
    from grpo import distributed as dist_utils
    from grpo.rollout.base import SamplingSettings
    from grpo.rollout.vllm import VLLMRolloutEngine

    dist_utils.init_distributed()  # the engine joins this world (external_launcher)
    engine = VLLMRolloutEngine(args.model, gpu_memory_utilization=args.vllm_mem,
                               max_model_len=args.prompt_len + args.max_new, seed=0,
                               enable_sleep=True, enforce_eager=args.enforce_eager)
    engine._vllm = FixedLengthVLLM(engine._vllm)  # the module the engine builds its SamplingParams from
    import vllm

    requests = [vllm.TokensPrompt(prompt_token_ids=p) for p in prompts]
    rows = []
    for logprobs in (False, True):
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
    return rows


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
    parser.add_argument("--enforce_eager", action="store_true")
    parser.add_argument("--json", required=True, help="append the rows to this JSON-lines file")
    args = parser.parse_args()
    rng = random.Random(0)
    vocab = json.load(open(os.path.join(args.model, "config.json")))["vocab_size"]
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    rows = bare_cases(args, prompts) if args.engine == "bare" else grpo_cases(args, prompts)
    with open(args.json, "a") as fh:
        for row in rows:
            row.update(prompts=args.prompts, k=args.k, prompt_len=args.prompt_len, max_new=args.max_new,
                       v1_multiprocessing=os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "default"))
            fh.write(json.dumps(row) + "\n")
            print(f"{row['engine']:>10} {row['call']:<27} logprobs={row['logprobs']!s:<5} {row['tokens']} tokens "
                  f"in {row['seconds']:.3f} s: {row['tok_s']:,.0f} tok/s (median {row['tok_s_median']:,.0f})",
                  flush=True)
    if args.engine == "grpo":
        os._exit(0)  # skip the interpreter's teardown, where an in-process vLLM engine can hang


if __name__ == "__main__":
    main()
