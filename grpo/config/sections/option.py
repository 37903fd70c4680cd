"""How a section declares an option: its default, its one-line help and the --help group it is listed under.

`metadata` is passed to argparse.add_argument by HfArgumentParser, so it holds only argparse's keywords (help,
choices, nargs, const); the group is kept here, keyed by the dataclass field itself, so that a section's fields keep
their group wherever the section is composed (GRPOConfig's FLAG_GROUPS reads it back with `groups_of`)."""
from __future__ import annotations

from dataclasses import Field, field, fields

from grpo.errors import ConfigError

_GROUP_OF: dict[Field, str] = {}  # each option's field -> its --help group


def option(default, help: str, group: str, **kw):
    made = field(default=default, metadata={"help": help, **kw})
    _GROUP_OF[made] = group
    return made


def option_list(default, help: str, group: str):
    made = field(default_factory=lambda: list(default), metadata={"help": help})
    _GROUP_OF[made] = group
    return made


def groups_of(cls) -> dict[str, str]:
    """Option name -> its --help group, for every option of the dataclass `cls`, in field order."""
    return {f.name: _GROUP_OF[f] for f in fields(cls)}


def need(cond: bool, flag: str, msg: str) -> None:
    """A check of an option: a ConfigError naming the flag and what to give instead where `cond` is false."""
    if not cond:
        raise ConfigError(f"--{flag}: {msg}")
