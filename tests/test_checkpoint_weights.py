"""Reading a checkpoint's 16-bit weights for QLoRA's re-quantization and rounding correction: from a model folder, or
from a hub id's copy in the local hub cache (no network)."""
import json
import os
import shutil

import pytest
import torch

from grpo.model.base_weights import CheckpointWeights, local_checkpoint_folder
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


def test_pytorch_bin_files_are_read_as_transformers_would(model_dir, tmp_path):
    from safetensors.torch import load_file

    expected = load_file(os.path.join(model_dir, "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    layer = torch.nn.Linear(expected[name].shape[1], expected[name].shape[0])

    def read(folder):
        with CheckpointWeights(str(folder), "--option") as weights:
            return weights.read(name, "layer", layer)

    one = tmp_path / "one"  # one .bin, beside a stray safetensors file that transformers would not load either
    one.mkdir()
    torch.save(expected, one / "pytorch_model.bin")
    torch.save({}, one / "optimizer.bin")
    from safetensors.torch import save_file

    save_file({"other": torch.zeros(2)}, str(one / "adapter_model.safetensors"))
    torch.testing.assert_close(read(one), expected[name], atol=0, rtol=0)

    legacy = tmp_path / "legacy"  # torch's pre-zip format, which cannot be memory-mapped
    legacy.mkdir()
    torch.save(expected, legacy / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    torch.testing.assert_close(read(legacy), expected[name], atol=0, rtol=0)

    sharded = tmp_path / "sharded"  # shards named by an index
    sharded.mkdir()
    names = sorted(expected)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file, held in shards.items():
        torch.save({n: expected[n] for n in held}, sharded / file)
    (sharded / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {n: file for file, held in shards.items() for n in held}}))
    torch.testing.assert_close(read(sharded), expected[name], atol=0, rtol=0)

    both = tmp_path / "both"  # safetensors first, as transformers prefers them
    shutil.copytree(model_dir, both)
    torch.save({name: torch.zeros_like(expected[name])}, both / "pytorch_model.bin")
    torch.testing.assert_close(read(both), expected[name], atol=0, rtol=0)


def test_a_folder_without_weights_is_refused_with_the_way_around(tmp_path):
    with pytest.raises(ConfigError, match="--qlora_block_size 32 reads .* has none: .* or pass --qlora_block_size 64 "
                                          "--qlora_block_scale absmax for bitsandbytes' stock 4-bit base$"):
        CheckpointWeights(str(tmp_path), "--qlora_block_size 32")
    # both readers: both ways around are needed
    with pytest.raises(ConfigError, match="pass --qlora_block_size 64 --qlora_block_scale absmax for bitsandbytes' "
                                          "stock 4-bit base and run without --qlora_init loftq$"):
        CheckpointWeights(str(tmp_path), "--qlora_block_scale mse and --qlora_init loftq")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="cannot read the checkpoint file .*pytorch_model.bin"):
        CheckpointWeights(str(tmp_path), "--qlora_init loftq")


def test_a_checkpoint_saved_quantized_is_refused(model_dir, tmp_path):
    quantized = tmp_path / "bnb-4bit"
    shutil.copytree(model_dir, quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="saved already quantized \\(bitsandbytes\\); use the 16-bit model"):
        CheckpointWeights(str(quantized), "--qlora_block_size 32")


def test_a_run_whose_checkpoint_has_no_weights_file_stops_before_any_model_loads(tiny_model, registry, tmp_path,
                                                                                 monkeypatch):
    import grpo.train.trainer as trainer_module
    from grpo.train.trainer import GRPOTrainer

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
    from grpo.model.base_weights import check_checkpoint_weights

    check_checkpoint_weights(tiny_config(str(without), registry, str(tmp_path / "run"), tuning_strategy="qlora",
                                         **stock), str(without))
