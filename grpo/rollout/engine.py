"""The rollout-engine protocol: what the training loop asks of the HF engine (CPU, fallback), the colocated vLLM
engine and the rollout ranks of server mode (remote.py).

Engines work on token ids (plus, for vision-language models, each prompt's images); the trainer owns
tokenization, chat templates and image processing.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch


@dataclass
class SamplingSettings:
    n: int                      # completions per prompt
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    logprobs: bool = True       # return the sampled tokens' log-probs (vLLM computes them only when asked)


@dataclass
class Completion:
    prompt_index: int           # which prompt of the generate() call this completes
    token_ids: list[int]        # includes the stop token when finish_reason == "stop"
    logprobs: list[float]       # log-prob of each token under softmax(logits / temperature), no top-p renormalising;
                                # empty when the sampling settings did not ask for them
    finish_reason: str          # "stop" | "length"
    # a multi-turn episode's (grpo.rollout.episodes): 1 on the model's tokens, 0 on the environment's (out of the
    # loss); None: every token is the model's
    mask: Optional[list[int]] = None
    # the experts each MoE layer routed each token to (engines asked to record them): [prompt + completion tokens - 1,
    # layers, top_k] int, -1 where a layer routes nothing (the last token is never routed: no forward reads it)
    routed_experts: Optional[torch.Tensor] = None
    # per token, the policy version (optimizer steps) whose weights sampled it; None where the engine keeps no count
    # (colocated engines always sample the policy being trained); server mode's stream fills it (stream.py)
    versions: Optional[list[int]] = None


@dataclass
class DeferredRequest:
    """What `submit` returns for an engine that generates only when collected (every colocated engine)."""
    prompt_token_ids: list[list[int]]
    sampling: SamplingSettings
    images: Optional[list] = None


class RolloutEngine(ABC):
    """Every method and attribute the training loop uses. HF, vLLM and remote (server-mode) engines subclass it;
    the defaults fit an engine that samples the live policy module and holds no memory of its own."""

    collective_generate: bool = False  # every rank must call generate together (tensor parallel, server mode)
    gathers_weights: bool = False      # its forward gathers ZeRO-3 partitions (HF engine): no rank may skip generate
    needs_every_weight: bool = False   # its sleep drops the weights: a sync then sends every weight, not a delta
    weights_dropped: bool = False      # such a sleep happened and no complete load_weights has followed
    last_sleep_freed_bytes: Optional[int] = None  # GPU memory the last sleep gave back (None: it never sleeps)
    takes_adapter: bool = False        # holds the base once and takes the LoRA adapter as adapter tensors
    sleeps_kv_only: bool = False       # its sleeps free the KV cache alone: its weights stay on the GPU
    merges_in_place: bool = False      # lora: merges the adapter into the base it shares with the trainer for a
                                       # rollout and takes it out before the trainer runs (release_base)
    runs_episodes: bool = False        # runs whole multi-turn episodes where it generates (server mode: on the
                                       # rollout ranks); otherwise the collector runs them turn by turn through generate
    idle_seconds: Sequence[float] = ()  # per rollout rank (server mode): seconds it waited with nothing to generate

    @property
    def generates_in_step(self) -> bool:
        """Every rank must call generate as often as the others, with no prompts of its own too (the engine then
        takes part in the collectives alone): a collective engine, or one whose forward gathers weights."""
        return self.collective_generate or self.gathers_weights

    @abstractmethod
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSettings,
                 images: Optional[list] = None) -> list[Completion]:
        """Completions ordered prompt by prompt: prompt 0's n completions, then prompt 1's, ...

        `images` (vision-language models): per prompt, a grpo.model.vision.PromptImages or None (a text prompt).
        """

    def submit(self, prompt_token_ids: list[list[int]], sampling: SamplingSettings,
               images: Optional[list] = None):
        """Ask for completions and return a ticket at once; `collect(ticket)` returns them. An engine elsewhere
        (server mode) starts generating now; a colocated one generates when collected."""
        return DeferredRequest(prompt_token_ids, sampling, images)

    def collect(self, ticket) -> list[Completion]:
        """The completions of a `submit`, as `generate` returns them."""
        return self.generate(ticket.prompt_token_ids, ticket.sampling, ticket.images)

    def submit_episodes(self, prompts: list, sampling: SamplingSettings, limits) -> object:
        """Start `sampling.n` multi-turn episodes per prompt (grpo.rollout.episodes.EpisodePrompt; the engine finds
        each one's environment by its dataset, `fields["data_source"]`) under `limits` (EpisodeLimits), and return a
        ticket at once; `collect_episodes(ticket)` returns the Episodes, ordered as run_episodes orders them.
        Engines with `runs_episodes` only."""
        raise NotImplementedError(f"{type(self).__name__} generates turn by turn; the collector runs its episodes")

    def collect_episodes(self, ticket) -> list:
        """The episodes of a `submit_episodes` (every rank calls it when generate is collective)."""
        raise NotImplementedError(f"{type(self).__name__} generates turn by turn; the collector runs its episodes")

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], complete: bool = True) -> None:
        """Replace the engine's weights by these (HF checkpoint names). `complete`: the last chunk of a load of every
        weight (an engine that dropped its weights may wake only then); a partial sync passes False until then."""
        raise NotImplementedError(f"{type(self).__name__} samples the live policy and holds no weights to load")

    def weight_views(self, policy) -> dict[str, torch.Tensor]:
        """checkpoint name -> the engine's own tensor that holds exactly that weight of `policy` (the module being
        trained), for a sync that writes there in place; the sync then ends with a load_weights call of the rest
        (maybe empty). Empty for an engine whose weights are not this process's to write (the default)."""
        return {}

    def load_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replace the engine's LoRA adapter by these tensors: peft names (`base_model.model.<module>.lora_A.weight`,
        `...lora_B.weight`), lora_B already multiplied by the layer's scaling. Engines with `takes_adapter` only."""
        raise NotImplementedError(f"{type(self).__name__} takes whole weights, not an adapter")

    def load_merge(self, layers: list) -> None:
        """The LoRA layers' (base weight, B, A, scale) to merge into the shared base for the next rollouts. Engines
        with `merges_in_place` only."""
        raise NotImplementedError(f"{type(self).__name__} does not merge an adapter in place")

    def release_base(self) -> None:
        """The trainer is about to read its base weights: an engine that merged an adapter into them takes it out."""

    def sleep(self, keep_weights: bool = False) -> None:
        """Release memory while the trainer runs; `keep_weights`: no sync follows, so the weights must survive."""

    def wake(self) -> None:
        """Take memory back before the next rollout."""

    def request_done(self, ticket) -> bool:
        """Whether a submitted request is generated already (server mode asks its rollout ranks; a colocated engine
        generates on collection: never)."""
        return False

    def mark_policy_version(self, version: int) -> None:
        """The weights just loaded (every load_weights / load_adapter call of one sync) are the policy after `version`
        optimizer steps: tokens sampled from here on carry it. An engine that keeps no count ignores it."""

    def close(self) -> None:
        """Release the engine for good (server mode: stop the rollout ranks)."""
