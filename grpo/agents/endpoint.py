"""An OpenAI-compatible endpoint in front of the rollout engine being trained, recording every call token-exactly.

Each episode gets a base URL of its own, `http://127.0.0.1:<port>/episodes/<key>/v1` (the key is random: a call names
its episode and nothing else can guess one), serving

    POST /chat/completions    messages (+ tools): the chat template renders them, the model's tool calls come back
                              as `tool_calls`
    POST /completions         one prompt, as text or token ids
    GET  /models              the one model served

without streaming. The HTTP side runs on an asyncio loop (the agents' loop); the engine stays with the thread that
owns it (the trainer's): that thread takes the waiting requests in batches (`next_batch`), generates them in one
`engine.generate` call and answers them (`generate_batch`). A batch is a round of turns, as in the trainer's own
episode loop: it goes to the engine once every open episode has a call waiting (or has ended), or once the agents'
loop has had nothing to do for a short window with calls waiting (an agent that waits between its turns, on a tool
that takes seconds, holds the others no longer than that; a loop busy with the agents' code is waited for). Every
answer is recorded as a CallRecord (records.py) with the prompt ids the engine was given, the sampled ids, their
log-probs, the policy version and the finish reason.

Tools offered in a chat request reach the model through the chat template's `tools=`; a template that ignores them
gets them in the system message instead (the Hermes-style instructions the trainer's own tool prompts use), so that
the model is told how to call them either way.

Sampling follows the run's settings (temperature, top-p): the trainer's log-probs are at that temperature, so a
request's own `temperature` / `top_p` are not applied (the count of such requests is kept, `sampling_ignored`).
Limits: `max_new_tokens` per call (a request may ask fewer), `max_prompt_tokens` for an episode's first prompt, and
`max_episode_tokens` for everything after it; a call past them is refused with OpenAI's `context_length_exceeded`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import secrets
import selectors
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from grpo.agents.http import JSONServer
from grpo.agents.loop_watch import IdleSelector, TrackedExecutor
from grpo.agents.openai_format import (RequestError, answer_message, chat_response, completion_response,
                                       normalise_message, parse_request, same_message)
from grpo.agents.records import CallRecord
from grpo.rollout.engine import Completion, RolloutEngine, SamplingSettings
from grpo.tools.errors import ToolError
from grpo.tools.template import EnvironmentTurns, template_shows_tools, tools_system_prompt


@dataclass
class EndpointLimits:
    max_new_tokens: int           # per call; a request's max_tokens may ask fewer
    max_prompt_tokens: int        # an episode's first prompt
    max_episode_tokens: int       # after the first prompt: every call's new and sampled tokens together


@dataclass
class _Call:
    """What a later call of the same episode is compared with: the call's record, and its request and answer as the
    endpoint read them."""
    record: CallRecord
    messages: Optional[list] = None   # chat: the request's messages (normalised)
    tools_key: str = ""               # chat: the tools offered, as JSON
    answer: Optional[dict] = None     # chat: the assistant message answered
    prompt_text: Optional[str] = None  # completions: the prompt as text (None when it came as ids)
    answer_text: str = ""             # completions: the text answered


@dataclass
class _Episode:
    key: str
    calls: list[_Call] = field(default_factory=list)
    open: bool = True
    sampling_ignored: int = 0     # requests whose temperature / top_p were not the run's
    refused: int = 0              # requests answered with an error


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    episode: str = ""             # its episode's key

    def answer(self, completion: Optional[Completion] = None, error: Optional[BaseException] = None) -> None:
        """Called from the engine's thread: resolve the waiting request on its loop (unless it was given up)."""
        answer_all([(self, completion, error)])


def answer_all(answers: list[tuple[GenerationRequest, Optional[Completion], Optional[BaseException]]]) -> None:
    """Called from the engine's thread: resolve the waiting requests (of one loop) in one hop to it."""
    if not answers:
        return

    def settle():
        for request, completion, error in answers:
            if not request.future.done():
                if error is not None:
                    request.future.set_exception(error)
                else:
                    request.future.set_result(completion)
    try:
        answers[0][0].loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the agents' loop has closed: every episode ended (timed out) while this generated
        pass


