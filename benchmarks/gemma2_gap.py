"""Where a random Gemma 2's engine-vs-trainer log-prob gap comes from: one small random Gemma 2 with Gemma-2-9B's
per-element statistics (head_dim 256, query_pre_attn_scalar 256, caps 50 / 30, 42 layers, weights std 0.02 scaled
by sqrt(9B width / this width)), saved in variants and scored by transformers (the trainer's side: grpo's soft-capped
eager attention) and by vLLM (prompt_logprobs over random prompts at temperature 1; processed log-probs of sampled
tokens at --temperature), one row per variant:

    norms   "ones": every norm weight 1, as benchmarks/random_model.py --four_bit wrote them until 2026-11-29 (Gemma
            scales by 1 + w: x2 at each of 4 norms a block and the final one); "zeros": Gemma's own neutral init
    caps    both soft-caps, or none (attn_logit_softcapping and final_logit_softcapping unset)
    bits    bf16 checkpoint, or bitsandbytes nf4 (blocks of 64, double quantization, lm_head skipped), as
            random_model.py --four_bit writes it (vLLM: load_format / quantization bitsandbytes)
    backend vLLM's attention: FLASH_ATTN (FA3 on Hopper), FLASH_ATTN with flash_attn_version 2, TRITON_ATTN,
            FLEX_ATTENTION
    adapter a random rank-16 LoRA on all 7 projections, handed to vLLM as grpo's sync does (load_adapter_tensors)

Columns: prompt / sampled = mean |HF bf16 - vLLM| log-prob (sampled: also the max); hf_fp32 = mean |HF bf16 - HF fp32|
over the prompts (bf16 checkpoints): how far bf16 rounding alone moves this model's log-probs. A gap as large as
hf_fp32 on every backend is a model that amplifies rounding (chaotic), not a mismatch; a gap on one backend or one
option alone is that option's. Each vLLM engine runs in a child process (--parallel at once, enforce_eager).

    python benchmarks/gemma2_gap.py --out /tmp/gemma2_gap              # every variant, ~5 min on one H200
    python benchmarks/gemma2_gap.py --out /tmp/gemma2_gap --only ones/FA3,zeros/FA3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WIDTH_9B, INTERMEDIATE_9B = 3584, 14336
PROMPTS, PROMPT_LEN, GEN_PROMPT_LEN, GEN_TOKENS, SAMPLES = 6, 320, 64, 128, 2
# variant: (checkpoint, vLLM attention backend, flash_attn_version, adapter)
VARIANTS = {
    "ones/FA3": ("ones", "FLASH_ATTN", None, False),
    "ones/FA2": ("ones", "FLASH_ATTN", 2, False),
    "ones/TRITON": ("ones", "TRITON_ATTN", None, False),
    "ones/FLEX": ("ones", "FLEX_ATTENTION", None, False),
    "ones-nocap/FA3": ("ones-nocap", "FLASH_ATTN", None, False),
    "zeros/FA3": ("zeros", "FLASH_ATTN", None, False),
    "zeros/TRITON": ("zeros", "TRITON_ATTN", None, False),
    "zeros/FA3+adapter": ("zeros", "FLASH_ATTN", None, True),
    "ones-nf4/FA3": ("ones-nf4", "FLASH_ATTN", None, False),
    "ones-nf4/FA3+adapter": ("ones-nf4", "FLASH_ATTN", None, True),
    "zeros-nf4/FA3": ("zeros-nf4", "FLASH_ATTN", None, False),
    "zeros-nf4/FA3+adapter": ("zeros-nf4", "FLASH_ATTN", None, True),
}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (CPU: the transformers side alone, for a smoke test)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def free() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def gemma2_config(layers: int, divisor: int, caps: bool):
    from transformers import Gemma2Config

    return Gemma2Config(hidden_size=WIDTH_9B // divisor, intermediate_size=INTERMEDIATE_9B // divisor,
                        num_hidden_layers=layers, num_attention_heads=16 // divisor,
                        num_key_value_heads=max(1, 8 // divisor), head_dim=256, query_pre_attn_scalar=256,
                        vocab_size=32000, max_position_embeddings=1024, sliding_window=256,  # prompts pass it
                        attn_logit_softcapping=50.0 if caps else None,
                        final_logit_softcapping=30.0 if caps else None, tie_word_embeddings=True,
                        bos_token_id=2, eos_token_id=1, pad_token_id=0)


def write_checkpoints(out: str, layers: int, divisor: int, names: set[str]) -> None:
    """The same random weights (bf16 normal, std 0.02 x sqrt(divisor)) under each checkpoint name needed."""
    from transformers import Gemma2ForCausalLM

    for name in sorted(names):
        folder = os.path.join(out, name)
        if os.path.isfile(os.path.join(folder, "config.json")):
            continue
        config = gemma2_config(layers, divisor, caps="nocap" not in name)
        with torch.device(DEVICE):
            model = Gemma2ForCausalLM(config).to(torch.bfloat16)
        generator = torch.Generator(device=DEVICE).manual_seed(0)
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if pname.endswith("norm.weight"):
                    param.fill_(1.0 if name.startswith("ones") else 0.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=generator, device=DEVICE) * 0.02 * divisor ** 0.5)
        if name.endswith("nf4"):
            write_nf4(model, folder)
        else:
            model.save_pretrained(folder, safe_serialization=True)
        del model
        free()


def write_nf4(model, folder: str) -> None:
    """random_model.py --four_bit's layout: the blocks' linear layers as nf4 codes and state, the rest bf16."""
    import bitsandbytes.functional as bnbf

    from grpo.model.quantized_checkpoint import bitsandbytes_4bit_config, write_safetensors_shards

    def tensors():
        for name, tensor in model.state_dict().items():
            if name == "lm_head.weight":  # tied to the embeddings
                continue
            if ".layers." in name and name.endswith("_proj.weight"):
                codes, state = bnbf.quantize_4bit(tensor, blocksize=64, compress_statistics=True, quant_type="nf4")
                yield name, codes.cpu()
                for key, value in state.as_dict(packed=True).items():
                    yield f"{name}.{key}", value.cpu()
            else:
                yield name, tensor.cpu()

    write_safetensors_shards(tensors(), folder)
    config = model.config
    config.quantization_config = bitsandbytes_4bit_config("nf4", True, torch.bfloat16, ["lm_head"])
    config.save_pretrained(folder)


def write_adapter(out: str, layers: int, divisor: int) -> str:
    """A random rank-16 LoRA (lora_B nonzero) as grpo's sync hands it over: peft names, lora_B scaled (alpha = r)."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import Gemma2ForCausalLM

    from grpo.sync.weight_sync import iter_adapter_tensors

    path = os.path.join(out, "adapter.safetensors")
    if os.path.isfile(path):
        return path
    with torch.device("meta"):
        base = Gemma2ForCausalLM(gemma2_config(layers, divisor, caps=True))
    base = base.to_empty(device=DEVICE).to(torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=16, target_modules=LORA_TARGETS))
    generator = torch.Generator(device=DEVICE).manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:  # A's default init keeps; B small but nonzero: the adapter moves the log-probs
                std = 0.02 if "lora_B" in name else 1 / param.shape[1] ** 0.5
                param.copy_(torch.randn(param.shape, generator=generator, device=DEVICE) * std)
    save_file({k: v.contiguous().cpu() for k, v in iter_adapter_tensors(model)}, path)
    return path


