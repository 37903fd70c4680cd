"""The chat template's side of tools: the tool list in the prompt, and the token ids of the environment's turns.

Environment turns are tokenized on their own (never the model's turn, which stays as sampled): render a fixed
conversation that ends with an assistant turn, render it again with the environment's messages and the next
assistant prompt appended, and tokenize the difference. The template's close of the assistant turn (e.g.
"<|im_end|>\\n") is part of what the environment inserts, less the stop token the model sampled itself.
"""
from __future__ import annotations

import json
from typing import Optional

from grpo.tools.errors import ToolError

_MARK = "GRPO-ASSISTANT-TURN-MARK"
_BASE = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": _MARK}]


class EnvironmentTurns:
    """Token ids for environment messages inserted after a model turn, in this tokenizer's chat template."""

    def __init__(self, tokenizer, template_kwargs: Optional[dict] = None):
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.base_text = self._render(_BASE, generation_prompt=False)
        if _MARK not in self.base_text:
            raise ToolError("the chat template does not show an assistant message's content; multi-turn episodes "
                            "need a template that renders assistant turns")
        # what the template writes after an assistant message's content, e.g. "<|im_end|>\n"
        self.turn_close = self.base_text[self.base_text.rindex(_MARK) + len(_MARK):]
        self._stop_texts: dict[int, str] = {}

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                      **self.template_kwargs)
        except Exception as exc:
            roles = ", ".join(sorted({m["role"] for m in messages}))
            raise ToolError(f"the chat template cannot render a conversation with the roles {roles}: "
                            f"{type(exc).__name__}: {exc}. Multi-turn episodes need a template that renders tool "
                            "(or user) turns after an assistant turn") from exc

    def text(self, messages: list[dict], last_model_token: Optional[int]) -> str:
        """The text the environment inserts after a model turn that ended with `last_model_token` (None: no token)."""
        full = self._render(_BASE + list(messages), generation_prompt=True)
        if not full.startswith(self.base_text):
            raise ToolError("the chat template renders an assistant turn differently once messages follow it, so "
                            "the environment's tokens cannot be appended to the model's; use a template whose "
                            "rendering of earlier turns does not change")
        close = self.turn_close
        stop = self._stop_text(last_model_token)
        if stop and close.startswith(stop):  # the model wrote the close's first token itself (its stop token)
            close = close[len(stop):]
        return close + full[len(self.base_text):]

    def ids(self, messages: list[dict], last_model_token: Optional[int]) -> list[int]:
        """The token ids of `text(...)`: the environment's messages and the prompt of the model's next turn."""
        return self.tokenizer.encode(self.text(messages, last_model_token), add_special_tokens=False)

    def _stop_text(self, token: Optional[int]) -> str:
        if token is None:
            return ""
        if token not in self._stop_texts:
            self._stop_texts[token] = self.tokenizer.decode([token])
        return self._stop_texts[token]


def template_shows_tools(tokenizer, schemas: list[dict], template_kwargs: Optional[dict] = None) -> bool:
    """Whether the chat template renders `tools=` into the prompt (many, e.g. plain ChatML ones, ignore it)."""
    messages = [{"role": "user", "content": "Hi."}]
    kwargs = dict(template_kwargs or {}, tokenize=False, add_generation_prompt=True)
    try:
        with_tools = tokenizer.apply_chat_template(messages, tools=schemas, **kwargs)
    except Exception:
        return False
    return with_tools != tokenizer.apply_chat_template(messages, **kwargs)


def tools_system_prompt(schemas: list[dict]) -> str:
    """The Hermes-style tool instructions, for a system prompt where the chat template ignores `tools=`."""
    listed = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return ("You may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
