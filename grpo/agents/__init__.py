"""Agents written against the OpenAI API, trained with GRPO.

An agent is an `async def agent(client, row)` whose `client` (an `openai.AsyncOpenAI`) talks to an OpenAI-compatible
endpoint in front of the rollout engine being trained (endpoint.py). Every call is recorded token-exactly
(records.py) and an episode's calls become one training sequence: the model's sampled tokens trained on, everything
else masked. Agents are registered by name (registry.py, --agent_module) and run many at a time (runner.py).
"""

from grpo.agents.endpoint import AgentEndpoint, EndpointLimits
from grpo.agents.records import AssembledEpisode, CallRecord, assemble_calls
from grpo.agents.registry import (AgentError, check_agents, get_agent, load_agent_module, register_agent,
                                  registered_agents)
from grpo.agents.runner import AgentEpisode, AgentLimits, agent_metrics, run_agent_episodes

__all__ = [
    "AgentEndpoint", "EndpointLimits", "CallRecord", "AssembledEpisode", "assemble_calls", "AgentError",
    "register_agent", "registered_agents", "get_agent", "load_agent_module", "check_agents", "AgentEpisode",
    "AgentLimits", "agent_metrics", "run_agent_episodes",
]
