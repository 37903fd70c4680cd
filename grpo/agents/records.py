"""What the agent endpoint records of each call, and one episode's calls assembled into one training sequence.

Every call the endpoint answers is kept as a CallRecord: the exact prompt ids the engine was given, the ids it sampled
with their log-probs, the policy version that sampled them and the engine's finish reason. An episode is the chain of
its agent's calls, in the order they arrived; it becomes one sequence token-exactly, without tokenizing anything again:

    prompt_ids      the first call's prompt
    completion_ids  call 1's sampled ids, then for each later call k the ids its prompt adds after call k-1's prompt +
                    completion (tool results, user turns, the template's turn markers: the environment's), then
                    call k's sampled ids
    mask            1 on sampled ids (they enter the loss, the KL and the entropy), 0 on the environment's
    logprobs        the engine's log-prob of each sampled id, 0 on the environment's

A later call's prompt must begin with the earlier call's prompt + completion ids. One that does not (the agent edited,
dropped or reordered earlier turns, ran two calls side by side, or started a new conversation) is a mismatch: the
episode is kept up to the call before it (`on_mismatch="truncate"`) or not trained on at all (`"drop"`), and says so.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

ON_MISMATCH = ("truncate", "drop")


@dataclass
class CallRecord:
    index: int                      # the call's place in its episode, in order of arrival (0, 1, ...)
    kind: str                       # "chat" (/v1/chat/completions) | "completion" (/v1/completions)
    prompt_ids: list[int]           # exactly what the engine was given
    completion_ids: list[int]       # exactly what it sampled (the stop token included when it stopped)
    logprobs: list[float]           # the engine's log-prob of each sampled id
    finish_reason: str              # the engine's: "stop" | "length"
    policy_version: int             # the version of the policy that sampled it (the trainer's step)
    request: dict = field(default_factory=dict)   # the request's body as received
    response: dict = field(default_factory=dict)  # the body answered
    extends: Optional[int] = None   # the earlier call whose prompt + completion ids this prompt was built on (None:
                                    # rendered on its own)
    rerender_differs: bool = False  # the chat template renders the same conversation to other ids than the recorded
                                    # ones (the recorded ids were used)
    unread_tool_calls: int = 0      # tool-call blocks in the answer that could not be read (left in its content)


@dataclass
class AssembledEpisode:
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    calls_kept: int = 0             # calls whose sampled ids are in the sequence
    mismatch: Optional[str] = None  # why a call does not extend the chain (None: every call does)
    dropped: bool = False           # a mismatch with on_mismatch="drop": nothing of the episode is trained on
    finish_reason: str = ""         # the last kept call's: "stop" | "length" ("" without calls)

    @property
    def sampled_tokens(self) -> int:
        return sum(self.mask)


def assemble_calls(calls: list[CallRecord], on_mismatch: str = "truncate") -> AssembledEpisode:
    """One training sequence from an episode's calls (in order of arrival); see the module's docstring."""
    if on_mismatch not in ON_MISMATCH:
        raise ValueError(f"on_mismatch must be one of {', '.join(ON_MISMATCH)}, got {on_mismatch!r}")
    episode = AssembledEpisode()
    if not calls:
        return episode
    first = calls[0]
    episode.prompt_ids = list(first.prompt_ids)
    chain = list(first.prompt_ids)  # every id so far: the prompt, then the completion as assembled
    for call in calls:
        if call is not first:
            if call.prompt_ids[:len(chain)] != chain:
                episode.mismatch = _mismatch_text(call, chain)
                break
            inserted = call.prompt_ids[len(chain):]
            episode.completion_ids += inserted
            episode.mask += [0] * len(inserted)
            episode.logprobs += [0.0] * len(inserted)
            chain += inserted
        if len(call.logprobs) != len(call.completion_ids):
            raise ValueError(f"call {call.index}: {len(call.logprobs)} log-probs for {len(call.completion_ids)} "
                             "sampled ids")
        episode.completion_ids += call.completion_ids
        episode.mask += [1] * len(call.completion_ids)
        episode.logprobs += [float(x) for x in call.logprobs]
        chain += call.completion_ids
        episode.calls_kept += 1
        episode.finish_reason = call.finish_reason
    if episode.mismatch is not None and on_mismatch == "drop":
        return AssembledEpisode(prompt_ids=episode.prompt_ids, mismatch=episode.mismatch, dropped=True)
    return episode


def _mismatch_text(call: CallRecord, chain: list[int]) -> str:
    common = next((i for i, (a, b) in enumerate(zip(call.prompt_ids, chain)) if a != b),
                  min(len(call.prompt_ids), len(chain)))
    if len(call.prompt_ids) < len(chain) and common == len(call.prompt_ids):
        how = f"it stops at id {common}, inside the {len(chain)} ids of the calls before it"
    else:
        how = f"it differs at id {common} of {len(chain)}"
    return (f"call {call.index}'s prompt does not begin with the earlier calls' prompt and sampled ids ({how}): the "
            "agent changed the conversation it had, or started another; the calls from there on are not trained on")
