"""Failures in the training loop: one message naming step, phase and rank; the traceback in train.log.

Each phase method of the trainer is decorated with `@phase("rewards")`. An exception raised there becomes a
`StepFailure` (a TrainingError) whose message names the step and the phase: `step 2 (rewards): ...`.

With several ranks, the rank that fails first (the "primary" failure) writes `output_dir/failures/rank<R>.json`
(rank, step, phase, error, traceback) and then tears down its process group, so the other ranks, blocked in a
collective, fail at once (gloo) or at --ddp_timeout_minutes (NCCL) instead of hanging. A rank whose own error
looks like such a broken collective reads the records and reports the failing rank's error instead of its own:
every rank ends with the same line, `rank 1 failed at step 2 (rewards): ...`. A rank that died without a record
(killed, out of host memory) is found by its pid file (`failures/rank<R>.pid`, by a rank of its own node), which
then writes the record in its stead, or by its heartbeat going silent (failure_watch.py, any node). With several nodes
a rank is named with its node: `rank 3 (node 1, host gpu-b) failed at step 2 (rewards): ...`; the records live in
--output_dir, which every node sees (shared_output.py checks it at the start).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import socket
import threading
import time
import traceback
from typing import Optional

from grpo.runtime import distributed as dist_utils
from grpo.runtime.failure_watch import BEAT_S, FailureWatch, note_phase
from grpo.config.strategy import Strategy
from grpo.errors import GRPOError, TrainingError

logger = logging.getLogger("grpo")
FAILURES_DIR = "failures"
PEER_WAIT_S = 10.0  # how long a rank with a broken collective waits for the failing rank's record


class StepFailure(TrainingError):
    """A failure already reported (message names step, phase and, with several ranks, the rank)."""


def phase(name: str, after_step: bool = False, passes: tuple = ()):
    """Decorate a trainer method: its exceptions become a StepFailure naming the step and this phase.

    The decorated object needs `self.failures` (a FailureReporter) and `self.state.step` (steps completed);
    phases run after the step counter moved on (eval, save) pass after_step=True. Exceptions of the `passes`
    types (deliberate stops whose message says it all) go through unchanged. On an object without `failures` (a
    part the trainer calls, e.g. the rollout collector) the exception only records the phase, innermost first, and
    the trainer's own phase reports it under that name.
    """
    def wrap(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            state = getattr(self, "state", None)
            step = state.step + (0 if after_step else 1) if hasattr(state, "step") else None
            left = note_phase(name, step)  # what a peer says of this rank should it die here
            try:
                return method(self, *args, **kwargs)
            except Exception as exc:
                if not hasattr(exc, "grpo_phase"):
                    try:
                        exc.grpo_phase = name  # the innermost phase names the failure
                    except AttributeError:  # an exception type without attributes keeps the outer name
                        pass
                if isinstance(exc, (StepFailure, *passes)) or getattr(self, "failures", None) is None:
                    raise
                step = self.state.step + (0 if after_step else 1)
                where = getattr(exc, "grpo_phase", name)
                if _is_out_of_memory(exc):
                    sizes = self.memory_sizes() if hasattr(self, "memory_sizes") else {}
                    settings = self.memory_settings() if hasattr(self, "memory_settings") else {}
                    exc_ = OutOfMemory(out_of_memory_message(where, sizes, self.state.last_checkpoint, exc, settings))
                    _log_traceback_to_file(f"step {step} ({where}): out of memory", exc)  # the allocator's detail
                    raise self.failures.report(exc_, step, where) from exc
                raise self.failures.report(exc, step, where) from exc
            finally:
                note_phase(*left)
        return run
    return wrap


class OutOfMemory(TrainingError):
    """The GPU ran out of memory; the message names the sizes involved and the flags that help."""


# what helps, per phase: the flags worth trying first
_OOM_KNOBS = {
    "rollout": ["--vllm_kv_cache_gib (a number of GiB: vLLM's KV cache; auto sizes it to the step)",
                "--vllm_gpu_memory_utilization (lower leaves more for training, higher more KV cache for vLLM)",
                "fewer --per_device_train_batch_size prompts or --k_samples", "--rollout_max_new_tokens"],
    "log-probs": ["--max_tokens_per_micro_batch (lower)", "--logprob_chunk_tokens (lower)",
                  "--vllm_gpu_memory_utilization (lower, with --vllm_sleep)"],
    "optimize": ["--max_tokens_per_micro_batch (lower)", "--gradient_checkpointing true",
                 "--logprob_chunk_tokens (lower)", "--vllm_gpu_memory_utilization (lower, with --vllm_sleep)",
                 "--deepspeed zero3 (several GPUs) or --tuning_strategy lora / qlora"],
}


def _knobs_for(phase_name: str, settings: dict) -> list[str]:
    knobs = list(_OOM_KNOBS.get(phase_name, _OOM_KNOBS["optimize"]))
    if settings.get("checkpointing"):
        knobs = [k for k in knobs if not k.startswith("--gradient_checkpointing")]
    strategy = Strategy.read(settings.get("strategy"))
    if strategy is not None and strategy.has_adapter:
        knobs = [k.replace(" or --tuning_strategy lora / qlora", "") for k in knobs]
    if settings.get("engine_keeps_weights") and phase_name != "rollout":
        knobs.insert(1, "--vllm_sleep_level 2 (vLLM's 16-bit weights leave the GPU while the trainer runs)")
        if strategy.sixteen_bit_adapter:
            knobs.insert(1, "--rollout_weights in_place (vLLM and the trainer share one 16-bit base)")
    return knobs


def _is_out_of_memory(exc: BaseException) -> bool:
    import torch

    kinds = tuple(k for k in (getattr(torch, "OutOfMemoryError", None),
                              getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)) if k is not None)
    return isinstance(exc, kinds) or (isinstance(exc, RuntimeError) and "CUDA out of memory" in str(exc))


def out_of_memory_message(phase_name: str, sizes: dict, last_checkpoint: Optional[str], exc: BaseException,
                          settings: Optional[dict] = None) -> str:
    """One paragraph: what ran out, with which sizes, what to change, and where to resume from. `settings`: what the
    run already does (`checkpointing`, `strategy`, `engine_keeps_weights`: a merged vLLM engine that keeps its 16-bit
    weights through training), so that only what it does not do is suggested."""
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    detail = first_line.split(". ")[0] if first_line else "CUDA out of memory"
    knobs = _knobs_for(phase_name, settings or {})
    size_text = ", ".join(f"{key} {value}" for key, value in sizes.items()) or "sizes unknown"
    resume = (f"the last checkpoint is {last_checkpoint} (continue with --resume_from_checkpoint latest)"
              if last_checkpoint else "no checkpoint was saved yet")
    return (f"out of GPU memory ({detail}) with {size_text}. What helps: {'; '.join(knobs)}. Then {resume}.")


class FailureReporter:
    """Turns an exception into one clear message and tells the other ranks about it. Collective to create."""

    def __init__(self, output_dir: str, rank: int, world: int, rollout_ranks: int = 0):
        """`rollout_ranks`: server mode's rollout ranks, the job's ranks `world` .. `world + rollout_ranks - 1`,
        which beat too (failure_watch.RankHeartbeat) and are watched like training ranks."""
        self.rank, self.world = rank, world
        self.peers = list(range(world + rollout_ranks))  # every rank watched, by its job rank
        self.output_dir = output_dir
        self.folder = os.path.join(output_dir, FAILURES_DIR)
        self.node, self.host = dist_utils.node_rank(), socket.gethostname()
        self.several_nodes = dist_utils.node_count() > 1
        self.watch: Optional[FailureWatch] = None
        if len(self.peers) > 1:
            if rank == 0:  # records of an earlier run in this output_dir are stale
                shutil.rmtree(self.folder, ignore_errors=True)
                os.makedirs(self.folder, exist_ok=True)
            if world > 1:
                dist_utils.barrier()
            _write_json(os.path.join(self.folder, f"rank{rank}.pid"), {"pid": os.getpid(), "host": self.host,
                                                                       "node": self.node})
            self.watch = FailureWatch(self)
            self.watch.start()

    def close(self) -> None:
        """Training ended on every rank (or this process stops): the watch over the other ranks ends."""
        if self.watch is not None:
            self.watch.stop()
            self.watch = None

    def label(self, rank: int, node: Optional[int] = None, host: Optional[str] = None,
              pid: Optional[int] = None) -> str:
        """"rank 3 (node 1, host gpu-b)" with several nodes, "rank 3" on one; the pid when given."""
        parts = [dist_utils.node_label(node, host)] if self.several_nodes else []
        parts += [f"pid {pid}"] if pid is not None else []
        if rank >= self.world:  # a rollout rank: named as its own messages name it
            return f"rollout rank {rank - self.world} (job rank {rank}{''.join(', ' + p for p in parts)})"
        return f"rank {rank}" + (f" ({', '.join(parts)})" if parts else "")

    # ------------------------------------------------------------------------------------------------
    def report(self, exc: Exception, step: int, phase_name: str) -> StepFailure:
        """The StepFailure to raise for `exc`; writes this rank's record and breaks the collectives (primary)."""
        _log_traceback_to_file(f"rank {self.rank}, step {step} ({phase_name}) failed", exc)
        if len(self.peers) > 1:
            peer = self._peer_failure(wait=_looks_like_broken_collective(exc))
            if peer is not None:  # another rank failed first; our error is the consequence
                self._write_record(step, phase_name, exc, primary=False)
                # said at once: the launcher may stop this rank before its caller prints anything
                logger.error(f"{self.label(self.rank)} stopped: {peer}")
                return StepFailure(peer)
        message = self._message(step, phase_name, exc)
        if len(self.peers) > 1:
            self._write_record(step, phase_name, exc, primary=True, message=message)
            if self.world > 1:
                self._break_collectives()
        return StepFailure(message)

    def raise_if_peer_failed(self) -> None:
        """Raise the failing rank's StepFailure when another rank failed or died (e.g. on the launcher's SIGTERM)."""
        if len(self.peers) > 1:
            peer = self._peer_failure(wait=False)
            if peer is not None:
                raise StepFailure(peer)

    # ------------------------------------------------------------------------------------------------
    def _message(self, step: int, phase_name: str, exc: Exception) -> str:
        where = f"step {step} ({phase_name})"
        if self.world > 1:
            where = f"{self.label(self.rank)} failed at {where}"
        if isinstance(exc, GRPOError):
            return f"{where}: {exc}"
        log = os.path.join(self.output_dir, "train.log") if self.rank == 0 else \
            os.path.join(self.folder, f"rank{self.rank}.json")
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"{where}: {type(exc).__name__}: {first_line} (traceback in {log})"

    def _write_record(self, step, phase_name, exc, primary: bool, message: Optional[str] = None) -> None:
        os.makedirs(self.folder, exist_ok=True)
        _write_json(os.path.join(self.folder, f"rank{self.rank}.json"), {
            "rank": self.rank, "node": self.node, "host": self.host, "step": step, "phase": phase_name,
            "primary": primary, "time": time.time(),
            "error": f"{type(exc).__name__}: {exc}", "message": message,
            "traceback": "".join(traceback.format_exception(exc))})

    def _records(self) -> list[dict]:
        out = []
        for r in self.peers:
            path = os.path.join(self.folder, f"rank{r}.json")
            if r != self.rank and os.path.isfile(path):
                try:
                    with open(path) as fh:
                        out.append(json.load(fh))
                except (OSError, ValueError):  # being written right now
                    continue
        return out

    def _peer_failure(self, wait: bool) -> Optional[str]:
        """The first primary failure of another rank, or a rank that died without one; with `wait` (this rank's
        collective broke), poll a while, then name a rank that fell silent meanwhile (on another node)."""
        start = time.monotonic()
        deadline = start + (PEER_WAIT_S if wait else 0.0)
        while True:
            first = self.first_primary()
            if first is not None:
                if self.rank == 0 and first.get("traceback"):
                    _log_file_only(f"rank {first['rank']} traceback:\n{first['traceback']}")
                return first["message"]
            dead = self.dead_peer()  # a failing rank writes its record before it exits: no record means killed
            if dead or time.monotonic() >= deadline:
                if dead is None and wait and self.watch is not None:  # (a beat may be read a few beats late)
                    dead = self.silent_peer(max(time.monotonic() - start - 3 * BEAT_S, 3 * BEAT_S))
                return dead
            time.sleep(0.2)

    def first_primary(self) -> Optional[dict]:
        """The earliest record of another rank that failed on its own (or was found dead)."""
        primary = sorted((r for r in self._records() if r.get("primary")), key=lambda r: r["time"])
        return primary[0] if primary else None

    def _pid_files(self) -> dict:
        """Per other rank: its pid file's contents (pid, host, node)."""
        out = {}
        for r in self.peers:
            path = os.path.join(self.folder, f"rank{r}.pid")
            if r == self.rank or not os.path.isfile(path):
                continue
            try:
                with open(path) as fh:
                    out[r] = json.load(fh)
            except (OSError, ValueError):
                continue
        return out

    def dead_peer(self) -> Optional[str]:
        """A rank of this node whose process is gone without a record: killed (signal, out of memory). Its record is
        written here in its stead, so that the other nodes, which cannot see its process, read what happened."""
        for r, info in self._pid_files().items():
            same_node = info.get("host") == self.host and info.get("node", 0) == self.node
            if same_node and not _alive(info["pid"]) and not self._has_record(r):
                where = _progress_text(self.watch.progress_of(r) if self.watch else None)
                message = (f"{self.label(r, info.get('node'), info.get('host'), info['pid'])} died without reporting "
                           f"an error{where}: it was killed by a signal or ran out of host memory (look for the OOM "
                           f"killer in `dmesg` on {info.get('host')})")
                self.record_for(r, message, info)
                return message
        return None

    def silent_peer(self, seconds: float) -> Optional[str]:
        """A rank (any node) whose heartbeat has not moved for `seconds`: dead, or its node lost. Recorded here."""
        for r, silent in self.watch.silent_ranks(seconds):
            if self._has_record(r):
                continue
            info = self._pid_files().get(r, {})
            where = _progress_text(self.watch.progress_of(r))
            message = (f"{self.label(r, info.get('node'), info.get('host'))} stopped without reporting an "
                       f"error{where}: no sign of life for {silent:.0f} s; it was killed, ran out of host memory, or "
                       f"its node or the network to it went down (that node's launcher output says which)")
            self.record_for(r, message, info)
            return message
        return None

    def _has_record(self, rank: int) -> bool:
        return os.path.isfile(os.path.join(self.folder, f"rank{rank}.json"))

    def record_for(self, rank: int, message: str, info: dict) -> None:
        """A primary record for `rank`, written by a witness of its death."""
        progress = (self.watch.progress_of(rank) if self.watch else None) or {}
        _write_json(os.path.join(self.folder, f"rank{rank}.json"), {
            "rank": rank, "node": info.get("node"), "host": info.get("host"), "step": progress.get("step"),
            "phase": progress.get("phase"), "primary": True, "time": time.time(), "error": "died",
            "message": message, "traceback": None, "witness": self.rank})

    def _break_collectives(self) -> None:
        """Tear down this rank's process group so that ranks waiting in a collective for it fail now."""
        import torch.distributed as dist

        try:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        except Exception as exc:  # tearing down is best effort: the error being reported matters more
            logger.debug(f"destroying the process group failed: {exc}")


