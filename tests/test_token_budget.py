"""--max_tokens_per_micro_batch auto: the activation estimate against numbers worked by hand, the budget it
resolves to for given GPU figures (no GPU needed: the figures are passed in), and the memory plan's budget checked
against the room measured once the model and engine are loaded."""
import os
from types import SimpleNamespace

import pytest

from grpo.errors import ConfigError
from grpo.memory.activations import (ESTIMATE_MARGIN, GIB, MIB, ModelShape, activation_bytes_per_token,
                                     fitted_chunk_tokens, logprob_chunk_bytes, micro_batch_bytes, model_shape)
from grpo.train.token_budget import GpuFigures, micro_batch_token_budget, resolve_token_budget, training_estimate

TINY = ModelShape(hidden=8, intermediate=16, layers=2, q_dim=8, vocab=32)
CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_configs")


def test_activation_estimate_worked_by_hand():
    # bf16 activations and adapters, dropout: layer = 8H + 4qa + 3Ia + (b + 1)(5H + q + I)
    #   = 64 + 64 + 96 + 3 x 64 = 416; backward = 4Ia = 128; ends = H(2a + 4) = 64
    assert activation_bytes_per_token(TINY, True, 2, 2, True, False) == (2 * 8 * 2 + 64, 416 + 128)  # (96, 544)
    assert activation_bytes_per_token(TINY, False, 2, 2, True, False) == (2 * 416 + 64, 128)         # (896, 128)
    # full fine-tuning: the trained weights' inputs a(2H + q + I) = 80 in place of the adapters' 192
    assert activation_bytes_per_token(TINY, True, 2, 0, False, False) == (96, 224 + 80 + 128)
    # qlora's fp32 residual stream and adapters, no dropout: layer = 64 + 128 + 192 + 4 x 64 = 640,
    # backward 256, ends 8 x 12 = 96, kept L H a + ends = 64 + 96
    assert activation_bytes_per_token(TINY, True, 4, 4, False, False) == (160, 640 + 256)
    # the full-logits path keeps 14 V per token more
    assert activation_bytes_per_token(TINY, True, 2, 2, True, True) == (96 + 14 * 32, 544)



def test_logprob_chunk_and_peak_worked_by_hand():
    assert logprob_chunk_bytes(4, 32, full_logits=False) == 20 * 4 * 32 == 2560
    assert logprob_chunk_bytes(4, 32, full_logits=True) == 0
    # t kept + max(chunk, t transient): the chunk's logits or one layer's backward, whichever is larger
    assert micro_batch_bytes(10, 96, 544, 2048) == 960 + 5440
    assert micro_batch_bytes(2, 96, 544, 2048) == 192 + 2048


