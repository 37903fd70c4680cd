"""Vision-language models: detection, prompt rendering with images, pixel inputs, and the parts LoRA/QLoRA need.

Prompts are rendered as the model's processor does it (Qwen2-VL family): the chat template writes one
`<|image_pad|>` per image, which is then repeated grid_t * grid_h * grid_w / merge_size**2 times (the image's
merged patches). The grid follows from the image size alone, so a whole dataset is rendered without decoding a
pixel; pixels are processed once per prompt when the prompt is drawn (its k samples share them).
The image processor comes from AutoImageProcessor (or the AutoProcessor when it builds), so the same code runs where
torchvision is missing and transformers cannot build the full Qwen2-VL processor.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from grpo.errors import ConfigError, DatasetError
from grpo.data.images import IMAGE_MARKER, describe, image_size, open_image

logger = logging.getLogger("grpo")
VISION_TOWERS = ("visual", "vision_tower", "vision_model")  # attribute names of vision encoders in HF VL models
IMAGE_TOKEN = "<|image_pad|>"


def is_vision_language(model_path: str, trust_remote_code: bool = False) -> bool:
    """True when the model folder / hub id holds an image-text-to-text model (its config has a vision_config)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return False
    return getattr(config, "vision_config", None) is not None


# ------------------------------------------------------------------------------------------------ processor
@dataclass
class PromptImages:
    """One prompt's images, decoded (for vLLM) and processed (for the HF model): shared by its k samples."""
    images: list                     # PIL RGB images, in prompt order
    pixel_values: torch.Tensor       # [patches, C * temporal_patch * patch * patch]
    image_grid_thw: torch.Tensor     # [images, 3] long
    image_token_id: int


def image_token_types(model, input_ids: torch.Tensor, image_token_id: int) -> dict:
    """{"mm_token_type_ids": 1 on image tokens, 0 elsewhere} for models whose forward takes it (newer transformers'
    Qwen2-VL computes its multimodal rope from it), else {}."""
    import inspect

    from transformers import PreTrainedModel

    for module in model.modules():  # the transformers model itself: peft's wrapper forwards `config` but takes **kwargs
        if isinstance(module, PreTrainedModel) and getattr(module.config, "vision_config", None) is not None:
            if "mm_token_type_ids" in inspect.signature(module.forward).parameters:
                return {"mm_token_type_ids": (input_ids == image_token_id).long()}
            return {}
    return {}


def model_image_inputs(payloads: Sequence[Optional[PromptImages]], prompt_index: Sequence[int],
                       device=None) -> dict:
    """pixel_values / image_grid_thw for sequences whose prompts are `prompt_index` (in order); {} with no image.

    The model finds each sequence's images by its image tokens, in batch order, so a prompt's tensors are repeated
    for each of its sequences (views of the one processed copy until concatenated).
    """
    picked = [payloads[i] for i in prompt_index if payloads[i] is not None]
    if not picked:
        return {}
    out = {"pixel_values": torch.cat([p.pixel_values for p in picked]),
           "image_grid_thw": torch.cat([p.image_grid_thw for p in picked])}
    return {k: v.to(device) for k, v in out.items()} if device is not None else out


