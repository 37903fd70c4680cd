"""Every option of a run: the schema (options.py, composed of the sections in sections/, each with its fields and
checks; validation.py runs the checks), resolved once per run and then frozen (GRPOConfig.resolve / freeze), the
command line and JSON files (cli.py), a run's saved options (saved.py), the accepted values of each option
(choices.py), the guide's spellings (guide_spellings.py) and the shipped files (shipped.py)."""
from grpo.config.choices import EMBEDDED_MODEL
from grpo.config.cli import parse_args
from grpo.config.options import FLAG_GROUPS, GUIDE_SPELLINGS, GRPOConfig, upgrade_saved_options

__all__ = ["GRPOConfig", "parse_args", "FLAG_GROUPS", "GUIDE_SPELLINGS", "EMBEDDED_MODEL", "upgrade_saved_options"]