def token_lists(seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(10, 32000, (PROMPTS, PROMPT_LEN), generator=g).tolist()
    return prompts, [p[:GEN_PROMPT_LEN] for p in prompts]


# ------------------------------------------------------------------------------------------ vLLM (child process)
def run_engine(spec: dict) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt

    kwargs = dict(model=spec["folder"], dtype="bfloat16", enforce_eager=True, max_model_len=1024, seed=0,
                  skip_tokenizer_init=True, logprobs_mode="processed_logprobs", gpu_memory_utilization=0.12,
                  kv_cache_memory_bytes=2 * 2**30, max_num_seqs=16, attention_backend=spec["backend"])
    if spec["fa_version"]:
        kwargs["attention_config"] = {"flash_attn_version": spec["fa_version"]}
    if spec["folder"].endswith("nf4"):
        kwargs.update(quantization="bitsandbytes", load_format="bitsandbytes")
    if spec["adapter"]:
        kwargs.update(enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=16)
    llm = LLM(**kwargs)
    request = {}
    if spec["adapter"]:
        from safetensors.torch import load_file

        from grpo.rollout.vllm_lora import load_adapter_tensors, lora_request

        load_adapter_tensors(llm, load_file(spec["adapter"]))
        request = {"lora_request": lora_request()}
    prompts, gen_prompts = token_lists()
    scored = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                          SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False, **request)
    prompt_lp = [[step[t].logprob for step, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])] for o in scored]
    generated = llm.generate([TokensPrompt(prompt_token_ids=p) for p in gen_prompts],
                             SamplingParams(n=SAMPLES, max_tokens=GEN_TOKENS, temperature=spec["temperature"],
                                            top_p=1.0, logprobs=0, detokenize=False, ignore_eos=True, seed=0),
                             use_tqdm=False, **request)
    samples = [{"prompt": i, "ids": list(s.token_ids), "logprobs": [step[t].logprob for step, t in
                                                                     zip(s.logprobs, s.token_ids)]}
               for i, o in enumerate(generated) for s in o.outputs]
    return {"prompt_logprobs": prompt_lp, "samples": samples}


