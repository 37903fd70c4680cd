"""The log-prob chunk's bytes in the memory plan (grpo.memory.activations.logprob_chunk_bytes: 20 c V in the
backward, 22 behind a final logit soft-cap in bf16 (24 in fp32), half without gradients) against what the chunked
log-probs really allocate, counted by torch's profiler allocation by allocation on CPU: the equation is the code's,
not a guess."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from grpo.algorithm.logprobs import hidden_token_logprobs
from grpo.memory.activations import logprob_chunk_bytes
from grpo.train.logprobs import SoftCappedHead

HIDDEN, VOCAB, CHUNK = 64, 4096, 128


def peak_allocated(fn) -> int:
    """The most bytes fn held at once beyond what was allocated before it: the running sum of the profiler's
    allocation (+) and free (-) events, in the order they happened."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("temperature,entropy,capped", [(1.0, False, False), (0.7, False, False),
                                                        (0.7, True, False), (1.0, True, True), (0.7, False, True)])
def test_a_chunks_backward_holds_what_the_plan_counts(temperature, entropy, capped, dtype):
    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False).to(dtype).requires_grad_(False)
    head = SoftCappedHead(head, 30.0) if capped else head  # Gemma 2's final logit soft-cap
    hidden = torch.randn(CHUNK, HIDDEN, dtype=dtype, requires_grad=True)
    ids = torch.randint(0, VOCAB, (CHUNK,))

    def step():
        logprobs, _ = hidden_token_logprobs(hidden, head, ids, temperature, chunk_tokens=CHUNK, with_entropy=entropy)
        logprobs.sum().backward()

    def no_grad_pass():
        with torch.no_grad():
            hidden_token_logprobs(hidden, head, ids, temperature, chunk_tokens=CHUNK, with_entropy=False)

    step()  # (first calls allocate once-only workspaces)
    planned = logprob_chunk_bytes(CHUNK, VOCAB, full_logits=False, capped_logits=capped, act_bytes=dtype.itemsize)
    trained = peak_allocated(step)
    # the [c, V] tensors are the peak; the rest (hidden's gradient, [c] vectors) is under 1% of it here
    assert planned <= trained <= 1.02 * planned, (trained / (CHUNK * VOCAB), "bytes per c V")
    assert peak_allocated(no_grad_pass) <= 1.01 * planned / 2