class VisionProcessor:
    """Tokenizer + image processor + chat template, as the model's processor combines them (Qwen2-VL family)."""

    def __init__(self, tokenizer, image_processor, chat_template: Optional[str]):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.chat_template = chat_template
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise ConfigError(f"the tokenizer has no {IMAGE_TOKEN} token; only Qwen2-VL / Qwen2.5-VL style vision "
                              f"models are supported")
        self.merge_size = int(getattr(image_processor, "merge_size", 2))
        video = tokenizer.convert_tokens_to_ids("<|video_pad|>")
        # tokens a completion must never hold: the scoring forward would take them for image / video inputs
        self.placeholder_token_ids = [self.image_token_id] + \
            ([video] if video is not None and video != tokenizer.unk_token_id else [])

    @classmethod
    def from_pretrained(cls, model_path: str, tokenizer, trust_remote_code: bool = False) -> "VisionProcessor":
        from transformers import AutoImageProcessor, AutoProcessor

        image_processor, template = None, None
        try:
            processor = AutoProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)
            image_processor = getattr(processor, "image_processor", None)
            template = getattr(processor, "chat_template", None)
        except Exception as exc:  # e.g. no torchvision: the video processor (and so the processor) cannot build
            logger.debug(f"AutoProcessor unavailable ({type(exc).__name__}: {exc}); using the image processor")
        if image_processor is None:
            try:
                image_processor = AutoImageProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)
            except Exception as exc:
                raise ConfigError(f"--model_name_or_path {model_path}: no image processor could be loaded "
                                  f"({type(exc).__name__}: {exc}); the folder needs preprocessor_config.json") from exc
        template = template or _folder_chat_template(model_path) or getattr(tokenizer, "chat_template", None)
        if not template:
            raise ConfigError(f"--model_name_or_path {model_path}: the vision-language model has no chat template")
        return cls(tokenizer, image_processor, template)

    # ---- rendering (no pixels decoded) ----
    def tokens_per_image(self, width: int, height: int) -> int:
        """Image tokens the model sees for an image of this size: merged patches of the resized image."""
        count = getattr(self.image_processor, "get_number_of_image_patches", None)
        if count is not None:
            return count(height, width, {}) // self.merge_size ** 2
        from PIL import Image  # older image processors: process a blank image of that size

        grid = self.image_processor(images=[Image.new("RGB", (width, height))], return_tensors="pt")["image_grid_thw"]
        return int(grid.prod()) // self.merge_size ** 2

    def render(self, messages: list[dict], refs: list[dict], where: str) -> tuple[str, list[int]]:
        """(prompt text with one image token per image, token ids with each image's tokens expanded)."""
        chat = [{"role": m["role"], "content": _content_parts(m["content"])} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(chat, chat_template=self.chat_template,
                                                      add_generation_prompt=True, tokenize=False)
        except Exception as exc:
            raise DatasetError(f"{where}: the chat template rejects the prompt ({type(exc).__name__}: {exc})") \
                from exc
        pieces = text.split(IMAGE_TOKEN)
        if len(pieces) - 1 != len(refs):
            raise DatasetError(f"{where}: the chat template wrote {len(pieces) - 1} image placeholder(s) for "
                               f"{len(refs)} image(s)")
        expanded = pieces[0]
        for ref, piece in zip(refs, pieces[1:]):
            try:
                count = self.tokens_per_image(*image_size(ref))
            except OSError as exc:
                raise DatasetError(f"{where}: image {describe(ref)} cannot be read ({exc})") from None
            expanded += IMAGE_TOKEN * count + piece
        return text, self.tokenizer(expanded, add_special_tokens=False)["input_ids"]

    # ---- pixels (once per drawn prompt) ----
    def prompt_images(self, refs: list[dict]) -> Optional[PromptImages]:
        if not refs:
            return None
        images = [open_image(r) for r in refs]
        out = self.image_processor(images=images, return_tensors="pt")
        return PromptImages(images, out["pixel_values"], out["image_grid_thw"].long(), self.image_token_id)

    def save_pretrained(self, path: str) -> None:
        """The image processor (and chat template) next to a saved model, so the folder loads as a VL model."""
        self.image_processor.save_pretrained(path)
        with open(os.path.join(path, "chat_template.json"), "w") as fh:
            json.dump({"chat_template": self.chat_template}, fh)


def _content_parts(content: str):
    """A message's string with IMAGE_MARKERs -> the chat template's list of parts (plain string without images)."""
    if IMAGE_MARKER not in content:
        return content
    parts = []
    for i, text in enumerate(content.split(IMAGE_MARKER)):
        if i:
            parts.append({"type": "image"})
        if text:
            parts.append({"type": "text", "text": text})
    return parts


def _folder_chat_template(model_path: str) -> Optional[str]:
    for name in ("chat_template.json", "chat_template.jinja"):
        path = os.path.join(model_path, name)
        if os.path.isfile(path):
            with open(path) as fh:
                return json.load(fh).get("chat_template") if name.endswith(".json") else fh.read()
    return None


def load_vision_processor(model_path: str, tokenizer, config, rows) -> Optional[VisionProcessor]:
    """The VisionProcessor of a vision-language model; None for a text model (an error if `rows` hold images)."""
    if is_vision_language(model_path, config.trust_remote_code):
        return VisionProcessor.from_pretrained(model_path, tokenizer, config.trust_remote_code)
    if "images" in rows.column_names:
        with_images = sorted({s for s, refs in zip(rows["data_source"], rows["images"]) if refs})
        raise ConfigError(f"dataset(s) {', '.join(with_images)} hold images, but --model_name_or_path "
                          f"{config.model_name_or_path} is a text-only model; use a vision-language model (e.g. "
                          f"Qwen2.5-VL) or text datasets")
    return None


def render_vision_prompts(dataset, processor: VisionProcessor, max_prompt_length: int, filter_overlong: bool = False,
                          split: str = "train"):
    """Like data.render_prompts, for a vision-language model: prompt_text, prompt_ids (image tokens expanded)."""
    from grpo.data.files import map_fingerprint, quiet_progress
    from grpo.data.render import enforce_prompt_length

    has_images = "images" in dataset.column_names

    def render(row, index):
        where = f"dataset '{row['data_source']}': row {index + 1}"
        text, ids = processor.render(row["messages"], row["images"] if has_images else [], where)
        return {"prompt_text": text, "prompt_ids": ids}

    with quiet_progress():
        fingerprint = map_fingerprint(dataset, "render_vision_prompts", processor.tokenizer.name_or_path,
                                      processor.chat_template, repr(processor.image_processor))
        rendered = dataset.map(render, with_indices=True, keep_in_memory=True, load_from_cache_file=False,
                               new_fingerprint=fingerprint)
    return enforce_prompt_length(rendered, max_prompt_length, filter_overlong, split)


# ---------------------------------------------------------------------------------------------------- models
def vision_tower_names(model) -> list[str]:
    """Qualified names of the vision encoder modules (e.g. 'model.visual')."""
    return [name for name, _ in model.named_modules() if name.split(".")[-1] in VISION_TOWERS]


def language_linear_names(model) -> list[str]:
    """The language model's linear layers (outside the vision tower, without the output layer): LoRA's default."""
    towers = [n + "." for n in vision_tower_names(model)]
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name.split(".")[-1] == "lm_head":
            continue
        if not any((name + ".").startswith(t) for t in towers):
            names.append(name)
    return names


def freeze_vision_tower(model) -> int:
    """requires_grad False on the vision encoder; returns the number of parameters frozen."""
    frozen = 0
    for name in vision_tower_names(model):
        for p in model.get_submodule(name).parameters():
            if p.requires_grad:
                p.requires_grad_(False)
                frozen += p.numel()
    return frozen


def vision_lora_layers(model) -> list[str]:
    """Qualified names of the LoRA layers inside the vision tower (--lora_target_modules naming vision layers, e.g.
    qkv): vLLM's LoRA leaves such layers unadapted (grpo.rollout.engines says which engine can take them)."""
    towers = [n + "." for n in vision_tower_names(model)]
    return [name for name, module in model.named_modules()
            if hasattr(module, "lora_A") and any((name + ".").startswith(t) for t in towers)]


def quantization_skip_modules(model_path: str, trust_remote_code: bool = False) -> list[str]:
    """Modules QLoRA keeps unquantized: the vision encoder and the output layer.

    Both spellings of each tower: transformers >= 5.2x matches these as prefixes of qualified names (so the nested
    "model.visual" is needed), older releases as substrings.
    """
    return [f"model.{tower}" for tower in VISION_TOWERS] + list(VISION_TOWERS) + ["lm_head"]


# ------------------------------------------------------------------------------------------- checkpoint names
# transformers >= 4.52 nests Qwen2-VL's parts as model.visual / model.language_model; save_pretrained writes the
# original layout (visual.*, model.layers.*, lm_head.*), which is what vLLM loaded. Sync sends those names.
CHECKPOINT_PREFIXES = {
    "qwen2_vl": (("model.language_model.", "model."), ("model.visual.", "visual.")),
    "qwen2_5_vl": (("model.language_model.", "model."), ("model.visual.", "visual.")),
}


# vLLM 0.26's bitsandbytes loader quantizes every linear layer its quant_config reaches, the vision tower's too
# (qwen2_5_vl.py / qwen2_vl.py pass it to the tower), unless llm_int8_skip_modules names a component of the layer's vLLM
# prefix (layers/quantization/bitsandbytes.py, is_layer_skipped_bnb): "visual" keeps the tower in 16 bits there, and
# "model.visual" is the name transformers >= 5.2x matches (as a prefix of its qualified names).
VISION_SKIP_MODULES = {"qwen2_vl": ["model.visual", "visual"], "qwen2_5_vl": ["model.visual", "visual"]}


def vision_skip_modules(model) -> list[str]:
    """What a 4-bit checkpoint's llm_int8_skip_modules names to keep this model's vision tower in 16 bits, for
    transformers and vLLM alike; [] for a text model."""
    return list(VISION_SKIP_MODULES.get(getattr(getattr(model, "config", None), "model_type", None), []))


def checkpoint_prefixes(model) -> tuple[tuple[str, str], ...]:
    """(live prefix, checkpoint prefix) renames for this model's parameters; () for text models."""
    config = getattr(model, "config", None)
    return CHECKPOINT_PREFIXES.get(getattr(config, "model_type", None), ())


def rename(name: str, prefixes: tuple[tuple[str, str], ...]) -> str:
    for live, saved in prefixes:
        if name.startswith(live):
            return saved + name[len(live):]
    return name
