"""A rollout rank's stream of work (server mode): requests queue up as training rank 0 posts them, and the engine
generates one unit at a time; between two units the rank takes whatever arrived (more requests, new weights), so
generation never waits for the trainer and weights never wait for a whole batch to drain.

A unit is, with `segment_tokens` 0, one whole request (one engine.generate call, exactly as a request was generated
before streaming). With `segment_tokens` N > 0 it is N more tokens of every sequence in flight, all requests together
(continuous batching at that granularity): new requests join at the next unit, finished sequences leave, and new
weights land between two units, in the middle of sequences (partial rollouts). A sequence continues by being
resubmitted as prompt + its tokens so far, which is how the HF engine (whose generate cannot take new weights
mid-call) and vLLM (whose prefix cache keeps the resubmitted prefix cheap) both do it. With partial = "restart" a
sequence that holds tokens of older weights starts again from its prompt instead.

Every token keeps the version of the weights that sampled it and its log-prob under them, so the trainer's rollout
correction weights each token by the policy that actually sampled it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from grpo.rollout.engine import Completion, RolloutEngine, SamplingSettings

PARTIAL_ROLLOUTS = ("continue", "restart")


@dataclass
class Sequence:
    """One completion in flight: the n-th sample of a prompt of a request."""
    prompt_index: int                 # within its request
    prompt_ids: list[int]
    image: object = None              # the prompt's processed images (vision-language models) or None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    restarts: int = 0

    def as_completion(self) -> Completion:
        return Completion(self.prompt_index, list(self.tokens), list(self.logprobs), self.finish_reason,
                          versions=list(self.versions))


@dataclass
class Request:
    """A `generate` (or `episodes`) message: its number (the reply's key) and what it asks for."""
    number: int
    sampling: SamplingSettings
    prompts: list
    images: Optional[list] = None
    episodes: Optional[tuple] = None             # (run the episodes: a callable of the engine) for an episodes message
    sequences: list[Sequence] = field(default_factory=list)  # segment mode: its completions in flight

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


class RolloutStream:
    """The requests of one rollout rank, generated unit by unit (see the module's docstring)."""

    def __init__(self, engine, segment_tokens: int = 0, partial: str = "continue",
                 between_turns: Optional[Callable[[], None]] = None):
        """`between_turns`: called before each turn of episodes (the rank takes its messages: new weights land
        between two turns); None: episodes run under one version."""
        if partial not in PARTIAL_ROLLOUTS:
            raise ValueError(f"partial must be one of {PARTIAL_ROLLOUTS}, got {partial!r}")
        self.engine = engine
        self.segment_tokens = segment_tokens
        self.partial = partial
        self.between_turns = between_turns
        self.version = 0                   # the policy version of the engine's weights (mark_version)
        self.waiting: deque[Request] = deque()  # not started, in the order they came
        self.running: list[Request] = []   # segment mode: requests with sequences in flight

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def requests(self) -> list[Request]:
        return [*self.running, *self.waiting]

    @property
    def unit_kind(self) -> str:
        """What the next unit runs (the message kind a failure in it names)."""
        head = self.waiting[0] if self.waiting else None
        return "episodes" if head is not None and head.episodes is not None and not self.running else "generate"

    def add(self, number: int, prompts: list, sampling: SamplingSettings, images: Optional[list] = None) -> None:
        self.waiting.append(Request(number, sampling, prompts, images))

    def add_episodes(self, number: int, run) -> None:
        """An episodes message: `run(engine)` plays them when they come up, turn by turn (see _episodes)."""
        self.waiting.append(Request(number, None, [], episodes=(run,)))

    def clear(self) -> None:
        self.waiting.clear()
        self.running.clear()

    def mark_version(self, version: int) -> None:
        """Every weight of a sync is in: tokens from here on are `version`'s. With partial = "restart", sequences
        begun under older weights start over."""
        self.version = version
        if self.partial == "restart":
            for request in self.running:
                for s in request.sequences:
                    if s.finish_reason is None and s.tokens:
                        s.tokens, s.logprobs, s.versions = [], [], []
                        s.restarts += 1

    def step(self) -> list[tuple[int, list]]:
        """Generate one unit; returns the requests it finished: (number, completions or episodes)."""
        head = self.waiting[0] if self.waiting else None  # (left in the queue until done: a failure reports it too)
        if head is not None and head.episodes is not None and not self.running:
            done = (head.number, self._episodes(head))
        elif self.segment_tokens <= 0:
            done = self._whole(head)
        else:
            return self._segment()
        self.waiting.popleft()
        return [done]

    # -------------------------------------------------------------------------------------------- units
    def _whole(self, request: Request) -> tuple[int, list]:
        """One request in one generate call, every token at the current version."""
        if request.episodes is not None:
            return request.number, self._episodes(request)
        completions = self.engine.generate(request.prompts, request.sampling, request.images) \
            if request.prompts or self.engine.collective_generate else []
        return request.number, [replace(c, versions=[self.version] * len(c.token_ids)) for c in completions]

    def _episodes(self, request: Request) -> list:
        """An episodes request, run whole, turn by turn; new weights may land between two turns, and each turn's
        tokens keep the version that sampled them."""
        return request.episodes[0](TurnByTurn(self))

    def _segment(self) -> list[tuple[int, list]]:
        """`segment_tokens` more tokens of every sequence in flight (requests waiting join first, up to an episodes
        request, which runs alone once the sequences ahead of it are done)."""
        while self.waiting and self.waiting[0].episodes is None:
            request = self.waiting.popleft()
            request.sequences = [Sequence(i, list(ids), request.images[i] if request.images else None)
                                 for i, ids in enumerate(request.prompts) for _ in range(request.sampling.n)]
            self.running.append(request)
        # one generate call per sampling setting and piece length: a sequence's last piece is what its budget leaves,
        # so no call asks for more than prompt + --rollout_max_new_tokens (vLLM's max_model_len)
        by_settings: dict[tuple, list[tuple[Request, Sequence]]] = {}
        for request in self.running:
            s = request.sampling
            for sequence in request.sequences:
                if sequence.finish_reason is None:
                    piece = min(self.segment_tokens, s.max_new_tokens - len(sequence.tokens))
                    key = (s.temperature, s.top_p, s.greedy, s.logprobs, piece)
                    by_settings.setdefault(key, []).append((request, sequence))
        for (temperature, top_p, greedy, logprobs, piece), rows in by_settings.items():
            self._advance(rows, SamplingSettings(n=1, max_new_tokens=piece, temperature=temperature, top_p=top_p,
                                                 greedy=greedy, logprobs=logprobs))
        done = [r for r in self.running if r.finished]
        self.running = [r for r in self.running if not r.finished]
        return [(r.number, [s.as_completion() for s in r.sequences]) for r in done]

    def _advance(self, rows: list[tuple[Request, Sequence]], sampling: SamplingSettings) -> None:
        """One generate call for these sequences (one sampling setting, one piece length): each resubmitted as prompt +
        its tokens."""
        budgets = [r.sampling.max_new_tokens - len(s.tokens) for r, s in rows]
        images = [s.image for _, s in rows] if any(s.image is not None for _, s in rows) else None
        new = self.engine.generate([s.prompt_ids + s.tokens for _, s in rows], sampling, images)
        for (request, s), budget, completion in zip(rows, budgets, new):
            taken = min(budget, len(completion.token_ids))  # a longer piece than this sequence may still take
            s.tokens += completion.token_ids[:taken]
            s.logprobs += completion.logprobs[:taken]
            s.versions += [self.version] * taken
            if completion.finish_reason == "stop" and taken == len(completion.token_ids):
                s.finish_reason = "stop"
            elif len(s.tokens) >= request.sampling.max_new_tokens:
                s.finish_reason = "length"
            elif not completion.token_ids:  # an engine that returns nothing would loop for ever
                s.finish_reason = "length"


class TurnByTurn(RolloutEngine):
    """The engine as the turns of episodes see it: before each turn the rank takes what came (the stream's
    between_turns), and each turn's tokens carry the version that sampled them."""

    def __init__(self, stream: RolloutStream):
        self.stream = stream
        self.collective_generate = stream.engine.collective_generate
        self.gathers_weights = stream.engine.gathers_weights

    def generate(self, prompt_token_ids, sampling, images=None) -> list[Completion]:
        if self.stream.between_turns is not None:
            self.stream.between_turns()
        completions = self.stream.engine.generate(prompt_token_ids, sampling, images)
        return [replace(c, versions=[self.stream.version] * len(c.token_ids)) for c in completions]
