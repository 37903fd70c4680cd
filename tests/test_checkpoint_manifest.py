"""Checkpoints verify themselves: damaged files are named on resume, 'latest' falls back, rotation keeps one intact."""
import json
import os
import shutil

import pytest
import torch

from grpo.checkpoint.store import list_checkpoints, rotate_checkpoints
from grpo.config.options import GRPOConfig
from grpo.errors import CheckpointError, ConfigError, TrainingError
from grpo.checkpoint.manifest import MANIFEST_FILE, quick_problem, verify_checkpoint, write_manifest
from grpo.train.trainer import GRPOTrainer

from .trainer_setup import assert_same_weights, even_tokens, tiny_config, trainable_weights

ENGINE_FILE = "engine/mp_rank_00_model_states.pt"


@pytest.fixture(scope="module")
def saved_run(tiny_model, registry, tmp_path_factory):
    """A lora run of 3 steps with a checkpoint after each (all kept). Tests copy it before damaging it."""
    out = str(tmp_path_factory.mktemp("saved") / "run")
    GRPOTrainer(tiny_config(tiny_model, registry, out, max_steps=3, save_steps=1, save_total_limit=3),
                reward_funcs=[even_tokens]).train()
    return out


def copy_run(saved_run, tmp_path) -> str:
    out = str(tmp_path / "run")
    shutil.copytree(saved_run, out)
    return out


