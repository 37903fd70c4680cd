"""The embedded SmolLM2-135M-Instruct, trained for 2 steps with lora and qlora on the shipped `arith` set."""
import os

import pytest
import torch

from grpo.config.options import GRPOConfig
from grpo.train.reporting import read_metrics
from grpo.train.trainer import GRPOTrainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def smol_config(output_dir, strategy):
    return GRPOConfig(model_name_or_path="smollm2-135m-instruct", tuning_strategy=strategy,
                      dataset_config_path=os.path.join(ROOT, "configs", "dataset_config.json"),
                      dataset_names=["arith"], output_dir=output_dir, max_steps=2, per_device_train_batch_size=2,
                      k_samples=4, rollout_max_new_tokens=24, max_prompt_length=128, max_seq_length=152,
                      lora_rank=8, lora_alpha=16, save_steps=0, eval_max_prompts=2, seed=3)


@pytest.mark.parametrize("strategy", ["lora", "qlora"])
def test_smollm2_trains_and_saves_a_usable_adapter(strategy, tmp_path):
    out = str(tmp_path / strategy)
    result = GRPOTrainer(smol_config(out, strategy)).train()
    rows = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "loss" in r]
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert "rewards/boxed_accuracy" in rows[0] and "rewards/format" in rows[0]

    # the adapter loads with plain transformers + peft (no grpo code) and generates
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = result["saved"]["lora_adapter"]
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    base = AutoModelForCausalLM.from_pretrained(_base_path(adapter))
    model = PeftModel.from_pretrained(base, adapter)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    assert tokenizer.decode(generated[0, prompt["input_ids"].shape[1]:]).strip()


def _base_path(adapter_dir):
    import json

    with open(os.path.join(adapter_dir, "adapter_config.json")) as fh:
        return json.load(fh)["base_model_name_or_path"]