def test_soft_capped_attention_scores_worked_by_hand():
    """A model with soft-capped attention logits (grpo.model.attention: the eager computation in blocks of
    QUERY_BLOCK queries, each checkpointed) holds one block's scores at a time, N heads x Q queries x S keys for a
    row of S tokens (Q = min(S, QUERY_BLOCK)): N Q per token, 22 bytes a score in bf16 (3 a + 16) in one layer's
    backward; and its two additive masks, [S, S] each a row, 2 a S per token, through the whole step."""
    from dataclasses import replace

    from transformers import AutoConfig, Gemma2Config

    from grpo.model.attention import QUERY_BLOCK

    capped = replace(TINY, score_heads=2)  # rows of S = 10 (shorter than a block): N Q = 20 scores per token
    # bf16, dropout: layer = 416; backward = 128 + (3 x 2 + 16) x 20 = 568; ends = 64 + 2 x 2 x 10 = 104
    assert activation_bytes_per_token(capped, True, 2, 2, True, False, row_tokens=10) == (32 + 104, 416 + 568)
    assert activation_bytes_per_token(capped, False, 2, 2, True, False, row_tokens=10) == (2 * 416 + 104, 568)
    # fp32: layer = 640; backward = 256 + (3 x 4 + 16) x 20 = 816; ends = 96 + 2 x 4 x 10 = 176
    assert activation_bytes_per_token(capped, True, 4, 4, False, False, row_tokens=10) == (64 + 176, 640 + 816)
    # a row longer than a block: its scores stop at the block, its masks do not
    long_row = QUERY_BLOCK + 88
    assert activation_bytes_per_token(capped, True, 2, 2, True, False, row_tokens=long_row) == \
        (32 + 64 + 4 * long_row, 416 + 128 + 22 * 2 * QUERY_BLOCK)
    # SDPA keeps no scores: the row length changes nothing
    assert activation_bytes_per_token(TINY, True, 2, 2, True, False, row_tokens=10) == (96, 544)
    assert model_shape(Gemma2Config(num_attention_heads=4, attn_logit_softcapping=50.0)).score_heads == 4
    assert model_shape(Gemma2Config(num_attention_heads=4, attn_logit_softcapping=None)).score_heads == 0
    # Gemma-2-9B (16 heads), 4,096 new tokens after a 256-token prompt, micro-batches of one 4,352-token row,
    # checkpointing, blocks of 512 queries: 16 x 512 = 8,192 scores a token, 22 bytes each: 180,224 bytes a token,
    # 784,334,848 (0.73 GiB) a micro-batch on top of what SDPA would hold (whole rows' scores: 6.21 GiB); the masks
    # 2 x 2 x 4,352 = 17,408 bytes a token
    assert QUERY_BLOCK == 512
    shape = model_shape(AutoConfig.from_pretrained(os.path.join(CONFIGS, "gemma-2-9b")))
    assert shape.score_heads == 16
    with_scores = activation_bytes_per_token(shape, True, 2, 2, False, True, row_tokens=4352)
    without = activation_bytes_per_token(shape, True, 2, 2, False, True)
    assert with_scores[1] - without[1] == 22 * 16 * 512 == 180_224
    assert with_scores[0] - without[0] == 2 * 2 * 4352 == 17_408
    assert 4352 * 180_224 == 784_334_848 and round(784_334_848 / GIB, 2) == 0.73


def test_model_shape_from_a_transformers_config():
    from transformers import Qwen2Config

    cfg = Qwen2Config(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100)
    assert model_shape(cfg) == ModelShape(hidden=64, intermediate=160, layers=3, q_dim=64, vocab=100)


def test_the_estimate_reads_the_model_as_it_is_trained():
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo.config import GRPOConfig
    from grpo.model.loading import _enable_checkpointing

    cfg = Qwen2Config(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False)
    model = get_peft_model(Qwen2ForCausalLM(cfg), LoraConfig(r=2, lora_dropout=0.05, target_modules="all-linear"))
    config = GRPOConfig(logprob_chunk_tokens=8)
    # fp32 here: a = b = 4, d = 1; layer = 8 x 64 + 4 x 64 x 4 + 3 x 160 x 4 + 5 (5 x 64 + 64 + 160) = 6176,
    # ends = 64 x 12 = 768, backward = 4 x 160 x 4 = 2560, chunk = 20 x 8 x 100
    assert training_estimate(config, model) == (2 * 6176 + 768, 2560, 16_000, False)
    _enable_checkpointing(model)
    assert training_estimate(config, model) == (2 * 64 * 4 + 768, 6176 + 2560, 16_000, True)
    # full logits (--logprob_chunk_tokens 0): 14 V per token kept, no chunk
    assert training_estimate(GRPOConfig(logprob_chunk_tokens=0), model) == (1280 + 1400, 8736, 0, True)


def figures(free_gib, usable_gib=80, cached_gib=0.0, to_come_gib=0.0, capped_allocated_gib=None, total_gib=80,
            lent_gib=0.0):
    """An 80 GiB GPU (by default) with the rollout engine asleep; `usable_gib` below it with `capped_allocated_gib`:
    --gpu_memory_gib, and what torch's allocator has handed out under it (`lent_gib` of it unmapped by the sleeping
    engine, lent to the cap meanwhile)."""
    return GpuFigures(free=int(free_gib * GIB), cached=int(cached_gib * GIB), total=int(total_gib * GIB),
                      usable=int(usable_gib * GIB), to_come=int(to_come_gib * GIB),
                      capped_allocated=None if capped_allocated_gib is None else int(capped_allocated_gib * GIB),
                      lent=int(lent_gib * GIB))


