"""A model with a final logit soft-cap (Gemma 2: z = cap tanh(head(h) / cap)) takes the chunked hidden-state path,
with the cap applied per chunk: the same log-probs, entropies and gradients as its own full logits."""
import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

from grpo.rollout.engine import Completion
from grpo.train.logprobs import SoftCappedHead, completion_logprobs, decoder_and_head
from grpo.train.step_data import build_rollout_batch


def test_soft_capped_logits_come_through_the_chunked_path_unchanged():
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                          final_logit_softcapping=3.0, attn_logit_softcapping=50.0, sliding_window=16)
    model = Gemma2ForCausalLM(config).float()
    with torch.no_grad():  # logits large enough that the cap bends them
        model.lm_head.weight.mul_(40)
    parts = decoder_and_head(model)
    assert parts is not None and isinstance(parts[1], SoftCappedHead) and parts[1].cap == 3.0
    prompts = [[5, 6, 7, 8], [9, 10]]
    completions = [Completion(0, [11, 12, 13], [], "length"), Completion(1, [14, 15, 16, 17, 18], [], "length"),
                   Completion(1, [19], [], "stop")]
    batch = build_rollout_batch(prompts, completions, pad_id=0)
    results = {}
    for chunk in (0, 2):  # 0: the model's own (capped) logits; 2: hidden states, two tokens at a time
        model.zero_grad()
        logprobs, entropy = completion_logprobs(model, batch, temperature=0.7, with_entropy=True,
                                                chunk_tokens=chunk, entropy_grad=True)
        (logprobs.sum() + entropy.sum()).backward()
        results[chunk] = (logprobs.detach(), entropy.detach(), model.lm_head.weight.grad.clone())
    full, chunked = results[0], results[2]
    assert full[0].abs().max() > 0.1  # the capped logits are not all alike
    for a, b in zip(full, chunked):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    raw = model.lm_head(torch.randn(3, 32))
    assert raw.abs().max() > 3 and parts[1](torch.randn(3, 32)).abs().max() <= 3.0


def test_soft_capped_attention_is_loaded_in_blocks_and_keeps_its_cap(tmp_path, grpo_log):
    """Gemma 2 soft-caps its attention logits; torch's SDPA kernels leave the cap out (transformers 5.17 loads Gemma 2
    with them by default, silently; vLLM applies the cap), so grpo's loader asks for the eager computation in blocks
    of queries, says why, and the policy's log-probs are the eager model's, not those of the model without the cap
    (SDPA's)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from grpo.config.options import GRPOConfig
    from grpo.model.attention import SOFT_CAPPED, attention_implementation
    from grpo.model.loading import load_policy
    from .tiny_models import make_tiny_gemma2_model_dir

    folder = make_tiny_gemma2_model_dir(str(tmp_path / "gemma2"), attention_cap=2.0)
    policy = load_policy(GRPOConfig(model_name_or_path=folder, tuning_strategy="full"), folder, torch.float32,
                         torch.device("cpu"), checkpointing=False)
    assert policy.config._attn_implementation == SOFT_CAPPED
    said = "attention: eager, in blocks of 512 queries (attn_logit_softcapping 2: torch's SDPA kernels leave the"
    assert any(said in line for line in grpo_log), grpo_log
    ids = torch.tensor([[5, 7, 8, 28, 9, 29, 12, 40, 41, 42, 43, 44, 45]])

    def logprobs(model):
        with torch.no_grad():
            return torch.log_softmax(model.eval()(ids).logits, dim=-1)

    eager = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
    uncapped = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32,
                                                    attn_logit_softcapping=None)
    torch.testing.assert_close(logprobs(policy), logprobs(eager), rtol=0, atol=1e-5)
    assert (logprobs(policy) - logprobs(uncapped)).abs().max() > 0.2  # the cap bites (0.40 nats here)
    assert attention_implementation(LlamaConfig()) is None  # other models load as transformers chooses


@pytest.mark.parametrize("block", [5, 512])
def test_blocks_of_queries_compute_eager_attention(block, monkeypatch):
    """The soft-capped attention a block of queries at a time (5: five blocks of a 23-token row, the last short; 512:
    one) gives eager attention's logits and gradients, padded rows and sliding-window layers included, with and
    without gradient checkpointing around the layers."""
    from grpo.model import attention

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                          attn_logit_softcapping=2.0, final_logit_softcapping=30.0, sliding_window=8)
    attention.register_soft_capped_attention()
    monkeypatch.setattr(attention, "QUERY_BLOCK", block)
    eager = Gemma2ForCausalLM._from_config(config, attn_implementation="eager").float()
    blocks = Gemma2ForCausalLM._from_config(config, attn_implementation=attention.SOFT_CAPPED).float()
    blocks.load_state_dict(eager.state_dict())
    ids = torch.randint(3, 97, (2, 23), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # the second row left-padded

    def run(model):
        model.train().zero_grad()
        logits = model(input_ids=ids, attention_mask=mask).logits
        logits[mask.bool()].log_softmax(-1)[:, 5].sum().backward()
        return logits.detach()[mask.bool()], {name: p.grad.clone() for name, p in model.named_parameters()}

    logits, grads = run(eager)
    for checkpointing in (False, True):
        if checkpointing:
            blocks.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        got_logits, got_grads = run(blocks)
        torch.testing.assert_close(got_logits, logits, rtol=0, atol=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-5)
    assert logits.abs().max() > 0.1


def test_padding_free_is_refused_before_loading_a_soft_capped_model(tmp_path):
    """A packed micro-batch is one row; eager attention's scores grow with its square (the plan counts rows of one
    sequence): the run is refused from the model's config, before any weight loads, and a plain model packs."""

    from grpo.config import parse_args
    from grpo.errors import ConfigError
    from grpo.memory import planner

    def plan(model):
        return planner.print_plan(parse_args(["--model_name_or_path", f"tests/model_configs/{model}", "--plan_only",
                                              "--gpu_memory_gib", "24", "--padding_free",
                                              "--output_dir", str(tmp_path)]))

    with pytest.raises(ConfigError, match="--padding_free packs a micro-batch into one row.*attn_logit_softcapping 50"):
        plan("gemma-2-9b")
    assert plan("qwen2.5-7b") == 0


