"""Routing replay (grpo.model.routing_replay): the trainer's MoE layers send each token to the experts the rollout
engine routed it to, with gate weights from the trainer's own router; the HF engine records that routing; the step
carries it to the trainer's forward; --routing_replay's defaults and refusals."""
import math
from types import SimpleNamespace

import pytest
import torch

from grpo.errors import ConfigError
from grpo.model.routing_replay import (RouterAgreement, find_routers, replayed_choice, replayed_gate_weights,
                                       routing_replay_of, same_expert_sets)
from grpo.rollout.engine import Completion
from grpo.rollout.routing_record import recorded_routing
from grpo.train.step_data import build_rollout_batch

from .tiny_models import make_tiny_moe_model_dir, make_tiny_tokenizer


# ------------------------------------------------------------------------------------------------ the pure functions
def test_gate_weights_are_the_trainers_probabilities_at_the_replayed_experts_by_hand():
    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]]))  # p = [.1 .2 .3 .4], [.4 .3 .2 .1]
    experts = torch.tensor([[3, 0], [1, 2]])
    torch.testing.assert_close(replayed_gate_weights(logits, experts, renormalise=False),
                               torch.tensor([[0.4, 0.1], [0.3, 0.2]]))
    # renormalised over the replayed pair: 0.4 / 0.5, 0.1 / 0.5; 0.3 / 0.5, 0.2 / 0.5
    torch.testing.assert_close(replayed_gate_weights(logits, experts, renormalise=True),
                               torch.tensor([[0.8, 0.2], [0.6, 0.4]]))


def test_the_gate_weights_carry_the_routers_gradient():
    logits = torch.zeros(1, 3, requires_grad=True)  # p = 1/3 each
    weights = replayed_gate_weights(logits, torch.tensor([[2]]), renormalise=False)
    weights.sum().backward()
    # d p_2 / d z = p_2 (onehot_2 - p) = 1/3 (-1/3, -1/3, 2/3)
    torch.testing.assert_close(logits.grad, torch.tensor([[-1 / 9, -1 / 9, 2 / 9]]))


def test_agreement_compares_sets_and_unrecorded_tokens_keep_their_own_choice():
    own = torch.tensor([[0, 1], [2, 3], [1, 2]])
    replayed = torch.tensor([[1, 0], [2, 0], [-1, -1]])
    assert same_expert_sets(own, replayed).tolist() == [True, False, False]
    experts, recorded = replayed_choice(own, replayed)
    assert experts.tolist() == [[1, 0], [2, 0], [1, 2]] and recorded.tolist() == [True, True, False]


# ------------------------------------------------------------------------------------------------ tiny mixtures
def tiny_qwen3_moe(norm_topk_prob: bool):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob, tie_word_embeddings=False, initializer_range=0.2))


def tiny_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, initializer_range=0.2))


MODELS = {"mixtral": tiny_mixtral, "qwen3_moe": lambda: tiny_qwen3_moe(True),
          "qwen3_moe_unnormalised": lambda: tiny_qwen3_moe(False)}
IDS = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(1))
MASK = torch.ones_like(IDS)


def own_routing(model, ids=IDS):
    """The model's own routing of `ids` [rows, tokens, layers, k], recorded as the HF engine records it."""
    with torch.no_grad(), recorded_routing(model, ids.shape[0], model.config.num_hidden_layers,
                                           model.config.num_experts_per_tok) as record:
        model(ids)
    return record.columns()


@pytest.mark.parametrize("family", sorted(MODELS))
def test_replaying_the_models_own_picks_changes_nothing(family):
    model = MODELS[family]().eval()
    routed = own_routing(model)
    assert routed.shape == (3, 9, 2, 2) and len(find_routers(model)) == 2
    agreement = RouterAgreement()
    with torch.no_grad():
        want = model(IDS).logits
        with routing_replay_of(model).replaying(routed, MASK, agreement):
            got = model(IDS).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert agreement.totals() == (3 * 9 * 2, 3 * 9 * 2)  # every token of every layer, all alike


