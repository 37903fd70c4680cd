"""lora's in-place merge (grpo.sync.in_place_merge): the adapter merged into the base the trainer shares with the
engine, and taken out again bit for bit."""
import os
import signal

import pytest
import torch

from grpo.model.layer_weights import checkpoint_name
from grpo.sync.in_place_merge import (InPlaceMerge, in_place_layers, lora_delta, merge_recording, pack_codes,
                                      unmerge_recorded, unpack_codes)
from grpo.sync.merge_record import BITS_OF, ESCAPE
from grpo.sync.shared_base import lora_base_names, share_base_weights
from grpo.sync.weight_sync import sync_weights

from .sync_setup import IDS, trained_policy
from .test_sync import VLLM_PACKED, RecordingEngine, vllm_layout
from .tiny_models import make_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny")))


def bits(tensor):
    return tensor.view(BITS_OF[tensor.element_size()])


def test_a_merge_by_hand_and_its_exact_unmerge():
    """bf16 steps: 2^-8 below 1, 2^-7 from 1 to 2. D = s * B @ A with B = [[1]], A = [[d0, d1, d2, d3]], s = 1.
      W = 1 - 2^-8, D = 3 * 2^-9: W + D = 1.001953..., W' = 1;  W' - D = 0.994140625, halfway between 0.9921875
          (even mantissa) and W: g = 0.9921875, one step below W: code c + 1 = 2
      W = 1, D = 3 * 2^-9: W' = 1.0078125 (1.005859375 is nearer it than 1);  g = round(1.001953125) = 1: code 1
      W = 2^-10, D = 1: W' = 1 (2^-10 is under half a step of 1);  g = 0, thousands of steps from W: ESCAPE, W kept
      W = -0.5, D = 0: W' = g = W: code 1
    Codes 2, 1, 3, 1 in one byte, the first in the lowest bits: 2 + 1 * 4 + 3 * 16 + 1 * 64 = 118. W = 2^-10 in bf16
    has exponent 127 - 10 = 117 and no mantissa bits: 117 * 2^7 = 14976."""
    weight = torch.tensor([[1 - 2**-8, 1.0, 2**-10, -0.5]], dtype=torch.bfloat16)
    original = weight.clone()
    lora_b, lora_a = torch.tensor([[1.0]]), torch.tensor([[3 * 2**-9, 3 * 2**-9, 1.0, 0.0]])
    record = merge_recording(weight, lora_b, lora_a, 1.0)
    assert weight.tolist() == [[1.0, 1.0078125, 1.0, -0.5]]
    assert record.codes.tolist() == [118] and unpack_codes(record.codes).tolist() == [2, 1, ESCAPE, 1]
    assert record.escapes == 1 and record.escape_index.tolist() == [2] and record.escape_bits.tolist() == [14976]
    unmerge_recorded(weight, lora_b, lora_a, 1.0, record)
    assert torch.equal(bits(weight), bits(original))


def test_codes_pack_four_to_a_byte():
    codes = torch.tensor([3, 0, 1, 2, 0, 0, 0, 3], dtype=torch.uint8)
    assert pack_codes(codes).tolist() == [3 + 0 + 1 * 16 + 2 * 64, 3 * 64]
    assert torch.equal(unpack_codes(pack_codes(codes)), codes)


