"""A rollout rank's life in --rollout_mode server (the process's main, which grpo/entry/train.py runs on those ranks):
build an engine, then answer training rank 0 until it says stop.

Messages (see grpo/rollout/bridge.py): ("start", spec) once, then ("generate", (prompt ids, sampling, images)),
("episodes", (episode prompts, sampling, limits)), ("weights", layout) or ("adapter", layout) followed by the
tensors over the weight group, ("version", n) once a sync's weights are all in (the policy after n optimizer steps),
and ("stop", None). Every message gets a reply: {"ok": ...} or {"error": text}; a request's comes once it is generated
(with "idle_s": the seconds this rank has waited with nothing to generate), the others' at once. After an error the
rank only waits for the stop, so that training rank 0 can print the error before the launcher ends the job.
"""
from __future__ import annotations

import logging
import os
import socket
import time
import traceback
from datetime import timedelta
from typing import Optional

import torch

from grpo.config.cpu_sizing import size_for_cpu
from grpo.runtime.quiet_output import quiet_progress_bars
from grpo.runtime import distributed as dist_utils
from grpo.errors import ConfigError, GRPOError
from grpo.runtime.failure_watch import RankHeartbeat, note_phase
from grpo.runtime.failures import FAILURES_DIR
from grpo.runtime.roles import job_rank, rollout_index, rollout_ranks_of
from grpo.runtime.distributed import seed_everything
from grpo.rollout.bridge import BridgeClosed, RolloutBridge, connect_store
from grpo.rollout.stream import RolloutStream

logger = logging.getLogger("grpo")


def serve_rollouts(config) -> int:
    """Run this rollout rank until training rank 0 stops it; the process's exit code. The rank resolves its own copy
    of the options once, as the training ranks do (the caller's GRPOConfig stays as given), and freezes it."""
    from grpo.runtime.console_log import setup_console_logging

    setup_console_logging(is_main=False)
    config = config.thawed()
    size_for_cpu(config, on_cpu=not torch.cuda.is_available())  # the training ranks' options, as they size them
    config.freeze()  # nothing sets an option from here on
    quiet_progress_bars()  # off a terminal: no bars of weight loading in a log file
    count = rollout_ranks_of(config)
    index, rank = rollout_index(count), job_rank()  # (vLLM's launcher variables overwrite RANK later)
    timeout = timedelta(minutes=config.ddp_timeout_minutes)
    device = dist_utils.device()  # the launcher's LOCAL_RANK: its own GPU
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = connect_store(timeout)
    bridge = RolloutBridge(store, index + 1, count + 1, device, timeout)
    try:
        return _serve(bridge, config, index, count, device, rank)
    except BridgeClosed as exc:  # training rank 0 is gone (it stopped, or failed and said so itself)
        logger.error(f"rollout rank {index}: the training ranks stopped without a word ({exc})")
        return 1


def _serve(bridge: RolloutBridge, config, index: int, count: int, device: torch.device, rank: int) -> int:
    """Answer messages until the stop; the exit code."""
    return RolloutServer(bridge, config, index, count, device, rank).run()


class StopAsked(Exception):
    """The stop came while episodes were running: they end here."""


class Reported(Exception):
    """A message taken while episodes were running failed, and training rank 0 was told: the episodes end here."""


