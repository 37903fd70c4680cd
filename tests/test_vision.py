"""Vision-language GRPO on CPU: image rows in the registry, prompt rendering, generate/score with the same pixels,
VL strategies (frozen vision tower, unquantized under QLoRA), checkpoint names for sync, and end-to-end runs."""
import io
import json
import os

import datasets
import pytest
import torch
from PIL import Image

from grpo.train.step_data import build_rollout_batch
from grpo.config.options import GRPOConfig
from grpo.data import load_prompt_datasets
from grpo.errors import ConfigError, DatasetError
from grpo.data.images import IMAGE_MARKER
from grpo.model.loading import load_policy, load_tokenizer
from grpo.train.reporting import read_metrics
from grpo.rollout.engine import SamplingSettings
from grpo.rollout.hf import HFRolloutEngine
from grpo.rollout.vllm import collapse_image_tokens
from grpo.train.logprobs import completion_logprobs
from grpo.train.micro_batches import form_micro_batches, micro_batch_groups
from grpo.sync.weight_sync import iter_policy_weights
from grpo.train.trainer import GRPOTrainer
from grpo.model.vision import VisionProcessor, language_linear_names, vision_tower_names

from .test_cli import assert_clean_failure, run_cli
from .tiny_vl_models import make_tiny_vl_model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = torch.device("cpu")
COLORS = {"red": (220, 30, 30), "blue": (40, 70, 220)}


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    return make_tiny_vl_model_dir(str(tmp_path_factory.mktemp("tiny_vl")))


