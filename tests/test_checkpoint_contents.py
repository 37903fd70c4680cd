"""What a checkpoint holds: lora / qlora checkpoints the trainable weights only (none of the frozen base, a tied output
layer and 4-bit quantization state included), full fine-tuning everything; the options and the base model it was
trained on; and a resume onto another base stops before any model loads."""
import json
import logging
import os
import shutil

import pytest
import torch

from grpo.checkpoint.store import list_checkpoints
from grpo.errors import CheckpointError
from grpo.train.trainer import GRPOTrainer

from .trainer_setup import assert_same_weights, even_tokens, tiny_config

@pytest.fixture(scope="module")
def tied_model(tiny_model, tmp_path_factory):
    """The tiny model with its output layer tied to the embedding, as SmolLM2's is."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = str(tmp_path_factory.mktemp("tied") / "model")
    model = AutoModelForCausalLM.from_pretrained(tiny_model, tie_word_embeddings=True)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(folder)
    return folder


def saved_engine_state(checkpoint: str) -> dict:
    """DeepSpeed's module file of rank 0 (mp_rank_00_model_states.pt; under ZeRO-3 zero_pp_rank_0_...)."""
    engine = os.path.join(checkpoint, "engine")
    name, = [n for n in os.listdir(engine) if n.endswith("mp_rank_00_model_states.pt") and "rank_1" not in n]
    return torch.load(os.path.join(engine, name), map_location="cpu", weights_only=False)


def train_and_save(model, registry, out, caplog, **options):
    logger = logging.getLogger("grpo")  # it does not propagate to the root logger, where caplog listens
    logger.addHandler(caplog.handler)
    try:
        trainer = GRPOTrainer(tiny_config(model, registry, out, max_steps=1, save_steps=1, eval_on_start=False,
                                          **options), reward_funcs=[even_tokens])
        trainer.train()
    finally:
        logger.removeHandler(caplog.handler)
    (_, checkpoint), = list_checkpoints(out)
    return trainer, checkpoint


@pytest.mark.parametrize("strategy", ["lora", "qlora"])
def test_adapter_checkpoints_hold_no_frozen_weight(strategy, tied_model, registry, tmp_path, caplog):
    trainer, checkpoint = train_and_save(tied_model, registry, str(tmp_path / "run"), caplog,
                                         tuning_strategy=strategy)
    module = trainer.engine.module
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    frozen = set(module.state_dict()) - trainable
    assert any(name.endswith("lm_head.weight") for name in frozen)  # tied: not a parameter under that name
    if strategy == "qlora":
        assert any(".absmax" in name or "quant_state" in name for name in frozen)  # 4-bit state beside the weights
    state = saved_engine_state(checkpoint)
    assert set(state["module"]) == trainable, sorted(set(state["module"]) ^ trainable)[:5]
    assert all("lora_" in name for name in state["module"])
    assert state["frozen_param_fragments"] is None and state["frozen_param_shapes"] is None
    # the options it was trained with and the base model's files go with it
    assert json.loads((tmp_path / "run" / "checkpoint-1" / "grpo_config.json").read_text())["tuning_strategy"] == \
        strategy
    record = json.loads((tmp_path / "run" / "checkpoint-1" / "base_model.json").read_text())
    assert record["model_name_or_path"] == tied_model and "model.safetensors" in record["files"]
    # one line per checkpoint with its size
    saved_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint saved:")]
    size = sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(checkpoint) for n in names)
    assert saved_lines == [f"checkpoint saved: {checkpoint} ({size / 1000:.1f} KB)"], saved_lines


def test_full_fine_tuning_checkpoints_keep_every_weight(tied_model, registry, tmp_path, caplog):
    trainer, checkpoint = train_and_save(tied_model, registry, str(tmp_path / "run"), caplog,
                                         tuning_strategy="full")
    state = saved_engine_state(checkpoint)
    assert set(state["module"]) == set(trainer.engine.module.state_dict())
    assert not os.path.exists(os.path.join(checkpoint, "base_model.json"))  # the checkpoint holds its base


def test_resume_onto_another_base_stops_before_any_model_loads(tiny_model, registry, tmp_path, caplog, monkeypatch):
    import grpo.train.trainer as trainer_module

    model = str(tmp_path / "model")
    shutil.copytree(tiny_model, model)
    out = str(tmp_path / "run")
    train_and_save(model, registry, out, caplog)
    # the same folder, retrained: same size, other weights
    from safetensors.torch import load_file, save_file

    weights = load_file(os.path.join(model, "model.safetensors"))
    save_file({k: v + 0.01 for k, v in weights.items()}, os.path.join(model, "model.safetensors"),
              metadata={"format": "pt"})
    monkeypatch.setattr(trainer_module, "load_policy", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(CheckpointError, match="holds a LoRA adapter trained on another base model: .*whose "
                                              "model.safetensors differs \\(same size, other contents\\)"):
        GRPOTrainer(tiny_config(model, registry, out, max_steps=2, resume_from_checkpoint="latest"))


def gathered_trainable_weights(trainer) -> dict:
    """The trainable weights, whole also where ZeRO-3 partitions them."""
    import deepspeed

    params = [(n, p) for n, p in trainer.engine.module.named_parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        return {n: p.detach().clone() for n, p in params}


def test_zero3_adapter_checkpoints_resume_exactly(tied_model, registry, tmp_path):
    # ZeRO-3 partitions every weight, frozen ones too: its checkpoint must still leave them out and resume exactly
    common = dict(deepspeed="zero3", max_steps=3, save_steps=1, save_total_limit=5, lora_dropout=0.1,
                  eval_on_start=False)
    straight = GRPOTrainer(tiny_config(tied_model, registry, str(tmp_path / "a"), **common),
                           reward_funcs=[even_tokens])
    straight.train()
    expected = gathered_trainable_weights(straight)
    trainable = set(expected)
    for _, checkpoint in list_checkpoints(str(tmp_path / "a")):
        state = saved_engine_state(checkpoint)
        assert set(state["module"]) <= trainable and state["frozen_param_fragments"] is None
    os.makedirs(tmp_path / "b")
    shutil.copytree(tmp_path / "a" / "checkpoint-1", tmp_path / "b" / "checkpoint-1")
    resumed = GRPOTrainer(tiny_config(tied_model, registry, str(tmp_path / "b"), resume_from_checkpoint="latest",
                                      **common), reward_funcs=[even_tokens])
    assert resumed.state.step == 1
    resumed.train()
    assert_same_weights(gathered_trainable_weights(resumed), expected)
