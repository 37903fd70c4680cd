"""Reading a checkpoint's 16-bit weights for QLoRA's re-quantization and rounding correction: from a model folder, or
from a hub id's copy in the local hub cache (no network)."""
import os
import shutil

import pytest
import torch

from grpo.checkpoint_weights import CheckpointWeights, local_checkpoint_folder
from grpo.errors import ConfigError

from .tiny_models import make_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny")))


def fake_hub_cache(root, repo_id: str, model_dir: str) -> str:
    """The layout huggingface_hub keeps a downloaded model in: models--<org>--<name>/{refs/main, snapshots/<sha>}."""
    repo = os.path.join(root, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", "0123456789abcdef0123456789abcdef01234567")
    shutil.copytree(model_dir, snapshot)
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as fh:
        fh.write(os.path.basename(snapshot))
    return snapshot


def test_reads_weights_from_a_folder_or_a_cached_hub_id(model_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants
    from safetensors.torch import load_file

    expected = load_file(os.path.join(model_dir, "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    out_features, in_features = expected[name].shape
    layer = torch.nn.Linear(in_features, out_features)
    with CheckpointWeights(model_dir, "--option") as weights:
        torch.testing.assert_close(weights.read(name, "layer", layer), expected[name], atol=0, rtol=0)
        with pytest.raises(ConfigError, match="--option: the checkpoint in .* has no weight 'no.such.weight'"):
            weights.read("no.such.weight", "some.layer", layer)
        with pytest.raises(ConfigError, match=r"has shape \(\d+, \d+\), layer other \(3, 5\)"):
            weights.read(name, "other", torch.nn.Linear(5, 3))

    snapshot = fake_hub_cache(str(tmp_path), "someorg/tiny", model_dir)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert os.path.samefile(local_checkpoint_folder("someorg/tiny", "--option"), snapshot)
    with CheckpointWeights("someorg/tiny", "--option") as weights:
        torch.testing.assert_close(weights.read(name, "layer", layer), expected[name], atol=0, rtol=0)
    with pytest.raises(ConfigError, match="--option reads .* no local copy of 'someorg/other'"):
        local_checkpoint_folder("someorg/other", "--option")


def test_a_folder_without_safetensors_is_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError,
                       match="--qlora_block_size 32 reads .* has none: .* or run without --qlora_block_size"):
        CheckpointWeights(str(tmp_path), "--qlora_block_size 32")


def test_a_run_whose_checkpoint_has_no_safetensors_stops_before_any_model_loads(tiny_model, registry, tmp_path,
                                                                                monkeypatch):
    import grpo.trainer as trainer_module
    from grpo.trainer import GRPOTrainer

    from .trainer_setup import tiny_config

    without = tmp_path / "model_as_bin"
    shutil.copytree(tiny_model, without)
    for file in without.glob("*.safetensors"):
        file.unlink()
    monkeypatch.setattr(trainer_module, "load_policy", lambda *a, **k: pytest.fail("a model was loaded"))
    for options, named in [(dict(qlora_block_size=32), "--qlora_block_size 32 reads"),
                           (dict(qlora_block_size=32, qlora_block_scale="mse"),
                            "--qlora_block_size 32 and --qlora_block_scale mse reads"),
                           (dict(qlora_init="loftq"), "--qlora_init loftq reads")]:
        with pytest.raises(ConfigError, match=named + " .* has none"):
            GRPOTrainer(tiny_config(str(without), registry, str(tmp_path / "run"), tuning_strategy="qlora",
                                    **options))
    # plain qlora quantizes whatever transformers loads: no safetensors needed, nothing refused
    from grpo.checkpoint_weights import check_checkpoint_weights

    check_checkpoint_weights(tiny_config(str(without), registry, str(tmp_path / "run"), tuning_strategy="qlora"),
                             str(without))
