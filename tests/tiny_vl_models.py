"""A tiny random Qwen2.5-VL / Qwen2-VL (vision tower included) with a word-level tokenizer, the VL special tokens,
a Qwen-VL style chat template and a saved image processor, for fast CPU tests."""
import os

import torch

SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
WORDS = ["system", "user", "assistant", "What", "How", "many", "color", "is", "the", "shape", "shapes", "are", "in",
         "image", "Give", "bounding", "box", "of", "as", "?", ".", ",", "[", "]", "red", "green", "blue", "yellow",
         "circle", "square", "triangle", "Answer", "with", "one", "word", "A", "B", "C", "D"] + \
    [str(i) for i in range(40)]
# Qwen2-VL's template, trimmed: string contents as they are; list contents by part (image parts -> placeholder)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_vl_tokenizer():
    from .tiny_models import make_tiny_tokenizer

    return make_tiny_tokenizer(specials=SPECIALS, words=WORDS, chat_template=CHAT_TEMPLATE)


def make_tiny_vl_model_dir(path: str, arch: str = "qwen2_5_vl", seed: int = 0, min_pixels: int = 56 * 56,
                           max_pixels: int = 112 * 112) -> str:
    """Write a ~200k-parameter random VL model + tokenizer + image processor to `path`.

    Images are resized to between min_pixels and max_pixels (a 56x56 image becomes 4 image tokens). Weights are
    drawn wide (initializer_range 0.1) so that log-probs are far from uniform, as in the text tiny model.
    """
    from transformers import GenerationConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = make_tiny_vl_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, initializer_range=0.1,
                tie_word_embeddings=False, pad_token_id=ids["<pad>"], eos_token_id=ids["<|im_end|>"],
                bos_token_id=None)
    special = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                   vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if arch == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig as Config, Qwen2_5_VLForConditionalGeneration as Model

        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                      initializer_range=0.1)
    elif arch == "qwen2_vl":
        from transformers import Qwen2VLConfig as Config, Qwen2VLForConditionalGeneration as Model

        vision = dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, initializer_range=0.1)
    else:
        raise ValueError(f"unknown arch {arch}")
    config = Config(text_config=text, vision_config=vision, tie_word_embeddings=False, **special)
    torch.manual_seed(seed)
    model = Model(config)
    model.generation_config = GenerationConfig(eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<pad>"])
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels).save_pretrained(path)
    return path
