"""--push_to_hub without a network: the checks before training (no token, offline, a hub that does not answer, a
refused token) stop a run in seconds before any weight loads, a local stand-in for the hub's whoami gives the
repository, and what a run uploads, file by file, at the end and at each checkpoint (huggingface_hub's HfApi
replaced by a recorder)."""
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import huggingface_hub
import pytest
from huggingface_hub import constants

from grpo.checkpoint import hub
from grpo.config import GRPOConfig
from grpo.errors import ConfigError

from .trainer_setup import ROOT, child_env, tiny_config


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once closed


@pytest.fixture
def online(monkeypatch):
    """The hub as huggingface_hub sees it: online, a token set, the endpoint a test picks."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_test_token")

    def at(endpoint):
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    return at


@pytest.fixture
def fake_hub():
    """A local server that answers /api/whoami-v2 as the hub does: 200 with the user for hf_test_token, else 401."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            good = self.headers.get("authorization") == "Bearer hf_test_token"
            body = json.dumps({"name": "me"} if good else {"error": "Invalid credentials"}).encode()
            self.send_response(200 if good and self.path == "/api/whoami-v2" else 401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_options_as_transformers_spells_them():
    from grpo.config import parse_args

    config = parse_args(["--push_to_hub", "--hub_model_id", "me/x", "--hub_private_repo", "--hub_strategy",
                         "every_save"])
    assert (config.push_to_hub, config.hub_model_id, config.hub_private_repo, config.hub_strategy) == \
        (True, "me/x", True, "every_save")
    assert (GRPOConfig().push_to_hub, GRPOConfig().hub_strategy) == (False, "end")
    with pytest.raises(SystemExit):
        parse_args(["--hub_strategy", "checkpoint"])


def test_without_push_to_hub_nothing_is_asked(monkeypatch):
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: pytest.fail("the token was read"))
    assert hub.check_hub(GRPOConfig()) is None


def test_offline_or_without_a_token_the_run_is_refused(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match="--push_to_hub: HF_HUB_OFFLINE is set"):
        hub.check_hub(GRPOConfig(push_to_hub=True))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(ConfigError, match="--push_to_hub: no Hugging Face token here; log in with `hf auth login`"):
        hub.check_hub(GRPOConfig(push_to_hub=True))


def test_a_hub_that_does_not_answer_is_named_in_seconds(online):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    online(endpoint)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=f"--push_to_hub: the hub at {endpoint} could not be reached"):
        hub.check_hub(GRPOConfig(push_to_hub=True))
    assert time.perf_counter() - start < 5


def test_the_repository_is_completed_with_the_tokens_user_and_a_refused_token_is_named(online, fake_hub,
                                                                                       monkeypatch, tmp_path):
    online(fake_hub)
    assert hub.check_hub(GRPOConfig(push_to_hub=True, output_dir=str(tmp_path / "my-run"))) == "me/my-run"
    assert hub.check_hub(GRPOConfig(push_to_hub=True, hub_model_id="x")) == "me/x"
    assert hub.check_hub(GRPOConfig(push_to_hub=True, hub_model_id="org/x")) == "org/x"
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_wrong")
    with pytest.raises(ConfigError, match="refused the token \\(401\\)"):
        hub.check_hub(GRPOConfig(push_to_hub=True))


def test_train_grpo_without_a_reachable_hub_stops_in_seconds_before_loading(tiny_model, registry, tmp_path):
    out = tmp_path / "run"
    env = child_env(HF_HUB_OFFLINE="0", HF_TOKEN="hf_test_token", HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_grpo.py"), "--model_name_or_path", tiny_model,
                           "--dataset_config_path", registry, "--dataset_names", "toy", "--output_dir", str(out),
                           "--max_steps", "1", "--push_to_hub"], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300)
    seconds = time.perf_counter() - start
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "error: --push_to_hub: the hub at http://127.0.0.1:" in proc.stderr
    assert "could not be reached" in proc.stderr
    assert "Traceback" not in proc.stderr and "loading" not in proc.stderr.lower()
    assert not (out / "lora_adapter").exists() and not (out / "checkpoints").exists()
    assert seconds < 60, seconds  # the interpreter and the data; no model, no DeepSpeed engine


