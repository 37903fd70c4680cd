"""Errors that carry a message meant for the user (printed without a traceback by the CLI)."""


class GRPOError(Exception):
    """Base class: something the user can fix (a flag, a file, a registry entry)."""


class ConfigError(GRPOError, ValueError):
    """An invalid flag value or flag combination."""


class DatasetError(GRPOError):
    """A problem with dataset_config.json or a dataset it names."""


class RewardError(GRPOError):
    """A reward function is unknown, raised, or returned something unusable."""


class TrainingError(GRPOError):
    """Training cannot continue (e.g. repeated non-finite losses)."""


class CheckpointError(GRPOError):
    """A checkpoint is damaged, incomplete or cannot be loaded."""
