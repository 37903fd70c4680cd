"""A `verifiers` environment trained as a grpo agent: its dataset as the prompt rows, its rollout against the episode's
client, its rubric as the reward (`pip install '.[verifiers]'`, docs/agents.md).

    import verifiers as vf
    from grpo.agents import register_agent
    from grpo.agents.verifiers_adapter import VerifiersEpisodes

    math_env = VerifiersEpisodes(vf.load_environment("my-math-env"))
    math_env.write_rows("data/my_math_env.jsonl")  # the registry entry's "path"

    @register_agent("my_math_env")
    async def my_math_env(client, row):
        return await math_env.play(client, row)

`play` runs the environment's own `rollout` (every turn it takes, its tools, its stop conditions) with the episode's
`openai.AsyncOpenAI` wrapped in verifiers' chat-completions client, scores it with the environment's rubric, and
returns `{"completion", "reward", "metrics"}` for the built-in `agent_reward`. The classic environment API
(`vf.SingleTurnEnv`, `vf.MultiTurnEnv`, `vf.ToolEnv`, `vf.Rubric`) is the one adapted: verifiers 0.4 dropped it for
harnesses run as separate programs (and asks for openai<3, which the agents extra does not allow).
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Optional

from grpo.agents.registry import AgentError

TESTED_VERSION = "0.3.1"
INSTALL_HINT = (f"a verifiers environment needs the verifiers package: pip install '.[verifiers]' (grpo is tested "
                f"with verifiers=={TESTED_VERSION})")
PROMPT_FIELD, ANSWER_FIELD = "prompt", "answer"  # the columns write_rows writes (the entry's messages / answer field)


def import_verifiers():
    """verifiers and a chat-completions client of it for the endpoint, or one clear error naming the extra."""
    try:
        import verifiers as vf
        from openai import BadRequestError
        from verifiers.clients import OpenAIChatCompletionsClient
    except ImportError as exc:
        raise AgentError(f"{INSTALL_HINT} ({exc})") from exc
    if not hasattr(vf, "Environment"):
        raise AgentError(f"verifiers {getattr(vf, '__version__', '?')} has no classic environment API "
                         f"(vf.Environment); {INSTALL_HINT}")

    class EndpointClient(OpenAIChatCompletionsClient):
        """verifiers' client, knowing the endpoint's `context_length_exceeded` for what it is: an episode out of room
        (verifiers reads overlong prompts from the error's wording, and would fail the episode instead)."""

        async def get_native_response(self, *args, **kwargs):
            try:
                return await super().get_native_response(*args, **kwargs)
            except BadRequestError as exc:
                if exc.code == "context_length_exceeded":
                    raise vf.OverlongPromptError(str(exc)) from exc
                raise
    return vf, EndpointClient


class VerifiersEpisodes:
    """One verifiers environment: its rows for the registry, and one episode of it per `play(client, row)`."""

    def __init__(self, env, split: str = "train", sampling_args: Optional[dict] = None, model: str = "policy"):
        vf, self._client_type = import_verifiers()
        if not isinstance(env, vf.Environment):
            raise AgentError(f"VerifiersEpisodes takes a verifiers environment (vf.Environment), got "
                             f"{type(env).__name__}")
        if getattr(env.rubric, "has_group_rewards", False):
            raise AgentError(f"{type(env).__name__}'s rubric has group-level reward functions (taking states, "
                             "completions, ... of a whole group); each episode is scored alone here (its group is "
                             "compared by GRPO's advantages): give the environment per-rollout reward functions")
        if split not in ("train", "eval"):
            raise AgentError(f"split must be 'train' or 'eval', got {split!r}")
        self.env = env
        self.split = split
        self.model = model
        self.sampling_args = dict(sampling_args or {})  # sampling follows the run's options whatever is asked here
        dataset = env.get_dataset() if split == "train" else env.get_eval_dataset()
        self.inputs = [dict(row) for row in dataset]
        # a training row finds its environment input (info, task, example_id) by its prompt and answer
        self._by_key = {}
        for item in self.inputs:
            self._by_key.setdefault(_row_key(plain_messages(item[PROMPT_FIELD]), item.get(ANSWER_FIELD)), item)

    def rows(self) -> list[dict]:
        """The environment's dataset as registry rows: `prompt` (its chat messages), `answer` (text), `example_id`."""
        return [{PROMPT_FIELD: plain_messages(item[PROMPT_FIELD]), ANSWER_FIELD: _answer_text(item.get(ANSWER_FIELD)),
                 "example_id": item.get("example_id", i)} for i, item in enumerate(self.inputs)]

    def write_rows(self, path: str) -> str:
        """The rows as JSON lines at `path` (the registry entry: "messages_field": "prompt", "answer_field":
        "answer"); rewritten only when they changed, atomically (every rank of a run imports the agent file)."""
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in self.rows())
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                if f.read() == text:
                    return path
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
        return path

    def input_of(self, row: dict) -> dict:
        """The environment's own input for a training row (found by its messages and answer); a row it does not have
        (the entry added a system prompt or template) becomes an input of its messages and answer."""
        messages = [dict(m) for m in row.get("messages") or []]
        found = self._by_key.get(_row_key(messages, row.get(ANSWER_FIELD)))
        if found is not None:
            return dict(found)
        return {PROMPT_FIELD: messages, ANSWER_FIELD: row.get(ANSWER_FIELD) or "", "task": "default", "info": {},
                "example_id": row.get("index") or 0}

    async def play(self, client, row: dict) -> dict:
        """One episode: the environment's rollout against `client`, scored by its rubric. An error the environment
        recorded fails the episode, as an agent that raises does; one out of room after its first call (the endpoint's
        context_length_exceeded) ends there and is scored, while a first prompt that does not fit stays an error."""
        state = await self.env.rollout(self.input_of(row), self._client_type(client), self.model,
                                       dict(self.sampling_args))
        error = state.get("error")
        if error is not None and not state.get("prompt_too_long"):
            raise RuntimeError(f"verifiers rollout failed: {error!r}")
        if state.get("prompt_too_long") and not state.get("trajectory"):  # the run's to fix, not the episode's end
            raise RuntimeError("the environment's first prompt does not fit the endpoint (--max_prompt_length)")
        await self.env.rubric.score_rollout(state)
        return {"completion": last_assistant_text(state.get("completion")), "reward": float(state["reward"]),
                "metrics": dict(state.get("metrics") or {})}


def plain_messages(messages) -> list[dict]:
    """Chat messages as plain dicts without empty keys (verifiers' datasets and pydantic messages alike)."""
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    out = []
    for message in messages or []:
        if hasattr(message, "model_dump"):
            message = message.model_dump()
        out.append({k: v for k, v in dict(message).items() if v is not None})
    return out


def last_assistant_text(completion) -> str:
    """The model's last answer of a verifiers completion (a list of messages, or text)."""
    if isinstance(completion, str):
        return completion
    for message in reversed(plain_messages(completion)):
        if message.get("role") == "assistant" and isinstance(message.get("content"), str):
            return message["content"]
    return ""


def _answer_text(answer: Any) -> str:
    if answer is None:
        return ""
    return answer if isinstance(answer, str) else json.dumps(answer)


def _row_key(messages: list[dict], answer: Any) -> str:
    return json.dumps([messages, _answer_text(answer)], sort_keys=True)
