"""A thread on every rank (with several ranks) that keeps the job from outliving a failure on another node.

A rank blocked in an NCCL collective for a peer that died waits for --ddp_timeout_minutes, and a rank on another node
cannot see that peer's process. So each rank
  - beats: writes `failures/rank<R>.alive` (a counter, and the step and phase it is in) every BEAT_S seconds and on
    every phase change, so that the others know where it was when it went silent;
  - watches: a failure record of another rank (failures.py), a rank of its own node whose process is gone (it writes
    the record in its stead, for the other nodes), or a rank whose heartbeat stood still for STALE_S seconds (any
    node; the record again). Seen one, it gives the main thread GRACE_S seconds to stop with that message on its
    own (gloo ranks do, their collective fails at once), then logs the message and ends the process: every node
    stops within about STALE_S + GRACE_S seconds of a death, and within GRACE_S of a reported error.
Silence is measured on this rank's own clock (when the counter last changed), so clocks of the nodes need not agree.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Optional

logger = logging.getLogger("grpo")
BEAT_S = 1.0
STALE_S = 60.0   # a heartbeat still for this long: the rank is gone (a shared file system may lag a few seconds)
GRACE_S = 10.0   # the main thread's time to report a failure itself before the watch ends the process
STOPPED = "stopped"  # the last phase of a rank that ended as asked (RankHeartbeat.stop)

_progress = {"phase": None, "step": None}
_active: Optional["FailureWatch"] = None


def note_phase(phase: Optional[str], step: Optional[int]) -> tuple:
    """This rank entered `phase` of `step` (None keeps the step); returns what it was in before, to restore."""
    before = (_progress["phase"], _progress["step"])
    _progress["phase"] = phase
    if step is not None:
        _progress["step"] = step
    if _active is not None:
        if phase is not None and phase != before[0]:
            try:
                _active.beat()  # now: a rank killed in this phase must be known to have been in it
            except OSError:  # the watch's next beat will say it
                pass
        _active.wake.set()
    return before


def last_progress() -> dict:
    return dict(_progress)


class FailureWatch:
    """See the module's docstring. `reporter`: the rank's failures.FailureReporter (its folder, its checks)."""

    def __init__(self, reporter):
        self.reporter = reporter
        self.wake = threading.Event()
        self._stopped = False
        self._beats = 0
        self._started = time.monotonic()
        self._seen: dict = {}      # rank -> (its last counter, when it changed here, its progress)
        self._failure: Optional[tuple] = None  # (message, when seen)
        self._thread = threading.Thread(target=self._run, name="grpo-failure-watch", daemon=True)
        self._lock = threading.Lock()
        self._beat_lock = threading.Lock()  # the main thread beats on a phase change, the watch every BEAT_S

    def start(self) -> None:
        global _active
        _active = self
        self.beat()
        self._thread.start()

    def stop(self) -> None:
        global _active
        self._stopped = True
        self.wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if _active is self:
            _active = None

    # --------------------------------------------------------------------------------------------
    def progress_of(self, rank: int) -> Optional[dict]:
        """Where `rank` was when it last beat (its step and phase), read now: its last beat may be newer than ours."""
        try:
            with open(os.path.join(self.reporter.folder, f"rank{rank}.alive")) as fh:
                info = json.load(fh)
            return {"step": info.get("step"), "phase": info.get("phase")}
        except (OSError, ValueError):
            with self._lock:
                seen = self._seen.get(rank)
            return seen[2] if seen else None

    def silent_ranks(self, seconds: float) -> list[tuple[int, float]]:
        """Other ranks whose heartbeat has not moved for `seconds` or more, longest silent first."""
        now = time.monotonic()
        with self._lock:
            # a rollout rank beats from its first message on (after the trainer's model has loaded, which may take
            # long), and says "stopped" when training rank 0 stops it: silence counts only between the two
            quiet = [(r, now - self._seen.get(r, (None, self._started, None))[1])
                     for r in self.reporter.peers if r != self.reporter.rank
                     and (r < self.reporter.world or (r in self._seen and self._seen[r][2].get("phase") != STOPPED))]
        return sorted([(r, s) for r, s in quiet if s >= seconds], key=lambda item: -item[1])

    # --------------------------------------------------------------------------------------------
    def _run(self) -> None:
        last_look = 0.0
        while not self._stopped:
            self.wake.wait(BEAT_S)
            self.wake.clear()
            if self._stopped:
                break
            try:
                self.beat()
                if time.monotonic() - last_look >= BEAT_S:
                    last_look = time.monotonic()
                    self._look()
            except Exception as exc:  # the watch must never be what stops a healthy run
                logger.debug(f"failure watch: {exc}")

    def beat(self) -> None:
        with self._beat_lock:
            self._beats += 1
            write_beat(self.reporter.folder, self.reporter.rank, self._beats)

    def _read_beats(self) -> None:
        now = time.monotonic()
        for r in self.reporter.peers:
            if r == self.reporter.rank:
                continue
            try:
                with open(os.path.join(self.reporter.folder, f"rank{r}.alive")) as fh:
                    info = json.load(fh)
            except (OSError, ValueError):
                continue
            with self._lock:
                before = self._seen.get(r)
                if before is None or before[0] != info.get("beat"):
                    self._seen[r] = (info.get("beat"), now, {"step": info.get("step"), "phase": info.get("phase")})

    def _look(self) -> None:
        self._read_beats()
        if self._failure is None:
            first = self.reporter.first_primary()
            message = first["message"] if first else (self.reporter.dead_peer() or
                                                      self.reporter.silent_peer(STALE_S))
            if message:
                self._failure = (message, time.monotonic())
        if self._failure is not None and time.monotonic() - self._failure[1] >= GRACE_S:
            message = self._failure[0]
            logger.error(f"{self.reporter.label(self.reporter.rank)} stopped: {message}")
            for handler in logger.handlers + logging.getLogger().handlers:
                try:
                    handler.flush()
                except Exception:
                    pass
            os._exit(1)  # the main thread is stuck in a collective that will not return


def write_beat(folder: str, rank: int, beats: int) -> None:
    # written in place, not renamed: an NFS client may keep resolving the name to a renamed-away file for a minute,
    # while opening the same file always reads its newest contents (a half-written read is skipped)
    with open(os.path.join(folder, f"rank{rank}.alive"), "w") as fh:
        json.dump({"beat": beats, **_progress}, fh)


class RankHeartbeat:
    """A rank that the training ranks watch but that watches none itself: a rollout rank of server mode. It writes
    its pid file (so that a rank of its node can tell it was killed), then beats every BEAT_S seconds with the phase
    note_phase gave it: a rollout rank killed, or its node lost, stops the job within about GRACE_S (same node) or
    STALE_S + GRACE_S seconds instead of leaving training rank 0 waiting --ddp_timeout_minutes for its answer."""

    def __init__(self, folder: str, rank: int, node: int, host: str):
        self.folder, self.rank = folder, rank
        self._stopped = threading.Event()
        self._beats = 0
        with open(os.path.join(folder, f"rank{rank}.pid"), "w") as fh:
            json.dump({"pid": os.getpid(), "host": host, "node": node}, fh)
        self._thread = threading.Thread(target=self._run, name="grpo-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._beats += 1
            try:
                write_beat(self.folder, self.rank, self._beats)
            except OSError:  # a lagging shared file system: the next beat tries again
                pass
            self._stopped.wait(BEAT_S)

    def stop(self) -> None:
        """Stopped as asked: no longer a rank whose end is a failure."""
        self._stopped.set()
        self._thread.join(timeout=5)
        note_phase(STOPPED, None)
        try:
            os.remove(os.path.join(self.folder, f"rank{self.rank}.pid"))
            write_beat(self.folder, self.rank, self._beats + 1)
        except OSError:
            pass