@pytest.mark.parametrize("family", sorted(MODELS))
def test_other_picks_change_the_outputs_and_the_router_still_learns(family):
    model = MODELS[family]().train()
    routed = own_routing(model)
    other = (routed + 1) % 4  # every token elsewhere: {a, b} -> {a+1, b+1}, never the same set
    agreement = RouterAgreement()
    with torch.no_grad():
        want = model(IDS).logits
    with routing_replay_of(model).replaying(other, MASK, agreement):
        got = model(IDS).logits
    # the first layer never agrees; the second sees the first's new outputs and may pick some shifted sets itself
    assert (got - want).abs().max() > 1e-3 and agreement.share < 0.5
    got.logsumexp(-1).mean().backward()
    for router in find_routers(model):
        assert router.module.weight.grad is not None and router.module.weight.grad.abs().sum() > 0


def test_a_token_the_trainer_routes_elsewhere_gets_the_engines_experts():
    """One MoE block, one token forced elsewhere: its output is the engine's experts weighted by the trainer's
    probabilities at them, renormalised (Mixtral)."""
    model = tiny_mixtral().eval()
    block = model.model.layers[0].mlp
    hidden = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, _, own = block.gate(hidden.view(-1, 32))
    replayed = own.clone()
    replayed[2] = torch.tensor([e for e in range(4) if e not in own[2].tolist()])  # the two experts it did not pick
    routed = torch.full((1, 5, 2, 2), -1, dtype=torch.int32)
    routed[0, :, 0] = replayed
    with torch.no_grad(), routing_replay_of(model).replaying(routed, torch.ones(1, 5)):
        got = block(hidden)
    probs = torch.softmax(logits, -1)
    weights = probs.gather(-1, replayed) / probs.gather(-1, replayed).sum(-1, keepdim=True)
    with torch.no_grad():
        want = block.experts(hidden.view(-1, 32), replayed, weights).view(1, 5, 32)
        own_output = block(hidden)  # outside the replay: the trainer's own routing
    torch.testing.assert_close(got, want)
    assert (got[0, 2] - own_output[0, 2]).abs().max() > 1e-4  # the forced token moved
    torch.testing.assert_close(got[0, [0, 1, 3, 4]], own_output[0, [0, 1, 3, 4]])


def test_a_checkpointed_layer_recomputes_its_forward_with_the_replayed_routing():
    """Gradient checkpointing runs each layer's forward again in the backward, after the replay context ended:
    the gradients equal those of the same replay without checkpointing."""
    grads = []
    for checkpointing in (False, True):
        model = tiny_mixtral().train()
        routed = (own_routing(model) + 1) % 4
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        with routing_replay_of(model).replaying(routed, MASK):
            loss = model(IDS).logits.logsumexp(-1).mean()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=name)


