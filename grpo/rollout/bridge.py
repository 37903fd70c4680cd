"""The link between training rank 0 and the rollout ranks in --rollout_mode server.

The two sides live in different torch.distributed worlds (see grpo/roles.py), so they meet in two ways of their own:
  - messages (requests, completions, errors) are pickled into the key-value store of the training world, which
    training rank 0 hosts at MASTER_ADDR:MASTER_PORT; both sides reach it through a client of their own (a store
    client serves one operation at a time, and the process groups' own store traffic must not queue behind a wait);
  - weights travel through a process group made for the purpose over that store: training rank 0 is its rank 0,
    rollout rank i its rank i + 1 (NCCL on GPU, gloo on CPU), so tensors go device to device.
Each message to rollout rank i has a sequence number; the reply to it carries the same number.
"""
from __future__ import annotations

import os
import pickle
import time
from datetime import timedelta
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist

PREFIX = "grpo_rollout"


class BridgeClosed(RuntimeError):
    """The other side is gone (its store or group closed)."""


POLL_MAX = 0.01  # seconds between two looks at the store while waiting: the most a message waits unseen


def connect_store(timeout: timedelta) -> dist.Store:
    """A client of the training world's store at MASTER_ADDR:MASTER_PORT (waits for it to come up, up to
    `timeout`)."""
    return dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=timeout, wait_for_workers=False)


class RolloutBridge:
    """One end of the link: `rank` 0 is training rank 0, `rank` i + 1 rollout rank i; `size` = rollout ranks + 1."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device, timeout: timedelta):
        self.store = dist.PrefixStore(PREFIX, store)
        self.rank, self.size, self.device, self.timeout = rank, size, device, timeout
        self._sequence = [0] * size  # per rollout rank (index + 1): the next message's number
        group_store = dist.PrefixStore("weights", self.store)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(group_store, rank, size, options)
        else:
            self.group = dist.ProcessGroupGloo(group_store, rank, size, timeout)

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # best effort: the process is ending
                pass

    # ------------------------------------------------------------------------------------------ messages
    def send(self, rollout_rank: int, message) -> int:
        """Training rank 0: post `message` to a rollout rank; returns its number (the reply's key)."""
        number = self._sequence[rollout_rank + 1]
        self._sequence[rollout_rank + 1] += 1
        self._set(f"to/{rollout_rank}/{number}", message)
        return number

    def reply_of(self, rollout_rank: int, number: int, timeout: Optional[timedelta] = None):
        """Training rank 0: the rollout rank's reply to message `number` (waits for it up to `timeout`, by default
        --ddp_timeout_minutes)."""
        return self._take(f"from/{rollout_rank}/{number}", timeout or self.timeout)

    def receive(self, rollout_rank: int):
        """Rollout rank: the next message for it and its number; waits as long as the link stands (a training step
        with its checkpoint may take any time)."""
        number = self._sequence[rollout_rank + 1]
        self._sequence[rollout_rank + 1] += 1
        return self._take(f"to/{rollout_rank}/{number}", None), number

    def poll(self, rollout_rank: int):
        """Rollout rank: the next message and its number if one is waiting, else None (never waits: a rank with work
        looks between two units of generation)."""
        number = self._sequence[rollout_rank + 1]
        key = f"to/{rollout_rank}/{number}"
        try:
            waiting = self.store.check([key])
        except Exception as exc:  # the store's server (training rank 0) is gone
            raise BridgeClosed(f"the link closed ({type(exc).__name__}: {exc})") from exc
        if not waiting:
            return None
        self._sequence[rollout_rank + 1] += 1
        return self._take(key, None), number

    def has_reply(self, rollout_rank: int, number: int) -> bool:
        """Training rank 0: whether the rollout rank has answered message `number` (without taking the answer)."""
        try:
            return self.store.check([f"from/{rollout_rank}/{number}"])
        except Exception as exc:
            raise BridgeClosed(f"the link closed ({type(exc).__name__}: {exc})") from exc

    def reply(self, rollout_rank: int, number: int, message) -> None:
        self._set(f"from/{rollout_rank}/{number}", message)

    def _set(self, key: str, message) -> None:
        try:
            self.store.set(key, pickle.dumps(message))
        except Exception as exc:  # the store's server (training rank 0) is gone
            raise BridgeClosed(f"the link closed ({type(exc).__name__}: {exc})") from exc

    def _take(self, key: str, timeout: Optional[timedelta]):
        """The value at `key` once it is set, removed from the store; waits up to `timeout` (None: no limit).

        Polls with `check` (a blocking `wait` that times out logs a warning each time), backing off to POLL_MAX."""
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        pause = 0.0005
        try:
            while not self.store.check([key]):
                if deadline is not None and time.monotonic() > deadline:
                    raise BridgeClosed(f"no answer in {timeout}")
                time.sleep(pause)
                pause = min(2 * pause, POLL_MAX)
            value = self.store.get(key)
            self.store.delete_key(key)
        except BridgeClosed:
            raise
        except Exception as exc:  # the store's server (training rank 0) is gone
            raise BridgeClosed(f"the link closed ({type(exc).__name__}: {exc})") from exc
        return pickle.loads(value)

    # ------------------------------------------------------------------------------------------- weights
    def broadcast_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Training rank 0, after posting a `weights` message with their layout (see `layout`) to every rollout
        rank: each tensor, in order, to all of them."""
        for _, tensor in named_tensors:
            self._broadcast(tensor.to(self.device).contiguous())

    def receive_weights(self, layout: list[tuple[str, tuple, str]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Rollout rank: the tensors of a `weights` message, as they arrive."""
        for name, shape, dtype in layout:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            self._broadcast(tensor)
            yield name, tensor

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        try:
            self.group.broadcast([tensor], options).wait()
        except Exception as exc:
            raise BridgeClosed(f"the weight transfer broke off ({type(exc).__name__}: {exc})") from exc


def layout(named_tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple, str]]:
    """(name, shape, dtype name) per tensor: what a rollout rank allocates before the broadcast fills it."""
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in named_tensors]
