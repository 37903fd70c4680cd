"""An OpenEnv environment trained as a grpo agent: reset, then the model's answers as its actions through `step`, its
rewards as the episode's reward (`pip install '.[openenv]'`, docs/agents.md).

    from grpo.agents import register_agent
    from grpo.agents.openenv_adapter import OpenEnvEpisodes
    from my_env import GuessAction, GuessEnv          # an openenv EnvClient, or an openenv Environment

    guess = OpenEnvEpisodes(lambda: GuessEnv(base_url="http://localhost:8000"),
                            action_of=lambda text: GuessAction(guess=text.strip()),
                            observation_text=lambda observation: observation.feedback, max_turns=4)

    @register_agent("guess")
    async def guess_agent(client, row):
        return await guess.play(client, row)

`make_env()` gives each episode an environment of its own: an `EnvClient` (a server it talks to over its WebSocket),
or an `Environment` run in this process (its `reset_async` / `step_async`, on the agents' event loop: a slow step
holds every episode, so such environments are better served). One model call per turn; `play` returns
`{"completion", "reward", "rewards", "turns", "done"}` for the built-in `agent_reward`.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from grpo.agents.registry import AgentError

TESTED_VERSION = "0.10.0"
INSTALL_HINT = (f"an OpenEnv environment needs the openenv package: pip install '.[openenv]' (grpo is tested with "
                f"openenv=={TESTED_VERSION})")
REWARD_MODES = ("sum", "last")


def import_openenv():
    """OpenEnv's Environment and EnvClient base classes, or one clear error naming the extra."""
    try:
        from openenv.core.env_client import EnvClient
        from openenv.core.env_server.interfaces import Environment
    except ImportError as exc:
        raise AgentError(f"{INSTALL_HINT} ({exc})") from exc
    return Environment, EnvClient


class OpenEnvEpisodes:
    """How an OpenEnv environment plays as an agent: one `play(client, row)` per episode.

    make_env          () -> an EnvClient or an Environment, a new one per episode
    action_of         the model's answer (text) -> the environment's action
    observation_text  an observation -> the user message the model reads next ("" or None: none)
    max_turns         model calls per episode at most
    reward            "sum" of the step rewards, or the "last" one
    reset_kwargs      row -> keyword arguments of reset (a seed, a task id); default none
    """

    def __init__(self, make_env: Callable[[], Any], action_of: Callable[[str], Any],
                 observation_text: Callable[[Any], Optional[str]], max_turns: int = 8, reward: str = "sum",
                 reset_kwargs: Optional[Callable[[dict], dict]] = None, model: str = "policy"):
        self._environment_type, self._client_type = import_openenv()
        if reward not in REWARD_MODES:
            raise AgentError(f"reward must be one of {', '.join(REWARD_MODES)}, got {reward!r}")
        if max_turns < 1:
            raise AgentError(f"max_turns must be at least 1, got {max_turns}")
        self.make_env, self.action_of, self.observation_text = make_env, action_of, observation_text
        self.max_turns, self.reward, self.model = max_turns, reward, model
        self.reset_kwargs = reset_kwargs or (lambda row: {})

    async def play(self, client, row: dict) -> dict:
        """Reset; then per turn the model's answer to the conversation so far becomes an action, and the observation
        it brings the next user message, until the environment is done or max_turns. An episode out of room (the
        endpoint's context_length_exceeded after its first call) ends there with the rewards it has."""
        from openai import BadRequestError

        env = self._open(self.make_env())
        try:
            observation, _, done = await env.reset(**self.reset_kwargs(row))
            messages = [dict(m) for m in row.get("messages") or []] + self._user_turn(observation)
            rewards, text, turns = [], "", 0
            while not done and turns < self.max_turns:
                try:
                    response = await client.chat.completions.create(model=self.model, messages=messages)
                except BadRequestError as exc:
                    if exc.code == "context_length_exceeded" and turns > 0:
                        break
                    raise
                message = response.choices[0].message
                text = message.content or ""
                messages.append(message)  # passed back as it came: the next call continues from its recorded ids
                turns += 1
                observation, reward, done = await env.step(self.action_of(text))
                rewards.append(float(reward or 0.0))
                if not done:
                    messages += self._user_turn(observation)
        finally:
            await env.close()
        total = (rewards[-1] if rewards else 0.0) if self.reward == "last" else sum(rewards)
        return {"completion": text, "reward": total, "rewards": rewards, "turns": turns, "done": done}

    def _user_turn(self, observation) -> list[dict]:
        text = self.observation_text(observation)
        return [{"role": "user", "content": text}] if text else []

    def _open(self, env):
        if isinstance(env, self._client_type):
            return _ClientSteps(env)
        if isinstance(env, self._environment_type):
            return _InProcessSteps(env)
        raise AgentError(f"make_env must return an openenv EnvClient or Environment, got {type(env).__name__}")


class _ClientSteps:
    """An EnvClient's reset / step as (observation, reward, done)."""

    def __init__(self, env):
        self.env = env

    async def reset(self, **kwargs):
        result = await self.env.reset(**kwargs)
        return result.observation, result.reward, bool(result.done)

    async def step(self, action):
        result = await self.env.step(action)
        return result.observation, result.reward, bool(result.done)

    async def close(self):
        await self.env.close()


class _InProcessSteps:
    """An Environment's own reset / step (its observation carries reward and done)."""

    def __init__(self, env):
        self.env = env

    async def reset(self, **kwargs):
        observation = await self.env.reset_async(**kwargs)
        return observation, observation.reward, bool(observation.done)

    async def step(self, action):
        observation = await self.env.step_async(action)
        return observation, observation.reward, bool(observation.done)

    async def close(self):
        self.env.close()
