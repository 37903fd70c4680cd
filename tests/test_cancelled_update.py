"""A step cancelled for a non-finite loss leaves no trace: neither in the weights nor in the optimizer's moments."""
import types

import torch

from grpo.train import update as optimize
from grpo.train.trainer import GRPOTrainer
from grpo.train.update import base_optimizer, cancelled_update
from .trainer_setup import deepspeed_adamw_config, even_tokens, tiny_config, trainable_weights


def adamw_engine(lr=0.1, scheduler=None):
    """The parts of a DeepSpeed engine that cancelled_update uses, around a plain AdamW on one weight."""
    weight = torch.nn.Parameter(torch.tensor([1.0]))
    optimizer = torch.optim.AdamW([weight], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    return weight, types.SimpleNamespace(optimizer=optimizer, step=optimizer.step, lr_scheduler=scheduler)


def step_with_grad(weight, engine, grad, cancel=False):
    weight.grad = torch.tensor([grad])
    if cancel:
        with cancelled_update(engine):
            engine.step()
    else:
        engine.step()


def test_cancelled_step_keeps_the_moments_and_the_step_count():
    weight, engine = adamw_engine()
    step_with_grad(weight, engine, 1.0)
    # by hand: m = 0.1 * 1 = 0.1, v = 0.001 * 1 = 0.001; m_hat = 1, v_hat = 1, w = 1 - 0.1 * 1 / (1 + 1e-8)
    state = engine.optimizer.state[weight]
    assert torch.allclose(state["exp_avg"], torch.tensor([0.1]))
    assert torch.allclose(state["exp_avg_sq"], torch.tensor([0.001]))
    assert torch.allclose(weight.detach(), torch.tensor([0.9]))
    step_with_grad(weight, engine, 5.0, cancel=True)  # a partial gradient of a step that never happened
    assert torch.allclose(weight.detach(), torch.tensor([0.9]))
    assert torch.allclose(state["exp_avg"], torch.tensor([0.1]))
    assert torch.allclose(state["exp_avg_sq"], torch.tensor([0.001]))
    assert float(state["step"]) == 1.0
    assert engine.optimizer.param_groups[0]["lr"] == 0.1  # no scheduler: the lr comes back
    step_with_grad(weight, engine, 1.0)
    # by hand, as if the cancelled step had not been: m = 0.9 * 0.1 + 0.1 * 1 = 0.19, v = 0.999 * 0.001 + 0.001
    assert torch.allclose(state["exp_avg"], torch.tensor([0.19]))
    assert torch.allclose(state["exp_avg_sq"], torch.tensor([0.001999]))
    assert float(state["step"]) == 2.0


def test_cancelled_first_step_leaves_no_state():
    weight, engine = adamw_engine()
    step_with_grad(weight, engine, 3.0, cancel=True)
    assert len(engine.optimizer.state) == 0
    assert torch.equal(weight.detach(), torch.tensor([1.0]))
    step_with_grad(weight, engine, 1.0)  # the first real step starts the moments from zero: m = 0.1
    assert torch.allclose(engine.optimizer.state[weight]["exp_avg"], torch.tensor([0.1]))


def test_a_scheduler_keeps_setting_the_lr():
    weight, engine = adamw_engine()
    engine.lr_scheduler = object()  # present: cancelled_update leaves the lr to it
    step_with_grad(weight, engine, 1.0, cancel=True)
    assert engine.optimizer.param_groups[0]["lr"] == 0.0


def test_nan_in_the_last_micro_batch_leaves_deepspeed_moments_as_they_were(tiny_model, registry, tmp_path,
                                                                           monkeypatch):
    """Two micro-batches a step under ZeRO-2 with a DeepSpeed AdamW: step 2's second micro-batch is non-finite after
    its first has added a gradient. The moments after step 2 are those after step 1, bit for bit."""
    ds_path = deepspeed_adamw_config(tmp_path / "ds.json")
    real_loss = optimize.policy_loss
    calls: dict = {}

    def nan_in_second_micro_batch_of_step_2(*args, **kwargs):
        loss, metrics = real_loss(*args, **kwargs)
        step = trainer.state.step
        calls[step] = calls.get(step, 0) + 1
        return (loss * float("nan") if step == 1 and calls[step] == 2 else loss), metrics

    monkeypatch.setattr(optimize, "policy_loss", nan_in_second_micro_batch_of_step_2)
    trainer = GRPOTrainer(tiny_config(tiny_model, registry, str(tmp_path / "out"), tuning_strategy="full",
                                      max_steps=3, deepspeed=str(ds_path), eval_on_start=False,
                                      per_device_train_batch_size=1, gradient_accumulation_steps=2,
                                      max_tokens_per_micro_batch=0),
                          reward_funcs=[even_tokens])
    after: list = []  # (weights, moments) after steps 1, 2, ... and at the end
    real_sync = trainer._sync_rollout_weights

    def remember():
        state = base_optimizer(trainer.engine.optimizer).state
        after.append((
            trainable_weights(trainer),
            {i: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for i, s in enumerate(state.values())}))

    def remember_then_sync(*args, **kwargs):  # the sync follows every step but the last
        remember()
        return real_sync(*args, **kwargs)

    trainer._sync_rollout_weights = remember_then_sync
    trainer.train()
    remember()
    assert calls[1] == 2 and calls[0] == 2  # two micro-batches a step
    (weights_1, moments_1), (weights_2, moments_2), (weights_3, moments_3) = after[0], after[1], after[-1]
    assert moments_1 and all("exp_avg" in s for s in moments_1.values())
    for name in weights_1:
        assert torch.equal(weights_1[name], weights_2[name])
    for i in moments_1:
        for key in moments_1[i]:
            assert torch.equal(moments_1[i][key], moments_2[i][key]), (i, key)
    assert any(not torch.equal(moments_2[i]["exp_avg"], moments_3[i]["exp_avg"]) for i in moments_2)
