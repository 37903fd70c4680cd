"""Rollouts with Hugging Face `generate` on the policy being trained (CPU, or any GPU without vLLM)."""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Iterable, Optional

import torch

from grpo.rollout.engine import Completion, RolloutEngine, SamplingSettings
from grpo.model.routing_replay import routing_shape
from grpo.rollout.routing_record import recorded_routing, sequence_routing
from grpo.runtime import distributed as dist_utils
from grpo.runtime.deepspeed_config import zero3_partitioned
from grpo.runtime.sequence_parallel import unsharded_attention


def stop_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a turn: the tokenizer's EOS plus the generation config's (e.g. <|im_end|>)."""
    ids = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (tokenizer.eos_token_id, gen_eos):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return sorted(ids)


class HFRolloutEngine(RolloutEngine):
    """Samples from the live policy module, so weights never need syncing (load_weights is a no-op), or with
    `owns_model` from a copy of its own (a rollout rank in --rollout_mode server), which load_weights overwrites.

    `max_batch_size` bounds the prompts per `generate` call (each call decodes n sequences per prompt).
    `suppress_token_ids` are never sampled; their probability mass stays in the reported log-probs (as in the
    trainer's), which is negligible for the placeholder tokens this is meant for.
    `record_routing` (a mixture of experts): each completion carries the experts its tokens were routed to
    (grpo.rollout.routing_record), for the trainer to replay.
    """

    def __init__(self, model, tokenizer, max_batch_size: int = 64, suppress_token_ids: Optional[list[int]] = None,
                 owns_model: bool = False, record_routing: bool = False):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.owns_model = owns_model
        self.record_routing = record_routing
        # ZeRO-3: each forward gathers the partitioned weights in collectives (generate runs with synced_gpus), so a
        # rank whose rollouts come from another (sequence parallelism) still generates
        self.gathers_weights = zero3_partitioned(model)
        self._by_checkpoint_name: Optional[dict] = None
        # never sampled (e.g. a VL model's image placeholder, which the scoring forward would take for an image)
        self.suppress_token_ids = list(suppress_token_ids or [])
        self.stop_ids = stop_token_ids(model, tokenizer)
        # the pad id only fills the left of short prompts (masked) and the tail of finished rows (cut off)
        fallback_pad = self.stop_ids[0] if self.stop_ids else 0
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else fallback_pad

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSettings,
                 images: Optional[list] = None) -> list[Completion]:
        """n completions per prompt, prompt by prompt, each cut after its first stop token.

        `images`: per prompt, its grpo.model.vision.PromptImages (processed pixels) or None.
        """
        if not sampling.greedy and sampling.temperature <= 0:
            raise ValueError(f"temperature must be > 0 when sampling (got {sampling.temperature}); "
                             "use greedy=True for argmax decoding")
        was_training = self.model.training
        config = getattr(self.model, "config", None)
        use_cache = getattr(config, "use_cache", True)
        self.model.eval()
        if config is not None:
            config.use_cache = True  # gradient checkpointing turns the cache off for training
        try:
            out = []
            # under sequence parallelism the model's attention is sharded over a group for training; a rank
            # generates alone, over whole sequences
            with unsharded_attention():
                starts = range(0, len(prompt_token_ids), self.max_batch_size)
                # ZeRO-3 on several ranks: a rank with fewer chunks (or no prompts) runs stand-in ones, since the
                # others' forwards wait for its share of every weight gather
                stand_ins = self._chunks_of_every_rank(len(starts)) - len(starts)
                for start in starts:
                    chunk = prompt_token_ids[start:start + self.max_batch_size]
                    chunk_images = images[start:start + self.max_batch_size] if images else None
                    out += [replace(c, prompt_index=c.prompt_index + start)
                            for c in self._generate_chunk(chunk, sampling, chunk_images)]
                for _ in range(stand_ins):
                    self._generate_chunk([[self.pad_id]], SamplingSettings(n=1, max_new_tokens=1, greedy=True))
            return out
        finally:
            if config is not None:
                config.use_cache = use_cache
            self.model.train(was_training)

    @property
    def _gathers_with_peers(self) -> bool:
        return self.gathers_weights and dist_utils.world_size() > 1

    def _chunks_of_every_rank(self, chunks: int) -> int:
        """The most generate chunks any rank has in this call (all ranks call it together under ZeRO-3)."""
        return int(dist_utils.all_max([float(chunks)])[0]) if self._gathers_with_peers else chunks

    def _generate_chunk(self, prompts: list[list[int]], sampling: SamplingSettings,
                        images: Optional[list] = None) -> list[Completion]:
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            input_ids[i, width - len(p):] = torch.tensor(p)
            attention[i, width - len(p):] = 1
        # greedy samples of one prompt are identical: decode once, repeat below
        per_prompt = 1 if sampling.greedy else sampling.n
        kwargs = dict(max_new_tokens=sampling.max_new_tokens, num_return_sequences=per_prompt,
                      eos_token_id=self.stop_ids, pad_token_id=self.pad_id, use_cache=True,
                      output_logits=sampling.logprobs, return_dict_in_generate=True)
        if self._gathers_with_peers:
            # every forward gathers ZeRO-3 partitions over all ranks: a rank whose rows all stopped keeps stepping
            # until every rank's have (transformers sets this itself only under its own DeepSpeed integration)
            kwargs["synced_gpus"] = True
        if self.suppress_token_ids:
            kwargs["suppress_tokens"] = self.suppress_token_ids
        if sampling.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        if images:  # each prompt's pixels once; generate repeats them for its num_return_sequences
            from grpo.model.vision import image_token_types, model_image_inputs

            token_id = next(p.image_token_id for p in images if p is not None)
            kwargs.update(model_image_inputs(images, range(len(prompts)), device),
                          **image_token_types(self.model, input_ids.to(device), token_id))
        with self._routing_record(len(prompts) * per_prompt) as record:
            result = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                                         **kwargs)
        columns = record.columns() if record is not None else None  # [P*n, width + steps - 1, layers, k]
        new_tokens = result.sequences[:, width:].cpu()                          # [P*n, T]
        temperature = 1.0 if sampling.greedy else sampling.temperature
        # one step at a time: the whole [P*n, T, V] logits tensor in fp32 would be large
        logprobs = torch.stack([
            torch.log_softmax(step_logits.float() / temperature, dim=-1)
            .gather(-1, new_tokens[:, t].to(step_logits.device).unsqueeze(-1)).squeeze(-1).cpu()
            for t, step_logits in enumerate(result.logits)], dim=1) if sampling.logprobs else None  # [P*n, T]
        completions = []
        stop = set(self.stop_ids)
        for row in range(new_tokens.shape[0]):
            tokens = new_tokens[row].tolist()
            end = next((i + 1 for i, t in enumerate(tokens) if t in stop), None)
            finish = "stop" if end is not None else "length"
            end = end if end is not None else len(tokens)
            row_logprobs = logprobs[row, :end].tolist() if logprobs is not None else []
            routed = None
            if columns is not None:
                prompt = len(prompts[row // per_prompt])
                routed = sequence_routing(columns, row, width - prompt, width, end)
            completions += [Completion(row // per_prompt, tokens[:end], row_logprobs, finish, routed_experts=routed)
                            for _ in range(sampling.n // per_prompt)]
        return completions

    def _routing_record(self, rows: int):
        """A context recording the routers' choices over `rows` sequences (record_routing), else a null context."""
        if not self.record_routing:
            return contextlib.nullcontext()
        return recorded_routing(self.model, rows, *routing_shape(self.model.config))

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], complete: bool = True) -> None:
        """A model of its own: copy these (checkpoint names) into it. Otherwise nothing to do: generation uses the
        trained module itself."""
        if not self.owns_model:
            for _ in named_tensors:  # consumed all the same: the sender may stream them
                pass
            return
        own = self._weights_by_checkpoint_name()
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in own:
                    raise KeyError(f"the rollout model has no weight named {name!r} (it has e.g. "
                                   f"{', '.join(list(own)[:3])})")
                if own[name].shape != tensor.shape:
                    raise ValueError(f"weight {name!r}: the rollout model's is {tuple(own[name].shape)}, the "
                                     f"trainer sent {tuple(tensor.shape)}")
                own[name].copy_(tensor)

    def _weights_by_checkpoint_name(self) -> dict:
        """The model's tensors by the checkpoint names the trainer sends (vision-language models: see
        grpo/vision.py; tied weights appear under each of their names), built on the first sync and kept: a sync
        arrives in many calls."""
        if self._by_checkpoint_name is None:
            from grpo.sync.checkpoint_layout import checkpoint_views

            self._by_checkpoint_name = checkpoint_views(self.model)
        return self._by_checkpoint_name
