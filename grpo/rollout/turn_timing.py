"""Where a multi-turn rollout's time goes, per model turn: in the engine's generate, or around it.

The trainer's own episode loop (grpo.rollout.episodes.run_episodes) and the agents' endpoint
(grpo.agents.runner.run_agent_episodes) both drive the engine through `generate`; what they spend around it (the
environment's step and the tokenization of its turns; the HTTP round-trip, the chat template's rendering, the
decoding, the agent's own code, the wait that gathers calls into one batch) is their overhead. `TimedEngine` counts the
seconds inside `generate`, `TurnTimes` adds up one step's loops, and its metrics are per model turn (a model turn: one
turn of a trainer episode, one call an agent made and the endpoint answered):

    <prefix>/turn_s             wall seconds of the loops per model turn
    <prefix>/turn_engine_s      ... of them inside engine.generate
    <prefix>/turn_overhead_s    ... around it (turn_s - turn_engine_s): what the loop itself costs
    <prefix>/engine_calls       engine.generate calls (each a batch of turns)
"""
from __future__ import annotations

import time
from dataclasses import dataclass


class TimedEngine:
    """The engine with its `generate` calls timed (seconds and count); every other attribute is the engine's."""

    def __init__(self, engine):
        self._engine = engine
        self.seconds = 0.0
        self.calls = 0

    def generate(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._engine.generate(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1

    def __getattr__(self, name):
        return getattr(self._engine, name)


@dataclass
class TurnTimes:
    """One step's multi-turn loops of one kind, added up."""
    seconds: float = 0.0         # wall seconds of the loops
    engine_seconds: float = 0.0  # of them inside engine.generate
    turns: int = 0               # model turns
    engine_calls: int = 0

    def add(self, seconds: float, engine: TimedEngine, turns: int) -> None:
        self.seconds += seconds
        self.engine_seconds += engine.seconds
        self.engine_calls += engine.calls
        self.turns += turns

    def metrics(self, prefix: str) -> dict:
        """{} when no turn was played."""
        if not self.turns:
            return {}
        return {f"{prefix}/turn_s": self.seconds / self.turns,
                f"{prefix}/turn_engine_s": self.engine_seconds / self.turns,
                f"{prefix}/turn_overhead_s": max(0.0, self.seconds - self.engine_seconds) / self.turns,
                f"{prefix}/engine_calls": float(self.engine_calls)}