def png(color, size=(56, 56)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def write_registry(folder, entries: dict) -> str:
    path = os.path.join(folder, "registry.json")
    with open(path, "w") as fh:
        json.dump(entries, fh)
    return path


def color_set(folder, rows=16) -> str:
    """`colors`: solid red or blue images, "What color is the image ?" -> the color (only the image tells)."""
    os.makedirs(os.path.join(folder, "img"), exist_ok=True)
    with open(os.path.join(folder, "colors.jsonl"), "w") as fh:
        for i in range(rows):
            color = list(COLORS)[i % 2]
            name = f"img/{i}.png"
            with open(os.path.join(folder, name), "wb") as img:
                img.write(png(COLORS[color], (56 + 28 * (i % 3), 56)))
            fh.write(json.dumps({"q": "What color is the image ?", "a": color, "image": name}) + "\n")
    return write_registry(folder, {"colors": {"path": "colors.jsonl", "prompt_field": "q", "answer_field": "a",
                                              "image_field": "image", "rewards": {"vqa_accuracy": 1.0}}})


# ------------------------------------------------------------------------------------------------ data
def test_image_sources_paths_lists_bytes_and_message_parts(tmp_path):
    registry = color_set(str(tmp_path), rows=4)
    with open(tmp_path / "parts.jsonl", "w") as fh:  # image parts inside chat messages, two images in one row
        fh.write(json.dumps({"messages": [{"role": "user", "content": [
            {"type": "image", "image": "img/0.png"}, {"type": "text", "text": "Left or"},
            {"type": "image", "image": "img/1.png"}, {"type": "text", "text": "right ?"}]}], "a": "left"}) + "\n")
    datasets.Dataset.from_dict({"q": ["What color ?"], "a": ["red"], "pic": [{"bytes": png(COLORS["red"]),
                                                                            "path": None}]},
                               features=datasets.Features({"q": datasets.Value("string"), "a": datasets.Value("string"),
                                                           "pic": datasets.Image()})).to_parquet(tmp_path / "b.parquet")
    with open(tmp_path / "text.jsonl", "w") as fh:
        fh.write(json.dumps({"q": "What is 1 + 1 ?", "a": "2"}) + "\n")
    entries = json.load(open(registry))
    entries.update({"parts": {"path": "parts.jsonl", "messages_field": "messages", "answer_field": "a",
                              "rewards": {"vqa_accuracy": 1.0}},
                    "parquet": {"path": "b.parquet", "prompt_field": "q", "answer_field": "a", "image_field": "pic",
                                "rewards": {"vqa_accuracy": 1.0}},
                    "text": {"path": "text.jsonl", "prompt_field": "q", "answer_field": "a",
                             "rewards": {"vqa_accuracy": 1.0}}})
    registry = write_registry(str(tmp_path), entries)
    train, _ = load_prompt_datasets(registry, ["colors", "parts", "parquet", "text"], 1.0, 0, max_images_per_prompt=2)
    by_source = {row["data_source"]: row for row in train}
    colors = by_source["colors"]
    assert os.path.isabs(colors["images"][0]["path"]) and colors["images"][0]["path"].startswith(str(tmp_path))
    assert colors["messages"][-1]["content"] == IMAGE_MARKER + "What color is the image ?"
    parts = by_source["parts"]
    assert parts["messages"][0]["content"] == f"{IMAGE_MARKER}Left or{IMAGE_MARKER}right ?"
    assert [r["path"] for r in parts["images"]] == [str(tmp_path / "img" / "0.png"), str(tmp_path / "img" / "1.png")]
    assert by_source["parquet"]["images"][0]["bytes"] == png(COLORS["red"])
    assert by_source["text"]["images"] == []
    # a text-only registry gives exactly the rows it gave before images existed
    text_only, _ = load_prompt_datasets(registry, ["text"], 1.0, 0)
    assert text_only.column_names == ["messages", "answer", "data_source"]


@pytest.mark.parametrize("problem", ["missing", "unreadable", "too_many"])
def test_bad_images_are_one_clear_error(problem, tmp_path):
    registry = color_set(str(tmp_path), rows=3)
    rows = [json.loads(line) for line in open(tmp_path / "colors.jsonl")]
    if problem == "missing":
        rows[2]["image"] = "img/nope.png"
        expected = ["dataset 'colors': record 3", "image not found", str(tmp_path / "img" / "nope.png")]
    elif problem == "unreadable":
        (tmp_path / "img" / "bad.png").write_text("not an image")
        rows[1]["image"] = "img/bad.png"
        expected = ["dataset 'colors': record 2", str(tmp_path / "img" / "bad.png"), "cannot be read"]
    else:
        rows[0]["image"] = ["img/0.png", "img/1.png"]
        expected = ["dataset 'colors': record 1", "2 images", "--max_images_per_prompt 1"]
    with open(tmp_path / "colors.jsonl", "w") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError) as info:
        load_prompt_datasets(registry, ["colors"], 1.0, 0)
    for fragment in expected:
        assert fragment in str(info.value)


def test_bad_image_stops_the_cli_before_any_model_loads(tmp_path):
    registry = color_set(str(tmp_path), rows=3)
    (tmp_path / "img" / "1.png").unlink()
    # the model path does not even exist: the image check must come first
    proc, seconds = run_cli("--dataset_config_path", registry, "--dataset_names", "colors", "--model_name_or_path",
                            str(tmp_path / "no_model"), "--tuning_strategy", "qlora", "--output_dir",
                            str(tmp_path / "out"))
    assert_clean_failure(proc, "dataset 'colors': record 2", "image not found", str(tmp_path / "img" / "1.png"))
    assert len(proc.stderr.strip().splitlines()) == 1
    assert seconds < 30


def test_images_need_a_vision_language_model(tmp_path):
    from .tiny_models import make_tiny_model_dir

    registry = color_set(str(tmp_path), rows=4)
    config = GRPOConfig(model_name_or_path=make_tiny_model_dir(str(tmp_path / "text_model")),
                        dataset_config_path=registry, dataset_names=["colors"], output_dir=str(tmp_path / "o"),
                        max_steps=1)
    with pytest.raises(ConfigError, match="text-only model"):
        GRPOTrainer(config)


