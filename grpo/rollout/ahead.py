"""The training side of streamed rollouts (server mode, --max_staleness K): the requests posted ahead of training.

Each step (each round, under dynamic sampling) takes the oldest request and posts new ones until K are ahead, so the
rollout ranks always have the next K steps' prompts to generate. Each request remembers the data position from
before its prompts were drawn: a checkpoint saves the oldest one's, so a resumed run draws every prompt not yet
trained on again (the restored policy generates them) and skips none.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional


@dataclass
class Ahead:
    pending: object                # grpo.rollout.dynamic_sampling.PendingRollouts
    position_before: tuple         # (epoch, position) before its prompts were drawn


class RequestsAhead:
    def __init__(self):
        self._queue: deque[Ahead] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, pending, position_before: tuple) -> None:
        self._queue.append(Ahead(pending, position_before))

    def pop(self):
        """The oldest request, or None."""
        return self._queue.popleft().pending if self._queue else None

    def position_before_oldest(self) -> Optional[tuple]:
        return self._queue[0].position_before if self._queue else None

    def pending(self) -> list:
        return [a.pending for a in self._queue]


def steps_to_post(ahead: int, depth: int, step: int, total_steps: int) -> int:
    """How many requests to post now: enough for `depth` ahead, none for a step past the run's last (step is the
    one being collected; the queue's requests are for the steps after it)."""
    return max(0, min(depth, total_steps - step - 1) - ahead)