def test_lora_delta_is_s_times_b_at_a():
    lora_b, lora_a = torch.tensor([[1.0, 2.0], [0.0, -1.0]]), torch.tensor([[1.0, 0.5], [3.0, -2.0]])
    # B @ A = [[1 + 6, 0.5 - 4], [-3, 2]], times s = 0.5
    assert lora_delta(lora_b, lora_a, 0.5).tolist() == [[3.5, -1.75], [-1.5, 1.0]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("b_scale", [1e-4, 1e-2, 1.0])
def test_the_round_trip_is_exact_for_any_adapter_size(dtype, b_scale):
    """W' = round(W + D) as a merged sync computes it, and W back bit for bit, from adapters far smaller than W to
    far larger (most elements then escape)."""
    torch.manual_seed(0)
    weight = (torch.randn(64, 96) * 0.02).to(dtype)
    original = weight.clone()
    lora_b, lora_a = (torch.randn(64, 8) * b_scale).to(dtype), ((torch.rand(8, 96) * 2 - 1) / 96**0.5).to(dtype)
    merge = InPlaceMerge()
    merge.set_adapter([(weight, lora_b, lora_a, 2.0)])
    merge.merge()
    assert torch.equal(weight, (original.float() + lora_delta(lora_b, lora_a, 2.0)).to(dtype))
    merge.merge()  # merging a merged base changes nothing
    assert torch.equal(weight, (original.float() + lora_delta(lora_b, lora_a, 2.0)).to(dtype))
    merge.unmerge()
    merge.unmerge()
    assert torch.equal(bits(weight), bits(original))


def test_a_merged_base_refuses_a_new_adapter():
    weight = torch.zeros(2, 4)
    merge = InPlaceMerge()
    merge.set_adapter([(weight, torch.ones(2, 1), torch.ones(1, 4), 1.0)])
    merge.merge()
    with pytest.raises(RuntimeError, match="unmerge"):
        merge.set_adapter([(weight, torch.ones(2, 1), torch.ones(1, 4), 1.0)])
    with pytest.raises(ValueError, match="cannot be merged in place"):
        InPlaceMerge().set_adapter([(torch.zeros(2, 3), torch.ones(2, 1), torch.ones(1, 3), 1.0)])


class SharedBaseEngine(RecordingEngine):
    """The engine side of in-place mode on CPU: its weights (vLLM's layout) are the trainer's base, and it merges the
    synced adapter into them (as grpo.rollout.vllm.VLLMRolloutEngine does when it generates)."""
    merges_in_place = True

    def __init__(self):
        super().__init__()
        self.merge = InPlaceMerge()

    def load_merge(self, layers):
        self.merge.unmerge()
        self.merge.set_adapter(layers)


def test_the_trainer_and_the_engine_share_one_base_that_samples_the_merged_policy(model_dir):
    """A trained lora policy shares its base with an engine in vLLM's layout; a sync hands over B and A (never a
    base tensor); merged, the engine's weights are what peft's merge gives and the base model computes the merged
    policy; unmerged, the policy computes bit for bit as before. An update after the sync does not reach the merge;
    the next sync's does."""
    policy = trained_policy(model_dir, "lora").eval()
    with torch.no_grad():
        before = policy(IDS).logits
    peft_merged = {checkpoint_name(name): p.detach().clone()
                   for name, p in __import__("copy").deepcopy(policy).merge_and_unload().named_parameters()}
    engine_model = vllm_layout(model_dir, vocab_rows=64 * -(-policy.config.vocab_size // 64) + 64)
    required = lora_base_names(policy)
    assert "model.layers.1.self_attn.k_proj.weight" in required and len(required) == 14  # 2 layers x 7 linears
    shared = share_base_weights(policy, engine_model, VLLM_PACKED, required=required)
    assert shared.kept == 0
    engine = SharedBaseEngine()
    stats = sync_weights(engine, policy, "lora")
    assert engine.calls == [] and stats.tensors == 2 * 14
    assert stats.bytes == sum(p.numel() * 4 for name, p in policy.named_parameters() if "lora_" in name)
    synced = {name: p.detach().clone() for name, p in policy.named_parameters() if "lora_B" in name}
    with torch.no_grad():  # an optimizer step after the sync: the engine merges what it was handed
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.mul_(3.0)
        after_update = policy(IDS).logits
    engine.merge.merge()
    k_rows = engine_model.get_parameter("model.layers.1.self_attn.qkv_proj.base_layer.weight")[64:96]
    k_merged = peft_merged["model.layers.1.self_attn.k_proj.weight"]
    assert not torch.equal(k_rows, k_merged)  # peft multiplies in another order: equal to rounding
    torch.testing.assert_close(k_rows, k_merged, atol=1e-6, rtol=1e-6)
    with torch.no_grad(), policy.disable_adapter():  # the shared base now holds the merged policy of the sync
        torch.testing.assert_close(policy(IDS).logits, before, atol=1e-5, rtol=1e-5)
    engine.merge.unmerge()
    with torch.no_grad():
        assert torch.equal(policy(IDS).logits, after_update)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(synced[name])
        assert torch.equal(policy(IDS).logits, before)
    # a later sync copies into the first one's buffers (one batched copy) and merges what it was handed
    buffers = [layer.lora_b.data_ptr() for layer in engine.merge.layers]
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.mul_(2.0)
        doubled = policy(IDS).logits
    sync_weights(engine, policy, "lora")
    assert [layer.lora_b.data_ptr() for layer in engine.merge.layers] == buffers
    engine.merge.merge()
    with torch.no_grad(), policy.disable_adapter():
        torch.testing.assert_close(policy(IDS).logits, doubled, atol=1e-5, rtol=1e-5)
    engine.merge.unmerge()
    with torch.no_grad():
        assert torch.equal(policy(IDS).logits, doubled)


def test_in_place_layers_are_the_lora_layers_with_their_scale(model_dir):
    policy = trained_policy(model_dir, "lora")
    layers = in_place_layers(policy)
    q = policy.base_model.model.model.layers[0].self_attn.q_proj
    assert len(layers) == 14 and layers[0][0].data_ptr() == q.base_layer.weight.data_ptr()
    assert layers[0][1].data_ptr() == q.lora_B["default"].weight.data_ptr() and layers[0][3] == 8 / 4  # alpha / r


def test_sharing_for_an_in_place_merge_is_all_or_nothing(model_dir):
    """One LoRA layer whose base the engine does not hold exactly: merging into the trainer's tensors would miss the
    engine there, so nothing is shared (the engine then takes merged weights of its own)."""
    policy = trained_policy(model_dir, "lora").eval()
    engine_model = vllm_layout(model_dir, vocab_rows=64 * -(-policy.config.vocab_size // 64) + 64)
    with torch.no_grad():
        engine_model.get_parameter("model.layers.0.mlp.down_proj.base_layer.weight")[0, 0] += 1.0
    result = share_base_weights(policy, engine_model, VLLM_PACKED, required=lora_base_names(policy))
    frozen = [p for name, p in policy.named_parameters() if not p.requires_grad]
    assert (result.shared, result.kept) == (0, len(frozen))
    assert policy.base_model.model.lm_head.weight.data_ptr() != engine_model.lm_head.weight.data_ptr()


def test_a_new_adapter_keeps_the_kernel_buffers_of_its_layers_only_where_they_fit(monkeypatch):
    """A layer whose rank moves it from torch's merge to the kernel's gets buffers in the kernel's layout (torch's
    record has another), and a set_adapter that fails on a later layer leaves the last adapter as it was."""
    import sys
    import types

    from grpo.sync import in_place_merge

    weights = [torch.zeros(8, 16, dtype=torch.bfloat16) for _ in range(2)]
    merge = InPlaceMerge()
    merge.set_adapter([(w, torch.ones(8, 2), torch.ones(2, 16), 1.0) for w in weights])
    merge.merge()
    merge.unmerge()
    assert all(layer.record is not None and not layer.use_kernel for layer in merge.layers)
    made = []
    monkeypatch.setitem(sys.modules, "grpo.sync.merge_kernel",
                        types.SimpleNamespace(new_record=lambda weight: made.append(weight) or f"kernel {len(made)}"))
    monkeypatch.setattr(in_place_merge, "_kernel_fits", lambda weight, lora_b: lora_b.shape[1] == 1)
    merge.set_adapter([(weights[0], torch.ones(8, 1), torch.ones(1, 16), 1.0),
                       (weights[1], torch.ones(8, 2), torch.ones(2, 16), 1.0)])
    assert [layer.record for layer in merge.layers[:1]] == ["kernel 1"] and not merge.layers[1].use_kernel
    merge.set_adapter([(weights[0], torch.full((8, 1), 2.0), torch.ones(1, 16), 1.0)])
    assert merge.layers[0].record == "kernel 1" and len(made) == 1  # the kernel's own buffers, kept
    kept_b = merge.layers[0].lora_b
    with pytest.raises(ValueError, match="cannot be merged in place"):
        merge.set_adapter([(weights[0], torch.full((8, 1), 3.0), torch.ones(1, 16), 1.0),
                           (torch.zeros(2, 3), torch.ones(2, 1), torch.ones(1, 3), 1.0)])
    assert len(merge.layers) == 1 and merge.layers[0].lora_b is kept_b and torch.equal(kept_b, torch.full(
        (8, 1), 2.0, dtype=torch.bfloat16))


def three_layer_merge() -> tuple[InPlaceMerge, list, list]:
    """An adapter on three bf16 layers, unmerged: the merge, its weights and copies of them."""
    torch.manual_seed(0)
    weights = [(torch.randn(8, 16) * 0.02).to(torch.bfloat16) for _ in range(3)]
    originals = [w.clone() for w in weights]
    merge = InPlaceMerge()
    merge.set_adapter([(w, torch.randn(8, 2) * 0.01, torch.randn(2, 16), 2.0) for w in weights])
    return merge, weights, originals


def test_a_merge_cut_off_halfway_leaves_the_base_whole_and_an_unmerge_finishes_later(monkeypatch):
    """An error in the second layer's merge (out of memory, an interrupt) takes the first out again before it
    propagates; an unmerge cut off after one layer leaves the others merged, a merge then merges that one again, and
    the next unmerge finishes them."""
    from grpo.sync import in_place_merge

    merge, weights, originals = three_layer_merge()
    real_merge, real_unmerge, calls = in_place_merge.merge_recording, in_place_merge.unmerge_recorded, []

    def fails_second(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_merge(*args)

    monkeypatch.setattr(in_place_merge, "merge_recording", fails_second)
    with pytest.raises(KeyboardInterrupt):
        merge.merge()
    assert not merge.merged and all(torch.equal(bits(w), bits(o)) for w, o in zip(weights, originals))
    monkeypatch.setattr(in_place_merge, "merge_recording", real_merge)
    merge.merge()
    assert merge.whole and not torch.equal(weights[0], originals[0])
    merged = [w.clone() for w in weights]

    def fails_after_first(*args):
        monkeypatch.setattr(in_place_merge, "unmerge_recorded", lambda *a: (_ for _ in ()).throw(MemoryError()))
        return real_unmerge(*args)

    monkeypatch.setattr(in_place_merge, "unmerge_recorded", fails_after_first)
    with pytest.raises(MemoryError):
        merge.unmerge()
    assert [layer.merged for layer in merge.layers] == [False, True, True] and merge.merged and not merge.whole
    assert torch.equal(bits(weights[0]), bits(originals[0]))
    monkeypatch.setattr(in_place_merge, "unmerge_recorded", real_unmerge)
    merge.merge()  # a generate after it merges the layer taken out, and only that one
    assert merge.whole and all(torch.equal(bits(w), bits(m)) for w, m in zip(weights, merged))
    merge.unmerge()
    assert not merge.merged and all(torch.equal(bits(w), bits(o)) for w, o in zip(weights, originals))


def sleeping_engine(merge: InPlaceMerge, calls: list, fail: Exception | None = None):
    """A VLLMRolloutEngine around a CPU merge, without vLLM: its memory release recorded (or failing)."""
    from grpo.rollout.vllm import VLLMRolloutEngine

    engine = object.__new__(VLLMRolloutEngine)
    engine._in_place, engine.merges_in_place = merge, True

    def release_memory(keep_weights):
        calls.append(("memory", merge.merged))
        if fail is not None:
            raise fail

    engine._release_memory = release_memory
    return engine


def test_a_sleep_frees_the_engine_memory_first_and_takes_the_adapter_out_even_when_that_fails():
    torch.manual_seed(0)
    weight = (torch.randn(8, 16) * 0.02).to(torch.bfloat16)
    original = weight.clone()
    merge = InPlaceMerge()
    merge.set_adapter([(weight, torch.randn(8, 2).to(torch.bfloat16), torch.randn(2, 16).to(torch.bfloat16), 2.0)])
    calls = []
    merge.merge()
    sleeping_engine(merge, calls).sleep()
    assert calls == [("memory", True)] and not merge.merged  # the KV cache went first, then the adapter came out
    assert torch.equal(bits(weight), bits(original))
    merge.merge()
    with pytest.raises(RuntimeError, match="the sleep's own error"):  # its error, not a later one, propagates
        sleeping_engine(merge, calls, fail=RuntimeError("the sleep's own error")).sleep()
    assert not merge.merged and torch.equal(bits(weight), bits(original))


@pytest.fixture
def ctrl_c_raises():
    """SIGINT handled as Python's default does (KeyboardInterrupt); a background job, as CI may run in, ignores it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_interrupt_during_a_merge_or_an_unmerge_waits_for_the_pass_to_end(monkeypatch, ctrl_c_raises):
    """Ctrl-C while the layers are merged (or taken out) is handled once every layer's launch has its flag: the merge
    is then undone whole, the unmerge finished whole, and the base is W bit for bit either way."""
    from grpo.sync import in_place_merge

    merge, weights, originals = three_layer_merge()
    real_merge, real_unmerge, done = in_place_merge.merge_recording, in_place_merge.unmerge_recorded, []

    def interrupted_merge(*args):  # the signal lands between the first layer's merge and its flag
        record = real_merge(*args)
        done.append("merge")
        if len(done) == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return record

    monkeypatch.setattr(in_place_merge, "merge_recording", interrupted_merge)
    with pytest.raises(KeyboardInterrupt):
        merge.merge()
    assert done == ["merge"] * 3  # every layer merged before the interrupt was handled, then all taken out
    assert not merge.merged and all(torch.equal(bits(w), bits(o)) for w, o in zip(weights, originals))
    monkeypatch.setattr(in_place_merge, "merge_recording", real_merge)
    merge.merge()
    done.clear()

    def interrupted_unmerge(*args):
        real_unmerge(*args)
        done.append("unmerge")
        if len(done) == 1:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(in_place_merge, "unmerge_recorded", interrupted_unmerge)
    with pytest.raises(KeyboardInterrupt):
        merge.unmerge()
    assert done == ["unmerge"] * 3 and not merge.merged
    assert all(torch.equal(bits(w), bits(o)) for w, o in zip(weights, originals))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is back