# ------------------------------------------------------------------------------------------ transformers (parent)
def hf_model(folder: str, adapter: str | None, fp32: bool = False):
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo.model.attention import attention_implementation

    config = AutoConfig.from_pretrained(folder)
    implementation = "eager" if fp32 else (attention_implementation(config) or "eager")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32 if fp32 else torch.bfloat16,
                                                 attn_implementation=implementation, device_map=DEVICE)
    if adapter:
        from peft import LoraConfig, get_peft_model
        from safetensors.torch import load_file

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules=LORA_TARGETS))
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, tensor in load_file(adapter).items():
                params[name.replace(".weight", ".default.weight")].copy_(tensor)
    return model.eval()


@torch.no_grad()
def hf_logprobs(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 under softmax(logits / T), the logits soft-capped by the model."""
    x = torch.tensor([ids], device=DEVICE)
    logits = model(input_ids=x).logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None]).squeeze(-1).cpu()


def compare(model, engine: dict, temperature: float) -> dict:
    prompts, gen_prompts = token_lists()
    prompt_gaps = torch.cat([(hf_logprobs(model, p) - torch.tensor(lp)).abs()
                             for p, lp in zip(prompts, engine["prompt_logprobs"])])
    sampled = []
    for s in engine["samples"]:
        ids = gen_prompts[s["prompt"]] + s["ids"]
        ours = hf_logprobs(model, ids, temperature)[-len(s["ids"]):]
        sampled.append((ours - torch.tensor(s["logprobs"])).abs())
    sampled = torch.cat(sampled)
    return {"prompt": prompt_gaps.mean().item(), "sampled": sampled.mean().item(), "sampled_max": sampled.max().item()}


def hf_precision_gap(folder: str) -> float:
    """mean |HF bf16 - HF fp32| over the prompts: what bf16 rounding alone does to this model."""
    prompts, _ = token_lists()
    low = hf_model(folder, None)
    a = torch.cat([hf_logprobs(low, p) for p in prompts])
    del low
    high = hf_model(folder, None, fp32=True)
    b = torch.cat([hf_logprobs(high, p) for p in prompts])
    del high
    free()
    return (a - b).abs().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/gemma2_gap")
    parser.add_argument("--only", default="", help="comma-separated variant names (default: all): " +
                        ", ".join(VARIANTS))
    parser.add_argument("--layers", type=int, default=42)
    parser.add_argument("--width_divisor", type=int, default=4, help="hidden 3584 / this (heads alike)")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--parallel", type=int, default=4, help="vLLM engines at once (child processes)")
    parser.add_argument("--engine", default=None, help=argparse.SUPPRESS)  # a child: one engine's spec (JSON)
    args = parser.parse_args()
    if args.engine:
        spec = json.loads(args.engine)
        result = run_engine(spec)
        with open(spec["result"], "w") as fh:
            json.dump(result, fh)
        return
    os.makedirs(args.out, exist_ok=True)
    names = [n for n in (args.only.split(",") if args.only else VARIANTS) if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    start = time.time()
    write_checkpoints(args.out, args.layers, args.width_divisor, {VARIANTS[n][0] for n in names})
    adapter = write_adapter(args.out, args.layers, args.width_divisor) if any(VARIANTS[n][3] for n in names) else None
    print(f"checkpoints written ({time.time() - start:.0f}s)", flush=True)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
    pending, running, results = list(names), {}, {}
    while pending or running:
        while pending and len(running) < args.parallel:
            name = pending.pop(0)
            checkpoint, backend, fa_version, with_adapter = VARIANTS[name]
            tag = name.replace("/", "_").replace("+", "_")
            spec = dict(folder=os.path.join(args.out, checkpoint), backend=backend, fa_version=fa_version,
                        adapter=adapter if with_adapter else None, temperature=args.temperature,
                        result=os.path.join(args.out, f"{tag}.json"))
            log = open(os.path.join(args.out, f"{tag}.log"), "w")
            running[name] = (subprocess.Popen([sys.executable, os.path.abspath(__file__), "--engine", json.dumps(spec)],
                                              cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), spec, log)
        time.sleep(2)
        for name, (proc, spec, log) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[name]
            if proc.returncode == 0:
                with open(spec["result"]) as fh:
                    results[name] = json.load(fh)
                print(f"{name}: engine done ({time.time() - start:.0f}s)", flush=True)
            else:
                tail = open(log.name).read()[-1500:]
                results[name] = {"error": tail.strip().splitlines()[-1] if tail.strip() else f"rc {proc.returncode}"}
                print(f"{name}: engine failed (rc {proc.returncode}), see {log.name}:\n{tail}", flush=True)
    rows, precision = {}, {}
    for name in names:
        checkpoint, backend, fa_version, with_adapter = VARIANTS[name]
        folder = os.path.join(args.out, checkpoint)
        if not checkpoint.endswith("nf4") and checkpoint not in precision:
            precision[checkpoint] = hf_precision_gap(folder)
        if "error" in results[name]:
            rows[name] = {"error": results[name]["error"]}
            continue
        model = hf_model(folder, adapter if with_adapter else None)
        rows[name] = {**compare(model, results[name], args.temperature), "hf_fp32": precision.get(checkpoint)}
        del model
        free()
    print(f"\nmean |HF - vLLM| log-prob (nats); {args.layers} layers, hidden {WIDTH_9B // args.width_divisor}, "
          f"temperature {args.temperature} for sampled tokens; torch {torch.__version__}")
    print(f"{'variant':24s} {'prompt':>8s} {'sampled':>8s} {'max':>7s} {'hf_fp32':>8s}")
    for name, row in rows.items():
        if "error" in row:
            print(f"{name:24s} failed: {row['error'][:200]}")
            continue
        fp32 = "-" if row["hf_fp32"] is None else f"{row['hf_fp32']:.4f}"
        print(f"{name:24s} {row['prompt']:8.4f} {row['sampled']:8.4f} {row['sampled_max']:7.3f} {fp32:>8s}")
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    print(f"({time.time() - start:.0f}s; {os.path.join(args.out, 'results.json')})")


if __name__ == "__main__":
    main()
