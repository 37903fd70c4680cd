"""The training ranks' view of the rollout ranks in --rollout_mode server: a RolloutEngine whose work is done elsewhere.

Every training rank calls generate / load_weights together (they are collectives of the training world); rank 0
speaks to the rollout ranks through the bridge (bridge.py) and hands each training rank its own completions back.
Prompts are split evenly over the rollout ranks in training-rank order, so each rollout rank gets a contiguous share.
Multi-turn episodes travel the same way and come back whole: the rollout ranks run them, tools included
(grpo/entry/serve.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Iterable, Optional

import torch

from grpo.runtime import distributed as dist_utils
from grpo.errors import TrainingError
from grpo.rollout.engine import Completion, RolloutEngine, SamplingSettings
from grpo.rollout.bridge import BridgeClosed, RolloutBridge, connect_store, layout


STOP_WAIT = timedelta(seconds=60)


@dataclass
class Ticket:
    """A request in flight; rank 0 keeps where each prompt came from and which messages carry it."""
    owners: list = field(default_factory=list)   # per prompt: (training rank, its index there)
    ranks: int = 0                               # training ranks
    bounds: list = field(default_factory=list)   # per rollout rank: its [start, end) of the prompts
    numbers: list = field(default_factory=list)  # per rollout rank: the message number of its share


class RemoteRolloutEngine(RolloutEngine):
    collective_generate = True  # every training rank must call generate, even with no prompts of its own
    runs_episodes = True        # the rollout ranks run whole episodes (see grpo/entry/serve.py)

    def __init__(self, spec: dict, rollout_ranks: int, timeout_minutes: float, images_as_decoded: bool = False):
        """`spec`: what a rollout rank needs to build its engine (see grpo/entry/serve.py's _build_engine).
        `images_as_decoded`: the engines take the decoded images only (vLLM runs its own image processor), so the
        processed pixels, several MB per image, stay here."""
        self.count = rollout_ranks
        self.takes_adapter = spec.get("lora_rank") is not None  # the rollout ranks hold the base and take adapters
        self.images_as_decoded = images_as_decoded
        self.bridge: Optional[RolloutBridge] = None
        self.idle_seconds = [0.0] * rollout_ranks  # per rollout rank: seconds it waited with nothing to generate
        if dist_utils.is_main():
            timeout = timedelta(minutes=timeout_minutes)
            self.bridge = RolloutBridge(connect_store(timeout), 0, rollout_ranks + 1, dist_utils.device(), timeout)
            self._answers(self._post_all(("start", spec)))
        dist_utils.barrier()  # no rank goes on before every rollout engine is up

    # ------------------------------------------------------------------------------------------ protocol
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSettings,
                 images: Optional[list] = None) -> list[Completion]:
        return self.collect(self.submit(prompt_token_ids, sampling, images))

    def submit(self, prompt_token_ids: list[list[int]], sampling: SamplingSettings,
               images: Optional[list] = None) -> "Ticket":
        """Post the prompts of every training rank to the rollout ranks and return at once (--async_rollout: they
        generate while this rank trains); `collect` waits for the completions."""
        if images and self.images_as_decoded:
            images = [replace(p, pixel_values=None, image_grid_thw=None) if p is not None else None for p in images]
        return self._post_shares(prompt_token_ids, images,
                                 lambda ids, pics: ("generate", (ids, sampling, pics if any(pics) else None)))

    def collect(self, ticket: "Ticket") -> list:
        """This rank's completions (or episodes) of a submitted request (all training ranks call it together)."""
        per_rank: Optional[list] = None
        if self.bridge is not None:
            per_rank = [[] for _ in range(ticket.ranks)]
            for r, ((a, _), number) in enumerate(zip(ticket.bounds, ticket.numbers)):
                reply = self._answer(r, number, whole=True)
                for c in reply["ok"]:  # prompt_index is within the share; back to the owner's numbering
                    rank, local = ticket.owners[a + c.prompt_index]
                    per_rank[rank].append(replace(c, prompt_index=local))
                self.idle_seconds[r] = max(self.idle_seconds[r], reply.get("idle_s", 0.0))
            per_rank = [(mine, list(self.idle_seconds)) for mine in per_rank]
        mine, idle = dist_utils.scatter_objects(per_rank)
        self.idle_seconds = idle  # every training rank holds the same figures (for the step's metrics)
        return mine

    def request_done(self, ticket: "Ticket") -> bool:
        """Rank 0: whether every rollout rank has answered the request (without taking the answers)."""
        return self.bridge is not None and all(self.bridge.has_reply(r, number)
                                               for r, number in enumerate(ticket.numbers))

    def mark_policy_version(self, version: int) -> None:
        """Close a sync: every rollout rank now samples with `version`'s weights, and tags its tokens so."""
        if self.bridge is not None:
            self._answers(self._post_all(("version", version)))

    def submit_episodes(self, prompts: list, sampling: SamplingSettings, limits) -> "Ticket":
        """Post every training rank's episode prompts to the rollout ranks, which run the episodes next to their
        engine (tools and environments included) and return them whole: one message per step instead of a round
        trip per turn, and with --async_rollout they run while this rank trains."""
        shipped = [replace(p, environment=None) for p in prompts]  # found again by its dataset on the rollout rank
        # a rollout rank runs the episodes of several training ranks: as many environment threads as they would have
        training_ranks_each = -(-dist_utils.world_size() // self.count)
        limits = replace(limits, environment_workers=limits.environment_workers * training_ranks_each)
        return self._post_shares(shipped, None, lambda share, _: ("episodes", (share, sampling, limits)))

    def collect_episodes(self, ticket: "Ticket") -> list:
        return self.collect(ticket)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], complete: bool = True) -> None:
        """Rank 0 sends the tensors to every rollout rank; the other ranks only take part in gathering them."""
        tensors = list(named_tensors)
        if self.bridge is None:
            return
        numbers = self._post_all(("weights", layout(tensors)))
        self.bridge.broadcast_weights(tensors)
        self._answers(numbers)

    def load_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        """Rank 0 sends the adapter (adapter bytes only) to every rollout rank, which hands it to its engine."""
        if self.bridge is None:
            return
        named = list(tensors.items())
        numbers = self._post_all(("adapter", layout(named)))
        self.bridge.broadcast_weights(named)
        self._answers(numbers)

    def close(self) -> None:
        """Stop the rollout ranks (rank 0; best effort: they also stop when rank 0's store goes away)."""
        if self.bridge is None:
            return
        bridge, self.bridge = self.bridge, None
        try:
            numbers = [bridge.send(r, ("stop", None)) for r in range(self.count)]
            for r, number in enumerate(numbers):  # a stuck rollout rank must not hold a failing job for long
                bridge.reply_of(r, number, timeout=STOP_WAIT)
        except BridgeClosed:
            pass
        finally:
            bridge.close()

    # ------------------------------------------------------------------------------------------- helpers
    def _post_shares(self, items: list, images: Optional[list], message) -> "Ticket":
        """Gather every training rank's items (prompt ids or episode prompts) on rank 0, which posts each rollout
        rank a contiguous share: `message(share, its images)`."""
        parts = dist_utils.gather_objects((items, images))
        ticket = Ticket()
        if self.bridge is not None:
            ticket.owners = [(rank, i) for rank, (part, _) in enumerate(parts) for i in range(len(part))]
            ticket.ranks = len(parts)
            flat = [item for part, _ in parts for item in part]
            pics = [im for part, part_images in parts for im in (part_images or [None] * len(part))]
            if flat:
                ticket.bounds = _even_bounds(len(flat), self.count)
                ticket.numbers = [self.bridge.send(r, message(flat[a:b], pics[a:b])) for r, (a, b) in
                                  enumerate(ticket.bounds)]
        return ticket

    def _post_all(self, message) -> list[int]:
        """The same message to every rollout rank; its numbers, in rank order."""
        return [self.bridge.send(r, message) for r in range(self.count)]

    def _answers(self, numbers: list[int]) -> list:
        return [self._answer(r, n) for r, n in enumerate(numbers)]

    def _answer(self, rollout_rank: int, number: int, whole: bool = False):
        """The rollout rank's answer to message `number` (`whole`: the reply with what comes beside the answer)."""
        try:
            reply = self.bridge.reply_of(rollout_rank, number)
        except BridgeClosed as exc:
            raise TrainingError(f"rollout rank {rollout_rank} stopped answering: {exc}") from exc
        if "error" in reply:
            raise TrainingError(reply["error"])
        return reply if whole else reply["ok"]


def _even_bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of `parts` contiguous shares of `total` items, sizes differing by at most one."""
    base, extra = divmod(total, parts)
    bounds, start = [], 0
    for p in range(parts):
        end = start + base + (1 if p < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
