"""Run train_grpo.py and print the process's peak resident memory in each phase of the run (Linux only).

    python benchmarks/phase_rss.py train_grpo.py <train_grpo.py arguments>

Each phase starts by resetting the kernel's peak-RSS mark (/proc/self/clear_refs "5") and ends by reading it
(VmHWM), so a phase's figure is the highest RSS reached while it ran, not a sampled one. Phases: model loading,
DeepSpeed set-up, the rollout engine, the micro-batch budget, then per step the rollout, the log-prob passes, the
update, the weight sync, eval and saving. run_grpo.sh runs it in place of python:
    PYTHON="python3 benchmarks/phase_rss.py" bash run_grpo.sh
(it answers run_grpo.sh's `-c` import check like python does).
"""
from __future__ import annotations

import functools
import os
import runpy
import sys

_peaks: list[tuple[str, float, float]] = []  # (phase, peak GiB during it, RSS GiB at its end)
_depth = [0]


def _status_gib(field: str) -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def measured(name: str, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if _depth[0]:  # nested in a measured phase: counted there
            return fn(*args, **kwargs)
        _depth[0] += 1
        _reset_peak()
        try:
            return fn(*args, **kwargs)
        finally:
            _depth[0] -= 1
            _peaks.append((name, _status_gib("VmHWM"), _status_gib("VmRSS")))
            print(f"[phase_rss] {name}: peak {_peaks[-1][1]:.2f} GiB, after {_peaks[-1][2]:.2f} GiB",
                  file=sys.stderr, flush=True)
    return run


def instrument() -> None:
    import grpo.train.trainer as trainer

    for module_function in ("load_policy", "load_reference", "initialize_deepspeed", "build_rollout_engine",
                            "micro_batch_token_budget"):
        setattr(trainer, module_function, measured(module_function, getattr(trainer, module_function)))
    cls = trainer.GRPOTrainer
    for method, name in (("_collect_rollouts", "rollout"), ("_policy_and_reference_logprobs", "ref log-probs"),
                         ("_optimize", "update"), ("_sync_rollout_weights", "sync"), ("evaluate", "eval"),
                         ("_save_checkpoint", "save"), ("_save_final_model", "final model")):
        setattr(cls, method, measured(name, getattr(cls, method)))


def report() -> None:
    if not _peaks:
        return
    worst: dict[str, float] = {}
    for name, peak, _ in _peaks:
        worst[name] = max(worst.get(name, 0.0), peak)
    print("[phase_rss] peak RSS by phase (GiB, highest over the run):", file=sys.stderr)
    for name, peak in worst.items():
        print(f"[phase_rss]   {name:26s} {peak:6.2f}", file=sys.stderr)
    print(f"[phase_rss] process peak {max(worst.values()):.2f} GiB", file=sys.stderr, flush=True)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "-c":  # run_grpo.sh's import check
        code = sys.argv[2]
        sys.argv = ["-c", *sys.argv[3:]]
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
        return
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    import grpo  # noqa: F401  (sets the OpenMP wait policy before torch loads, as train_grpo.py does)

    instrument()
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        report()


if __name__ == "__main__":
    main()
