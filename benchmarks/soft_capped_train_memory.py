"""One training forward + backward of grpo's log-prob path (completion_logprobs, policy_loss) on a small Gemma 2 shape
with a 256k vocabulary and both soft-caps, LoRA and checkpointed layers as the trainer runs it; peak resident memory
(VmHWM) per phase, set beside the memory plan's equation for the same shape (grpo.memory.activations).

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/soft_capped_train_memory.py --vocab 4096 --hidden 512 \
        --heads 8 --head_dim 256 --new 2048 --layers 4

CPU, fp32, 2 x (128 + 2,048) tokens (docs/memory.md): "kept_after_fwd_mib" grows by the plan's L H a a token per
layer (+17.5 MiB from 2 to 4 layers; before the block attention passed its keys and values as checkpoint inputs,
+154: each layer's repeated keys and values kept as well). Linux only (/proc/self/clear_refs resets the peak).
"""
import argparse
import json

import torch

from grpo.algorithm import LossSettings, policy_loss
from grpo.memory.activations import activation_bytes_per_token, logprob_chunk_bytes, micro_batch_bytes, model_shape
from grpo.model.attention import attention_implementation
from grpo.rollout.engine import Completion
from grpo.train.logprobs import completion_logprobs
from grpo.train.step_data import build_rollout_batch

MIB = 2**20


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in dict(vocab=256000, rows=2, prompt=128, new=1024, chunk=512, hidden=256, layers=2, heads=4,
                            head_dim=64, entropy=1).items():
        p.add_argument(f"--{name}", type=int, default=value)
    p.add_argument("--final_cap", type=float, default=30.0, help="0: none")
    p.add_argument("--attn_cap", type=float, default=50.0)
    p.add_argument("--dtype", default="float32")
    a = p.parse_args()
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                       num_hidden_layers=a.layers, num_attention_heads=a.heads,
                       num_key_value_heads=max(1, a.heads // 2), head_dim=a.head_dim, max_position_embeddings=8192,
                       sliding_window=1024, final_logit_softcapping=a.final_cap or None,
                       attn_logit_softcapping=a.attn_cap, tie_word_embeddings=True)
    dtype = getattr(torch, a.dtype)
    model = Gemma2ForCausalLM._from_config(cfg, attn_implementation=attention_implementation(cfg)).to(dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")).train()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, a.vocab, (a.prompt,), generator=g).tolist() for _ in range(a.rows)]
    completions = [Completion(i, torch.randint(3, a.vocab, (a.new,), generator=g).tolist(), [], "length")
                   for i in range(a.rows)]
    batch = build_rollout_batch(prompts, completions, pad_id=0)
    base = status("VmRSS:")
    reset_peak()
    logprobs, entropy = completion_logprobs(model, batch, 1.0, with_entropy=bool(a.entropy), chunk_tokens=a.chunk)
    loss, _ = policy_loss(logprobs.float(), logprobs.detach(), torch.randn(a.rows), batch.completion_mask,
                          LossSettings(), entropy=entropy)
    forward, kept = status("VmHWM:") - base, status("VmRSS:") - base
    reset_peak()
    loss.backward()
    backward = status("VmHWM:") - base
    row = a.prompt + a.new
    tokens = a.rows * row
    plan_kept, plan_transient = activation_bytes_per_token(model_shape(cfg), True, dtype.itemsize, dtype.itemsize,
                                                           False, False, row_tokens=row)
    chunk = logprob_chunk_bytes(a.chunk, a.vocab, False, model_shape(cfg).capped_logits, dtype.itemsize)
    print(json.dumps(dict(vars(a), tokens=tokens, fwd_peak_mib=round(forward / MIB, 1),
                          kept_after_fwd_mib=round(kept / MIB, 1), bwd_peak_mib=round(backward / MIB, 1),
                          plan_kept_mib=round(tokens * plan_kept / MIB, 1),
                          plan_transient_mib=round(tokens * plan_transient / MIB, 1),
                          plan_chunk_mib=round(chunk / MIB, 1),
                          plan_mib=round(micro_batch_bytes(tokens, plan_kept, plan_transient, chunk) / MIB, 1))))


if __name__ == "__main__":
    main()
