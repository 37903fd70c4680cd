"""The plan checks itself: each phase of a step's own measured peak beside its planned peak, as `memory/<phase>_gib`
and `memory/<phase>_planned_gib` in metrics.jsonl, and a warning where a phase exceeds its plan by more than
WARN_ABOVE_PLAN; `memory/held_gib` is the most the driver saw this process hold in the step.

Held is measured as the driver sees this process (what nvidia-smi shows, vLLM's pool, the CUDA context and torch's
cached blocks included): NVML's per-process figure, polled every POLL_SECONDS by a thread while the phase runs. Where
NVML cannot name this process (a container whose PIDs the driver does not see), the GPU's used memory less what others
used when the watch started stands in; without NVML, torch's reserved peak plus the context.

A phase's own peak is that held peak less what an earlier phase left in torch's cache and this phase never used
(own_peak): torch keeps the blocks a phase freed, so without a colocated engine emptying the cache around its sleep
(server mode, the HF engine) every phase after the update would otherwise hold, and be judged by, the update's reserve.
The cache is not emptied for this (it would cost step time): at a phase's start the watch notes torch's free cache
(reserved less allocated: the carried cache) and resets torch's peak statistics; each poll's held figure is taken
less the smaller of the carried cache less the phase's growth in allocated bytes (torch's exact peak: what the phase
drew from the cache counts as its own) and the free cache at that poll (none once the cache is emptied). A phase that
starts on an empty cache (the colocated engine's) is measured as before, and one that grows past its plan, within the
carried cache or beyond it, still warns.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass, field

from grpo.memory.engine import CONTEXT_BYTES
from grpo.memory.plan import WARN_ABOVE_PLAN, MemoryPlan

logger = logging.getLogger("grpo")
GIB = 2**30
POLL_SECONDS = 0.05
FREE_GRAIN = 2**24  # polls kept per 16 MiB of torch's free cache (a long phase polls thousands of times)


def own_peak(polls: list[tuple[int, int]], carried: int, grown: int) -> int:
    """A phase's own peak (bytes): the most the driver saw the process hold at a poll, less the cache carried into the
    phase that it never used. `polls`: (held, torch's free cache) read together during the phase; `carried`: torch's
    free cache (reserved - allocated) at the phase's start; `grown`: torch's peak allocated bytes during the phase less
    those allocated at its start."""
    unused = max(0, carried - grown)
    return max((max(0, held - min(unused, free)) for held, free in polls), default=0)


def over_plan(peak: int, planned: int | None) -> bool:
    """Whether a phase's own peak goes more than WARN_ABOVE_PLAN over its planned peak."""
    return bool(planned) and peak > WARN_ABOVE_PLAN * planned


@dataclass
class PhaseReading:
    """One phase's figures as the watch reads them (bytes)."""
    allocated: int      # torch's allocated bytes at the start
    carried: int        # torch's free cache at the start: what earlier phases left cached
    polls: dict = field(default_factory=dict)  # a poll's free cache, rounded down to FREE_GRAIN -> the most held

    @property
    def held(self) -> int:
        """The most the driver saw this process hold."""
        return max(self.polls.values(), default=0)

    def note(self, held: int, free: int) -> None:
        free -= free % FREE_GRAIN  # (less free counts as more of the phase's own: a few MiB over at most)
        self.polls[free] = max(self.polls.get(free, 0), held)

    def peak(self, max_allocated: int) -> int:
        """The phase's own peak, given torch's peak allocated bytes since its start."""
        return own_peak([(held, free) for free, held in self.polls.items()], self.carried,
                        max(0, max_allocated - self.allocated))


class _Driver:
    """This process's GPU memory as the driver reports it."""

    def __init__(self, device_index: int):
        import pynvml
        import torch

        pynvml.nvmlInit()
        self._nvml = pynvml
        uuid = str(torch.cuda.get_device_properties(device_index).uuid)
        self.handle = next(h for h in (pynvml.nvmlDeviceGetHandleByIndex(i)
                                       for i in range(pynvml.nvmlDeviceGetCount()))
                           if uuid.replace("GPU-", "") in str(pynvml.nvmlDeviceGetUUID(h)))
        self.others = self.device_used() - (self.own() or 0)

    def own(self) -> int | None:
        for process in self._nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
            if process.pid == os.getpid() and process.usedGpuMemory is not None:
                return int(process.usedGpuMemory)
        return None

    def device_used(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def used(self) -> int:
        own = self.own()
        return own if own is not None else self.device_used() - self.others


class MemoryWatch:
    """Per-phase own peaks of this rank's GPU memory beside the plan's (module docstring). Inactive (every call a
    no-op) without a GPU or a plan. The CUDA reads are in phase() and _sample(); the figures go through begin(),
    note() and end(), which take numbers."""

    def __init__(self, plan: MemoryPlan | None, device):
        self.plan = plan
        self.active = plan is not None and bool(plan.budget) and getattr(device, "type", "cpu") == "cuda"
        self.peaks: dict[str, int] = {}   # phase -> its own peak (own_peak)
        self.held: dict[str, int] = {}    # phase -> the most the driver saw this process hold during it
        self._warned: set[str] = set()
        self._phase: str | None = None
        self._reading: PhaseReading | None = None
        self._lock = threading.Lock()
        self._driver = None
        if not self.active:
            return
        import torch

        self._torch = torch
        self._device = device
        try:
            self._driver = _Driver(device.index if device.index is not None else torch.cuda.current_device())
        except Exception as exc:  # noqa: BLE001 -- no NVML: torch's count stands in
            logger.info(f"memory watch: NVML unavailable ({exc}); phases measured by torch's reserved peak")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="grpo-memory-watch", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the figures (numbers in, no CUDA)
    def begin(self, name: str, reserved: int, allocated: int) -> None:
        """Phase `name` starts with torch holding `reserved` bytes, `allocated` of them in use."""
        with self._lock:
            free = max(0, reserved - allocated)
            self._reading = PhaseReading(allocated=allocated, carried=free)
            self._phase = name

    def note(self, held: int | None, reserved: int, allocated: int, reading: PhaseReading | None = None) -> None:
        """One poll: the process holds `held` bytes as the driver sees it (None: unread), torch `reserved` of which
        `allocated` are in use; into `reading` (the phase under way when the poll began), else the current one."""
        with self._lock:
            reading = reading or self._reading
            if reading is not None and held is not None:
                reading.note(held, max(0, reserved - allocated))

    def end(self, max_allocated: int) -> None:
        """The phase ends; `max_allocated`: torch's peak allocated bytes since it began."""
        with self._lock:
            name, reading = self._phase, self._reading
            self._phase = self._reading = None
            if name is not None:
                self.peaks[name] = reading.peak(max_allocated)
                self.held[name] = reading.held

    # ------------------------------------------------------------------ the CUDA glue
    def _poll(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            self._sample()

    def _sample(self) -> None:
        reading = self._reading  # a phase that ends meanwhile keeps this poll (its peak already taken)
        if reading is None:
            return
        try:
            # (the nested stats: one read, none of memory_reserved's flattening, every poll)
            stats = self._torch.cuda.memory_stats_as_nested_dict(self._device)
            reserved, allocated = stats["reserved_bytes"]["all"], stats["allocated_bytes"]["all"]
            held = self._driver.used() if self._driver is not None else reserved["peak"] + CONTEXT_BYTES
        except Exception:  # noqa: BLE001 -- a failed read is no reason to stop training
            return
        self.note(held, reserved["current"], allocated["current"], reading)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Measure the phase's own peak while the block runs, as phase `name`."""
        if not self.active:
            yield
            return
        cuda = self._torch.cuda
        if name == "rollout" and self.plan.capped and self.plan.sleep_level is not None:  # a colocated vLLM engine
            # under a cap vLLM's wake hands torch's cached blocks (the last update's) back to the driver anyway;
            # doing it first keeps them out of the rollout's peak
            cuda.empty_cache()
        cuda.reset_peak_memory_stats(self._device)
        self.begin(name, cuda.memory_reserved(self._device), cuda.memory_allocated(self._device))
        try:
            yield
        finally:
            self._sample()
            self.end(cuda.max_memory_allocated(self._device))

    def step_metrics(self) -> dict:
        """memory/<phase>_gib (its own peak) and memory/<phase>_planned_gib of the phases measured since the last call,
        and memory/held_gib (the most the driver saw held in any of them); a warning (once per phase) where a phase
        went more than WARN_ABOVE_PLAN over its plan."""
        if not self.active:
            return {}
        metrics = {}
        for name, peak in self.peaks.items():
            planned = self.plan.phases.get(name)
            metrics[f"memory/{name}_gib"] = round(peak / GIB, 3)
            if planned:
                metrics[f"memory/{name}_planned_gib"] = round(planned / GIB, 3)
            if over_plan(peak, planned) and name not in self._warned:
                self._warned.add(name)
                logger.warning(f"memory: {name} peaked at {peak / GIB:.2f} GiB, {peak / planned - 1:.0%} over its "
                               f"planned {planned / GIB:.2f} GiB (budget {self.plan.budget / GIB:.2f}); the plan "
                               "under-counts this run's shape: docs/memory.md says what to lower if it nears "
                               "the budget")
        if self.held:
            metrics["memory/held_gib"] = round(max(self.held.values()) / GIB, 3)
        self.peaks, self.held = {}, {}
        return metrics

    def close(self) -> None:
        if self.active:
            self._stop.set()
