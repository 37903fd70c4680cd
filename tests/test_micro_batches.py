"""Token-budget micro-batches, step-wide aggregation parts, chunked and packed log-probs against the plain ones."""
import pytest
import torch

from grpo.algorithm import (aggregate, aggregation_normaliser, aggregation_numerator, hidden_token_logprobs,
                            token_entropy, token_logprobs)
from grpo.train.micro_batches import cut_rows, form_micro_batches, pack_by_token_budget
from grpo.train.logprobs import completion_logprobs, pack_rows

from .optimize_setup import make_step
from .tiny_models import make_tiny_model_dir


def test_packing_keeps_the_budget_longest_first():
    prompts, completions = [3, 5, 2, 4, 1, 6], [10, 2, 7, 0, 4, 9]
    groups = pack_by_token_budget(prompts, completions, max_tokens=30)
    # longest first: rows 5 (6+9), 0 (3+10), 2, 1, 4, 3; padded sizes: {5, 0} would be 2 x (6+10) = 32 > 30,
    # {0, 2} is 2 x (3+10) = 26, {0, 2, 1} 3 x (5+10) = 45 > 30, {1, 4, 3} 3 x (5+4) = 27
    assert groups == [[5], [0, 2], [1, 4, 3]]
    for g in groups:
        assert len(g) * (max(prompts[i] for i in g) + max(completions[i] for i in g)) <= 30
    assert pack_by_token_budget([50], [50], max_tokens=30) == [[0]]  # too long for the budget: alone
    with pytest.raises(ValueError, match="max_tokens"):
        pack_by_token_budget([1], [1], 0)


def test_cut_rows_drops_unneeded_padding_and_fillers_carry_no_tokens():
    batch, _ = make_step()                                   # prompts up to 7, completions up to 9 tokens
    part = cut_rows(batch, [2, 3])                           # prompt 1 (7 tokens), completions of 1 and 6 tokens
    assert part.input_ids.shape == (2, 7 + 6) and part.completion_ids.shape == (2, 6)
    torch.testing.assert_close(part.completion_ids, batch.completion_ids[[2, 3], :6])
    mbs = form_micro_batches(batch, [[0, 1], [2]], count=4)
    assert [mb.empty for mb in mbs] == [False, False, True, True]
    assert mbs[3].batch.completion_mask.sum() == 0
    out = torch.zeros(batch.completion_ids.shape)
    for mb in mbs:
        mb.scatter(torch.ones(mb.batch.completion_ids.shape), into=out)
    assert out[:3].sum() > 0 and out[3:].sum() == 0


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batch_parts_sum_to_the_step_aggregate(aggregation):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.4).float()
    mask[4] = 0.0                                            # a row without tokens
    whole = aggregate(x, mask, aggregation, max_completion_length=8)
    d = aggregation_normaliser(mask, aggregation, 8)
    assert d == sum(aggregation_normaliser(mask[rows], aggregation, 8) for rows in ([0, 1], [2, 3, 4], [5]))
    parts = sum(aggregate(x[rows], mask[rows], aggregation, 8, normaliser=d) for rows in ([0, 1], [2, 3, 4], [5]))
    torch.testing.assert_close(parts, whole)
    torch.testing.assert_close(aggregation_numerator(x, mask, aggregation) / d, whole)


def chunk_case(seed: int, positions: int):
    """Random final hidden states [M, 16], an output layer to 50 tokens, token ids [M] and loss weights [M]."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(positions, 16, generator=g, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=False)
    return hidden, head, torch.randint(0, 50, (positions,), generator=g), torch.randn(positions, generator=g)


def test_chunked_logprobs_and_gradients_equal_the_full_logits():
    hidden, head, ids, weights = chunk_case(0, 37)
    logprobs, entropy = hidden_token_logprobs(hidden, head, ids, temperature=0.7, chunk_tokens=8, with_entropy=True)
    (logprobs * weights).sum().backward()
    grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    logits = head(hidden).unsqueeze(0)                       # [1, 37, 50]
    plain = token_logprobs(logits, ids.unsqueeze(0), temperature=0.7)[0]
    (plain * weights).sum().backward()
    torch.testing.assert_close(logprobs, plain)
    torch.testing.assert_close(entropy, token_entropy(logits.detach(), temperature=0.7)[0])
    torch.testing.assert_close(grads[0], hidden.grad)
    torch.testing.assert_close(grads[1], head.weight.grad)


def test_chunked_entropy_gradient_equals_the_full_logits():
    """An entropy bonus on the chunked path: the gradient of sum_t w_t H_t matches the one through full logits."""
    hidden, head, ids, weights = chunk_case(1, 29)
    logprobs, entropy = hidden_token_logprobs(hidden, head, ids, temperature=0.7, chunk_tokens=8, with_entropy=True,
                                              entropy_grad=True)
    (entropy * weights).sum().backward()
    grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    plain = token_entropy(head(hidden).unsqueeze(0), temperature=0.7, with_grad=True)[0]
    (plain * weights).sum().backward()
    torch.testing.assert_close(entropy, plain)
    torch.testing.assert_close(grads[0], hidden.grad)
    torch.testing.assert_close(grads[1], head.weight.grad)


def test_pack_rows_positions():
    batch, _ = make_step()
    ids, positions, predicting = pack_rows(cut_rows(batch, [0, 1]))     # prompt 0 (3) + 4, prompt 0 (3) + 9
    assert ids.shape == (1, 7 + 12)
    assert positions[0].tolist() == list(range(7)) + list(range(12))
    assert predicting.tolist() == [2, 3, 4, 5] + [7 + 2 + j for j in range(9)]
    torch.testing.assert_close(ids[0, predicting + 1], batch.completion_ids[[0] * 4 + [1] * 9,
                                                                          list(range(4)) + list(range(9))])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model_dir(str(tmp_path_factory.mktemp("mb_model")))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.mark.parametrize("strategy", ["full", "lora"])
def test_chunked_and_packed_forwards_equal_the_padded_logits_with_gradients(strategy, tiny):
    import copy

    model = copy.deepcopy(tiny)
    if strategy == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    batch, _ = make_step()
    weights = torch.randn(batch.completion_ids.shape, generator=torch.Generator().manual_seed(3))
    results = []
    for kwargs in (dict(chunk_tokens=0), dict(chunk_tokens=5), dict(chunk_tokens=5, packed=True)):
        model.zero_grad()
        logprobs, entropy = completion_logprobs(model, batch, 0.8, with_entropy=True, entropy_grad=True, **kwargs)
        # an entropy bonus too: its gradient takes the same path
        ((logprobs + 0.3 * entropy) * weights * batch.completion_mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((logprobs.detach(), entropy.detach(), grads))
    mask = batch.completion_mask.bool()
    for logprobs, entropy, grads in results[1:]:
        torch.testing.assert_close(logprobs[mask], results[0][0][mask], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropy[mask], results[0][1][mask], rtol=1e-5, atol=1e-5)
        assert grads.keys() == results[0][2].keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, results[0][2][name], rtol=1e-4, atol=1e-4, msg=name)
