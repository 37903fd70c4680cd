"""An agent written against the OpenAI API, trained with GRPO as it is.

It offers the model a calculator in the OpenAI tools format, runs the calls the model makes and returns the model's
final answer; grpo points its `client` at an endpoint in front of the model being trained and records every call's
tokens. The shipped dataset `arith_agent` names it:

    python train_grpo.py --dataset_names arith_agent --agent_module examples/calculator_agent.py \
        --max_prompt_length 320 --max_seq_length 576 --max_episode_tokens 256 --rollout_max_new_tokens 64

(the calculator's instructions take ~200 of SmolLM2's tokens of the first prompt, as for `arith_calc`).

The same function runs against any OpenAI-compatible server:

    import asyncio; from openai import AsyncOpenAI
    asyncio.run(calculator_agent(AsyncOpenAI(), {"messages": [{"role": "user", "content": "What is 12 * 7?"}]}))
"""
import json

from openai import AsyncOpenAI, BadRequestError

from grpo.agents import register_agent
from grpo.tools.calculator import calculator

MAX_CALLS = 3  # model calls per episode: a calculator call or two, then the answer
TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression and return its value.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string",
                                          "description": "Numbers with + - * / // % ** and parentheses, e.g. "
                                                         "\"(12 + 7) * 3\"."}},
            "required": ["expression"],
        },
    },
}]


def run_tool(call) -> str:
    """The tool message's content for one of the model's tool calls (a failure as an 'Error: ...' text the model
    reads, as grpo's own tools word it)."""
    if call.function.name != "calculator":
        return f"Error: unknown tool {call.function.name!r}; the tools are: calculator"
    try:
        return str(calculator(**json.loads(call.function.arguments or "{}")))
    except Exception as exc:  # bad JSON, wrong arguments, an expression it refuses
        return f"Error: {exc}"


@register_agent("calculator_agent")
async def calculator_agent(client: AsyncOpenAI, row: dict):
    """The dataset row's messages (its system prompt and template applied), then up to MAX_CALLS model calls with
    the calculator offered; returns the model's answer (None when it was still calling tools at the end, or the
    episode had no room left for another call)."""
    messages = list(row["messages"])
    for _ in range(MAX_CALLS):
        try:
            response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        except BadRequestError as exc:
            # the episode's tokens are used up after a call or two: it ends here (a first prompt that does not fit
            # --max_prompt_length is the run's to fix, and stays an error)
            if exc.code == "context_length_exceeded" and len(messages) > len(row["messages"]):
                return None
            raise
        message = response.choices[0].message
        messages.append(message)  # passed back as it came: the next call continues from its recorded tokens
        if not message.tool_calls:
            return message.content
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
    return None
