"""An agent written against the OpenAI API, trained with GRPO as it is.

It offers the model a calculator in the OpenAI tools format, runs the calls the model makes and returns the model's
final answer; grpo points its `client` at an endpoint in front of the model being trained and records every call's
tokens. The shipped dataset `arith_agent` names it:

    python train_grpo.py --dataset_names arith_agent --agent_module examples/calculator_agent.py \
        --rollout_engine hf --max_steps 20

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
            if exc.code == "context_length_exceeded":  # the episode's tokens are used up: it ends here
                return None
            raise
        message = response.choices[0].message
        messages.append(message)  # passed back as it came: the next call continues from its recorded tokens
        if not message.tool_calls:
            return message.content
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
    return None
