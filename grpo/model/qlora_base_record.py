"""Beside a saved qlora adapter, how its 4-bit base was rounded (lora_adapter/qlora_base.json), so that a run
continuing the adapter (--lora_adapter_path) can say when its own base is rounded otherwise: the adapter then starts
as another policy. Allowed, as moving to a better base can be the point, but said, with the options to pass."""
from __future__ import annotations

import json
import logging
import os
from typing import Optional

from grpo.config.option_compare import as_compared
from grpo.config.saved import VALUES_BEFORE_THE_OPTION
from grpo.config.strategy import Strategy

logger = logging.getLogger(__name__)
BASE_FILE = "qlora_base.json"
BASE_OPTIONS = ("qlora_quant_type", "qlora_block_size", "qlora_block_scale", "qlora_skip_modules")


def write_base_options(adapter_dir: str, config) -> None:
    with open(os.path.join(adapter_dir, BASE_FILE), "w") as fh:
        json.dump({option: getattr(config, option) for option in BASE_OPTIONS}, fh, indent=1)


def warn_if_another_base(adapter_dir: str, config) -> None:
    if not config.strategy.four_bit_base:
        return
    trained_on = _trained_on(adapter_dir)
    if trained_on is None:
        return
    changed = [option for option in BASE_OPTIONS if option in trained_on and
               as_compared(option, trained_on[option]) != as_compared(option, getattr(config, option))]
    if changed:
        moves = "; ".join(f"--{option} {trained_on[option]} -> {getattr(config, option)}" for option in changed)
        given = " ".join(f"--{option} {trained_on[option]}" for option in changed if trained_on[option] is not None)
        logger.warning(f"--lora_adapter_path: the adapter in {adapter_dir} was trained on a 4-bit base rounded "
                       f"otherwise ({moves}), so it starts as another policy; to continue on its own base, pass "
                       f"{given or 'no --qlora_skip_modules'}")


def _trained_on(adapter_dir: str) -> Optional[dict]:
    """The adapter's record; else, for an adapter saved before there was one, the qlora run's grpo_config.json in
    the output folder above it (its options missing there are those of their time); else None."""
    record = os.path.join(adapter_dir, BASE_FILE)
    if os.path.isfile(record):
        with open(record) as fh:
            return json.load(fh)
    folder = os.path.abspath(adapter_dir)
    for above in (os.path.dirname(folder), os.path.dirname(os.path.dirname(folder))):
        saved = os.path.join(above, "grpo_config.json")
        if os.path.isfile(saved):
            try:
                with open(saved) as fh:
                    options = json.load(fh)
            except (OSError, ValueError):
                return None
            if Strategy.read(options.get("tuning_strategy")) is not Strategy.QLORA:
                return None
            return {option: {**VALUES_BEFORE_THE_OPTION, **options}.get(option) for option in BASE_OPTIONS}
    return None