class RolloutServer:
    """One rollout rank's loop. Generation runs as a stream (grpo/rollout/stream.py): `generate` and `episodes`
    requests queue up and are answered once generated; every other message is answered at once, also while
    requests are in flight, since the rank looks for messages between two units of generation (and between two
    turns of episodes). Weights apply there; no token is sampled between a sync's first tensors and its `version`,
    which closes it."""

    def __init__(self, bridge: RolloutBridge, config, index: int, count: int, device: torch.device, rank: int):
        self.bridge, self.config, self.index, self.count, self.device, self.rank = \
            bridge, config, index, count, device, rank
        self.engine = None
        self.failure: Optional[str] = None  # the first error's text, repeated to every later message
        self.episodes = None                # what running episodes here needs (EpisodeHost)
        self.heartbeat = None               # the training ranks' failure watch sees this rank die (failure_watch)
        self.stream: Optional[RolloutStream] = None
        self.syncing = False                # a sync's weights came in, its version not yet
        self.idle = 0.0                     # seconds waited with nothing to generate, sent with every answer
        self.stopped = False

    def run(self) -> int:
        finished: list = []  # (number, answer): generated, sent once the messages that came meanwhile are taken
        while True:
            busy = self.stream is not None and self.stream.has_work and not self.failure
            message = self._next_message(wait=self.syncing or not (finished or busy))
            if message is not None:
                try:
                    self._take(*message)
                except StopAsked:
                    pass
                if self.stopped:
                    return 1 if self.failure else 0
                continue
            # a weight update the trainer sends after reading these answers cannot overtake the requests already here
            for number, answer in finished:
                self._answer(number, answer)
            finished = []
            if busy:
                try:
                    finished = self.stream.step()
                except StopAsked:  # (between two turns of episodes)
                    return 1 if self.failure else 0
                except Reported:
                    pass
                except BridgeClosed:
                    raise
                except Exception as exc:  # every request in flight gets the error
                    self._fail(exc, self.stream.unit_kind, None)

    def between_turns(self) -> None:
        """Between two turns of episodes: take what came (new requests queue, new weights apply)."""
        while True:
            message = self._next_message(wait=self.syncing)
            if message is None:
                return
            self._take(*message)
            if self.stopped:
                raise StopAsked()
            if self.failure:
                raise Reported()

    def _next_message(self, wait: bool):
        waited_from = time.perf_counter()
        message = self.bridge.receive(self.index) if wait else self.bridge.poll(self.index)
        if wait and not self.syncing:
            self.idle += time.perf_counter() - waited_from
        return message

    def _answer(self, number: int, answer) -> None:
        self.bridge.reply(self.index, number, {"ok": answer, "idle_s": self.idle})

    def _fail(self, exc: Exception, kind: str, number: Optional[int]) -> None:
        """Report the failure to training rank 0 (which stops the job with it), for this message and every request
        in flight."""
        self.failure = _failure_text(exc, kind, self.index, self.rank)
        if number is not None:
            self.bridge.reply(self.index, number, {"error": self.failure})
        if self.stream is not None:
            for request in self.stream.requests():
                self.bridge.reply(self.index, request.number, {"error": self.failure})
            self.stream.clear()

    def _take(self, payload_message, number: int) -> None:
        """One message."""
        kind, payload = payload_message
        bridge, index = self.bridge, self.index
        note_phase(kind, None)
        if self.heartbeat is None and kind == "start":  # training rank 0 has made the failures folder by now
            try:
                self.heartbeat = RankHeartbeat(os.path.join(self.config.output_dir, FAILURES_DIR), self.rank,
                                               dist_utils.node_rank(), socket.gethostname())
            except OSError as exc:  # only the watch over this rank is lost
                logger.warning(f"rollout rank {index}: no heartbeat in {self.config.output_dir} ({exc}); if this "
                               "rank dies, training rank 0 notices only at --ddp_timeout_minutes")
        if kind == "stop":
            if self.heartbeat is not None:
                self.heartbeat.stop()
            bridge.reply(index, number, {"ok": True})
            bridge.close()
            self.stopped = True
            return
        if self.failure:  # only the stop is awaited now
            for _ in bridge.receive_weights(payload) if kind in ("weights", "adapter") else ():
                pass  # (the sender's broadcast must not be left waiting)
            bridge.reply(index, number, {"error": self.failure})
            return
        try:
            if kind == "start":
                self.episodes = EpisodeHost.for_run(self.config, payload.get("episode_datasets") or [])
                self.engine = _build_engine(self.config, payload, index, self.count, self.device, self.rank)
                # with pieces (partial rollouts), episodes take updates between two turns too; without, a request
                # of episodes runs under one version, as --async_rollout always did (and the ranks of a
                # tensor-parallel engine must meet in every turn)
                turn_updates = self.config.rollout_segment_tokens > 0 and not self.engine.collective_generate
                self.stream = RolloutStream(self.engine, segment_tokens=self.config.rollout_segment_tokens,
                                            partial=self.config.partial_rollouts,
                                            between_turns=self.between_turns if turn_updates else None)
                answer = True
            elif kind in ("generate", "episodes"):  # answered once generated
                if kind == "generate":
                    prompts, sampling, images = payload
                    self.stream.add(number, prompts, sampling, images or None)
                else:
                    self.stream.add_episodes(number, lambda engine, asked=payload: self.episodes.run(engine, *asked))
                if self.engine.collective_generate:
                    # the ranks of a tensor-parallel engine meet in every generate and every weight transfer: they
                    # keep one order, the messages', by generating each request as it comes
                    for done, answer in self.stream.step():
                        self._answer(done, answer)
                return
            elif kind == "weights":
                self.syncing = True
                tensors = bridge.receive_weights(payload)
                try:
                    self.engine.load_weights(tensors)
                finally:  # take every tensor the sender broadcasts, even after a failure: it must not wait
                    for _ in tensors:
                        pass
                answer = True
            elif kind == "adapter":  # a dict: every tensor arrives before the engine swaps its adapter
                self.syncing = True
                self.engine.load_adapter(dict(bridge.receive_weights(payload)))
                answer = True
            elif kind == "version":  # the sync is whole: tokens from here on are this version's
                self.stream.mark_version(payload)
                self.syncing = False
                answer = True
            else:
                raise RuntimeError(f"unknown message {kind!r}")
            bridge.reply(index, number, {"ok": answer})
        except (BridgeClosed, StopAsked):
            raise
        except Exception as exc:
            self._fail(exc, kind, number)


