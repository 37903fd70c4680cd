"""Errors of tools and environments: the user's to fix (ToolError), or a tool's run to report to the model."""
from grpo.errors import GRPOError


class ToolError(GRPOError):
    """A tool or environment is unknown, its module is missing, or its function cannot be described to the model."""


class ToolTimeout(Exception):
    """A tool ran past its time limit (counted as a timeout; the model reads the message)."""


class ToolFailure(Exception):
    """A tool ran and reports a failure in its own words, e.g. the python tool's traceback (counted as an error; the
    model reads the message as it is)."""
