"""GPU check of weight sync into vLLM for a vision-language model (Qwen2.5-VL architecture), in its own process.

    python tests/gpu/vl_sync_check.py --strategy qlora --out result.json
    python tests/gpu/vl_sync_check.py --strategy qlora --rollout_weights adapter --out result.json

Builds (once) a ~200M-parameter random Qwen2.5-VL-shaped model with the tiny test tokenizer and a Qwen2-VL image
processor, trains it with DeepSpeed for 3 steps on one fixed prompt (an image + text), syncs after each step and
records, as mean |vLLM log-prob - trainer log-prob| over the text after the image:
  synced / stale / never_synced   as in tests/gpu/sync_check.py
plus `image_tokens_match` (vLLM expanded the image to as many tokens as grpo's renderer did) and a generation from
the woken engine with the image. With --rollout_weights adapter (lora / qlora) the engine holds the trainer's base
(qlora: its 4-bit base written with the tower in 16 bits), shared with the trainer (`shared_base`), and each sync
sends the adapter alone through vLLM's LoRA.
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import torch  # noqa: E402

MODEL_DIR = os.environ.get("GRPO_GPU_VL_MODEL", "/tmp/grpo_gpu_vl_model")
LEARNING_RATES = {"full": 1e-4, "lora": 5e-3, "qlora": 5e-3}


def build_model(path: str) -> str:
    """A random Qwen2.5-VL (~200M: 12 x 1024 language layers, 8-block vision tower) saved with its processor."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    from tests.tiny_vl_models import SPECIALS, make_tiny_vl_tokenizer

    tokenizer = make_tiny_vl_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, tie_word_embeddings=False,
                         pad_token_id=ids["<pad>"], eos_token_id=ids["<|im_end|>"], bos_token_id=None),
        vision_config=dict(depth=8, hidden_size=512, intermediate_size=1376, num_heads=8, out_hidden_size=1024,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[3, 7]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)  # log-probs far from uniform
    model.generation_config = GenerationConfig(eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<pad>"])
    tmp = path + ".tmp"
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=224 * 224)
    image_processor.save_pretrained(tmp)
    try:  # vLLM builds the model's processor from the folder
        from transformers import AutoProcessor, Qwen2_5_VLProcessor

        Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                            chat_template=tokenizer.chat_template).save_pretrained(tmp)
        AutoProcessor.from_pretrained(tmp)
    except Exception as exc:  # noqa: BLE001 - reported, the check goes on with what was saved
        print(json.dumps({"processor_warning": f"{type(exc).__name__}: {exc}"}), flush=True)
    os.replace(tmp, path)
    return path


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["full", "lora", "qlora"], required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sleep_level", type=int, default=2, choices=[1, 2])
    parser.add_argument("--rollout_weights", choices=["merged", "adapter"], default="merged")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import deepspeed

    from grpo.runtime import distributed as dist_utils
    from grpo.train.step_data import build_rollout_batch
    from grpo.config.options import GRPOConfig
    from grpo.runtime.deepspeed_config import load_deepspeed_config
    from grpo.data.images import IMAGE_MARKER
    from grpo.model.loading import load_policy, load_tokenizer
    from grpo.rollout.engine import Completion, SamplingSettings
    from grpo.rollout.vllm import VLLMRolloutEngine
    from grpo.train.logprobs import completion_logprobs
    from grpo.sync.weight_sync import sync_weights
    from grpo.model.vision import VisionProcessor

    dist_utils.init_distributed()
    path = build_model(MODEL_DIR)
    cfg = GRPOConfig(model_name_or_path=path, tuning_strategy=args.strategy, lora_rank=16, lora_alpha=32,
                     lora_dropout=0.0, deepspeed="zero2", per_device_train_batch_size=1, k_samples=2)
    device = dist_utils.device()
    tokenizer = load_tokenizer(path)
    processor = VisionProcessor.from_pretrained(path, tokenizer)
    policy = load_policy(cfg, path, torch.bfloat16, device)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=policy, model_parameters=trainable,
                                      optimizer=torch.optim.AdamW(trainable, lr=LEARNING_RATES[args.strategy]),
                                      config=load_deepspeed_config(cfg, use_bf16=True))
    start = time.perf_counter()
    adapter = args.rollout_weights == "adapter"
    quantized = adapter and args.strategy == "qlora"
    engine_path = path
    if quantized:  # as the trainer does: the engine loads the trainer's own 4-bit base, tower in 16 bits
        from grpo.model.quantized_checkpoint import write_4bit_checkpoint

        engine_path = os.path.join(os.path.dirname(os.path.abspath(args.out)), "base-4bit")
        write_4bit_checkpoint(engine.module, engine_path, source=path)
    parked = {}
    if adapter:  # as the trainer does: its base waits in CPU memory while the engine loads
        from grpo.sync.shared_base import park_frozen_base

        parked = park_frozen_base(engine.module)
    vllm = VLLMRolloutEngine(engine_path, gpu_memory_utilization=0.3, max_model_len=1024, seed=0,
                             enforce_eager=True, sleep_level=args.sleep_level, max_images_per_prompt=1,
                             image_token_id=processor.image_token_id, lora_rank=16 if adapter else None,
                             quantized=quantized)
    engine_start_s = time.perf_counter() - start
    shared = None
    if adapter:  # ... then its frozen base (qlora: the packed 4-bit weights too) becomes views of the engine's own
        shared = vllm.share_base(engine.module, parked)
        shared = shared and {"shared_tensors": shared.shared, "kept_tensors": shared.kept,
                             "kept": shared.kept_names[:8], "shared_gib": shared.shared_bytes / 2**30,
                             "parked_tensors": len(parked),
                             "base_on_gpu": all(p.is_cuda for p in engine.module.parameters())}

    shapes = os.path.join(ROOT, "data", "shapes", "images", "0000.png")
    ref = {"bytes": None, "path": shapes}
    _, prompt_ids = processor.render([{"role": "user", "content": IMAGE_MARKER + "How many shapes are in the image ?"}],
                                     [ref], "check")
    images = [processor.prompt_images([ref])]
    text = torch.randint(12, 80, (48,), generator=torch.Generator().manual_seed(1)).tolist()  # words of the vocab
    batch = build_rollout_batch([prompt_ids], [Completion(0, text, [0.0] * len(text), "length")],
                                tokenizer.pad_token_id, images=images).to(device)

    def trainer_logprobs():
        with torch.no_grad():
            return completion_logprobs(engine.module, batch, 1.0)[0][0].float().cpu()

    def vllm_logprobs():
        values = vllm.prompt_logprobs(prompt_ids + text, images=images[0].images)
        return torch.tensor(values[-len(text):]), len(values) + 1

    def gap(a, b):
        return (a - b).abs().mean().item()

    initial, vllm_len = vllm_logprobs()
    current = trainer_logprobs()
    first = sync_weights(vllm, engine.module, args.strategy, first_sync=True)
    previous, _ = vllm_logprobs()
    rows = [{"step": 0, "image_tokens_match": vllm_len == len(prompt_ids) + len(text),
             "synced": gap(previous, current), "never_synced": gap(initial, current),
             "engine_start_s": engine_start_s, "shared_base": shared, "sync_s": first.seconds,
             "sync_mib": first.bytes / 2**20, "sync_tensors": first.tensors}]
    print(json.dumps(rows[-1]), flush=True)
    for step in range(1, args.steps + 1):
        vllm.sleep()
        engine.module.train()
        loss = -completion_logprobs(engine, batch, 1.0)[0].mean()  # raise p(text | image)
        engine.backward(loss)
        engine.step()
        current = trainer_logprobs()
        stats = sync_weights(vllm, engine.module, args.strategy)
        vllm.wake()
        synced, _ = vllm_logprobs()
        rows.append({"step": step, "loss": loss.item(), "synced": gap(synced, current),
                     "synced_max": (synced - current).abs().max().item(), "stale": gap(previous, current),
                     "never_synced": gap(initial, current), "sync_s": stats.seconds,
                     "sync_mib": stats.bytes / 2**20, "sync_tensors": stats.tensors})
        previous = synced
        print(json.dumps(rows[-1]), flush=True)
    out = vllm.generate([prompt_ids, prompt_ids], SamplingSettings(n=4, max_new_tokens=16),
                        images=[images[0], images[0]])
    rows.append({"completions": len(out), "prompt_order": [c.prompt_index for c in out],
                 "no_placeholder_sampled": all(processor.image_token_id not in c.token_ids for c in out),
                 "finite_logprobs": all(torch.isfinite(torch.tensor(c.logprobs)).all().item() for c in out)})
    print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as fh:
        json.dump({"strategy": args.strategy, "rollout_weights": args.rollout_weights, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