def _failure_text(exc: Exception, kind: str, index: int, rank: int) -> str:
    """What training rank 0 prints for a failure here; the traceback goes to this rank's log."""
    text = str(exc) if isinstance(exc, GRPOError) else f"{type(exc).__name__}: {exc}"
    logger.error(f"rollout rank {index} failed in {kind}:\n{traceback.format_exc()}")
    return f"rollout rank {index} (job rank {rank}) failed in {kind}: {text}"


class EpisodeHost:
    """Multi-turn episodes on a rollout rank: the run's tokenizer (environment turns are rendered with it, exactly as
    the trainer would) and each episode dataset's environment, with --tool_module imported here too: tools run in
    the rollout rank's process."""

    def __init__(self, config, datasets: dict):
        from grpo.model.embedded import resolve_model_path
        from grpo.model.loading import load_tokenizer

        self.datasets = datasets
        self.tokenizer = load_tokenizer(resolve_model_path(config.model_name_or_path), config.trust_remote_code) \
            if datasets else None

    @classmethod
    def for_run(cls, config, names: list[str]) -> "EpisodeHost":
        """The host for the trainer's episode datasets `names`, found and checked here as the trainer did (before the
        engine loads: a registry or tool module on this node that differs from the trainer's fails fast)."""
        if not names:
            return cls(config, {})
        from grpo.data import load_dataset_registry
        from grpo.data.episode_datasets import run_episode_datasets

        datasets = run_episode_datasets(config, load_dataset_registry(config.dataset_config_path))
        if sorted(datasets) != sorted(names):
            raise ConfigError(f"the trainer runs dataset(s) {', '.join(names)} as episodes, but as this rollout rank "
                              f"reads {config.dataset_config_path} (and --tool_module) it would run "
                              f"{', '.join(sorted(datasets)) or 'none'}: the registry and --tool_module must be the "
                              "same on every node")
        return cls(config, datasets)

    def run(self, engine, prompts: list, sampling, limits) -> list:
        from grpo.rollout.episodes import run_episodes

        for prompt in prompts:  # environments travel by name: the dataset's
            prompt.environment = self.datasets[prompt.fields["data_source"]].environment  # checked at the start
        # a tensor-parallel engine generates with the other ranks of its group, each turn until none has episodes
        any_rank = dist_utils.any_rank if engine.collective_generate else bool
        return run_episodes(engine, self.tokenizer, prompts, sampling, limits, any_rank=any_rank)