def test_plenty_of_memory_keeps_the_cap():
    # room = 79 - 4 (5% of 80 kept back) = 75 GiB; / 1.5 = 50 GiB; / 2 MiB per token = 25600 -> capped
    budget, line = resolve_token_budget(figures(79), MIB, MIB, GIB, 768, True)
    assert budget == 16384
    assert "16384 tokens" in line and "75.0 GiB free for training" in line


def test_tight_memory_picks_a_smaller_multiple_of_1024():
    # room = 40 - 4 = 36 GiB; / 1.5 = 24 GiB; / 2 MiB = 12288 tokens
    assert resolve_token_budget(figures(40), MIB, MIB, GIB, 768, True)[0] == 12288
    # a 24 GiB card with 14 GiB free: room = 14 - 1.2 = 12.8 GiB; / 1.5 / 2 MiB = 4369 -> 4096, the same with 4 of
    # the 14 GiB held in torch's cache; gradients to come (1 GiB): 11.8 GiB -> 4027 -> 3072
    card = dict(usable_gib=24, total_gib=24)
    assert resolve_token_budget(figures(14, **card), MIB, MIB, GIB, 768, True)[0] == 4096
    assert resolve_token_budget(figures(10, cached_gib=4, **card), MIB, MIB, GIB, 768, True)[0] == 4096
    assert resolve_token_budget(figures(14, to_come_gib=1, **card), MIB, MIB, GIB, 768, True)[0] == 3072
    # --gpu_memory_gib 24 on the 80 GiB GPU, 10 GiB counted by torch's cap: room = min(70 - 1.2, 24 - 10 - 1.2)
    # = 12.8 GiB -> 4096 as on the card; 1 GiB of gradients to come: min(67.8, 11.8) -> 3072
    assert resolve_token_budget(figures(70, usable_gib=24, capped_allocated_gib=10), MIB, MIB, GIB, 768, True)[0] \
        == 4096
    assert resolve_token_budget(figures(70, usable_gib=24, to_come_gib=1, capped_allocated_gib=10), MIB, MIB, GIB,
                                768, True)[0] == 3072
    # the chunk binds: room 18 GiB / 1.5 = 12; (12 - 10 GiB) / 1 MiB kept = 2048
    assert resolve_token_budget(figures(22), MIB, 0, 10 * GIB, 768, True)[0] == 2048
    # 900 tokens fit (room 2700 MiB / 1.5 / 2 MiB), less than 1024: one row of 768
    assert resolve_token_budget(figures(4 + 2700 / 1024), MIB, MIB, 0, 768, True)[0] == 768


def test_under_a_cap_what_torch_counts_binds_when_it_is_more_than_the_driver_sees():
    # --gpu_memory_gib 24 on the 80 GiB GPU, 10 GiB of it in use: room = min(70 - 1.2, 24 - 10 - 1.2) = 12.8 GiB.
    # Torch counts 12 GiB (2 more than the process holds): room = 24 - 12 - 1.2 = 10.8 GiB; / 1.5 / 2 MiB = 3686
    # tokens -> 3072
    assert resolve_token_budget(figures(70, usable_gib=24, capped_allocated_gib=10), MIB, MIB, GIB, 768, True)[0] \
        == 4096
    budget, line = resolve_token_budget(figures(70, usable_gib=24, capped_allocated_gib=12), MIB, MIB, GIB, 768, True)
    assert budget == 3072
    assert "10.8 GiB free for training" in line and "12.0 counted by torch's cap" in line
    # those 2 GiB are the sleeping engine's KV cache, back with the driver and lent to the cap while it sleeps: the
    # room is the card's again, 24 + 2 - 12 - 1.2 = 12.8 GiB -> 4096
    budget, line = resolve_token_budget(figures(70, usable_gib=24, capped_allocated_gib=12, lent_gib=2), MIB, MIB,
                                        GIB, 768, True)
    assert budget == 4096 and "12.8 GiB free for training" in line and "10.0 counted by torch's cap" in line


