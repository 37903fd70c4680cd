"""--push_to_hub: the trained model (the LoRA adapter, or the full model) with its model card, the run's options and
curves, uploaded to the Hugging Face Hub through huggingface_hub, as transformers' Trainer spells it
(--hub_model_id, --hub_private_repo, --hub_strategy end | every_save).

check_hub runs before training starts, before any weight loads: the token is there and the hub answers (within
HUB_TIMEOUT_S seconds), else a ConfigError says what is missing. hub_files lists what an upload holds, file by file
(testable without a network); push uploads them in one commit.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Optional, Union

from grpo.config.choices import EMBEDDED_MODEL
from grpo.errors import ConfigError

logger = logging.getLogger("grpo")

HUB_TIMEOUT_S = 10.0
# the run's own files that go beside the model: its options, its metrics and their curves
RUN_FILES = ("grpo_config.json", "metrics.jsonl", "training_curves.png")


def check_hub(config) -> Optional[str]:
    """The repository the run pushes to (--hub_model_id, completed with the token's user name; default: that user's
    repository named after the output folder), or None without --push_to_hub. Raises ConfigError in seconds where
    no token is set or the hub does not answer."""
    if not config.push_to_hub:
        return None
    try:
        import huggingface_hub
        from huggingface_hub import constants
    except ImportError:
        raise ConfigError("--push_to_hub needs huggingface_hub: pip install huggingface_hub") from None
    if constants.HF_HUB_OFFLINE:
        raise ConfigError("--push_to_hub: HF_HUB_OFFLINE is set, so nothing can be uploaded; unset it (the hub must "
                          "be reachable from here) or leave --push_to_hub out and upload the saved model later with "
                          "`hf upload`")
    token = huggingface_hub.get_token()
    if not token:
        raise ConfigError("--push_to_hub: no Hugging Face token here; log in with `hf auth login` or set HF_TOKEN "
                          "(a token with write access), or leave --push_to_hub out")
    user = hub_user(token, constants.ENDPOINT)
    name = config.hub_model_id or os.path.basename(os.path.abspath(config.output_dir))
    repo_id = name if "/" in name else f"{user}/{name}"
    logger.info(f"--push_to_hub: the hub answers (user {user}); the model goes to {repo_id} "
                f"({'at each checkpoint and ' if config.hub_strategy == 'every_save' else ''}at the end)")
    return repo_id


def hub_user(token: str, endpoint: str, timeout: float = HUB_TIMEOUT_S) -> str:
    """The token's user name, asked of the hub at `endpoint` within `timeout` seconds."""
    from huggingface_hub.utils import build_hf_headers, get_session

    try:
        response = get_session().get(f"{endpoint}/api/whoami-v2", headers=build_hf_headers(token=token),
                                     timeout=timeout)
    except Exception as exc:  # no route, no name resolution, a proxy that refuses, a timeout
        raise ConfigError(f"--push_to_hub: the hub at {endpoint} could not be reached ({type(exc).__name__}: {exc}; "
                          f"waited at most {timeout:g} s); check the network (HF_ENDPOINT, a proxy), or leave "
                          "--push_to_hub out and upload the saved model later with `hf upload`") from None
    if response.status_code == 401:
        raise ConfigError(f"--push_to_hub: the hub at {endpoint} refused the token (401); log in again with "
                          "`hf auth login` or set HF_TOKEN to a token with write access")
    if response.status_code != 200:
        raise ConfigError(f"--push_to_hub: the hub at {endpoint} answered {response.status_code} to "
                          f"/api/whoami-v2: {response.text[:300]}")
    return response.json()["name"]


def hub_files(config, model_folder: str, output_dir: str) -> dict[str, Union[str, bytes]]:
    """What an upload holds: path in the repository -> a local file, or the bytes written there. The model folder's
    files at the top (the adapter or the full model, the tokenizer, README.md: the model card), the run's options,
    metrics and curves beside them. An adapter names the base as the user did (a hub id) instead of the local copy
    it was trained from."""
    files: dict[str, Union[str, bytes]] = {}
    for folder, _, names in os.walk(model_folder):
        for name in names:
            path = os.path.join(folder, name)
            files[os.path.relpath(path, model_folder).replace(os.sep, "/")] = path
    if "adapter_config.json" in files and _hub_id(config.model_name_or_path):
        with open(files["adapter_config.json"]) as fh:
            adapter = json.load(fh)
        adapter["base_model_name_or_path"] = config.model_name_or_path
        files["adapter_config.json"] = (json.dumps(adapter, indent=2, sort_keys=True) + "\n").encode()
    present = [name for name in RUN_FILES if os.path.isfile(os.path.join(output_dir, name))]
    for name in present:
        files[name] = os.path.join(output_dir, name)
    if "README.md" in files and present:
        with open(files["README.md"]) as fh:
            card = fh.read().rstrip("\n")
        listed = ", ".join(f"[`{name}`]({name})" for name in present)
        files["README.md"] = f"{card}\n\n## The run\n\nOptions, metrics and curves of the run: {listed}.\n".encode()
    return files


def _hub_id(name: str) -> bool:
    """A model named by its hub id (not a local folder, not the embedded model)."""
    return name != EMBEDDED_MODEL and not os.path.exists(name) and name.count("/") == 1


def push(repo_id: str, files: dict[str, Union[str, bytes]], private: Optional[bool], message: str) -> str:
    """Upload `files` to `repo_id` (made where missing, private as asked) in one commit; returns the commit's URL."""
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi()
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    operations = [CommitOperationAdd(path_in_repo=path, path_or_fileobj=source)
                  for path, source in sorted(files.items())]
    commit = api.create_commit(repo_id, operations=operations, commit_message=message, repo_type="model")
    return commit.commit_url
