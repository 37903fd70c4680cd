"""Colocated, in-process vLLM rollout engine (tested with vllm 0.26.0 on torch 2.11).

Every training rank holds the engine in its own process: `distributed_executor_backend="external_launcher"` with
`VLLM_ENABLE_V1_MULTIPROCESSING=0`, so the model lives in this process and `load_weights` reaches it directly.

Tensor parallelism (vLLM 0.26.0, vllm/distributed/parallel_state.py `initialize_model_parallel`): vLLM joins the
training job's torch.distributed world and lays it out as ExternalDP x DP x PP x PCP x TP, so with
`tensor_parallel_size=N` ranks [0..N-1], [N..2N-1], ... form the TP groups and each group is one engine. Every rank
of a group runs the same scheduler and sampler, which only agree when the caller guarantees that
  - every rank builds the engine at the same point (the constructor runs collectives over the whole world),
  - every rank of a group passes the same `seed`, and calls generate / load_weights / sleep / wake together,
  - every rank of a group generates the same prompts: generate() gathers the group's prompts over vLLM's own TP
    group, the group generates them together, and each rank keeps the completions of its own prompts.

Sleep: level 0 keeps the weights on the GPU and frees the KV cache alone, so a sync writes only what changed (lora /
qlora: the adapted layers); grpo's default where the engine's 16-bit copy is small next to the GPU. Level 2 (KV cache
and weights dropped) otherwise: the trainer syncs after every step anyway, and with
`needs_every_weight` set the sync sends the whole policy (lora / qlora too), a copy on the GPU, where level 1
would park the weights in pinned CPU memory at every sleep and copy them back at every wake. Level 2 relies on
the model's load_weights rewriting every parameter from checkpoint tensors (callers that sync only what changed need
level 0 or 1). MLA attention's W_UK_T / W_UV, which vLLM derives from kv_b_proj at load and decodes through, are
views of kv_b_proj's bf16 weight on CUDA (vLLM 0.26, layers/attention/mla_attention.py), so rewriting kv_b_proj, by a
sync or an in-place merge, reaches them. load_weights (and weight_views, for a sync that writes the engine's tensors
in place) wakes the weights first, then overwrites them; wake() brings back the KV cache, and refuses to run on
weights that a level-2 sleep dropped and no sync has loaded since.

Adapter mode (`lora_rank` set, --rollout_weights adapter): the engine holds the base once (qlora: the trainer's own
4-bit base, `quantized`) and samples through vLLM's LoRA layers; a sync hands it the adapter alone (vllm_lora.py).
It sleeps at level 1, as the base and the LoRA slots must survive; an adapter synced while it sleeps is applied when
it wakes, so the sync moves adapter bytes only and parks nothing.

In-place mode (`merge_in_place`, lora, --rollout_weights in_place): the engine loads the 16-bit checkpoint with no
LoRA layers, the trainer's frozen base becomes views of its weights (every LoRA layer's, or the engine falls back to
merged weights of its own), and a sync hands it the adapter, which it merges into that one base when it generates and
takes out again, exactly, once the rollout's completions are in (release_base: queued on the GPU while the CPU scores
them), at the latest at its next sleep() (also with --vllm_sleep false, where sleep frees nothing) or when the
trainer runs a forward (grpo.sync.in_place_merge). So the trainer's base is its own whenever the trainer runs; the
engine samples at merged speed and the GPU holds the base once; its sleeps drop the KV cache only.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Iterable

import torch

from grpo.errors import ConfigError, TrainingError
from grpo.rollout.engine import Completion, RolloutEngine, SamplingSettings

if TYPE_CHECKING:
    from grpo.sync.shared_base import SharedBase

logger = logging.getLogger("grpo")
INSTALL_HINT = "--rollout_engine vllm needs vLLM: pip install .[vllm] (tested with vllm 0.26.0)"


def _import_vllm():
    # the engine core must run in this process (no worker subprocess), both for external_launcher's determinism
    # and so that load_weights reaches the model; vLLM reads this variable when it is imported
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        import vllm
    except ImportError as exc:
        raise ConfigError(INSTALL_HINT) from exc
    return vllm


class VLLMRolloutEngine(RolloutEngine):
    """RolloutEngine over an in-process vLLM `LLM` sharing the training GPUs (see the module docstring)."""

    def __init__(self, model_path: str, *, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.3,
                 dtype: str = "bfloat16", max_model_len: int = 2048, seed: int = 0, enable_sleep: bool = True,
                 sleep_level: int = 2, enforce_eager: bool = False, stop_token_ids: list[int] | None = None,
                 max_images_per_prompt: int = 0, image_token_id: int | None = None,
                 kv_cache_bytes: int | None = None, lora_rank: int | None = None, quantized: bool = False,
                 keep_torch_cache: bool = True, merge_in_place: bool = False, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, record_routing: bool = False):
        """`max_images_per_prompt` > 0 (with the model's `image_token_id`) serves a vision-language model: prompts
        then come with their images, passed as multi_modal_data (vLLM runs the model's own image processor).
        `sleep_level` 2 drops the weights in sleep(), so every sync must send all of them; 0 keeps them and frees
        the KV cache alone (see the module docstring).
        `kv_cache_bytes`: the KV cache's size, instead of what `gpu_memory_utilization` leaves after the weights.
        `lora_rank`: adapter mode (module docstring), for adapters of up to this rank; `quantized`: `model_path` is a
        pre-quantized bitsandbytes folder (grpo.model.quantized_checkpoint).
        `keep_torch_cache`: the blocks torch's allocator caches stay through sleep and wake where the GPU has room
        for what the wake maps beside them (False: always handed back to the driver, as under --gpu_memory_gib,
        whose cap on torch counts them).
        `merge_in_place`: in-place mode (module docstring), once share_base has made the trainer's base this
        engine's. `max_num_seqs`, `max_num_batched_tokens`: vLLM's batch limits (the memory plan's: what a card of
        the budget's size gets by default), else vLLM's defaults for this GPU.
        `record_routing` (a mixture of experts): vLLM returns the experts it routed each token to
        (`enable_return_routed_experts`; each CompletionOutput's `routed_experts`, [prompt + completion tokens - 1,
        layers, top_k], vLLM 0.26), which each completion carries for the trainer to replay."""
        if sleep_level not in (0, 1, 2):
            raise ConfigError(f"sleep_level={sleep_level}: vLLM sleeps at level 0 (weights kept on the GPU), 1 (kept "
                              "in CPU memory) or 2 (dropped)")
        vllm = _import_vllm()
        self._vllm = vllm
        self.tp = tensor_parallel_size
        # the ranks of a tensor-parallel group gather their prompts: each must call generate, with prompts or not
        self.collective_generate = tensor_parallel_size > 1
        self.max_model_len = max_model_len
        self.stop_token_ids = list(stop_token_ids or [])
        self.enable_sleep = enable_sleep
        self.takes_adapter = lora_rank is not None
        # the base is loaded once, never synced: it is kept (on the GPU, or parked in CPU memory)
        self.sleep_level = 1 if self.takes_adapter and sleep_level == 2 else sleep_level
        # read by grpo.sync.weight_sync.sync_weights: a level-2 sleep leaves nothing of the previous weights to
        # build on
        self.needs_every_weight = enable_sleep and self.sleep_level == 2
        self.weights_dropped = False  # a level-2 sleep dropped them and no load_weights has run since
        self.image_token_id = image_token_id
        self.suppress_token_ids = [image_token_id] if image_token_id is not None else []  # never sample a placeholder
        multimodal = {"limit_mm_per_prompt": {"image": max_images_per_prompt, "video": 0}} \
            if max_images_per_prompt > 0 else {}
        adapter = {}
        if self.takes_adapter:
            from grpo.rollout.vllm_lora import engine_lora_rank, lora_request

            adapter = dict(enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=engine_lora_rank(lora_rank))
            self._lora_request = lora_request()
        self._pending_adapter: dict | None = None  # synced while asleep: applied at wake
        self._in_place = None
        if merge_in_place:
            from grpo.sync.in_place_merge import InPlaceMerge

            self._in_place = InPlaceMerge()
        self.merges_in_place = False  # set by share_base once the trainer's LoRA layers view this engine's weights
        self._adapter_loaded = False
        if quantized:
            adapter["quantization"] = "bitsandbytes"
        limits = {name: value for name, value in (("max_num_seqs", max_num_seqs),
                                                  ("max_num_batched_tokens", max_num_batched_tokens)) if value}
        routing = {"enable_return_routed_experts": True} if record_routing else {}
        self.llm = vllm.LLM(
            model=model_path, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len, seed=seed,
            enable_sleep_mode=enable_sleep, enforce_eager=enforce_eager,
            # token ids in and out, so no tokenizer is needed, except by the multimodal processor of a VL model
            # (vLLM 0.26 fails in it with skip_tokenizer_init: 'NoneType' has no attribute 'convert_tokens_to_ids')
            skip_tokenizer_init=not multimodal,
            distributed_executor_backend="external_launcher",
            # log-probs after temperature, like the trainer's log_softmax(logits / T) (vllm/v1/sample/sampler.py)
            logprobs_mode="processed_logprobs", kv_cache_memory_bytes=kv_cache_bytes, **multimodal, **adapter,
            **limits, **routing)
        self._asleep: set[str] = set()  # vLLM allocation tags now released: "weights", "kv_cache"
        self._views: tuple | None = None  # (policy, its writable blocks): found once, as neither changes shape
        self.shares_base = False  # the trainer's base tensors view this engine's: it never releases its weights
        self.sleeps_kv_only = sleep_level == 0  # its sleeps free the KV cache alone (set too when it shares_base)
        self.keep_torch_cache = keep_torch_cache
        self.last_sleep_freed_bytes = 0
        self._sleeps = 0
        self._warned_top_p = False

    # -------------------------------------------------------------------------------------- generation
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSettings,
                 images: list | None = None) -> list[Completion]:
        """n completions per prompt, prompt by prompt, with their sampling log-probs and finish reasons.

        `images`: per prompt, a grpo.model.vision.PromptImages (its PIL images are what vLLM gets) or None.
        """
        too_long = [len(p) for p in prompt_token_ids if len(p) >= self.max_model_len]
        if too_long:
            raise ConfigError(f"a prompt of {max(too_long)} tokens does not fit vLLM's max_model_len "
                              f"{self.max_model_len}: raise --max_seq_length or lower --max_prompt_length")
        self._warn_top_p(sampling)
        self._merge_adapter()
        mine = list(zip(prompt_token_ids, _image_lists(images, len(prompt_token_ids))))
        prompts, offset = self._gather_group_prompts(mine)  # (token ids, PIL images or None) per prompt
        params = self._vllm.SamplingParams(
            n=sampling.n, max_tokens=sampling.max_new_tokens,
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p, logprobs=0 if sampling.logprobs else None,
            detokenize=False,
            stop_token_ids=self.stop_token_ids or None,
            logit_bias={t: -100.0 for t in self.suppress_token_ids} or None)
        requests = [self._request(ids, pil) for ids, pil in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False, **self._adapter_request())
        completions = []
        for index, request in enumerate(outputs[offset:offset + len(prompt_token_ids)]):
            for sample in sorted(request.outputs, key=lambda s: s.index):
                ids = list(sample.token_ids)
                # logprobs=0: each step holds just the sampled token's entry
                logprobs = [step[token].logprob for step, token in zip(sample.logprobs or [], ids)]
                finish = "stop" if sample.finish_reason == "stop" else "length"
                completions.append(Completion(index, ids, logprobs, finish,
                                              routed_experts=_routed_experts(getattr(sample, "routed_experts", None))))
        return completions

    def prompt_logprobs(self, token_ids: list[int], images: list | None = None) -> list[float]:
        """log p(token_t | tokens_<t) for t >= 1 under the engine's current weights, at temperature 1.

        With `images` (PIL), `token_ids` hold each image's expanded image tokens, as the trainer's do; the
        returned list then has one entry per token of the sequence vLLM expands them to (the same length).
        """
        params = self._vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        self._merge_adapter()
        out = self.llm.generate([self._request(token_ids, images)], params, use_tqdm=False,
                                **self._adapter_request())[0]
        ids = out.prompt_token_ids
        return [step[token].logprob for step, token in zip(out.prompt_logprobs[1:], ids[1:])]

    def _adapter_request(self) -> dict:
        if not (self.takes_adapter and self._adapter_loaded):  # before the first sync: the base (lora_B = 0)
            return {}
        if self._pending_adapter is not None:
            raise RuntimeError("vLLM was asked to generate before its adapter was applied: wake() first")
        return {"lora_request": self._lora_request}

    def _request(self, token_ids: list[int], images: list | None):
        """A token prompt; with images, each image's run of image tokens collapsed to one (vLLM's processor
        expands it again from the image, as the HF processor does) and the images as multi_modal_data."""
        if not images:
            return self._vllm.TokensPrompt(prompt_token_ids=token_ids)
        ids = collapse_image_tokens(token_ids, self.image_token_id)
        return self._vllm.TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": list(images)})

    def _warn_top_p(self, sampling: SamplingSettings) -> None:
        # vLLM's processed log-probs come after top-p masking, i.e. renormalised over the nucleus; the trainer's are not
        if sampling.top_p < 1.0 and not sampling.greedy and not self._warned_top_p:
            self._warned_top_p = True
            logger.warning(f"top_p={sampling.top_p}: vLLM reports log-probs renormalised over the top-p nucleus "
                           "(higher than the trainer's by -log(nucleus mass)); use top_p=1 for matching log-probs")

    # ----------------------------------------------------------------------------------------- weights
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], complete: bool = True) -> None:
        """Overwrite the engine's weights with these (HF checkpoint names), then drop its cached prefixes.
        `complete`: these tensors finish a load of every weight (grpo.sync.weight_sync.sync_weights passes False for
        all chunks but the last), so after a level-2 sleep the engine may wake again only once a whole sync has
        landed."""
        self._wake_weights()
        tensors = list(named_tensors)
        if tensors:  # the model's own load_weights maps checkpoint names onto vLLM's fused / sharded parameters
            self.llm.apply_model(lambda model: model.load_weights(tensors))
        if complete:
            self.weights_dropped = False
        self._forget_cached_prefixes()  # cached KV blocks were computed with the old weights

    def _forget_cached_prefixes(self) -> None:
        """Drop vLLM's cached KV blocks after new weights (a prompt sharing their prefix would attend to the old
        weights' keys and values); vLLM refuses while a request runs, which no sync leaves: say so, never sample on."""
        if self.llm.reset_prefix_cache() is False:
            raise TrainingError("vLLM refused to reset its prefix cache (blocks still in use): the next rollouts "
                                "would reuse keys and values of other weights, or of a released cache")

    def weight_views(self, policy) -> dict[str, torch.Tensor]:
        """Merged weights on one GPU: the engine's own blocks of the checkpoint's tensors that a sync can overwrite in
        place (grpo.sync.engine_layout.writable_blocks), its weights woken first. Empty under tensor parallelism
        (a rank holds shards; load_weights splits them), with the adapter (the base never changes), and for a
        vision-language model (vLLM renames its checkpoint's tensors; load_weights knows how). Found at the first
        sync and kept: a sleep and a wake map the engine's weights at the same addresses, so the views stay its own."""
        if self.takes_adapter or self.tp > 1 or self.image_token_id is not None:
            return {}
        self._wake_weights()
        if self._views is None or self._views[0] is not policy:
            from grpo.sync.engine_layout import writable_blocks
            from grpo.sync.weight_sync import checkpoint_shapes
            from grpo.rollout.vllm_memory import engine_model

            model = engine_model(self.llm)
            self._views = (policy, writable_blocks(model, getattr(model, "packed_modules_mapping", None) or {},
                                                   checkpoint_shapes(policy)))
        return self._views[1]

    def _wake_weights(self) -> None:
        if "weights" in self._asleep:
            from grpo.rollout.vllm_memory import lend_unmapped_to_cap
            from grpo.runtime.gpu_budget import end_engine_loan

            end_engine_loan()  # the cap counts the weights again as they are mapped back; the KV cache stays lent
            self._make_room({"weights"})
            self.llm.wake_up(tags=["weights"])  # parked weights come back before they are partly overwritten
            self._asleep.discard("weights")
            lend_unmapped_to_cap(self._asleep)

    def load_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        """Adapter mode: replace the engine's adapter by these tensors (grpo.sync.weight_sync.iter_adapter_tensors).
        While the engine sleeps they wait for wake(), so the base is not brought back for them."""
        if not self.takes_adapter:
            raise RuntimeError("this vLLM engine was started without LoRA: it takes whole weights (load_weights)")
        if self._asleep:
            self._pending_adapter = tensors
            return
        self._apply_adapter(tensors)

    def _apply_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        from grpo.rollout.vllm_lora import load_adapter_tensors

        load_adapter_tensors(self.llm, tensors)
        self._pending_adapter = None
        self._adapter_loaded = True
        self._forget_cached_prefixes()  # cached KV blocks were computed with the old adapter

    def load_merge(self, layers: list) -> None:
        """In-place mode: the adapter to merge into the shared base from now on, (weight, B, A, scale) per LoRA
        layer (grpo.sync.in_place_merge.in_place_layers); merged by the next generate."""
        if not self.merges_in_place:
            raise RuntimeError("this vLLM engine does not share its base with the trainer: it takes whole weights")
        self._in_place.unmerge()
        self._in_place.set_adapter(layers)

    def _merge_adapter(self) -> None:
        if self.merges_in_place and not self._in_place.whole:  # (an unmerge cut off halfway leaves some merged)
            self._in_place.merge()
            self._forget_cached_prefixes()  # cached KV blocks were computed with other weights

    def release_base(self) -> None:
        """In-place mode: take the adapter out of the shared base, exactly, before the trainer reads it (its
        forward calls this; so does sleep()). The next generate merges it again."""
        if self.merges_in_place and self._in_place.merged:
            self._in_place.unmerge()

    # ------------------------------------------------------------------------------------------ memory
    def share_base(self, policy, parked: dict | None = None) -> "SharedBase | None":
        """Adapter mode, one GPU per engine: the policy's frozen base tensors (qlora: its packed 4-bit weights too)
        become views of this engine's weights (grpo.sync.shared_base), so the GPU holds the base once; from then on
        a sleep drops the KV cache only. `parked`: the tensors grpo.sync.shared_base.park_frozen_base moved to CPU
        memory before this engine loaded. None where nothing can be shared (the parked tensors then go back)."""
        from grpo.sync.shared_base import lora_base_names, restore_parked, share_base_weights
        from grpo.rollout.vllm_memory import engine_model

        if not (self.takes_adapter or self._in_place is not None) or self.tp > 1:
            restore_parked(policy, parked or {})
            return None
        model = engine_model(self.llm)
        # in-place mode merges into the trainer's tensors: every LoRA layer's base must be the engine's, or none
        required = lora_base_names(policy) if self._in_place is not None else None
        result = share_base_weights(policy, model, getattr(model, "packed_modules_mapping", None), parked,
                                    required=required)
        self.shares_base = result.shared > 0
        self.merges_in_place = self._in_place is not None and self.shares_base
        if self.merges_in_place:  # its weights stay, whatever the sleep level: a sync hands over B and A alone
            self.needs_every_weight = False
        self.sleeps_kv_only = self.sleeps_kv_only or self.shares_base
        return result

    def sleep(self, keep_weights: bool = False) -> None:
        """Free the KV cache and the weights (level 2: dropped; level 1: parked in CPU memory) while the trainer
        uses the GPU. `keep_weights`: level 1 this time, for a sleep that no sync follows (after an evaluation).
        An engine at level 0, or that shares its base with the trainer, frees its KV cache only. In-place mode takes
        the adapter out of the base too, sleep or not: last, on the GPU's queue, so that the trainer's first steps on
        the CPU overlap it."""
        try:
            self._release_memory(keep_weights)
        except BaseException:
            try:
                self.release_base()
            except Exception as exc:  # (a CUDA error sticks to the context: the first one says what went wrong)
                logger.warning(f"the adapter could not be taken out of the shared base after a failed sleep: {exc}")
            raise
        self.release_base()  # (no wait: the trainer's kernels queue behind it on the same stream)

    def _release_memory(self, keep_weights: bool) -> None:
        if not self.enable_sleep or self._asleep:
            return
        level = 1 if keep_weights else self.sleep_level
        torch.cuda.synchronize()
        before = torch.cuda.mem_get_info()[0]
        # marked first: an interrupt inside llm.sleep must not leave the engine believed awake and whole
        self._asleep = {"kv_cache"} if self.sleeps_kv_only else {"weights", "kv_cache"}
        self.weights_dropped = level == 2 and not self.sleeps_kv_only
        if self.sleeps_kv_only:
            from grpo.rollout.vllm_memory import release_kv_cache

            self._forget_cached_prefixes()  # the cached blocks' contents are about to go
            release_kv_cache(empty_torch_cache=not self.keep_torch_cache)
        else:
            self.llm.sleep(level=level)
        torch.cuda.synchronize()
        self.last_sleep_freed_bytes = torch.cuda.mem_get_info()[0] - before
        from grpo.rollout.vllm_memory import lend_unmapped_to_cap

        lend_unmapped_to_cap(self._asleep)  # torch's cap still counts what the engine unmapped: lent until the wake
        self._sleeps += 1
        log = logger.info if self._sleeps == 1 else logger.debug
        log(f"vLLM asleep: {self.last_sleep_freed_bytes / 2**30:.2f} GiB GPU memory freed")

    def wake(self) -> None:
        """Take the memory back (the weights parked by a level-1 sleep if no sync woke them, then the KV cache)
        before the next rollout; weights a level-2 sleep dropped must have been synced since."""
        if self.weights_dropped:
            raise RuntimeError("vLLM's weights were dropped by its level-2 sleep and no sync has loaded them since: "
                               "call grpo.sync.weight_sync.sync_weights(engine, ...) after sleep() and before "
                               "generating")
        if self._asleep:
            from grpo.runtime.gpu_budget import end_engine_loan

            end_engine_loan()  # the cap counts the engine's memory again as it maps it back
            self._make_room(self._asleep)
            if self.sleeps_kv_only:
                from grpo.rollout.vllm_memory import restore_kv_cache

                restore_kv_cache(self.llm)
            else:
                self.llm.wake_up(tags=sorted(self._asleep, key=["weights", "kv_cache"].index))
            self._asleep = set()
        if self._pending_adapter is not None:
            self._apply_adapter(self._pending_adapter)

    def _make_room(self, tags: set[str]) -> None:
        """Before a wake: hand torch's cached blocks (the update's freed activations) back to the driver, through
        which vLLM maps its memory, unless the GPU has room for that memory beside them. Emptying the cache and
        filling it again in the next update cost about 0.1 s a step at 0.68B (benchmarks/RESULTS.md)."""
        from grpo.rollout.vllm_memory import asleep_bytes, room_beside_cache

        torch.cuda.synchronize()
        if self.keep_torch_cache and room_beside_cache(torch.cuda.mem_get_info()[0], asleep_bytes(tags)):
            return
        torch.cuda.empty_cache()

    # --------------------------------------------------------------------------- tensor-parallel groups
    def _gather_group_prompts(self, prompts: list) -> tuple[list, int]:
        """All prompts of this rank's TP group (in rank order) and where this rank's own start."""
        if self.tp == 1:
            return prompts, 0
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()  # the very group vLLM formed, so the gather matches its layout
        parts: list = [None] * group.world_size
        torch.distributed.all_gather_object(parts, prompts, group=group.cpu_group)
        return [p for part in parts for p in part], sum(len(part) for part in parts[:group.rank_in_group])



def _routed_experts(routed) -> torch.Tensor | None:
    """vLLM's routing of one sample (numpy uint8 / uint16 [tokens, layers, k], or None) as the trainer replays it."""
    if routed is None:
        return None
    from grpo.model.routing_replay import ROUTING_DTYPE

    return torch.from_numpy(routed.astype("int32", copy=False)).to(ROUTING_DTYPE)


def _image_lists(images: list | None, count: int) -> list:
    """Per prompt, its PIL images (None for a text prompt)."""
    if not images:
        return [None] * count
    return [p.images if p is not None else None for p in images]


def collapse_image_tokens(token_ids: list[int], image_token_id: int | None) -> list[int]:
    """Each run of consecutive image tokens becomes one (the placeholder the chat template wrote)."""
    if image_token_id is None:
        raise ConfigError("a prompt has images, but the vLLM engine was started without the model's image token")
    out: list[int] = []
    for token in token_ids:
        if not (token == image_token_id and out and out[-1] == image_token_id):
            out.append(token)
    return out
