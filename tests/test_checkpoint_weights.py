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


def test_a_folder_of_pytorch_bin_files_is_read_like_safetensors(model_dir, tmp_path):
    from safetensors.torch import load_file

    expected = load_file(os.path.join(model_dir, "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    torch.save(expected, tmp_path / "pytorch_model.bin")
    layer = torch.nn.Linear(expected[name].shape[1], expected[name].shape[0])
    with CheckpointWeights(str(tmp_path), "--option") as weights:
        torch.testing.assert_close(weights.read(name, "layer", layer), expected[name], atol=0, rtol=0)


def test_a_folder_without_weights_is_refused_with_the_way_around(tmp_path):
    with pytest.raises(ConfigError, match="--qlora_block_size 32 reads .* has none: .* or pass --qlora_block_size 64 "
                                          "--qlora_block_scale absmax for bitsandbytes' stock 4-bit base"):
        CheckpointWeights(str(tmp_path), "--qlora_block_size 32")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="cannot read the checkpoint file .*pytorch_model.bin"):
        CheckpointWeights(str(tmp_path), "--qlora_init loftq")


def test_a_run_whose_checkpoint_has_no_weights_file_stops_before_any_model_loads(tiny_model, registry, tmp_path,
                                                                                 monkeypatch):
    import grpo.trainer as trainer_module
    from grpo.trainer import GRPOTrainer

    from .trainer_setup import tiny_config

    without = tmp_path / "model_without_weights"
    shutil.copytree(tiny_model, without)
    for file in without.glob("*.safetensors"):
        file.unlink()
    monkeypatch.setattr(trainer_module, "load_policy", lambda *a, **k: pytest.fail("a model was loaded"))
    stock = dict(qlora_block_size=64, qlora_block_scale="absmax")
    for options, named in [(dict(), "--qlora_block_size 32 and --qlora_block_scale mse reads"),  # the defaults
                           (dict(stock, qlora_block_size=32), "--qlora_block_size 32 reads"),
                           (dict(stock, qlora_init="loftq"), "--qlora_init loftq reads")]:
        with pytest.raises(ConfigError, match=named + " .* has none"):
            GRPOTrainer(tiny_config(str(without), registry, str(tmp_path / "run"), tuning_strategy="qlora",
                                    **options))
    # bitsandbytes' stock base quantizes whatever transformers loads: nothing read, nothing refused
    from grpo.checkpoint_weights import check_checkpoint_weights

    check_checkpoint_weights(tiny_config(str(without), registry, str(tmp_path / "run"), tuning_strategy="qlora",
                                         **stock), str(without))
