"""Options from the command line and from JSON files: train_grpo.py's flags (generated from GRPOConfig, listed by
group in --help, each once) and `--config file.json` (read, like every JSON file users edit, by json_files.py)."""
from __future__ import annotations

import argparse
import difflib
import re
import sys
from dataclasses import fields
from typing import Optional

from grpo.config.guide_spellings import GUIDE_SWITCHES, check_guide_spellings_agree
from grpo.config.json_files import read_json_object  # noqa: F401 (also imported from here)
from grpo.config.options import FLAG_GROUPS, GRPOConfig
from grpo.errors import ConfigError

# --help sections, in order (docs/flags.md follows them too)
GROUP_TITLES = {"model": "Model and tuning strategy", "data": "Data and rewards", "training": "Optimisation",
                "grpo": "GRPO algorithm", "rollout": "Rollout engine", "logging": "Eval, checkpoints, logging",
                "distributed": "Distributed", "tools": "Tools and multi-turn episodes",
                "experimental": "Experimental (4-bit base rounding, vLLM sleep level, log-prob checks)",
                "guide": "The guide's spellings (each sets the option its help names)"}

USAGE = "%(prog)s [--flag value ...]   (python train_grpo.py --help lists every flag, by group)"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag once (HfArgumentParser adds a dashed twin, --lora-rank, which still parses), no "(default: None)"."""

    def _format_action_invocation(self, action):
        if not action.option_strings:
            return super()._format_action_invocation(action)
        if action.nargs == 0:
            return action.option_strings[0]
        return f"{action.option_strings[0]} {self._format_args(action, self._get_default_metavar_for_optional(action))}"

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser():
    """HfArgumentParser over GRPOConfig, its flags moved into one argument group per FLAG_GROUPS section."""
    from transformers import HfArgumentParser

    # allow_abbrev=False: a shortened or mistyped flag is an error, never another flag
    parser = HfArgumentParser(GRPOConfig, description="GRPO fine-tuning with verifiable rewards.", usage=USAGE,
                              formatter_class=_HelpFormatter, allow_abbrev=False)
    parser.add_argument("--config", default=None, help="JSON file of flag values; command-line flags win.")
    groups = {key: parser.add_argument_group(title) for key, title in GROUP_TITLES.items()}
    for action in list(parser._optionals._group_actions):
        if action.option_strings and action.option_strings[0] == f"--no_{action.dest}":
            # the negative of a boolean flag: say what it does (its default is the positive flag's)
            action.help = f"Turn --{action.dest} off (the same as --{action.dest} false)."
            action.default = argparse.SUPPRESS
        if action.dest in GUIDE_SWITCHES:  # bare --use_kl_penalty is on, as in the guide (true / false work too)
            action.nargs, action.const = "?", True
        if action.help and action.help is not argparse.SUPPRESS:  # argparse %-formats help: a plain "%" stays one
            action.help = re.sub(r"%(?!\()", "%%", action.help)
        group = FLAG_GROUPS.get(action.dest)
        if group is not None:  # moved from "options" into its section (argparse keeps one list per group)
            parser._optionals._group_actions.remove(action)
            groups[group]._group_actions.append(action)
    return parser


def parse_args(argv: Optional[list[str]] = None) -> GRPOConfig:
    """Parse CLI flags (and an optional ``--config file.json`` whose values act as defaults).

    With --resume_from_checkpoint the defaults are the run's own options, as its checkpoint saved them: only the
    flags given (on the command line or in --config) change them, and GRPOTrainer lists those that do.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    config_path = _pop_config_flag(argv)
    from_json = _read_config_json(config_path, {f.name for f in fields(GRPOConfig)}) if config_path else {}
    given = {**from_json, **_given_flags(argv)}
    check_guide_spellings_agree(given)
    saved_path = None
    if given.get("resume_from_checkpoint"):
        from grpo.config.saved import run_options

        saved_path, saved = run_options(given["resume_from_checkpoint"],
                                        given.get("output_dir", GRPOConfig.output_dir), GRPOConfig)
        parser.set_defaults(**saved)
    parser.set_defaults(**from_json)
    # the extra --config argument (already consumed above) comes back as a second, unused namespace
    *parsed, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if unknown:
        flags = [f"--{f.name}" for f in fields(GRPOConfig)]
        hints = [f"{u} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(u.split("=")[0], flags, 1))
                 else u for u in unknown if u.startswith("-")]
        parser.error(f"unrecognized arguments: {' '.join(hints or unknown)}")  # exits with status 2
    config = parsed[0]
    config.resumes_saved_options = saved_path
    # the options given (flags or --config), apart from defaults: on a CPU the others take CPU-sized values once the
    # device is known (grpo.config.cpu_sizing)
    config.given_options = frozenset(given)
    return config


def _given_flags(argv: list[str]) -> dict:
    """The options named on the command line, with their parsed values (nothing for the ones left out)."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS  # an option not given stays out of the namespace
    known, _ = parser.parse_known_args([a for a in argv if a not in ("-h", "--help")])
    return vars(known)


def _pop_config_flag(argv: list[str]) -> Optional[str]:
    for i, arg in enumerate(argv):
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config: give a JSON file path")
            path = argv[i + 1]
            del argv[i:i + 2]
            return path
        if arg.startswith("--config="):
            del argv[i]
            return arg.split("=", 1)[1]
    return None


def _read_config_json(path: str, known: set[str]) -> dict:
    values = read_json_object(path, ConfigError, "--config")
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"--config: {path} has unknown option(s) {', '.join(unknown)}; "
                          f"see `python train_grpo.py --help` for the valid names")
    return values