def test_a_run_sharing_the_gpu_with_another_process_is_not_counted_twice():
    # --gpu_memory_gib 24 on an 80 GiB GPU where another process holds 56 GiB and this run 10 (torch's count under
    # its cap): 14 GiB free. The other process's memory is already not free, the cap is this run's own:
    #   room = min(14 - 1.2, 24 - 10 - 1.2) = 12.8 GiB -> 4096 tokens, as on a 24 GiB card of its own
    # (subtracting what lies beyond the cap, 80 - 24, from the free memory as well would leave none: no row at all)
    shared = figures(14, usable_gib=24, capped_allocated_gib=10)
    assert round(shared.room / GIB, 6) == 12.8
    assert resolve_token_budget(shared, MIB, MIB, GIB, 768, True)[0] == 4096
    # the other process at 60 GiB leaves 10 free: then the free memory binds, min(10 - 1.2, 12.8) = 8.8 GiB;
    # / 1.5 / 2 MiB = 3003 tokens -> 2048
    budget, line = resolve_token_budget(figures(10, usable_gib=24, capped_allocated_gib=10), MIB, MIB, GIB, 768, True)
    assert budget == 2048
    assert "8.8 GiB free for training (24.0 GiB usable, 10.0 free on the GPU with the rollout engine asleep, 10.0 " \
           "counted by torch's cap, 1.2 kept back)" in line