def test_sequence_parallel_is_refused_before_loading_a_soft_capped_model(tmp_path, monkeypatch):
    """DeepSpeed's Ulysses attention wraps SDPA (which drops the soft-cap) or flash attention, not grpo's eager
    blocks: --sequence_parallel_size on a soft-capped model is refused from its config, before any weight loads,
    saying what to use; a plain model plans."""
    from grpo.config import parse_args
    from grpo.errors import ConfigError
    from grpo.memory import planner

    monkeypatch.setenv("WORLD_SIZE", "2")  # two ranks, one sequence-parallel group

    def plan(model):
        return planner.print_plan(parse_args(["--model_name_or_path", f"tests/model_configs/{model}", "--plan_only",
                                              "--gpu_memory_gib", "24", "--sequence_parallel_size", "2",
                                              "--output_dir", str(tmp_path)]))

    with pytest.raises(ConfigError, match=r"--sequence_parallel_size 2: .*attn_logit_softcapping 50.*"
                                          r"use --sequence_parallel_size 1"):
        plan("gemma-2-9b")
    assert plan("qwen2.5-7b") == 0


@pytest.mark.parametrize("groups", [1, 2])
def test_checkpointed_layers_keep_no_keys_or_values_until_their_backward(groups):
    """With the layers checkpointed, a layer's forward keeps its input alone for the backward (the memory plan's
    L H a a token): the keys and values its blocks of queries read (repeated to the query heads where grouped) are
    freed once the layer has run. Passed to each block's checkpoint through its closure, they were not: 2 q a bytes a
    token in every layer (Gemma-2-9B: 5.6 GiB more than planned over two 4,352-token rows)."""
    import gc
    import weakref

    from transformers import AttentionInterface

    from grpo.model import attention

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=4 // groups, head_dim=16,
                          max_position_embeddings=128, attn_logit_softcapping=2.0, final_logit_softcapping=30.0,
                          sliding_window=8)
    attention.register_soft_capped_attention()
    model = Gemma2ForCausalLM._from_config(config, attn_implementation=attention.SOFT_CAPPED).float().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    seen = []
    real_repeat = torch.Tensor.repeat_interleave

    def watched(module, query, key, value, *args, **kwargs):
        seen.extend(weakref.ref(t) for t in (key, value))
        return attention.soft_capped_attention(module, query, key, value, *args, **kwargs)

    def repeat_watched(self, *args, **kwargs):  # the grouped case's repeated copies
        out = real_repeat(self, *args, **kwargs)
        seen.append(weakref.ref(out))
        return out

    ids = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    AttentionInterface.register(attention.SOFT_CAPPED, watched)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.Tensor, "repeat_interleave", repeat_watched)
            loss = model(input_ids=ids).logits.log_softmax(-1)[..., 5].sum()
    finally:
        attention.register_soft_capped_attention()
    gc.collect()
    assert len(seen) >= 2 * config.num_hidden_layers
    assert [ref for ref in seen if ref() is not None] == []  # all freed while the graph waits for its backward
    loss.backward()  # (and the backward still reaches every layer)
    assert all(p.grad is not None for p in model.model.layers[0].self_attn.parameters())


def test_a_soft_capped_reward_model_scores_with_its_cap(tmp_path, grpo_log):
    """A Gemma 2 reward model loads with the attention that keeps its cap, as the policy does: its scores are the
    eager model's, not those of the model without the cap (what SDPA computes)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from grpo.model.attention import SOFT_CAPPED, attention_implementation
    from grpo.rewards.reward_model import register_reward_models
    from .tiny_models import make_tiny_gemma2_model_dir

    folder = make_tiny_gemma2_model_dir(str(tmp_path / "gemma2_rm"), attention_cap=2.0, reward_model=True)
    (rm,) = register_reward_models([folder], torch.device("cpu"), attention=attention_implementation)
    completions = ["The answer is 7", "boxed { 9 }"]
    messages = [[{"role": "user", "content": "What is 2 + 2 ?"}]] * 2
    scores = rm(completions, ["4"] * 2, prompts=["x"] * 2, prompt_messages=messages)
    assert rm.model.config._attn_implementation == SOFT_CAPPED
    assert any("reward model 'gemma2_rm' loaded" in line and SOFT_CAPPED in line for line in grpo_log), grpo_log

    tokenizer = AutoTokenizer.from_pretrained(folder)

    def scored(**overrides):
        model = AutoModelForSequenceClassification.from_pretrained(folder, attn_implementation="eager",
                                                                   dtype=torch.float32, **overrides).eval()
        out = []
        for completion in completions:
            text = tokenizer.apply_chat_template(messages[0] + [{"role": "assistant", "content": completion}],
                                                 tokenize=False)
            with torch.no_grad():
                out.append(model(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item())
        return out

    assert scores == pytest.approx(scored(), abs=1e-5)
    uncapped = scored(attn_logit_softcapping=None)
    assert max(abs(a - b) for a, b in zip(scores, uncapped)) > 2e-3, (scores, uncapped)  # the cap bites
