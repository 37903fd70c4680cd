"""Tools the model can call during an episode, and environments that answer its turns (one file each).

A tool is a plain Python function registered with @register_tool(name); its signature and docstring become the JSON
schema the chat template shows the model. Built-ins: `calculator` (safe arithmetic) and `python` (sandboxed code).
Users add their own in a file passed with --tool_module, next to @register_environment functions.
"""

from grpo.tools.calculator import calculator, evaluate, format_number
from grpo.tools.calls import ToolCall, parse_tool_calls, text_outside_calls, tool_message
from grpo.tools.environment import (DEFAULT_ENVIRONMENT, EnvironmentStep, check_environment, get_environment,
                                    register_environment, registered_environments, step_environment,
                                    tool_environment)
from grpo.tools.errors import ToolError, ToolFailure, ToolTimeout
from grpo.tools.execute import ToolResult, execute_call, execute_calls
from grpo.tools.registry import (Tool, check_tools, get_tool, load_tool_module, register_tool, registered_tools,
                                 tool_schemas)
from grpo.tools.sandbox import SandboxLimits, SandboxResult, python, run_python
from grpo.tools.template import EnvironmentTurns, template_shows_tools, tools_system_prompt

__all__ = [
    "register_tool", "registered_tools", "get_tool", "tool_schemas", "check_tools", "load_tool_module", "Tool",
    "register_environment", "registered_environments", "get_environment", "check_environment", "step_environment",
    "EnvironmentStep", "tool_environment", "DEFAULT_ENVIRONMENT", "ToolCall", "parse_tool_calls",
    "text_outside_calls", "tool_message", "ToolResult", "execute_call", "execute_calls", "ToolError", "ToolFailure",
    "ToolTimeout", "calculator", "evaluate", "format_number", "python", "run_python", "SandboxLimits",
    "SandboxResult", "EnvironmentTurns", "template_shows_tools", "tools_system_prompt",
]