def test_the_log_prob_chunk_is_halved_while_it_limits_the_micro_batch():
    # kept 1 MiB, transient 3 MiB per token, room 8 GiB: the chunk binds above 8 x 3 / 4 = 6 GiB. 1024 tokens of
    # 16 GiB -> 512 of 8 GiB -> 256 of 4 GiB, which no longer binds: t = min(8 GiB / 4 MiB, 4 GiB / 1 MiB) = 2048
    assert fitted_chunk_tokens(8 * GIB, 1024, 16 * GIB, MIB, 3 * MIB) == (256, 4 * GIB)
    assert fitted_chunk_tokens(8 * GIB, 1024, GIB, MIB, 3 * MIB) == (1024, GIB)  # not binding: kept as given
    assert fitted_chunk_tokens(GIB // 10, 1024, 16 * GIB, MIB, 3 * MIB) == (128, 2 * GIB)  # never below 128
    assert fitted_chunk_tokens(GIB // 10, 200, 16 * GIB, MIB, 3 * MIB) == (200, 16 * GIB)
    # room 80 GiB: 20480 tokens by the activations, capped at 16384, so the chunk binds only above
    # 80 - 16 GiB = 64 GiB (not 80 x 3 / 4 = 60): 62 GiB is kept, 70 halved
    assert fitted_chunk_tokens(80 * GIB, 1024, 62 * GIB, MIB, 3 * MIB) == (1024, 62 * GIB)
    assert fitted_chunk_tokens(80 * GIB, 1024, 70 * GIB, MIB, 3 * MIB) == (512, 35 * GIB)
    # room 12 GiB before the 1.5 margin: with the 16 GiB chunk no row fits; with 4 GiB, 2048 tokens
    gpu = figures(4 + 12, usable_gib=80)
    assert resolve_token_budget(gpu, MIB, 3 * MIB, 4 * GIB, 768, True)[0] == 2048
    with pytest.raises(ConfigError):
        resolve_token_budget(gpu, MIB, 3 * MIB, 16 * GIB, 768, True)


def test_one_row_that_does_not_fit_is_an_error_with_the_figures_and_the_remedies():
    # a 24 GiB card with 2 GiB free: room = 2 - 1.2 = 0.8 GiB; one row of 768 tokens: 1.5 x (768 MiB kept +
    # max(1 GiB, 768 MiB)) = 2.6 GiB
    card = dict(usable_gib=24, total_gib=24)
    with pytest.raises(ConfigError) as err:
        resolve_token_budget(figures(2, **card), MIB, MIB, GIB, 768, False)
    message = str(err.value)
    for part in ("--max_tokens_per_micro_batch auto", "--max_seq_length 768", "needs about 2.6 GiB",
                 "0.8 GiB is free for training", "24.0 GiB usable", "--gradient_checkpointing true",
                 "--gpu_memory_gib", "--rollout_weights in_place (lora) or adapter (qlora)", "checkpointing off"):
        assert part in message, part
    with pytest.raises(ConfigError) as err:  # already on: not suggested
        resolve_token_budget(figures(2, **card), MIB, MIB, GIB, 768, True)
    assert "--gradient_checkpointing true" not in str(err.value)
    assert "--logprob_chunk_tokens" in str(err.value)
    # the chunk as small as auto makes it, under a cap: --gpu_memory_gib 24 of the 80 GiB GPU, 22 GiB counted by
    # torch's cap (58 free): room = min(56.8, 24 - 22 - 1.2) = 0.8 GiB
    with pytest.raises(ConfigError) as err:
        resolve_token_budget(figures(58, usable_gib=24, capped_allocated_gib=22), MIB, MIB, GIB, 768, True,
                             smallest_chunk=True)
    assert "0.8 GiB is free for training" in str(err.value)
    assert "--logprob_chunk_tokens" not in str(err.value) and "22.0 counted by torch's cap" in str(err.value)


def test_qwen_7b_qlora_within_15_and_16_gib_comes_out_below_the_measured_failure():
    # the calibration runs: Qwen2.5-7B's shape, qlora (bf16 activations and adapters, dropout), checkpointing, one
    # H100 with expandable segments, 9.5 GiB counted by torch's cap with the engine asleep. --gpu_memory_gib 16
    # (room min(75 - 0.1 - 1, 16 - 9.5 - 0.1 - 1) = 5.4 GiB) ran 6144 tokens; --gpu_memory_gib 15 (room 4.4 GiB)
    # ran out of memory at 5120
    shape = ModelShape(hidden=3584, intermediate=18944, layers=28, q_dim=3584, vocab=151936)
    kept, transient = activation_bytes_per_token(shape, True, 2, 2, True, False)
    assert (round(kept / MIB, 2), round(transient / MIB, 2)) == (0.22, 0.42)  # as the runs' logs say
    chunk = logprob_chunk_bytes(1024, shape.vocab, False)

    def auto(cap_gib):
        gpu = figures(75, usable_gib=cap_gib, to_come_gib=0.1, capped_allocated_gib=9.5)
        chunk_tokens, chunk_bytes = fitted_chunk_tokens(gpu.room / ESTIMATE_MARGIN, 1024, chunk, kept, transient)
        return resolve_token_budget(gpu, kept, transient, chunk_bytes, 768, True)[0], chunk_tokens

    # 5.4 / 1.5 = 3.6 GiB: the 2.90 GiB chunk binds (above 3.6 - 0.22 MiB x 5760 tokens = 2.36), halved to 1.45;
    # then min(3.6 GiB / 0.64 MiB, (3.6 - 1.45) GiB / 0.22 MiB) = 5760 tokens
    assert auto(16) == (5120, 512)
    assert auto(15) == (4096, 512)   # 2.93 GiB: the chunk binds (above 1.92), halved to 1.45; 4693 tokens


def test_cpu_and_explicit_values_are_kept():
    import torch

    from grpo.config import GRPOConfig

    cpu = torch.device("cpu")
    # auto is the plan's to resolve: without one, a clear error (no budget of its own here)
    with pytest.raises(ValueError, match="--max_tokens_per_micro_batch auto is the memory plan's budget"):
        micro_batch_token_budget(GRPOConfig(), None, None, cpu)
    assert micro_batch_token_budget(GRPOConfig(max_tokens_per_micro_batch=4096), None, None, cpu) == (4096, 1024)
    assert micro_batch_token_budget(GRPOConfig(max_tokens_per_micro_batch=0, logprob_chunk_tokens=256), None, None,
                                    cpu) == (0, 256)
    # with a plan: auto is the plan's tokens and log-prob chunk; an explicit value stays as given
    plan = SimpleNamespace(micro_batch_tokens=6144, logprob_chunk_tokens=512, longest=512)
    assert micro_batch_token_budget(GRPOConfig(), None, None, cpu, plan) == (6144, 512)
    assert micro_batch_token_budget(GRPOConfig(max_tokens_per_micro_batch=4096), None, None, cpu, plan) == (4096, 1024)


def test_a_cpu_runs_plan_gives_its_budget():
    import os

    import torch

    from grpo.config import GRPOConfig
    from grpo.memory.planner import plan_run

    model = os.path.join(os.path.dirname(__file__), "model_configs", "llama-3.2-3b")
    config = GRPOConfig(model_name_or_path=model, tuning_strategy="lora")
    plan = plan_run(config, model, on_gpu=False)
    assert plan.budget == 0 and plan.micro_batch_tokens == 16384 and plan.gradient_checkpointing  # RAM: always on
    assert micro_batch_token_budget(config, None, None, torch.device("cpu"), plan) == (16384, 1024)


class SleepyEngine:
    """Stands in for the rollout engine: measured asleep, woken at once."""

    def __init__(self):
        self.calls = []

    def sleep(self, keep_weights=False):
        self.calls.append(("sleep", keep_weights))

    def wake(self):
        self.calls.append(("wake",))


def test_on_a_gpu_the_plans_budget_is_lowered_only_where_the_measured_room_holds_less(monkeypatch, grpo_log):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo.config import GRPOConfig
    from grpo.runtime import gpu_budget

    cfg = Qwen2Config(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False)
    model = get_peft_model(Qwen2ForCausalLM(cfg), LoraConfig(r=2, lora_dropout=0.05, target_modules="all-linear"))
    config = GRPOConfig(logprob_chunk_tokens=8)
    # as worked above (fp32, no checkpointing): kept 13,120 and transient 2560 bytes a token; chunk 20 x 8 x 100
    assert training_estimate(config, model) == (13_120, 2560, 16_000, False)
    to_come = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    # an 80 GiB GPU (4 GiB kept back) with the gradients, the margin and 1.5 x 3000 x 15,680 bytes free: 3000 tokens
    # fit by the activations ((room / 1.5 - chunk) / kept = 3584 does not bind) -> 2048 in steps of 1024
    free = 4 * GIB + to_come + int(1.5 * 3000 * 15_680)
    monkeypatch.setattr(gpu_budget, "usable_gpu_bytes", lambda cap_gib, device=None: 80 * GIB)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    gpu = torch.device("cuda", 0)
    engine = SleepyEngine()
    planned = SimpleNamespace(micro_batch_tokens=4096, logprob_chunk_tokens=8, longest=64)
    assert micro_batch_token_budget(config, model, engine, gpu, planned) == (2048, 8)
    assert engine.calls == [("sleep", True), ("wake",)]  # measured asleep, as during an update; left awake
    assert grpo_log[-1].startswith("micro-batches of up to 2048 tokens (--max_tokens_per_micro_batch auto: the "
                                   "memory plan's 4096, lowered: the room measured after loading holds 2048)")
    # a plan below what the room holds stands
    assert micro_batch_token_budget(config, model, SleepyEngine(), gpu,
                                    SimpleNamespace(micro_batch_tokens=1024, logprob_chunk_tokens=8,
                                                    longest=64)) == (1024, 8)
    assert "the memory plan's 1024; the room measured after loading holds 2048" in grpo_log[-1]
    # without a plan: refused before anything is measured
    with pytest.raises(ValueError, match="pass the run's plan"):
        micro_batch_token_budget(config, model, SleepyEngine(), gpu)
    # not one row of 768 tokens in the room: the error with the figures, before any rollout
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4 * GIB + to_come + 1000, 80 * GIB))
    with pytest.raises(ConfigError, match="one row of --max_seq_length 768 tokens needs"):
        micro_batch_token_budget(config, model, SleepyEngine(), gpu, planned)