def test_the_trainer_checks_the_hub_before_the_data_or_a_model_loads(monkeypatch, tmp_path):
    from grpo.train import trainer as trainer_module

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    monkeypatch.setattr(trainer_module, "prepare_run", lambda *a, **k: pytest.fail("the run's data was prepared"))
    with pytest.raises(ConfigError, match="--push_to_hub: no Hugging Face token"):
        trainer_module.GRPOTrainer(GRPOConfig(push_to_hub=True, output_dir=str(tmp_path / "out")))


def test_an_upload_holds_the_model_its_card_and_the_runs_options_and_curves(tmp_path):
    model, out = tmp_path / "run" / "lora_adapter", tmp_path / "run"
    model.mkdir(parents=True)
    (model / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/cache/local-copy", "r": 4}))
    for name in ("adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes(b"x")
    (model / "README.md").write_text("# the card\n")
    for name in ("grpo_config.json", "metrics.jsonl", "training_curves.png", "train.log"):
        (out / name).write_bytes(b"y")
    config = GRPOConfig(model_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct", output_dir=str(out))
    files = hub.hub_files(config, str(model), str(out))
    assert sorted(files) == ["README.md", "adapter_config.json", "adapter_model.safetensors", "grpo_config.json",
                             "metrics.jsonl", "tokenizer.json", "tokenizer_config.json", "training_curves.png"]
    assert files["adapter_model.safetensors"] == str(model / "adapter_model.safetensors")
    assert files["metrics.jsonl"] == str(out / "metrics.jsonl")
    # the adapter names the base by its hub id; the card lists the run's files
    assert json.loads(files["adapter_config.json"]) == {"base_model_name_or_path":
                                                        "HuggingFaceTB/SmolLM2-135M-Instruct", "r": 4}
    assert files["README.md"].decode().startswith("# the card\n\n## The run\n")
    assert "[`training_curves.png`](training_curves.png)" in files["README.md"].decode()
    # a local base stays as saved
    local = hub.hub_files(GRPOConfig(model_name_or_path=str(tmp_path)), str(model), str(out))
    assert local["adapter_config.json"] == str(model / "adapter_config.json")


class RecordingApi:
    """huggingface_hub.HfApi's two calls a push makes, recorded."""
    calls: list = []

    def create_repo(self, repo_id, private=None, exist_ok=False, repo_type=None):
        self.calls.append(("create_repo", repo_id, private, exist_ok))

    def create_commit(self, repo_id, operations, commit_message, repo_type=None):
        files = {op.path_in_repo: op.path_or_fileobj for op in operations}
        self.calls.append(("commit", repo_id, commit_message, sorted(files)))
        return type("Commit", (), {"commit_url": f"https://hub.invalid/{repo_id}/commit/{len(self.calls)}"})()


def test_a_run_pushes_at_each_checkpoint_and_at_the_end(tiny_model, registry, tmp_path, monkeypatch):
    from grpo.train import trainer as trainer_module

    RecordingApi.calls = []
    monkeypatch.setattr(trainer_module, "check_hub", lambda config: "me/run")
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    out = tmp_path / "run"
    config = tiny_config(tiny_model, registry, str(out), max_steps=2, save_steps=1, push_to_hub=True,
                         hub_strategy="every_save", hub_private_repo=True, eval_on_start=False)
    trainer = trainer_module.GRPOTrainer(config)
    trainer.train()
    commits = [c for c in RecordingApi.calls if c[0] == "commit"]
    assert [c[2] for c in commits] == ["step 1", "step 2", "final model, step 2"]
    assert {c for c in RecordingApi.calls if c[0] == "create_repo"} == {("create_repo", "me/run", True, True)}
    adapter = sorted(os.listdir(out / "lora_adapter"))
    assert "adapter_model.safetensors" in adapter and "README.md" in adapter
    final = sorted(set(adapter) | {"grpo_config.json", "metrics.jsonl", "training_curves.png"})
    assert commits[-1][3] == final
    assert set(commits[0][3]) == set(final) - {"training_curves.png"} or set(commits[0][3]) == set(final)
    assert not (out / "hub_upload").exists()  # a checkpoint's upload folder goes once pushed
