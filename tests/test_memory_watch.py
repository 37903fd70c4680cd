"""grpo.memory.watch judges each phase by its own peak: the driver's figure less the cache an earlier phase left in
torch and this phase never used. The watch reads CUDA only in phase() and its poll; these tests give the numbers it
would read (in GiB, multiples of 1/8 so the arithmetic is exact) to begin / note / end, and check them by hand."""
from types import SimpleNamespace

import pytest
import torch

from grpo.memory import watch as watch_module
from grpo.memory.watch import FREE_GRAIN, GIB, MemoryWatch, own_peak, over_plan


def gib(x: float) -> int:
    return int(x * GIB)


@pytest.fixture
def watch(monkeypatch):
    """An active watch without CUDA (the numbers come from the test), its warnings collected in `watch.warned`."""
    plan = SimpleNamespace(budget=gib(10), capped=False, sleep_level=None,
                           phases={"rollout": gib(3), "logprobs": gib(2.25), "train": gib(6.75)})
    w = MemoryWatch(plan, torch.device("cpu"))
    assert not w.active  # no GPU: inactive, every call a no-op
    w.active = True
    w.warned = []
    monkeypatch.setattr(watch_module.logger, "warning", w.warned.append)
    return w


def run_phase(w, name, start, polls, max_allocated):
    """Phase `name`: torch (reserved, allocated) at its start, polls of (held, reserved, allocated), torch's peak."""
    w.begin(name, gib(start[0]), gib(start[1]))
    for held, reserved, allocated in polls:
        w.note(gib(held), gib(reserved), gib(allocated))
    w.end(gib(max_allocated))


# Server mode after the first update (the measured run's shape): 0.5 GiB outside torch (the context), 1 GiB of
# tensors kept, and torch's cache grown by the update to 6.75 GiB reserved, so the driver sees 7.25 GiB held and
# 5.75 GiB carried over free into the next phase.
CARRIED_START = (6.75, 1.0)


def test_carried_cache_does_not_warn(watch):
    """Log-probs allocate 0.625 GiB more at their peak (1.625), all from the carried cache: the driver still sees
    7.25 GiB. Unused carry 5.75 - 0.625 = 5.125 (a poll saw 5.25 free, more than that); own peak 7.25 - 5.125 =
    2.125 = 0.5 outside + 1.625 allocated, under the planned 2.25. Judged by the driver's figure it was 222% over."""
    run_phase(watch, "logprobs", CARRIED_START, [(7.25, 6.75, 1.5), (7.25, 6.75, 1.0)], max_allocated=1.625)
    metrics = watch.step_metrics()
    assert metrics["memory/logprobs_gib"] == 2.125
    assert metrics["memory/logprobs_planned_gib"] == 2.25
    assert metrics["memory/held_gib"] == 7.25  # what the driver saw: torch's cache included
    assert watch.warned == []


def test_growth_within_the_carried_cache_warns(watch):
    """Log-probs that allocate 3 GiB more (peak 4.0) grow the process not at all (the cache serves them), yet need
    more than planned: unused carry 5.75 - 3 = 2.75 (the poll at 3.75 allocated saw 3.0 free); own peak
    7.25 - 2.75 = 4.5 = 0.5 + 4.0, over 1.1 x 2.25 = 2.475."""
    run_phase(watch, "logprobs", CARRIED_START, [(7.25, 6.75, 3.75)], max_allocated=4.0)
    metrics = watch.step_metrics()
    assert metrics["memory/logprobs_gib"] == 4.5
    assert len(watch.warned) == 1 and "logprobs peaked at 4.50 GiB, 100% over its planned 2.25 GiB" in watch.warned[0]


def test_growth_beyond_the_carried_cache_warns(watch):
    """A phase that allocates 6.5 GiB more (peak 7.5) uses the whole carried cache and grows torch to 7.5 GiB
    reserved: nothing of the carry is unused, so its own peak is the driver's 8.0 GiB, as before this change."""
    run_phase(watch, "logprobs", CARRIED_START, [(7.25, 6.75, 2.0), (8.0, 7.5, 7.5)], max_allocated=7.5)
    metrics = watch.step_metrics()
    assert metrics["memory/logprobs_gib"] == metrics["memory/held_gib"] == 8.0
    assert len(watch.warned) == 1