def test_expandable_segments_are_turned_on_unless_the_user_chose(monkeypatch):
    import os

    import torch

    from grpo.runtime.gpu_budget import use_expandable_segments

    settings = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", settings.append, raising=False)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(name, "")  # recorded, so that what the function sets is undone after the test
        monkeypatch.delenv(name)
    assert use_expandable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"  # where vLLM looks for it
    assert settings == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")  # other settings kept
    assert use_expandable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512,expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")  # the user's choice stands
    assert not use_expandable_segments()
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    assert not use_expandable_segments()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")  # torch applies it; vLLM must see it too
    assert use_expandable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert len(settings) == 2


def test_sequence_parallel_ranks_need_room_for_their_share_of_a_row():
    # 900 tokens fit (room 2700 MiB / 1.5 / 2 MiB): a row of 1536 does not, its half on each of 2 ranks (768) does
    tight = figures(4 + 2700 / 1024)
    with pytest.raises(ConfigError, match="1536 tokens needs"):
        resolve_token_budget(tight, MIB, MIB, 0, 1536, True)
    assert resolve_token_budget(tight, MIB, MIB, 0, 1536, True, sp_size=2)[0] == 768
    with pytest.raises(ConfigError, match=r"1536 tokens \(512 on each rank of its sequence-parallel group\)"):
        resolve_token_budget(figures(4 + 900 / 1024), MIB, MIB, 0, 1536, True, sp_size=3)


