"""The OpenAI API's shapes: requests read and checked, prompts made into token ids, responses written.

Prompt ids keep what the engine sampled. A chat request whose messages are an earlier call's messages, then that call's
answer (as returned), then new messages (tool results, a user turn) is built from the recorded ids: that call's prompt
and sampled ids, then the new messages alone, rendered by the chat template after an assistant turn (the environment's
tokens, grpo.tools.template.EnvironmentTurns). A completions request whose text is an earlier call's prompt text +
answer text + more is built the same way. Anything else is rendered (or tokenized) on its own; where that does not
continue the episode's calls, assembling the episode finds the mismatch (records.py).

The model's tool calls are read from its text with the trainer's own parser (grpo.tools.calls: Qwen/Hermes
`<tool_call>{...}</tool_call>` blocks) and answered in OpenAI's `tool_calls` form when the request offered tools.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Optional

from grpo.tools.calls import parse_tool_calls, text_outside_calls

# request fields read; any other is refused by name, so that an agent never gets a silently different behaviour
CHAT_FIELDS = {"model", "messages", "tools", "tool_choice", "parallel_tool_calls", "max_tokens",
               "max_completion_tokens", "temperature", "top_p", "n", "logprobs", "top_logprobs", "stream", "seed",
               "user", "metadata", "store", "return_token_ids", "stop", "frequency_penalty", "presence_penalty"}
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "logprobs", "stream", "seed",
                     "user", "echo", "return_token_ids", "stop", "frequency_penalty", "presence_penalty"}


class RequestError(Exception):
    """A request the endpoint answers with an OpenAI-style error body (status 400 unless said otherwise)."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": "invalid_request_error", "param": self.param,
                          "code": self.code}}


@dataclass
class ParsedRequest:
    kind: str                    # "chat" | "completion"
    max_tokens: Optional[int]    # what the request asked for (None: the endpoint's cap)
    logprobs: bool               # answer with the sampled tokens' log-probs
    return_token_ids: bool       # answer with the prompt's and the completion's ids (vLLM's field names)
    messages: Optional[list] = None   # chat: normalised messages
    tools: Optional[list] = None      # chat: the tools offered (OpenAI function schemas), None: none
    read_tool_calls: bool = False     # chat: answer the model's tool calls as `tool_calls` (tools offered, and
                                      # tool_choice is not "none")
    prompt_text: Optional[str] = None          # completions: the prompt as text ...
    prompt_ids: Optional[list[int]] = None     # ... or as token ids


def parse_request(kind: str, body) -> ParsedRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    allowed = CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(f"unsupported field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: this endpoint "
                           f"reads {', '.join(sorted(allowed))}", param=unknown[0])
    if body.get("stream"):
        raise RequestError("streaming is not supported: call without stream=True", param="stream")
    if body.get("n", 1) not in (1, None):
        raise RequestError("n > 1 is not supported: each choice would be an episode of its own; run more episodes",
                           param="n")
    if body.get("stop"):
        raise RequestError("stop sequences are not supported (the model stops at its end-of-turn token)",
                           param="stop")
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name):
            raise RequestError(f"{name} is not supported: the trained policy's tokens are sampled as they are",
                               param=name)
    if kind == "completion" and body.get("echo"):
        raise RequestError("echo is not supported", param="echo")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise RequestError(f"max_tokens must be a positive integer, got {max_tokens!r}", param="max_tokens")
    logprobs = body.get("logprobs")
    request = ParsedRequest(kind, max_tokens, bool(logprobs) or (kind == "completion" and logprobs == 0),
                            bool(body.get("return_token_ids")))
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        request.messages = [normalise_message(m, i) for i, m in enumerate(messages)]
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError("tools must be a list of function schemas", param="tools")
        request.tools = tools or None
        request.read_tool_calls = bool(tools) and body.get("tool_choice") != "none"
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one prompt
        if isinstance(prompt, str):
            request.prompt_text = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            request.prompt_ids = list(prompt)
        else:
            raise RequestError("prompt must be one text or one non-empty list of token ids (one prompt per request)",
                               param="prompt")
    return request


def normalise_message(message, index: int = 0) -> dict:
    """A chat message as the chat template and the comparisons here read it: text content (OpenAI's list of text
    parts joined), tool calls with their arguments as objects (what chat templates render)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(f"messages[{index}] must be an object with a role", param="messages")
    out = {"role": message["role"], "content": _text(message.get("content"), index)}
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise RequestError(f"messages[{index}].tool_calls must be a list", param="messages")
        out["tool_calls"] = [_normalise_call(c, index) for c in calls]
    return out


def _text(content, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{index}].content: only text parts are supported", param="messages")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"messages[{index}].content must be text or a list of text parts", param="messages")


def _normalise_call(call, index: int) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(f"messages[{index}].tool_calls: each call needs a function with a name", param="messages")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # left as written: the comparison and the template see the text
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def same_message(sent: dict, answered: dict) -> bool:
    """Whether a message of a request is the assistant message an earlier call answered (tool call ids aside: some
    agents write their own)."""
    def key(m):
        calls = [(c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                 for c in m.get("tool_calls") or []]
        return m["role"], m.get("content") or "", calls
    return key(sent) == key(answered)


def answer_message(text: str, tools_offered: bool, stopped: bool) -> tuple[dict, str, int]:
    """The assistant message for the model's text, the OpenAI finish reason ("stop", "length" or "tool_calls") and
    how many of its tool-call blocks could not be read (they stay in the content, as written)."""
    message = {"role": "assistant", "content": text}
    finish = "stop" if stopped else "length"
    if not tools_offered:
        return message, finish, 0
    calls = parse_tool_calls(text)
    readable = [c for c in calls if c.error is None]
    if readable:
        message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                 for c in readable]
        if len(readable) == len(calls):  # every block read: the content is what the model wrote around them
            message["content"] = text_outside_calls(text) or None
        if stopped:
            finish = "tool_calls"
    return message, finish, len(calls) - len(readable)


def chat_response(model: str, message: dict, finish: str, prompt_ids: list[int], completion_ids: list[int],
                  logprobs: Optional[list], return_token_ids: bool) -> dict:
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    if logprobs is not None:
        choice["logprobs"] = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")),
                                           "top_logprobs": []} for t, lp in logprobs]}
    body = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": _usage(prompt_ids, completion_ids)}
    return _with_ids(body, choice, prompt_ids, completion_ids, return_token_ids)


def completion_response(model: str, text: str, finish: str, prompt_ids: list[int], completion_ids: list[int],
                        logprobs: Optional[list], return_token_ids: bool) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    if logprobs is not None:
        offsets, at = [], 0
        for token, _ in logprobs:
            offsets.append(at)
            at += len(token)
        choice["logprobs"] = {"tokens": [t for t, _ in logprobs], "token_logprobs": [lp for _, lp in logprobs],
                              "top_logprobs": None, "text_offset": offsets}
    body = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": _usage(prompt_ids, completion_ids)}
    return _with_ids(body, choice, prompt_ids, completion_ids, return_token_ids)


def _usage(prompt_ids, completion_ids) -> dict:
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion_ids),
            "total_tokens": len(prompt_ids) + len(completion_ids)}


def _with_ids(body, choice, prompt_ids, completion_ids, return_token_ids: bool) -> dict:
    if return_token_ids:  # vLLM's names for the same
        body["prompt_token_ids"] = list(prompt_ids)
        choice["token_ids"] = list(completion_ids)
    return body