class AgentEndpoint:
    def __init__(self, tokenizer, sampling: SamplingSettings, limits: EndpointLimits, policy_version: int = 0,
                 model_name: str = "policy", host: str = "127.0.0.1", port: int = 0):
        self.tokenizer = tokenizer
        self.sampling = dataclasses.replace(sampling, n=1, logprobs=True)
        self.limits = limits
        self.policy_version = policy_version
        self.model_name = model_name
        self.server = JSONServer(self.handle, host, port)
        self.host = host
        self.episodes: dict[str, _Episode] = {}
        # the batcher's state, shared with the engine's thread (under `_batcher`): the requests waiting for it, how
        # many calls have arrived and are still being read (rendered, tokenized), the open episodes, and when any of
        # that last changed
        self._batcher = threading.Condition()
        self._pending: list[GenerationRequest] = []
        self._preparing = 0
        self._open: set[str] = set()
        self._changed = time.monotonic()
        self._loop_idle: Optional[float] = 0.0  # since when the agents' loop waits with nothing to do (None: busy);
                                                # 0.0: not known (a loop without loop_selector() counts as idle)
        self._executor: Optional[TrackedExecutor] = None
        self._turns: dict[str, EnvironmentTurns] = {}
        self._shown: dict[str, bool] = {}  # per tools offered: whether the chat template renders `tools=`

    # ------------------------------------------------------------------------------------------- lifecycle
    async def start(self) -> int:
        return await self.server.start()

    async def close(self) -> None:
        await self.server.close()

    def open_episode(self) -> str:
        key = secrets.token_urlsafe(16)
        self.episodes[key] = _Episode(key)
        with self._batcher:
            self._open.add(key)
            self._changed_now()
        return key

    def base_url(self, key: str) -> str:
        return f"http://{self.host}:{self.server.port}/episodes/{key}/v1"

    def close_episode(self, key: str) -> tuple[list[CallRecord], dict]:
        """The episode's calls in order, and its counts; later calls of it are refused."""
        episode = self.episodes.pop(key)
        episode.open = False
        with self._batcher:
            self._open.discard(key)
            self._changed_now()
        return [c.record for c in episode.calls], {"sampling_ignored": episode.sampling_ignored,
                                                   "refused": episode.refused}

    # ------------------------------------------------------------------------------------------- HTTP side
    async def handle(self, method: str, path: str, body: bytes) -> tuple[int, object]:
        parts = path.split("?", 1)[0].strip("/").split("/")
        if len(parts) < 3 or parts[0] != "episodes" or parts[2] != "v1":
            return 404, _error(f"no route {path}: use the base URL the episode was given (.../episodes/<key>/v1)")
        episode = self.episodes.get(parts[1])
        if episode is None or not episode.open:
            return 404, _error("this episode is over (or its key is unknown): its calls are no longer answered")
        route = "/".join(parts[3:])
        if route == "models":
            return 200, {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                     "owned_by": "grpo"}]}
        if route not in ("chat/completions", "completions"):
            return 404, _error(f"no route /v1/{route}: this endpoint serves /v1/chat/completions, /v1/completions "
                               "and /v1/models")
        if method != "POST":
            return 405, _error(f"/v1/{route} takes POST")
        self._arrived()
        queued = [False]  # set once the call waits for the engine (then no longer counted as being read)
        try:
            try:
                payload = json.loads(body or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise RequestError(f"the body is not JSON: {exc}")
            return 200, await self._answer(episode, "chat" if route == "chat/completions" else "completion", payload,
                                           queued)
        except RequestError as exc:
            episode.refused += 1
            return exc.status, exc.body()
        finally:
            if not queued[0]:
                self._read_failed()

    async def _answer(self, episode: _Episode, kind: str, payload, queued: list) -> dict:
        request = parse_request(kind, payload)
        if payload.get("temperature") not in (None, self.sampling.temperature) or \
                payload.get("top_p") not in (None, self.sampling.top_p):
            episode.sampling_ignored += 1
        if kind == "chat":
            prompt_ids, extends, differs = self._chat_prompt(episode, request)
        else:
            prompt_ids, extends = self._text_prompt(episode, request)
            differs = False
        cap = self._cap(episode, prompt_ids, request.max_tokens)
        loop = asyncio.get_running_loop()
        generation = GenerationRequest(prompt_ids, cap, loop.create_future(), loop, episode.key)
        self._queue(generation)
        queued[0] = True
        if differs is None:  # (rendered while the call waits for the engine: it is not on the way to the batch)
            differs = self._differs(request, prompt_ids)
        completion: Completion = await generation.future
        if not episode.open:
            raise RequestError("the episode ended while this call was generating", status=404)
        ids, logprobs = list(completion.token_ids), list(completion.logprobs)
        stopped = completion.finish_reason == "stop"
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        shown = [(self.tokenizer.decode([t]), lp) for t, lp in zip(ids, logprobs)] if request.logprobs else None
        record = CallRecord(len(episode.calls), kind, prompt_ids, ids, logprobs, completion.finish_reason,
                            self.policy_version, payload, {}, extends, differs)
        if kind == "chat":
            message, finish, unread = answer_message(text, request.read_tool_calls, stopped)
            record.unread_tool_calls = unread
            record.response = chat_response(self.model_name, message, finish, prompt_ids, ids, shown,
                                            request.return_token_ids)
            episode.calls.append(_Call(record, request.messages, _tools_key(request.tools),
                                       normalise_message(message)))
        else:
            record.response = completion_response(self.model_name, text, "stop" if stopped else "length",
                                                  prompt_ids, ids, shown, request.return_token_ids)
            episode.calls.append(_Call(record, prompt_text=request.prompt_text, answer_text=text))
        return record.response

    # ------------------------------------------------------------------------------------------- prompts
    def _chat_prompt(self, episode: _Episode, request) -> tuple[list[int], Optional[int], Optional[bool]]:
        """The prompt ids, the earlier call they extend (None: rendered on their own), and whether the template
        renders the conversation to other ids than those (None: not known yet, for a call that extends an earlier
        one: `_differs` tells, once the call waits for the engine)."""
        tools_key = _tools_key(request.tools)
        for call in reversed(episode.calls):
            if call.messages is None or call.tools_key != tools_key:
                continue
            n = len(call.messages)
            sent = request.messages
            if len(sent) <= n or not same_message(sent[n], call.answer) or \
                    not all(same_message(a, b) for a, b in zip(sent[:n], call.messages)):
                continue
            record = call.record
            try:
                inserted = self._environment_turns(request.tools).ids(
                    sent[n + 1:], record.completion_ids[-1] if record.completion_ids else None)
            except ToolError:
                break  # this template cannot render turns after an assistant turn on their own
            return record.prompt_ids + record.completion_ids + inserted, record.index, None
        return self._render(request.messages, request.tools), None, False

    def _differs(self, request, prompt_ids: list[int]) -> bool:
        """Whether the chat template renders the call's messages to other ids than the prompt it was given (one that
        cannot render them: True)."""
        try:
            return self._render(request.messages, request.tools) != prompt_ids
        except RequestError:
            return True

    def _text_prompt(self, episode: _Episode, request) -> tuple[list[int], Optional[int]]:
        """The prompt ids, and the earlier call whose prompt text + answer this prompt's text begins with (None:
        tokenized on its own, or given as ids)."""
        if request.prompt_ids is not None:
            return list(request.prompt_ids), None
        for call in reversed(episode.calls):
            if call.prompt_text is None:
                continue
            before = call.prompt_text + call.answer_text
            if request.prompt_text.startswith(before):
                record = call.record
                rest = request.prompt_text[len(before):]
                return record.prompt_ids + record.completion_ids + \
                    (self.tokenizer.encode(rest, add_special_tokens=False) if rest else []), record.index
        return list(self.tokenizer.encode(request.prompt_text)), None

    def _render(self, messages: list[dict], tools: Optional[list]) -> list[int]:
        if tools and not self._template_shows(tools):
            # as the trainer's own tool prompts: a template that ignores `tools=` (plain ChatML, SmolLM2's) gets the
            # tools and the <tool_call> format in the system message, so that the model can call them
            messages, tools = with_tools_in_system(messages, tools), None
        try:
            ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
        except Exception as exc:
            raise RequestError(f"the chat template cannot render these messages: {type(exc).__name__}: {exc}",
                               param="messages") from exc
        return list(ids)

    def _template_shows(self, tools: list) -> bool:
        key = _tools_key(tools)
        if key not in self._shown:
            self._shown[key] = template_shows_tools(self.tokenizer, tools)
        return self._shown[key]

    def _environment_turns(self, tools: Optional[list]) -> EnvironmentTurns:
        key = _tools_key(tools)
        if key not in self._turns:
            self._turns[key] = EnvironmentTurns(self.tokenizer, {"tools": tools} if tools else None)
        return self._turns[key]

    def _cap(self, episode: _Episode, prompt_ids: list[int], asked: Optional[int]) -> int:
        """The most tokens this call may sample; refused when the episode has no room left."""
        limits = self.limits
        if not episode.calls:
            if len(prompt_ids) > limits.max_prompt_tokens:
                raise RequestError(f"the prompt is {len(prompt_ids)} tokens long; an episode's first prompt may be "
                                   f"at most {limits.max_prompt_tokens}", param="messages",
                                   code="context_length_exceeded")
            used = 0
        else:
            used = max(0, len(prompt_ids) - len(episode.calls[0].record.prompt_ids))
        room = limits.max_episode_tokens - used
        if room < 1:
            raise RequestError(f"the episode has used its {limits.max_episode_tokens} tokens after its first prompt "
                               f"({used} with this prompt)", param="messages", code="context_length_exceeded")
        return max(1, min(limits.max_new_tokens, asked or limits.max_new_tokens, room))

    # ------------------------------------------------------------------------------------------- engine side
    def _changed_now(self) -> None:  # (under `_batcher`)
        self._changed = time.monotonic()
        self._batcher.notify_all()

    def _arrived(self) -> None:
        """A call came in: its episode counts as waiting while it is read."""
        with self._batcher:
            self._preparing += 1
            self._changed_now()

    def _queue(self, request: GenerationRequest) -> None:
        with self._batcher:
            self._preparing -= 1
            self._pending.append(request)
            self._changed_now()

    def _read_failed(self) -> None:
        """A call that came in was refused (or failed) before it reached the engine's queue."""
        with self._batcher:
            self._preparing -= 1
            self._changed_now()

    def loop_selector(self) -> selectors.BaseSelector:
        """A selector for the agents' event loop (asyncio.SelectorEventLoop(selector)) that tells the batcher when
        the loop waits with nothing ready to run: calls still to come then wait on something outside it."""
        return IdleSelector(self._loop_waits)

    def loop_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """A default executor for that loop whose jobs count as the loop's work for their first moments
        (loop_watch.EXECUTOR_BUSY_S: a connection's address lookup, a quick tool in a thread: their episodes' calls
        follow); a longer job is something to wait on, as a timer is."""
        self._executor = TrackedExecutor()
        return self._executor

    def _loop_waits(self, waits: bool) -> None:
        if waits:
            with self._batcher:
                self._loop_idle = time.monotonic()
                self._batcher.notify_all()
        else:
            self._loop_idle = None

    def _round_complete(self) -> bool:  # (under `_batcher`)
        """Every open episode has a call waiting for the engine, none still being read."""
        if self._preparing or not self._pending:
            return False
        waiting = {r.episode for r in self._pending}
        return all(key in waiting for key in self._open)

    def next_batch(self, wait_s: float, window_s: float, max_s: float = 1.0) -> list[GenerationRequest]:
        """The requests waiting for the engine: empty when none came within `wait_s`; otherwise once every open
        episode has a call waiting (a round of turns, one batch), or once the agents' loop has waited with nothing to
        do, and nothing has changed (no call came in, no episode opened or ended), for `window_s`, or `max_s` after
        the first one came."""
        with self._batcher:
            if not self._pending and not self._batcher.wait_for(lambda: self._pending, timeout=wait_s):
                return []
            until = time.monotonic() + max_s
            while not self._round_complete():
                now = time.monotonic()
                if now >= until:
                    break
                idle = self._loop_idle
                if idle is None:  # the loop is running the agents' code: their calls are on their way
                    self._batcher.wait(until - now)  # (woken when it waits again, or a call comes in)
                    continue
                idle_until = max(idle, self._changed,
                                 self._executor.busy_until() if self._executor is not None else 0.0) + window_s
                if now >= idle_until:
                    break
                self._batcher.wait(min(idle_until, until) - now)
            batch, self._pending = self._pending, []
            self._changed_now()
            return batch

    def generate_batch(self, engine: RolloutEngine, batch: list[GenerationRequest]) -> None:
        """One engine call for the batch (in the thread that owns the engine); each completion is cut to its own
        request's cap, a prefix of a sample being a sample cut by length."""
        sampling = dataclasses.replace(self.sampling, max_new_tokens=max(r.max_new_tokens for r in batch))
        try:
            completions = engine.generate([r.prompt_ids for r in batch], sampling)
            if [c.prompt_index for c in completions] != list(range(len(batch))):
                raise RuntimeError(f"the rollout engine returned {len(completions)} completions for {len(batch)} "
                                   "prompts, or not in their order")
        except BaseException as exc:
            answer_all([(request, None, exc) for request in batch])
            raise
        answers = []
        for request, completion in zip(batch, completions):
            if len(completion.token_ids) > request.max_new_tokens:
                cut = request.max_new_tokens
                completion = Completion(completion.prompt_index, completion.token_ids[:cut], completion.logprobs[:cut],
                                        "length")
            answers.append((request, completion, None))
        answer_all(answers)


def with_tools_in_system(messages: list[dict], tools: list) -> list[dict]:
    """The messages with the tools' instructions (grpo.tools.tools_system_prompt) after the system message's text,
    or as a system message of their own before the others (as grpo.data.episode_datasets.prompts_with_tools does)."""
    instructions = tools_system_prompt(tools)  # (the schemas as offered: the trainer's tool prompts list them so too)
    messages = [dict(m) for m in messages]
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{instructions}"
    else:
        messages.insert(0, {"role": "system", "content": instructions})
    return messages


def _tools_key(tools: Optional[list]) -> str:
    return json.dumps(tools, sort_keys=True) if tools else ""


def _error(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