def test_a_warm_start_is_refused_for_a_vision_language_model(vl_model, tmp_path):
    """Demonstrations are laid out as text episodes: a vision-language run with --warm_start_steps stops with the
    flag to drop, before any model loads."""
    from grpo.train.setup import prepare_run

    registry = color_set(str(tmp_path), rows=4)
    with open(registry) as fh:
        entries = json.load(fh)
    entries["colors"]["demonstrations"] = "colors.jsonl"
    write_registry(str(tmp_path), entries)
    config = vl_config(vl_model, registry, str(tmp_path / "o"), ["colors"], warm_start_steps=2)
    with pytest.raises(ConfigError, match="vision-language model: drop --warm_start_steps"):
        prepare_run(config)


# ---------------------------------------------------------------------------------- rendering and pixels
@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl"])
def test_sampler_and_loss_see_the_same_pixels(arch, tmp_path):
    from transformers import AutoModelForImageTextToText

    path = make_tiny_vl_model_dir(str(tmp_path / arch), arch=arch)
    tokenizer = load_tokenizer(path)
    processor = VisionProcessor.from_pretrained(path, tokenizer)
    model = AutoModelForImageTextToText.from_pretrained(path)
    refs = [[{"bytes": png(COLORS["red"]), "path": None}], [{"bytes": png(COLORS["blue"], (84, 56)), "path": None}], []]
    messages = [[{"role": "user", "content": IMAGE_MARKER + "What color is the image ?"}],
                [{"role": "system", "content": "Answer with one word ."},
                 {"role": "user", "content": IMAGE_MARKER + "What color is the shape ?"}],
                [{"role": "user", "content": "How many shapes ?"}]]
    rendered = [processor.render(m, r, "test") for m, r in zip(messages, refs)]
    ids = [i for _, i in rendered]
    images = [processor.prompt_images(r) for r in refs]
    # 56x56 -> a 4x4 patch grid -> 4 merged image tokens; 84x56 -> 4x6 -> 6
    assert [i.count(processor.image_token_id) for i in ids] == [4, 6, 0]
    assert images[0].image_grid_thw.tolist() == [[1, 4, 4]] and images[2] is None
    assert "<|vision_start|><|image_pad|><|vision_end|>What color" in rendered[0][0]
    torch.manual_seed(0)
    out = HFRolloutEngine(model, tokenizer).generate(ids, SamplingSettings(n=3, max_new_tokens=6), images=images)
    batch = build_rollout_batch(ids, out, tokenizer.pad_token_id, images=images)
    assert batch.prompt_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    mask = batch.completion_mask.bool()
    with torch.no_grad():
        scored, _ = completion_logprobs(model, batch, 1.0)
        torch.testing.assert_close(scored[mask], batch.rollout_logprobs[mask], atol=1e-4, rtol=1e-4)
        # micro-batch rows carry their prompts' pixels
        part = batch.rows(3, 9)
        torch.testing.assert_close(completion_logprobs(model, part, 1.0)[0], scored[3:9], atol=1e-5, rtol=1e-5)
        # token-budget micro-batches regroup rows (longest first, image tokens counted) and keep their pixels
        budget = 2 * int(batch.attention_mask.sum(1).max())
        groups = micro_batch_groups(batch, budget, rows_per_micro_batch=9)
        assert len(groups) > 1 and sorted(sum(groups, [])) == list(range(9))
        assert any(g != list(range(g[0], g[0] + len(g))) for g in groups)  # not consecutive rows
        regrouped = torch.zeros_like(scored)
        for mb in form_micro_batches(batch, groups):
            mb.scatter(completion_logprobs(model, mb.batch, 1.0)[0], into=regrouped)
        torch.testing.assert_close(regrouped[mask], scored[mask], atol=1e-5, rtol=1e-5)
        # other pixels change the log-probs: the image reaches the scoring forward
        other = build_rollout_batch(ids, out, tokenizer.pad_token_id,
                                    images=[processor.prompt_images([{"bytes": png((0, 255, 0)), "path": None}]),
                                            images[1], None])
        changed, _ = completion_logprobs(model, other, 1.0)
    assert (changed[:3] - scored[:3]).abs().max() > 1e-3
    torch.testing.assert_close(changed[3:], scored[3:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl"])
def test_vision_log_probs_come_from_hidden_states_as_from_the_whole_logits(arch, tmp_path, monkeypatch):
    """The hidden-state path (the multimodal body, then the output layer a few tokens at a time) against the model's
    own logits (chunk_tokens 0), on image and text rows of one LoRA-adapted batch: the same log-probs, entropies and
    gradients, and no [N, T, V] logits."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from grpo.train.logprobs import decoder_and_head, vision_body_and_head

    path = make_tiny_vl_model_dir(str(tmp_path / arch), arch=arch)
    tokenizer = load_tokenizer(path)
    processor = VisionProcessor.from_pretrained(path, tokenizer)
    torch.manual_seed(0)
    base = AutoModelForImageTextToText.from_pretrained(path)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=language_linear_names(base),
                                            init_lora_weights=False))
    assert decoder_and_head(model) is None and vision_body_and_head(model) is not None
    refs = [[{"bytes": png(COLORS["red"]), "path": None}], []]
    messages = [[{"role": "user", "content": IMAGE_MARKER + "What color is the image ?"}],
                [{"role": "user", "content": "How many shapes ?"}]]
    ids = [processor.render(m, r, "test")[1] for m, r in zip(messages, refs)]
    images = [processor.prompt_images(r) for r in refs]
    out = HFRolloutEngine(model, tokenizer).generate(ids, SamplingSettings(n=2, max_new_tokens=7), images=images)
    batch = build_rollout_batch(ids, out, tokenizer.pad_token_id, images=images)
    weights = torch.arange(1.0, 1.0 + batch.completion_ids.numel()).view_as(batch.completion_ids)
    results = {}
    for chunk in (0, 3):  # the whole logits; 3 tokens of the output layer at a time
        if chunk:  # the model's own forward (its [N, T, V] logits) is not called
            monkeypatch.setattr("grpo.train.logprobs.completion_logits",
                                lambda *a: pytest.fail("the whole logits were computed"))
        model.zero_grad()
        logprobs, entropy = completion_logprobs(model, batch, 0.7, with_entropy=True, chunk_tokens=chunk,
                                                entropy_grad=True)
        ((logprobs * weights).sum() + entropy.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[chunk] = (logprobs.detach(), entropy.detach(), grads)
    (whole, whole_entropy, whole_grads), (hidden, hidden_entropy, hidden_grads) = results[0], results[3]
    assert whole.abs().sum() > 0 and whole_grads and whole_grads.keys() == hidden_grads.keys()
    torch.testing.assert_close(hidden, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden_entropy, whole_entropy, atol=1e-5, rtol=1e-5)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(hidden_grads[name], grad, atol=1e-4, rtol=1e-4, msg=name)


def test_vllm_prompts_collapse_image_runs():
    assert collapse_image_tokens([1, 9, 9, 9, 2, 9, 9, 3], 9) == [1, 9, 2, 9, 3]
    assert collapse_image_tokens([1, 2], 9) == [1, 2]


# -------------------------------------------------------------------------------------------- strategies
def policy(model_dir, strategy, **kw):
    cfg = GRPOConfig(model_name_or_path=model_dir, tuning_strategy=strategy, lora_rank=4, lora_alpha=8,
                     lora_dropout=0.0, **kw)
    return load_policy(cfg, model_dir, torch.float32, CPU)


def test_lora_adapts_the_language_model_and_freezes_the_vision_tower(vl_model):
    model = policy(vl_model, "lora")
    lora_layers = [n for n, m in model.named_modules() if hasattr(m, "lora_A")]
    assert lora_layers and not any(".visual." in n for n in lora_layers)
    assert len(lora_layers) == 2 * 7  # q k v o gate up down of the 2 language layers
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".visual." in n)
    # naming vision layers still adapts them
    named = policy(vl_model, "lora", lora_target_modules="qkv,q_proj")
    assert any(".visual." in n for n, m in named.named_modules() if hasattr(m, "lora_A"))


def test_qlora_keeps_the_vision_tower_unquantized(vl_model):
    import bitsandbytes as bnb

    model = policy(vl_model, "qlora")
    quantized = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 2 * 7 and not any(".visual." in n for n in quantized)
    assert not any(getattr(m, "support_avx512bf16_for_cpu", False) for m in model.modules())
    vision_linear = [m for n, m in model.named_modules() if ".visual." in n and isinstance(m, torch.nn.Linear)]
    assert vision_linear and all(type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 for m in vision_linear)


def test_qlora_default_base_reads_the_language_weights_under_their_checkpoint_names(vl_model):
    """The default base (blocks of 32, searched scales) is quantized again from the checkpoint's weights."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf
    from safetensors import safe_open

    from grpo.model.qlora_rounding import codebook, mse_block_rounding, round_4bit

    model = policy(vl_model, "qlora")
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(quantized) == 2 * 7 and {m.weight.quant_state.blocksize for m in quantized.values()} == {32}
    live = next(n for n in quantized if n.endswith("layers.1.self_attn.q_proj.base_layer"))
    with safe_open(os.path.join(vl_model, "model.safetensors"), "pt") as fh:  # saved as model.layers.*
        saved = fh.get_tensor("model.layers.1.self_attn.q_proj.weight")
    weight = quantized[live].weight
    torch.testing.assert_close(bnbf.dequantize_4bit(weight.data, weight.quant_state),
                               round_4bit(mse_block_rounding(saved.float(), codebook("nf4"), 32), "nf4", 32,
                                          double_quant=True), atol=0, rtol=0)


def test_full_trains_everything_but_the_vision_tower(vl_model):
    model = policy(vl_model, "full")
    assert vision_tower_names(model) == ["model.visual"]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and not any(n.startswith("model.visual.") for n in trainable)
    assert "lm_head.weight" in trainable
    unfrozen = policy(vl_model, "full", freeze_vision_tower=False)
    assert all(p.requires_grad for p in unfrozen.parameters())
    assert "lm_head" not in language_linear_names(model)


@pytest.mark.parametrize("strategy", ["lora", "qlora"])
def test_a_fresh_adapter_scores_like_the_base_model(vl_model, strategy):
    """Scoring through peft's wrapper sees what the transformers model under it sees (same multimodal rope
    positions and pixels), and the adapter starts at zero."""
    tokenizer = load_tokenizer(vl_model)
    processor = VisionProcessor.from_pretrained(vl_model, tokenizer)
    refs = [{"bytes": png(COLORS["red"]), "path": None}]
    _, ids = processor.render([{"role": "user", "content": IMAGE_MARKER + "What color is the image ?"}], refs, "t")
    text = [tokenizer.convert_tokens_to_ids(w) for w in ["red", "circle", "is", "the", "shape", "."]]
    from grpo.rollout.engine import Completion

    batch = build_rollout_batch([ids], [Completion(0, text, [0.0] * len(text), "length")], tokenizer.pad_token_id,
                                images=[processor.prompt_images(refs)])
    model = policy(vl_model, strategy)
    with torch.no_grad():
        adapted = completion_logprobs(model, batch, 1.0)[0]
        bare = completion_logprobs(model.get_base_model(), batch, 1.0)[0]
    assert bare.abs().min() > 0.01  # a real distribution, far from certain
    torch.testing.assert_close(adapted, bare, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------- sync names
# vLLM v0.26.0 vllm/model_executor/models/qwen2_5_vl.py, Qwen2_5_VLForConditionalGeneration.hf_to_vllm_mapper
VLLM_QWEN2_5_VL_PREFIXES = {"model.language_model.": "language_model.model.", "model.visual.": "visual.",
                            "lm_head.": "language_model.lm_head.", "model.": "language_model.model."}


def vllm_name(name: str) -> str:
    for prefix, new in VLLM_QWEN2_5_VL_PREFIXES.items():  # WeightsMapper._map_name: every matching prefix, in order
        if name.startswith(prefix):
            name = new + name[len(prefix):]
    return name


@pytest.mark.parametrize("strategy", ["full", "lora", "qlora"])
def test_sync_sends_the_checkpoint_names(vl_model, strategy):
    from safetensors import safe_open

    with safe_open(os.path.join(vl_model, "model.safetensors"), "pt") as fh:
        saved = set(fh.keys())
    model = policy(vl_model, strategy)
    names = [n for n, _ in iter_policy_weights(model, strategy, dtype=torch.float32, first_sync=True)]
    assert names and set(names) <= saved, set(names) - saved
    if strategy == "full":
        assert set(names) == saved  # every weight, vision tower included
    else:  # the adapted (and, for qlora, dequantized) language-model linears only
        assert len(names) == 2 * 7 and all(n.startswith("model.layers.") for n in names)
    mapped = {vllm_name(n) for n in names}
    assert all(n.startswith(("visual.", "language_model.model.", "language_model.lm_head.")) for n in mapped)
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert vllm_name("model.layers.0.self_attn.q_proj.weight") == "language_model.model.layers.0.self_attn.q_proj.weight"


# --------------------------------------------------------------------------------------------- training
def vl_config(model_dir, registry, out, names, **overrides):
    values = dict(model_name_or_path=model_dir, dataset_config_path=registry, dataset_names=names, output_dir=out,
                  per_device_train_batch_size=2, k_samples=4, rollout_max_new_tokens=6, max_prompt_length=96,
                  max_seq_length=104, max_steps=2, save_steps=0, eval_steps=0, eval_max_prompts=2,
                  train_split_ratio=0.99, lora_rank=4, lora_alpha=8, lora_dropout=0.0, seed=0,
                  log_to_file=False)
    values.update(overrides)
    values.setdefault("learning_rate", 1e-3 if values.get("tuning_strategy", "lora") == "full" else 1e-2)
    return GRPOConfig(**values)


@pytest.mark.parametrize("strategy", ["lora", "qlora", "full"])
def test_trains_on_shapes(strategy, vl_model, tmp_path):
    config = vl_config(vl_model, os.path.join(ROOT, "configs", "dataset_config.json"), str(tmp_path),
                       ["shapes"], tuning_strategy=strategy, kl_beta=0.1)
    result = GRPOTrainer(config).train()
    rows = [r for r in read_metrics(str(tmp_path / "metrics.jsonl")) if "loss" in r]
    assert len(rows) == 2 and all("rewards/vqa_accuracy" in r for r in rows)
    assert rows[0]["rollout/logprob_diff_max"] < 1e-3  # the sampler and the trainer saw the same pixels
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() for r in rows)
    saved = result["saved"]["lora_adapter" if strategy != "full" else "model"]
    assert os.path.isfile(os.path.join(saved, "preprocessor_config.json"))


def test_it_learns_what_only_the_image_tells(vl_model, tmp_path):
    registry = color_set(str(tmp_path / "data"), rows=16)
    steps = 30
    config = vl_config(vl_model, registry, str(tmp_path / "run"), ["colors"], tuning_strategy="lora",
                       max_steps=steps, per_device_train_batch_size=4, k_samples=16, rollout_max_new_tokens=1,
                       max_prompt_length=48, max_seq_length=49, learning_rate=2e-2, lora_rank=8,
                       lora_alpha=16, train_split_ratio=1.0)
    GRPOTrainer(config).train()
    rows = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if "loss" in r]
    first = sum(r.get("rewards/vqa_accuracy", 0.0) for r in rows[:5]) / 5
    last = sum(r.get("rewards/vqa_accuracy", 0.0) for r in rows[-5:]) / 5
    assert len(rows) == steps
    assert last >= 3 * first and last > 0.3, (first, last)