def test_sequence_parallel_micro_batches_count_a_rank_s_share_of_each_row():
    from grpo.config.options import GRPOConfig
    from grpo.runtime import distributed as dist_utils
    from grpo.train.update import step_micro_batches
    from tests.optimize_setup import make_step

    dist_utils.init_distributed()
    batch, _ = make_step()
    one = step_micro_batches(batch, GRPOConfig(), max_tokens=16)
    cfg = GRPOConfig()
    cfg.sequence_parallel_size = 2  # (validation wants a world of N ranks; this test runs one)
    halves = step_micro_batches(batch, cfg, max_tokens=8)  # 8 tokens per rank = 16 of each whole row
    rows = lambda mbs: [mb.rows.tolist() for mb in mbs]  # noqa: E731
    assert rows(halves) == rows(one)
    assert len(one) < len(step_micro_batches(batch, GRPOConfig(), max_tokens=8))  # the factor N matters
    # a number given as the option is the budget; auto without the resolved budget is refused
    assert rows(step_micro_batches(batch, GRPOConfig(max_tokens_per_micro_batch=16))) == rows(one)
    with pytest.raises(ValueError, match="pass it as max_tokens"):
        step_micro_batches(batch, GRPOConfig())


def test_the_sleeping_engines_memory_is_lent_to_the_cap_and_taken_back(monkeypatch):
    """--gpu_memory_gib 24 on an 80 GiB GPU is torch's fraction 24 / 80. While the engine sleeps, what it unmapped
    (2 GiB here) is back with the driver but still in torch's count: the fraction rises to 26 / 80 until the engine
    maps it again, so the process holds at most 24 GiB either way; without a cap nothing changes."""
    import torch

    from grpo.runtime import gpu_budget

    fractions = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=80 * GIB))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda share, index: fractions.append(share))
    monkeypatch.setattr(gpu_budget, "_caps", {})
    device = torch.device("cuda", 0)
    gpu_budget.lend_engine_memory(2 * GIB, device)  # no cap yet: nothing
    assert fractions == [] and gpu_budget.engine_loan_bytes(device) == 0
    gpu_budget.cap_gpu_memory(24, device)
    gpu_budget.lend_engine_memory(2 * GIB, device)
    assert gpu_budget.engine_loan_bytes(device) == 2 * GIB
    gpu_budget.end_engine_loan(device)
    gpu_budget.end_engine_loan(device)  # already back: nothing more
    assert fractions == [24 / 80, 26 / 80, 24 / 80] and gpu_budget.engine_loan_bytes(device) == 0
    gpu_budget.lend_engine_memory(70 * GIB, device)  # never past the whole GPU
    assert fractions[-1] == 1.0
    # a sync maps the weights back alone: the loan ends, then the KV cache still unmapped (1 GiB) is lent again;
    # nothing left unmapped: no loan
    gpu_budget.end_engine_loan(device)
    gpu_budget.lend_engine_memory(GIB, device)
    assert fractions[-2:] == [24 / 80, 25 / 80]
    gpu_budget.lend_engine_memory(0, device)
    assert fractions[-1] == 24 / 80 and gpu_budget.engine_loan_bytes(device) == 0
