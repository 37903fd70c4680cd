"""The plan checks itself: the measured peak of each phase of a step beside its planned peak, as `memory/<phase>_gib`
and `memory/<phase>_planned_gib` in metrics.jsonl, and a warning where a phase exceeds its plan by more than
WARN_ABOVE_PLAN.

Measured as the driver sees this process (what nvidia-smi shows, vLLM's pool, the CUDA context and torch's cached
blocks included): NVML's per-process figure, polled every POLL_SECONDS by a thread while the phase runs. Where NVML
cannot name this process (a container whose PIDs the driver does not see), the GPU's used memory less what others
used when the watch started stands in; without NVML, torch's reserved peak plus the context.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading

from grpo.memory.engine import CONTEXT_BYTES
from grpo.memory.plan import WARN_ABOVE_PLAN, MemoryPlan

logger = logging.getLogger("grpo")
GIB = 2**30
POLL_SECONDS = 0.05


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
    """Per-phase measured peaks of this rank's GPU memory beside the plan's (module docstring). Inactive (every call a
    no-op) without a GPU or a plan."""

    def __init__(self, plan: MemoryPlan | None, device):
        self.plan = plan
        self.active = plan is not None and bool(plan.budget) and getattr(device, "type", "cpu") == "cuda"
        self.peaks: dict[str, int] = {}
        self._warned: set[str] = set()
        self._phase: str | None = None
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

    def _poll(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            self._sample()

    def _sample(self) -> None:
        name = self._phase
        if name is None:
            return
        if self._driver is not None:
            try:
                used = self._driver.used()
            except Exception:  # noqa: BLE001 -- a failed read is no reason to stop training
                return
        else:
            used = self._torch.cuda.max_memory_reserved(self._device) + CONTEXT_BYTES
        self.peaks[name] = max(self.peaks.get(name, 0), used)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Measure the peak while the block runs, as phase `name`."""
        if not self.active:
            yield
            return
        if name == "rollout" and self.plan.capped and self.plan.sleep_level is not None:  # a colocated vLLM engine
            # under a cap vLLM's wake hands torch's cached blocks (the last update's) back to the driver anyway;
            # doing it first keeps them out of the rollout's peak
            self._torch.cuda.empty_cache()
        if self._driver is None:
            self._torch.cuda.reset_peak_memory_stats(self._device)
        self.peaks[name] = 0
        self._phase = name
        try:
            yield
        finally:
            self._sample()
            self._phase = None

    def step_metrics(self) -> dict:
        """memory/<phase>_gib and memory/<phase>_planned_gib of the phases measured since the last call; a warning
        (once per phase) where a phase went more than WARN_ABOVE_PLAN over its plan."""
        if not self.active:
            return {}
        metrics = {}
        for name, peak in self.peaks.items():
            planned = self.plan.phases.get(name)
            metrics[f"memory/{name}_gib"] = round(peak / GIB, 3)
            if planned:
                metrics[f"memory/{name}_planned_gib"] = round(planned / GIB, 3)
                if peak > WARN_ABOVE_PLAN * planned and name not in self._warned:
                    self._warned.add(name)
                    logger.warning(f"memory: {name} peaked at {peak / GIB:.2f} GiB, {peak / planned - 1:.0%} over its "
                                   f"planned {planned / GIB:.2f} GiB (budget {self.plan.budget / GIB:.2f}); the plan "
                                   "under-counts this run's shape: docs/memory.md says what to lower if it nears "
                                   "the budget")
        self.peaks = {}
        return metrics

    def close(self) -> None:
        if self.active:
            self._stop.set()
