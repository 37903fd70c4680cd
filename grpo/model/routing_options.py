"""--routing_replay resolved for the model: on by default for a mixture of experts whose routers can be replayed
(grpo.model.routing_replay), off for a dense model; refused with the reason where it was asked for and cannot be
done."""
from __future__ import annotations

import logging

from grpo.config.sections.rollout import routing_replay_conflict  # noqa: F401 (a check of the options, read here too)
from grpo.errors import ConfigError
from grpo.model.routing_replay import REPLAYABLE_FAMILIES, is_mixture_of_experts, replay_family

logger = logging.getLogger("grpo")


def resolve_routing_replay(config, model_config, agent_datasets=()) -> bool:
    """Resolve config.routing_replay (GRPOConfig.resolve) to whether this run replays routing (None: on where the
    model and options allow it) and return it; a ConfigError where it was asked for and cannot be done."""
    moe, family = is_mixture_of_experts(model_config), replay_family(model_config)
    conflict = routing_replay_conflict(config, agent_datasets)
    if config.routing_replay:
        if not moe:
            raise ConfigError("--routing_replay: this model is dense (it routes no token to experts), so there is no "
                              "routing to replay; drop --routing_replay")
        if family is None:
            raise ConfigError(f"--routing_replay: the routers of model type "
                              f"{getattr(model_config, 'model_type', '?')!r} cannot be replayed yet (families: "
                              f"{', '.join(REPLAYABLE_FAMILIES)}); drop --routing_replay")
        if conflict:
            raise ConfigError(f"--routing_replay: {conflict}; drop --routing_replay (or that option)")
    elif config.routing_replay is None:
        config.resolve(routing_replay=family is not None and conflict is None)
        if moe and not config.routing_replay:
            logger.info("routing replay is off for this mixture of experts: %s",
                        conflict or "its routers cannot be replayed yet")
    return bool(config.routing_replay)
