"""The HF rollout engine: order, stop handling, padding, and log-probs equal to a teacher-forced recomputation."""
import copy

import pytest
import torch

from grpo.train.step_data import build_rollout_batch
from grpo.model.loading import load_tokenizer
from grpo.rollout.engine import SamplingSettings
from grpo.rollout.hf import HFRolloutEngine
from grpo.train.logprobs import completion_logprobs

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
    # top-p only narrows what is sampled: the log-probs stay those of the full softmax(logits / T)
    for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (1.0, 0.8)):
        out = eng.generate(ps, SamplingSettings(n=3, max_new_tokens=10, temperature=temperature, top_p=top_p))
        batch = build_rollout_batch(ps, out, tok.pad_token_id)
        with torch.no_grad():
            recomputed, _ = completion_logprobs(eng.model, batch, temperature)
        mask = batch.completion_mask.bool()
        torch.testing.assert_close(recomputed[mask], batch.rollout_logprobs[mask], atol=1e-4, rtol=1e-4)


def test_logprobs_only_when_asked(engine):
    eng, tok = engine
    ps = prompts(tok)
    torch.manual_seed(3)
    asked = eng.generate(ps, SamplingSettings(n=2, max_new_tokens=6))
    torch.manual_seed(3)
    unasked = eng.generate(ps, SamplingSettings(n=2, max_new_tokens=6, logprobs=False))
    # the same samples, without log-probs; the batch then carries none (not zeros that would read as log p = 0)
    assert [c.token_ids for c in unasked] == [c.token_ids for c in asked]
    assert all(c.logprobs == [] for c in unasked) and all(len(c.logprobs) == len(c.token_ids) for c in asked)
    assert build_rollout_batch(ps, unasked, tok.pad_token_id).rollout_logprobs is None
    assert build_rollout_batch(ps, asked, tok.pad_token_id).rollout_logprobs is not None


@pytest.mark.parametrize("max_batch_size", [1, 2])  # 3 prompts: chunks of 1+1+1, and 2+1
def test_greedy_is_deterministic_and_chunking_changes_nothing(engine, max_batch_size):
    eng, tok = engine
    settings = SamplingSettings(n=2, max_new_tokens=8, greedy=True)
    one = eng.generate(prompts(tok), settings)
    assert [c.token_ids for c in eng.generate(prompts(tok), settings)] == [c.token_ids for c in one]
    chunked = HFRolloutEngine(eng.model, tok, max_batch_size=max_batch_size).generate(prompts(tok), settings)
    assert [c.token_ids for c in one] == [c.token_ids for c in chunked]
    assert [c.prompt_index for c in chunked] == [0, 0, 1, 1, 2, 2]
    assert one[0].token_ids == one[1].token_ids  # greedy: both samples of a prompt agree
    for a, b in zip(one, chunked):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)


def test_stop_token_ends_a_completion_and_the_rest_is_cut(engine):
    """A stop id the greedy path is known to hit: that row stops there, the others run to the length limit."""
    eng, tok = engine
    settings = SamplingSettings(n=1, max_new_tokens=8, greedy=True)
    free = eng.generate(prompts(tok), settings)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 8 for c in free)  # no EOS in 8 greedy steps
    stop = free[0].token_ids[2]  # the third token prompt 0 generates
    generation_config = copy.deepcopy(eng.model.generation_config)
    generation_config.eos_token_id = [tok.eos_token_id, stop]
    model = copy.copy(eng.model)  # same weights, another generation config
    model.generation_config = generation_config
    stopped = HFRolloutEngine(model, tok).generate(prompts(tok), settings)
    finish = []
    for before, after in zip(free, stopped):
        cut = before.token_ids.index(stop) + 1 if stop in before.token_ids else None
        assert after.token_ids == before.token_ids[:cut]  # stop token kept, nothing after it (no padding)
        assert after.logprobs == pytest.approx(before.logprobs[:cut], abs=1e-5)
        assert after.finish_reason == ("stop" if cut else "length")
        finish.append(after.finish_reason)
    assert finish[0] == "stop" and len(stopped[0].token_ids) <= 3 and "length" in finish


def test_training_mode_restored(engine):
    eng, tok = engine
    eng.model.train()
    eng.generate(prompts(tok)[:1], SamplingSettings(n=1, max_new_tokens=2))
    assert eng.model.training


def test_an_engine_with_a_model_of_its_own_loads_what_it_is_sent(engine):
    engine, tokenizer = engine
    own = HFRolloutEngine(copy.deepcopy(engine.model), tokenizer, owns_model=True)
    name, weight = next((n, p) for n, p in own.model.named_parameters() if n.endswith("q_proj.weight"))
    new = torch.full_like(weight, 0.25)
    own.load_weights([(name, new)])
    assert torch.equal(dict(own.model.named_parameters())[name], new)
    with pytest.raises(KeyError, match="no weight named 'model.nope.weight'"):
        own.load_weights([("model.nope.weight", new)])
    with pytest.raises(ValueError, match="the trainer sent"):
        own.load_weights([(name, new[:1])])
    # the engine of the live policy ignores what it is sent: its model is the policy
    before = dict(engine.model.named_parameters())[name].clone()
    engine.load_weights([(name, new)])
    assert torch.equal(dict(engine.model.named_parameters())[name], before)
