"""Datasets whose rows agents play (a registry entry with "agent"): --agent_module imported and every agent found
before the tokenizer or any model loads, and what agent episodes cannot run with refused there too."""
from __future__ import annotations

import importlib.util

from grpo.data.registry import DatasetSpec
from grpo.errors import ConfigError


def check_agent_datasets(config, registry: dict[str, DatasetSpec], names) -> dict:
    """{dataset name: grpo.agents.rollouts.AgentDataset} of the named datasets that name an agent; --agent_module
    imported (it must register at least one agent). A missing or failing file, an unknown agent and options agent
    episodes do not run with are one clear error each. grpo.agents is imported only for a run that has agents."""
    playing = [name for name in dict.fromkeys(names) if registry.get(name) is not None and registry[name].agent]
    if not (playing or config.agent_module):
        return {}
    from grpo.agents.registry import AgentError, agents_defined_in, check_agents, load_agent_module
    from grpo.agents.rollouts import AgentDataset

    if config.agent_module:
        load_agent_module(config.agent_module)
        if not agents_defined_in(config.agent_module):
            raise AgentError(f"--agent_module {config.agent_module} registers no agent: decorate an `async def "
                             "agent(client, row)` in it with @register_agent(\"name\") (from grpo.agents)")
    out = {}
    for name in playing:
        spec = registry[name]
        where = f"dataset '{name}' in {config.dataset_config_path}"
        try:
            agent = check_agents([spec.agent], config.agent_module)[0]
        except AgentError as exc:
            raise AgentError(f"{where}: {exc}") from None
        if spec.image_field:
            raise ConfigError(f"{where}: agents are for text prompts; this entry has an \"image_field\" (images in "
                              "the endpoint's messages are not supported)")
        out[name] = AgentDataset(name, spec.agent, agent)
    if out:
        check_agent_options(config, sorted(out))
    return out


def check_agent_options(config, datasets: list[str]) -> None:
    """What agent episodes need of the run: the openai client, and one engine that this process drives alone."""
    which = f"dataset(s) {', '.join(datasets)} name an agent"
    if importlib.util.find_spec("openai") is None:
        raise ConfigError(f"{which}, whose episodes call the model through the openai client: pip install "
                          "'grpo[agents]'")
    if config.rollout_mode == "server":
        raise ConfigError(f"{which}: agent episodes run against the engine of the process that trains; use "
                          "--rollout_mode colocate (server mode's rollout ranks do not serve the agents' endpoint)")
    if config.vllm_tp > 1:
        raise ConfigError(f"{which}: agent episodes drive one engine from one process, and a tensor-parallel engine "
                          f"generates with every rank of its group together; use --vllm_tp 1")
    if config.sequence_parallel_size > 1:
        raise ConfigError(f"{which}: agent episodes are not shared between the ranks of a sequence-parallel group; use "
                          "--sequence_parallel_size 1")
    if config.routing_replay:
        raise ConfigError(f"{which}: the agents' endpoint does not record the experts the engine routed each token "
                          "to, so --routing_replay cannot replay them; drop --routing_replay")
    config.resolve(routing_replay=False)  # (a mixture of experts trains agent episodes on its own routing)


def run_agent_datasets(config, registry: dict[str, DatasetSpec]) -> dict:
    """check_agent_datasets over the datasets a run trains and evaluates on."""
    return check_agent_datasets(config, registry, config.dataset_names + config.eval_dataset_names)


def agent_rollouts_over(config, agent_datasets: dict, engine):
    """The rows of `agent_datasets` played against the OpenAI-compatible endpoint over `engine`
    (grpo.agents.rollouts.AgentRollouts), which the rollout collector runs with the step's other rows; None for a run
    without agents."""
    if not agent_datasets:
        return None
    from grpo.agents.rollouts import agent_rollouts

    return agent_rollouts(config, agent_datasets, engine)