def _progress_text(progress: Optional[dict]) -> str:
    """" at step 2 (rewards)": where a rank was when last heard of (its heartbeat), or nothing."""
    if not progress or progress.get("step") is None:  # a rollout rank counts no steps: the message it was on
        return f" while answering '{progress['phase']}'" if progress and progress.get("phase") else ""
    return f" at step {progress['step']} ({progress.get('phase') or 'unknown phase'})"


def _looks_like_broken_collective(exc: BaseException) -> bool:
    """Errors a rank sees when a peer vanished: not our own, typed errors; communication / timeout ones."""
    if isinstance(exc, GRPOError):
        return False
    text = f"{type(exc).__name__} {exc}".lower()
    return isinstance(exc, (RuntimeError, ConnectionError, TimeoutError)) and any(
        word in text for word in ("gloo", "nccl", "connection", "closed", "timeout", "timed out", "peer", "socket",
                                  "broken pipe", "process group", "distbackend", "aborted"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_json(path: str, value: dict) -> None:
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"  # two writers of one record never share a temp file
    with open(tmp, "w") as fh:
        json.dump(value, fh, indent=1)
    os.replace(tmp, path)


def _log_file_only(text: str) -> None:
    """Write to train.log (the logger's file handler) without printing on the console."""
    record = logger.makeRecord(logger.name, logging.ERROR, __file__, 0, text, None, None)
    for handler in logger.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _log_traceback_to_file(headline: str, exc: BaseException) -> None:
    _log_file_only(headline + ":\n" + "".join(traceback.format_exception(exc)).rstrip())
