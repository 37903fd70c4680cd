"""The HF rollout engine: order, stop handling, padding, and log-probs equal to a teacher-forced recomputation."""
import pytest
import torch

from grpo.batch import build_rollout_batch
from grpo.models import load_tokenizer
from grpo.rollout.base import SamplingSettings
from grpo.rollout.hf import HFRolloutEngine
from grpo.scoring import completion_logprobs

from .tiny_models import make_tiny_model_dir


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny")))
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    return HFRolloutEngine(model, tokenizer, max_batch_size=64), tokenizer


def prompts(tokenizer):
    texts = ["<|im_start|>user\nWhat is 2 + 3 ?<|im_end|>\n<|im_start|>assistant\n",
             "<|im_start|>user\nGive the answer<|im_end|>\n<|im_start|>assistant\n", "What is"]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_order_stop_tokens_and_padding(engine):
    eng, tok = engine
    torch.manual_seed(0)
    out = eng.generate(prompts(tok), SamplingSettings(n=6, max_new_tokens=12, temperature=1.5))
    assert [c.prompt_index for c in out] == [0] * 6 + [1] * 6 + [2] * 6
    reasons = {c.finish_reason for c in out}
    assert reasons <= {"stop", "length"}
    for c in out:
        assert len(c.token_ids) == len(c.logprobs) and 1 <= len(c.token_ids) <= 12
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == tok.eos_token_id and tok.eos_token_id not in c.token_ids[:-1]
        else:
            assert len(c.token_ids) == 12 and tok.eos_token_id not in c.token_ids


def test_logprobs_match_teacher_forcing(engine):
    eng, tok = engine
    torch.manual_seed(1)
    ps = prompts(tok)
    for temperature in (1.0, 0.7):
        out = eng.generate(ps, SamplingSettings(n=3, max_new_tokens=10, temperature=temperature))
        batch = build_rollout_batch(ps, out, tok.pad_token_id)
        with torch.no_grad():
            recomputed, _ = completion_logprobs(eng.model, batch, temperature)
        mask = batch.completion_mask.bool()
        torch.testing.assert_close(recomputed[mask], batch.rollout_logprobs[mask], atol=1e-4, rtol=1e-4)


def test_greedy_is_deterministic_and_chunking_changes_nothing(engine):
    eng, tok = engine
    settings = SamplingSettings(n=2, max_new_tokens=8, greedy=True)
    one = eng.generate(prompts(tok), settings)
    eng_small = HFRolloutEngine(eng.model, tok, max_batch_size=2)  # one prompt per generate call
    chunked = eng_small.generate(prompts(tok), settings)
    assert [c.token_ids for c in one] == [c.token_ids for c in chunked]
    assert [c.prompt_index for c in one] == [c.prompt_index for c in chunked]
    assert one[0].token_ids == one[1].token_ids  # greedy: both samples of a prompt agree
    for a, b in zip(one, chunked):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)


def test_training_mode_restored(engine):
    eng, tok = engine
    eng.model.train()
    eng.generate(prompts(tok)[:1], SamplingSettings(n=1, max_new_tokens=2))
    assert eng.model.training