def test_colocated_phase_is_measured_as_before(watch):
    """A colocated engine's phases start on an empty cache (reserved = allocated): nothing carried, so the own peak
    is the driver's polled peak, and a rollout at 3.5 GiB against 3 planned (17% over) warns, once."""
    run_phase(watch, "rollout", (1.0, 1.0), [(3.0, 1.25, 1.125), (3.5, 1.5, 1.25), (2.0, 1.25, 1.0)],
              max_allocated=1.375)
    assert watch.step_metrics() == {"memory/rollout_gib": 3.5, "memory/rollout_planned_gib": 3.0,
                                    "memory/held_gib": 3.5}
    run_phase(watch, "rollout", (1.0, 1.0), [(3.5, 1.5, 1.25)], max_allocated=1.375)
    watch.step_metrics()
    assert len(watch.warned) == 1  # once per phase


def test_cache_emptied_during_the_phase():
    """An uncapped colocated rollout after the update: 5.75 GiB carried in, emptied before the engine's wake maps
    4 GiB. The first poll's 7.25 held less its 5.75 free is 1.5; after the emptying nothing is free to subtract and
    the wake's 5.5 GiB is the phase's own."""
    polls = [(gib(7.25), gib(5.75)), (gib(1.5), 0), (gib(5.5), 0)]
    assert own_peak(polls, carried=gib(5.75), grown=0) == gib(5.5)


def test_own_peak_arithmetic():
    assert own_peak([], carried=gib(1), grown=0) == 0  # no poll read: nothing measured
    assert own_peak([(gib(4), gib(2))], carried=gib(2), grown=gib(3)) == gib(4)  # used more than the carry
    assert own_peak([(gib(4), gib(1))], carried=gib(3), grown=gib(1)) == gib(3)  # the poll saw less free than 3-1
    assert over_plan(gib(2.5), gib(2.25)) and not over_plan(gib(2.25), gib(2.25)) and not over_plan(gib(9), None)


def test_polls_keep_the_most_held_per_free_grain(watch):
    """A long phase polls thousands of times; the reading keeps one figure per FREE_GRAIN of free cache."""
    watch.begin("train", gib(6.75), gib(1.0))
    for i in range(1000):
        watch.note(gib(7.25), gib(6.75), gib(1.0) + i)  # free cache within one grain of 5.75 GiB
    assert len(watch._reading.polls) <= 2
    watch.end(gib(1.0) + 999)
    assert gib(1.5) + 999 <= watch.peaks["train"] <= gib(1.5) + FREE_GRAIN  # (rounding free down: at most a grain over)
    assert watch.held["train"] == gib(7.25)


def test_inactive_watch_is_silent():
    w = MemoryWatch(None, torch.device("cpu"))
    with w.phase("train"):
        pass
    assert w.step_metrics() == {}


class FakeCuda:
    """torch.cuda's memory figures as the glue reads them, set by the test."""

    def __init__(self, reserved, allocated):
        self.reserved, self.allocated, self.peak_allocated, self.peak_reserved = reserved, allocated, allocated, reserved

    def reset_peak_memory_stats(self, device):
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def memory_reserved(self, device):
        return self.reserved

    def memory_allocated(self, device):
        return self.allocated

    def max_memory_allocated(self, device):
        return self.peak_allocated

    def memory_stats_as_nested_dict(self, device):
        return {"reserved_bytes": {"all": {"current": self.reserved, "peak": self.peak_reserved}},
                "allocated_bytes": {"all": {"current": self.allocated, "peak": self.peak_allocated}}}


@pytest.mark.parametrize("nvml", [True, False])
def test_phase_glue_reads_the_figures(watch, nvml):
    """phase() and a poll on torch.cuda's figures: the carried-cache case above. Without NVML the held figure is torch's
    reserved peak plus the context (CONTEXT_BYTES), which the own peak carries too."""
    cuda = FakeCuda(reserved=gib(6.75), allocated=gib(1.0))
    watch._torch, watch._device = SimpleNamespace(cuda=cuda), None
    watch._driver = SimpleNamespace(used=lambda: gib(7.25)) if nvml else None
    context = gib(0.5) if nvml else watch_module.CONTEXT_BYTES
    with watch.phase("logprobs"):
        cuda.allocated = cuda.peak_allocated = gib(1.625)
        watch._sample()
        cuda.allocated = gib(1.0)
    assert watch.peaks["logprobs"] == context + gib(1.625)
    assert watch.held["logprobs"] == context + gib(6.75)