def vllm_options(config, spec: dict, index: int) -> dict:
    """This rollout rank's vLLM engine, as training rank 0's spec says: the weights its memory plan chose
    (spec["rollout_weights"], as the loaded policy took them: "adapter" with the adapter's rank, else merged), never
    decided here again; the KV cache as given, or what --vllm_gpu_memory_utilization's share leaves (a GPU that only
    generates: --vllm_kv_cache_gib auto is refused in server mode)."""
    weights = spec["rollout_weights"]
    if (weights == "adapter") != bool(spec.get("lora_rank")):
        raise RuntimeError(f"the trainer's engine spec says weights {weights!r} with LoRA rank {spec.get('lora_rank')}")
    logger.info(f"rollout rank {index}: vLLM takes {weights} weights (the training ranks' memory plan)")
    kv_cache = config.vllm_kv_cache
    # ranks of one tensor-parallel group share a seed: they must sample the same completions
    return dict(tensor_parallel_size=config.vllm_tp, gpu_memory_utilization=config.vllm_memory_share,
                kv_cache_bytes=int(kv_cache * 2**30) if isinstance(kv_cache, float) else None,
                max_model_len=config.max_seq_length, seed=config.seed + index // config.vllm_tp,
                enable_sleep=False, enforce_eager=config.vllm_enforce_eager, stop_token_ids=spec["stop_token_ids"],
                max_images_per_prompt=spec["max_images_per_prompt"], image_token_id=spec["image_token_id"],
                lora_rank=spec["lora_rank"] if weights == "adapter" else None,
                quantized=weights == "adapter" and spec.get("quantized", False))


def _build_engine(config, spec: dict, index: int, count: int, device: torch.device, rank: int):
    """vLLM in a world of the rollout ranks (its tensor-parallel groups), or the HF engine on its own model copy."""
    from grpo.model.embedded import resolve_model_path

    model_path = resolve_model_path(config.model_name_or_path)  # this node's copy (the embedded one is converted here)
    if spec.get("model_path"):  # qlora with the adapter: training rank 0's 4-bit base
        model_path = spec["model_path"]
        if not os.path.isfile(os.path.join(model_path, "config.json")):
            raise ConfigError(f"the trainer's 4-bit base was written to {model_path}, which this rollout rank cannot "
                              "read: put --output_dir on storage every node sees, or use --rollout_weights merged")
    seed_everything(config.seed + rank)
    if config.uses_vllm:
        import torch.distributed as dist

        # vLLM's external launcher takes the process group it finds, and its rank layout from these variables
        os.environ.update(RANK=str(index), WORLD_SIZE=str(count))
        timeout = timedelta(minutes=config.ddp_timeout_minutes)
        world_store = dist.PrefixStore("grpo_rollout_world", connect_store(timeout))  # a client of its own
        dist.init_process_group("nccl", store=world_store, rank=index, world_size=count, timeout=timeout)
        from grpo.rollout.vllm import VLLMRolloutEngine

        return VLLMRolloutEngine(model_path, **vllm_options(config, spec, index))
    from grpo.model.loading import load_base_model, load_tokenizer
    from grpo.rollout.hf import HFRolloutEngine

    # the trainer's dtype, which is what its weight sync sends (see GRPOTrainer._sync_rollout_weights)
    model = load_base_model(model_path, getattr(torch, spec["dtype"]), device, config.trust_remote_code)
    model.requires_grad_(False)
    return HFRolloutEngine(model, load_tokenizer(model_path, config.trust_remote_code),
                           suppress_token_ids=spec["suppress_token_ids"], owns_model=True)
