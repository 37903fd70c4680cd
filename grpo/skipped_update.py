"""Cancelling an update whose loss went non-finite on some micro-batch, without leaving a trace in the optimizer.

By the time a non-finite loss shows, the micro-batches before it have already added their gradients, and the engine
must still take its step at the accumulation boundary (ZeRO's buffers and hooks expect it). The step is taken with
learning rate 0, so the weights stay; AdamW's update  p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)  is then 0.
But the moments would still move,  m = b1 * m + (1 - b1) * g_partial,  v = b2 * v + (1 - b2) * g_partial^2,  and the
step count with them (its bias correction), so every later step would feel a partial gradient of a step that
never happened. The optimizer's state is therefore copied (to host memory: a bad step is rare, a second copy of the
moments on the GPU may not fit) before that step and put back after it.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


def base_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer holding the moments: DeepSpeed's ZeRO / bf16 wrappers keep it as `.optimizer`."""
    for _ in range(8):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def _host_copy(value):
    return value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value


@contextmanager
def cancelled_update(engine):
    """Inside: `engine.step()` changes neither the weights nor the optimizer's state (moments, step counts); the
    learning-rate scheduler still advances, as it would for a step that trained."""
    base = base_optimizer(engine.optimizer)
    saved_state = {param: {key: _host_copy(value) for key, value in state.items()}
                   for param, state in base.state.items()}
    saved_group_steps = [group.get("step") for group in base.param_groups]  # optimizers that count per group
    saved_lrs = [group["lr"] for group in engine.optimizer.param_groups]
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0
    try:
        yield
    finally:
        for param in list(base.state):
            if param not in saved_state:  # the state was created by this step: back to the optimizer's lazy start
                del base.state[param]
        for param, state in saved_state.items():
            live = base.state[param]
            for key, value in state.items():
                if torch.is_tensor(value) and torch.is_tensor(live.get(key)):
                    live[key].copy_(value)
                else:
                    live[key] = value
        for group, step in zip(base.param_groups, saved_group_steps):
            if step is not None:
                group["step"] = step
        if getattr(engine, "lr_scheduler", None) is None:
            # a scheduler sets the next step's lr itself; without one (a DeepSpeed "optimizer" and no "scheduler")
            # nothing else would undo the 0
            for group, lr in zip(engine.optimizer.param_groups, saved_lrs):
                group["lr"] = lr