# ------------------------------------------------------------------------------------------------ the step's routing
def test_the_hf_engine_records_each_completions_routing_and_the_batch_lays_it_out(tmp_path):
    from transformers import AutoModelForCausalLM

    from grpo.rollout.engine import SamplingSettings
    from grpo.rollout.hf import HFRolloutEngine
    from grpo.train.logprobs import completion_logprobs
    from grpo.train.micro_batches import cut_rows

    folder = make_tiny_moe_model_dir(str(tmp_path / "moe"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    engine = HFRolloutEngine(model, make_tiny_tokenizer(), record_routing=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    completions = engine.generate(prompts, SamplingSettings(n=2, max_new_tokens=6))
    for c in completions:
        assert c.routed_experts.shape == (len(prompts[c.prompt_index]) + len(c.token_ids) - 1, 2, 2)
        assert c.routed_experts.min() >= 0
    batch = build_rollout_batch(prompts, completions, pad_id=0)
    assert batch.routed_experts.shape[:2] == batch.input_ids.shape
    real = batch.attention_mask.bool()
    last = real.cumsum(1) == real.sum(1, keepdim=True)  # each row's last token: never routed by the engine
    assert (batch.routed_experts[real & ~last] >= 0).all() and (batch.routed_experts[~real | last] == -1).all()
    # replayed in the trainer's forward (padded and padding-free), the engine's own routing changes nothing
    part = cut_rows(batch, [0, 3])
    with torch.no_grad():
        want, _ = completion_logprobs(model, part, 1.0)
        for packed in (False, True):
            agreement = RouterAgreement()
            with routing_replay_of(model).replaying(part.routed_experts, part.attention_mask, agreement):
                got, _ = completion_logprobs(model, part, 1.0, packed=packed)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert agreement.share == 1.0


def test_a_batch_refuses_completions_of_which_only_some_carry_routing():
    with_routing = Completion(0, [3, 4], [], "stop", routed_experts=torch.zeros(2, 1, 1, dtype=torch.int32))
    without = Completion(0, [3, 4], [], "stop")
    with pytest.raises(ValueError, match="1 of 2 completions came without the routing"):
        build_rollout_batch([[1]], [with_routing, without], pad_id=0)
    assert build_rollout_batch([[1]], [without, without], pad_id=0).routed_experts is None


# ------------------------------------------------------------------------------------------------ the option
def test_routing_replay_defaults_on_for_replayable_mixtures_and_is_refused_where_it_cannot_be(tmp_path, tiny_model,
                                                                                             registry):
    from transformers import AutoConfig, LlamaConfig

    from grpo.model.routing_options import resolve_routing_replay, routing_replay_conflict

    from .trainer_setup import tiny_config

    moe = AutoConfig.from_pretrained(make_tiny_moe_model_dir(str(tmp_path / "moe")))
    config = tiny_config(tiny_model, registry, str(tmp_path / "out"))
    assert config.routing_replay is None
    assert resolve_routing_replay(config, moe) is True and config.routing_replay is True
    dense = tiny_config(tiny_model, registry, str(tmp_path / "out"))
    assert resolve_routing_replay(dense, LlamaConfig()) is False
    with pytest.raises(ConfigError, match="--routing_replay: this model is dense"):
        resolve_routing_replay(tiny_config(tiny_model, registry, str(tmp_path / "out"), routing_replay=True),
                               LlamaConfig())
    # what the options alone rule out (validation refuses them at construction)
    options = dict(sequence_parallel_size=1, rollout_mode="colocate", dataset_names=["toy"])
    assert routing_replay_conflict(SimpleNamespace(**options)) is None
    assert "shards every row" in routing_replay_conflict(SimpleNamespace(**{**options, "sequence_parallel_size": 2}))
    assert "server" in routing_replay_conflict(SimpleNamespace(**{**options, "rollout_mode": "server"}))
    # datasets that agents play: off by default, refused when asked for
    assert resolve_routing_replay(tiny_config(tiny_model, registry, str(tmp_path / "out")), moe, {"toy": None}) is False
    with pytest.raises(ConfigError, match="--routing_replay: dataset.s. toy are played by agents"):
        resolve_routing_replay(tiny_config(tiny_model, registry, str(tmp_path / "out"), routing_replay=True), moe,
                               {"toy": None})


@pytest.mark.parametrize("strategy, options", [("full", {"gradient_checkpointing": True}),
                                               ("lora", {"padding_free": True})])
def test_a_grpo_step_with_the_hf_engine_replays_its_routing_and_trains(tmp_path, registry, strategy, options):
    """End to end on a tiny Mixtral: the HF engine samples from the policy itself, so the trainer's own routing
    agrees with the engine's everywhere (router_agreement 1), the engine's log-prob gap stays at rounding, and the
    model learns (full: the routers too; lora: the adapters of attention and experts)."""
    from grpo import GRPOTrainer

    from .trainer_setup import even_tokens, tiny_config, train_rows

    folder = make_tiny_moe_model_dir(str(tmp_path / "moe"))
    out = tmp_path / "out"
    trainer = GRPOTrainer(tiny_config(folder, registry, str(out), tuning_strategy=strategy, max_steps=2,
                                      logprob_check_steps=1, eval_on_start=False, **options),
                          reward_funcs=[even_tokens])
    assert trainer.config.routing_replay is True
    trained = {n: p.detach().clone() for n, p in trainer.engine.module.named_parameters() if p.requires_grad}
    trainer.train()
    rows = train_rows(out)
    assert len(rows) == 2
    for row in rows:
        assert row["rollout/router_agreement"] == 1.0
        assert row["rollout/logprob_diff_mean"] < 1e-4 and math.isfinite(row["loss"])
        assert row["rollout/logprob_diff_unreplayed_mean"] < 1e-4
    moved = {n for n, p in trainer.engine.module.named_parameters() if n in trained and
             (p.detach() - trained[n]).abs().max() > 0}
    assert moved
    if strategy == "full":
        assert {n for n in trained if n.endswith("gate.weight")} <= moved


def test_the_memory_plan_counts_a_micro_batchs_routing_array():
    """4 bytes per token, layer and pick, kept through the backward beside the activations; none for a dense model."""
    from dataclasses import replace

    from transformers import LlamaConfig, Qwen3MoeConfig

    from grpo.memory.activations import activation_bytes_per_token, model_shape

    moe = model_shape(Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=48, num_experts_per_tok=8,
                                     moe_intermediate_size=768, num_attention_heads=32, head_dim=128))
    assert moe.routed_picks == 48 * 8
    kept, transient = activation_bytes_per_token(moe, True, 2, 2, False, False)
    kept_without, transient_without = activation_bytes_per_token(replace(moe, routed_picks=0), True, 2, 2, False,
                                                                 False)
    assert (kept - kept_without, transient - transient_without) == (4 * 48 * 8, 0)
    assert model_shape(LlamaConfig()).routed_picks == 0


def test_vllms_routing_becomes_the_trainers_int32_array():
    """vLLM 0.26 hands each CompletionOutput's routed_experts as numpy uint8 (uint16 past 256 experts) [tokens,
    layers, k]; the completion carries it as int32."""
    import numpy as np

    from grpo.rollout.vllm import _routed_experts

    for dtype in (np.uint8, np.uint16):
        routed = np.arange(24, dtype=dtype).reshape(4, 3, 2)
        got = _routed_experts(routed)
        assert got.dtype == torch.int32 and got.tolist() == routed.astype(np.int64).tolist()
    assert _routed_experts(None) is None


def test_a_forward_without_replay_recomputes_its_checkpointed_layers_with_its_own_routing():
    """After a replayed forward, a forward with gradient outside any replay (a warm start's, say) is not given the
    earlier routing when its checkpointed layers run again in the backward."""
    grads = []
    for checkpointing in (False, True):
        model = tiny_mixtral().train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        with routing_replay_of(model).replaying((own_routing(model) + 1) % 4, MASK):
            model(IDS).logits.sum().backward()
        model.zero_grad()
        model(IDS).logits.logsumexp(-1).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=name)


def test_a_multi_turn_episode_carries_its_last_turns_routing_which_covers_it_all():
    """Each model turn's context is the prompt and every token before it, so the last turn's routing covers the
    episode (model and environment tokens) but its last token; replayed, it reproduces the trainer's log-probs."""
    from grpo.rollout.engine import SamplingSettings
    from grpo.rollout.episodes import EpisodeLimits, EpisodePrompt, run_episodes
    from grpo.rollout.hf import HFRolloutEngine
    from grpo.tools import EnvironmentStep, get_environment, register_environment
    from grpo.train.logprobs import completion_logprobs

    @register_environment("test_routing_wrong_again")
    def wrong_again(messages, answer, **fields):
        return EnvironmentStep([{"role": "user", "content": "2 + 3 ?"}], done=False)

    class AnswersFirst(HFRolloutEngine):
        """The first turn is given (ended, so that the environment answers), the second sampled with its routing."""
        def generate(self, prompt_token_ids, sampling, images=None):
            if getattr(self, "answered", False):
                return super().generate(prompt_token_ids, sampling, images)
            self.answered = True
            turn = tokenizer.encode("7", add_special_tokens=False) + [tokenizer.eos_token_id]
            return [Completion(i, list(turn), [0.0] * len(turn), "stop") for i in range(len(prompt_token_ids))
                    for _ in range(sampling.n)]

    tokenizer = make_tiny_tokenizer()
    model = tiny_mixtral_for(tokenizer).eval()
    engine = AnswersFirst(model, tokenizer, record_routing=True)
    messages = [{"role": "user", "content": "What is 2 + 3 ?"}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids)
    episode_prompt = EpisodePrompt(prompt_ids, messages, {"answer": "5"},
                                   environment=get_environment("test_routing_wrong_again"))
    torch.manual_seed(0)
    episodes = run_episodes(engine, tokenizer, [episode_prompt], SamplingSettings(n=2, max_new_tokens=4),
                            EpisodeLimits(max_turns=2, max_episode_tokens=60))
    completions = [e.as_completion() for e in episodes]
    assert all(0 in c.mask and c.mask[-1] == 1 for c in completions)  # environment tokens inside the episode
    for c in completions:
        assert c.routed_experts.shape[0] == len(prompt_ids) + len(c.token_ids) - 1
    batch = build_rollout_batch([prompt_ids], completions, pad_id=tokenizer.pad_token_id)
    agreement = RouterAgreement()
    with torch.no_grad():
        want, _ = completion_logprobs(model, batch, 1.0)
        with routing_replay_of(model).replaying(batch.routed_experts, batch.attention_mask, agreement):
            got, _ = completion_logprobs(model, batch, 1.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert agreement.share == 1.0


def tiny_mixtral_for(tokenizer):
    from transformers import GenerationConfig, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, initializer_range=0.2,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None))
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return model
