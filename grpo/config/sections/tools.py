"""Tools, multi-turn episodes and agents: the user's tools and agents, an episode's turns and tokens, the warm start on
demonstrations, the tool_call reward, the python tool's sandbox, and the checks of those options."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from grpo.config.sections.option import need, option, option_list


@dataclass
class ToolOptions:
    tool_module: Optional[str] = option(
        None, "Python file whose @register_tool / @register_environment functions become usable in the dataset "
              "config's \"tools\" and \"environment\" (docs/tools.md).", "tools")
    max_turns: int = option(
        4, "Datasets with tools or an environment: model turns per episode (each at most --rollout_max_new_tokens).",
        "tools")
    max_episode_tokens: Optional[int] = option(
        None, "Datasets with tools or an environment: completion tokens per episode, the model's and the "
              "environment's together (the prompt comes on top). Default: --max_seq_length - --max_prompt_length.",
        "tools")
    warm_start_steps: int = option(
        0, "Supervised steps on the datasets' \"demonstrations\" (the model's turns written out, e.g. tool calls) "
           "before the first GRPO step of a fresh run: a model that never calls its tools gets calls to prefer.",
        "tools")
    warm_start_datasets: list[str] = option_list(
        [], "Datasets whose \"demonstrations\" the warm start trains on (space or comma separated; default: "
            "--dataset_names). They are laid out as those datasets' tool episodes, so an agent that offers the same "
            "tools (its episodes those episodes token for token) starts from them: --dataset_names "
            "arith_products_agent --warm_start_datasets arith_products.", "tools")
    tool_call_reward: Optional[float] = option(
        None, "Weight of the tool_call reward (1 for an episode with a tool call that ran) in every named dataset that "
              "offers tools: replaces the registry's weight, or adds the reward where the entry has none; 0 turns it "
              "off. Default: the registry's.", "tools")
    tool_failure_penalty: Optional[float] = option(
        None, "What tool_call scores an episode whose tool calls all failed (bad JSON, unknown tool, wrong arguments), "
              "as a penalty >= 0: tool_call's `attempt` becomes -penalty in every named dataset that offers tools. "
              "Default: the registry's attempt.", "tools")
    allow_unsandboxed_code: bool = option(
        False, "Where no sandbox can be made (bubblewrap missing or namespaces refused), run the python tool's code "
               "as a plain process anyway: no isolation from the trainer, its files or the network (docs/tools.md).",
        "tools")
    agent_module: Optional[str] = option(
        None, "Python file whose @register_agent functions (`async def agent(client, row)` on the OpenAI API) become "
              "usable in the dataset config's \"agent\" (docs/agents.md).", "tools")
    agent_timeout_s: float = option(
        300.0, "Datasets with an agent: seconds one episode may run; past them it is cancelled and scores 0 (counted "
               "in agents/timeouts).", "tools")
    agent_max_concurrency: int = option(
        0, "Datasets with an agent: episodes running at once on a rank (their calls are generated in batches, a round "
           "of turns at a time); 0: all of the step's. Set a limit for a served environment that allows fewer "
           "sessions.", "tools")
    agent_on_mismatch: str = option(
        "truncate", "Datasets with an agent: an agent's call that does not continue its earlier calls' tokens is "
                    "never trained on; truncate keeps the episode up to it, drop trains on none of the episode.",
        "tools", choices=("truncate", "drop"))

    def check_tools(self) -> None:
        need(self.max_turns >= 1, "max_turns", f"must be >= 1, got {self.max_turns}")
        for name in ("tool_call_reward", "tool_failure_penalty"):
            value = getattr(self, name)
            need(value is None or (math.isfinite(value) and value >= 0), name,
                 f"must be a number >= 0, got {value}" + (" (a penalty is given as its size: 0.5 scores a failed "
                                                           "call -0.5)" if name == "tool_failure_penalty" else ""))
        need(self.warm_start_steps >= 0, "warm_start_steps", f"must be >= 0, got {self.warm_start_steps}")
        need(not self.warm_start_datasets or self.warm_start_steps > 0, "warm_start_datasets",
             "names the datasets whose demonstrations the warm start trains on; give --warm_start_steps too")
        need(self.max_episode_tokens is None or self.max_episode_tokens >= 1, "max_episode_tokens",
             f"must be >= 1, got {self.max_episode_tokens}")
        need(self.max_prompt_length + self.episode_token_budget <= self.max_seq_length, "max_episode_tokens",
             f"the prompt and an episode must fit --max_seq_length: --max_prompt_length {self.max_prompt_length} + "
             f"--max_episode_tokens {self.episode_token_budget} > {self.max_seq_length}; lower it or raise "
             "--max_seq_length")
        need(self.tool_module is None or bool(self.tool_module.strip()), "tool_module", "give a Python file's path")
        need(self.agent_module is None or bool(self.agent_module.strip()), "agent_module",
             "give a Python file's path")
        need(math.isfinite(self.agent_timeout_s) and self.agent_timeout_s > 0, "agent_timeout_s",
             f"must be a number of seconds > 0, got {self.agent_timeout_s}")
        need(self.agent_max_concurrency >= 0, "agent_max_concurrency",
             f"must be >= 0 (0: all of the step's episodes at once), got {self.agent_max_concurrency}")
        need(self.agent_on_mismatch in ("truncate", "drop"), "agent_on_mismatch",
             f"got '{self.agent_on_mismatch}', choose truncate or drop")