def damage(path: str, how: str) -> None:
    if how == "truncate":
        size = os.path.getsize(path)
        with open(path, "r+b") as fh:
            fh.truncate(size // 2)
    elif how == "delete":
        os.remove(path)
    elif how == "alter":  # same size, one byte flipped in the middle
        with open(path, "r+b") as fh:
            fh.seek(os.path.getsize(path) // 2)
            byte = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([byte[0] ^ 0xFF]))
    else:
        raise ValueError(how)


# ------------------------------------------------------------------------------------------ manifest alone
def test_manifest_names_the_damaged_file(tmp_path):
    folder = tmp_path / "ckpt"
    (folder / "engine").mkdir(parents=True)
    (folder / "engine" / "weights.pt").write_bytes(os.urandom(3 << 20))  # several 1 MiB chunks
    (folder / "trainer_state.json").write_text("{}")
    write_manifest(str(folder))
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    assert sorted(manifest["files"]) == ["engine/weights.pt", "trainer_state.json"]
    assert manifest["files"]["engine/weights.pt"]["size"] == 3 << 20
    assert verify_checkpoint(str(folder)) is None

    damage(str(folder / "engine" / "weights.pt"), "alter")
    assert quick_problem(str(folder)) is None  # sizes alone cannot see an altered byte
    assert "engine/weights.pt" in verify_checkpoint(str(folder)) and "checksum" in verify_checkpoint(str(folder))
    damage(str(folder / "engine" / "weights.pt"), "truncate")
    assert "cut short" in quick_problem(str(folder))
    damage(str(folder / "engine" / "weights.pt"), "delete")
    assert verify_checkpoint(str(folder)) == "engine/weights.pt is missing"
    (folder / MANIFEST_FILE).write_text("{not json")
    assert MANIFEST_FILE in verify_checkpoint(str(folder))


def test_every_checkpoint_has_a_manifest_of_all_its_files(saved_run):
    for _, path in list_checkpoints(saved_run):
        manifest = json.loads(open(os.path.join(path, MANIFEST_FILE)).read())
        on_disk = sorted(os.path.relpath(os.path.join(root, n), path) for root, _, names in os.walk(path)
                         for n in names if n != MANIFEST_FILE)
        assert sorted(manifest["files"]) == on_disk
        assert {ENGINE_FILE, "trainer_state.json", "rng_rank0.pt"} <= set(on_disk)
        assert verify_checkpoint(path) is None


# ------------------------------------------------------------------------------------------ resume
@pytest.mark.parametrize("how", ["truncate", "delete", "alter"])
def test_resume_from_a_damaged_checkpoint_names_it_and_the_file(how, saved_run, tiny_model, registry, tmp_path):
    out = copy_run(saved_run, tmp_path)
    damaged = os.path.join(out, "checkpoint-3")
    damage(os.path.join(damaged, ENGINE_FILE), how)
    with pytest.raises(CheckpointError) as info:
        GRPOTrainer(tiny_config(tiny_model, registry, out, max_steps=4, resume_from_checkpoint=damaged))
    message = str(info.value)
    assert damaged in message and ENGINE_FILE in message, message
    # and it says which checkpoint to use instead
    assert f"--resume_from_checkpoint {os.path.join(out, 'checkpoint-2')}" in message, message
    assert os.path.isdir(damaged)  # nothing is deleted


def test_a_deleted_trainer_state_is_named_too(saved_run, tiny_model, registry, tmp_path):
    out = copy_run(saved_run, tmp_path)
    damaged = os.path.join(out, "checkpoint-3")
    os.remove(os.path.join(damaged, "trainer_state.json"))
    with pytest.raises(CheckpointError, match="checkpoint-3 is damaged: trainer_state.json is missing"):
        GRPOTrainer(tiny_config(tiny_model, registry, out, max_steps=4, resume_from_checkpoint=damaged))


def test_latest_skips_a_damaged_checkpoint_and_continues_exactly(saved_run, tiny_model, registry, tmp_path):
    # reference: an undamaged copy resumed from checkpoint-2
    intact = str(tmp_path / "intact")
    shutil.copytree(saved_run, intact)
    reference = GRPOTrainer(tiny_config(tiny_model, registry, intact, max_steps=4, save_steps=1, save_total_limit=3,
                                        resume_from_checkpoint=os.path.join(intact, "checkpoint-2")),
                            reward_funcs=[even_tokens])
    assert reference.state.step == 2
    reference.train()
    expected = trainable_weights(reference)
    assert any(v.abs().sum() > 0 for k, v in expected.items() if "lora_B" in k)  # trained: B left its zero start

    out = copy_run(saved_run, tmp_path)
    damage(os.path.join(out, "checkpoint-3", ENGINE_FILE), "truncate")
    resumed = GRPOTrainer(tiny_config(tiny_model, registry, out, max_steps=4, save_steps=1, save_total_limit=3,
                                      resume_from_checkpoint="latest"), reward_funcs=[even_tokens])
    assert resumed.state.step == 2
    log = open(os.path.join(out, "train.log")).read()
    assert "checkpoint-3 is damaged" in log and f"{ENGINE_FILE} is" in log and "checkpoint-2" in log
    resumed.train()
    assert_same_weights(trainable_weights(resumed), expected)
    # step 3 was saved again over the damaged checkpoint: every checkpoint verifies now
    assert [step for step, _ in list_checkpoints(out)] == [2, 3, 4]
    assert all(verify_checkpoint(path) is None for _, path in list_checkpoints(out))


def test_latest_with_every_checkpoint_damaged_says_so(saved_run, tiny_model, registry, tmp_path):
    out = copy_run(saved_run, tmp_path)
    for step, path in list_checkpoints(out):
        damage(os.path.join(path, "rng_rank0.pt"), "alter")
    with pytest.raises(CheckpointError, match="every checkpoint in .* is damaged.*checkpoint-3: rng_rank0.pt"):
        GRPOTrainer(tiny_config(tiny_model, registry, out, max_steps=4, resume_from_checkpoint="latest"))


def test_checkpoint_without_manifest_still_loads(saved_run, tiny_model, registry, tmp_path):
    out = copy_run(saved_run, tmp_path)
    os.remove(os.path.join(out, "checkpoint-3", MANIFEST_FILE))  # as saved before manifests existed
    trainer = GRPOTrainer(tiny_config(tiny_model, registry, out, max_steps=4, resume_from_checkpoint="latest"))
    assert trainer.state.step == 3
    assert "has no manifest.json" in open(os.path.join(out, "train.log")).read()


def test_unloadable_legacy_checkpoint_names_the_checkpoint(saved_run, tiny_model, registry, tmp_path):
    out = copy_run(saved_run, tmp_path)
    legacy = os.path.join(out, "checkpoint-3")
    os.remove(os.path.join(legacy, MANIFEST_FILE))
    damage(os.path.join(legacy, ENGINE_FILE), "truncate")  # nothing can tell before torch.load fails
    with pytest.raises(CheckpointError, match=f"checkpoint {legacy} could not be loaded.*checkpoint-2"):
        GRPOTrainer(tiny_config(tiny_model, registry, out, max_steps=4, resume_from_checkpoint=legacy))


# ------------------------------------------------------------------------------------------ rotation
def test_rotation_never_removes_the_last_intact_checkpoint(saved_run, tmp_path):
    out = copy_run(saved_run, tmp_path)
    damage(os.path.join(out, "checkpoint-3", ENGINE_FILE), "truncate")
    removed = rotate_checkpoints(out, keep=1)
    # checkpoint-2 is the newest intact one: kept, with the damaged (newer) checkpoint-3 left for inspection
    assert removed == [os.path.join(out, "checkpoint-1")]
    assert [step for step, _ in list_checkpoints(out)] == [2, 3]


def test_rotation_during_training_keeps_the_intact_one(saved_run, tiny_model, registry, tmp_path):
    # resume from checkpoint-1 while a damaged checkpoint-3 sits in the folder; keep 1
    out = copy_run(saved_run, tmp_path)
    damage(os.path.join(out, "checkpoint-3", ENGINE_FILE), "delete")
    shutil.rmtree(os.path.join(out, "checkpoint-2"))
    GRPOTrainer(tiny_config(tiny_model, registry, out, max_steps=2, save_steps=1, save_total_limit=1,
                            resume_from_checkpoint="latest")).train()
    # the new checkpoint-2 is the newest intact one; the older checkpoint-1 went, the damaged one stayed
    assert [step for step, _ in list_checkpoints(out)] == [2, 3]
    assert verify_checkpoint(os.path.join(out, "checkpoint-2")) is None


# ------------------------------------------------------------------------------------------ failures
def test_a_failing_reward_names_step_and_phase(tiny_model, registry, tmp_path):
    def flaky(completions, answers, **row):
        flaky.calls += 1
        if flaky.calls == 2:
            raise ConnectionError("reward server unreachable")
        return [0.0] * len(completions)
    flaky.calls = 0

    # no eval at step 0: it would be the reward's first call
    trainer = GRPOTrainer(tiny_config(tiny_model, registry, str(tmp_path), max_steps=3, eval_on_start=False),
                          reward_funcs=[flaky])
    with pytest.raises(TrainingError, match=r"^step 2 \(rewards\): reward 'flaky'.*reward server unreachable"):
        trainer.train()
    log = (tmp_path / "train.log").read_text()
    assert "Traceback" in log and "ConnectionError: reward server unreachable" in log


def test_an_unexpected_error_becomes_a_training_error(tiny_model, registry, tmp_path, monkeypatch):
    import grpo.train.update as optimize_module

    def broken(*args, **kwargs):
        raise ZeroDivisionError("division by zero in a custom loss")

    monkeypatch.setattr(optimize_module, "policy_loss", broken)
    trainer = GRPOTrainer(tiny_config(tiny_model, registry, str(tmp_path), max_steps=2))
    with pytest.raises(TrainingError) as info:
        trainer.train()
    assert str(info.value) == (f"step 1 (optimize): ZeroDivisionError: division by zero in a custom loss "
                               f"(traceback in {tmp_path / 'train.log'})")
    assert "in broken" in (tmp_path / "train.log").read_text()


def test_ddp_timeout_is_validated():
    with pytest.raises(ConfigError, match="--ddp_timeout_minutes: must be > 0"):
        GRPOConfig(ddp_timeout_minutes=0)
