"""Agent episodes: many `async def agent(client, row)` at once against the endpoint, the engine driven meanwhile.

    episodes = run_agent_episodes(engine, tokenizer, agent, rows, SamplingSettings(n=4, max_new_tokens=128),
                                  AgentLimits(timeout_s=60))

runs `sampling.n` episodes per row (ordered row by row, as the engine orders completions), all at once (or at most
`max_concurrency` at a time: a served environment's session limit). The endpoint and the agents share one asyncio loop in a thread of their own; the calling thread keeps the
engine and generates the waiting calls in batches until every episode is over. Each episode gets an
`openai.AsyncOpenAI` of its own (no retries: a call is answered once) on its own base URL.

An agent that raises, or runs past `timeout_s`, gives its episode an error result (`error`, `timed_out`), never a
stopped run; its calls are still assembled (they are what the policy sampled) and the trainer scores it 0. An agent
that blocks the loop (a synchronous wait inside `async def`) holds every episode: once no episode could still be
within its time, the run goes on without the unfinished ones (error results) and leaves that loop behind.
The engine failing stops the run: that is not the agent's doing.
"""
from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from grpo.agents.endpoint import AgentEndpoint, EndpointLimits
from grpo.agents.openai_format import RequestError, normalise_message
from grpo.agents.records import ON_MISMATCH, CallRecord, assemble_calls
from grpo.agents.registry import check_agent_function
from grpo.rollout.engine import Completion, RolloutEngine, SamplingSettings

logger = logging.getLogger("grpo")

OPENAI_HINT = "agent episodes need the openai client: pip install 'grpo[agents]'"


@dataclass
class AgentLimits:
    max_prompt_tokens: int = 1024     # an episode's first prompt
    max_episode_tokens: int = 1024   # everything after it: sampled, tool and user tokens of every call together
    timeout_s: float = 300.0         # one episode, from its start to its agent's return
    max_concurrency: int = 0         # episodes running at once; 0: all of them, so that a round of turns is one engine
                                     # call (as the trainer's own episode loop); a limit makes later episodes start
                                     # as earlier ones end, out of step with them, and the rounds split
    on_mismatch: str = "truncate"    # a call that does not extend the episode's calls: keep the episode up to it
                                     # ("truncate") or not train on it ("drop")
    gather_s: float = 0.01           # calls wait for the engine until every running episode has one waiting (one
                                     # batch a round of turns), or until nothing came in for this long (an agent busy
                                     # between its turns holds the others no longer)
    gather_max_s: float = 1.0        # ... and at most this long after the first of them

    def __post_init__(self):
        if self.on_mismatch not in ON_MISMATCH:
            raise ValueError(f"on_mismatch must be one of {', '.join(ON_MISMATCH)}, got {self.on_mismatch!r}")
        if self.timeout_s <= 0 or self.max_concurrency < 0:
            raise ValueError(f"timeout_s must be > 0 and max_concurrency at least 0 (0: all), got {self.timeout_s} and "
                             f"{self.max_concurrency}")


@dataclass
class AgentEpisode:
    prompt_index: int
    row: dict
    prompt_ids: list[int] = field(default_factory=list)       # the first call's prompt
    completion_ids: list[int] = field(default_factory=list)   # see grpo.agents.records.assemble_calls
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)     # every call, in order of arrival
    result: Any = None              # what the agent returned
    error: Optional[str] = None     # why the agent failed (its exception, or the timeout); None: it returned
    timed_out: bool = False
    mismatch: Optional[str] = None  # why a call did not extend the earlier ones (records.assemble_calls)
    dropped: bool = False           # nothing of it is trained on (a mismatch under on_mismatch="drop")
    calls_kept: int = 0             # calls whose sampled ids are in completion_ids
    finish_reason: str = ""         # the last kept call's: "stop" | "length"
    sampling_ignored: int = 0       # calls that asked for another temperature / top_p than the run's
    refused_calls: int = 0          # calls answered with an error (bad request, no room left, ...)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def final_text(self) -> str:
        """The agent's answer as text: its result when that is text (or a dict's "completion" / "answer"), else the
        model's last answer."""
        if isinstance(self.result, str):
            return self.result
        if isinstance(self.result, dict):
            for key in ("completion", "answer"):
                if isinstance(self.result.get(key), str):
                    return self.result[key]
        for call in reversed(self.calls):
            choice = (call.response.get("choices") or [{}])[0]
            text = choice.get("message", {}).get("content") if call.kind == "chat" else choice.get("text")
            if text is not None:
                return text
        return ""

    @property
    def messages(self) -> list[dict]:
        """The conversation as the agent last had it (what rewards read as `messages`): its last chat call's messages
        and the answer to them; a completions call as one user and one assistant message; the row's messages when
        it made no call."""
        for call in reversed(self.calls):
            choice = (call.response.get("choices") or [{}])[0]
            if call.kind == "chat" and isinstance(call.request.get("messages"), list):
                try:
                    sent = [normalise_message(m, i) for i, m in enumerate(call.request["messages"])]
                    return sent + [normalise_message(choice.get("message") or {"role": "assistant"})]
                except RequestError:
                    continue
            if call.kind == "completion":
                prompt = call.request.get("prompt")
                return [{"role": "user", "content": prompt if isinstance(prompt, str) else ""},
                        {"role": "assistant", "content": choice.get("text") or ""}]
        return [dict(m) for m in self.row.get("messages") or []]

    def as_completion(self) -> Completion:
        """The episode in the engine protocol's shape, its mask with it."""
        finish = "length" if self.finish_reason == "length" else "stop"
        return Completion(self.prompt_index, self.completion_ids, self.logprobs, finish, mask=list(self.mask))


def run_agent_episodes(engine: RolloutEngine, tokenizer, agent: Callable, rows: list[dict],
                       sampling: SamplingSettings, limits: Optional[AgentLimits] = None, policy_version: int = 0,
                       model_name: str = "policy") -> list[AgentEpisode]:
    """`sampling.n` episodes of `agent` per row; see the module's docstring. `sampling.max_new_tokens` bounds each
    call (a request may ask fewer); `policy_version` is recorded with every call."""
    try:
        from openai import AsyncOpenAI
    except ImportError as exc:
        raise ImportError(OPENAI_HINT) from exc
    check_agent_function(agent)
    limits = limits or AgentLimits()
    endpoint = AgentEndpoint(tokenizer, sampling,
                             EndpointLimits(sampling.max_new_tokens, limits.max_prompt_tokens,
                                            limits.max_episode_tokens),
                             policy_version=policy_version, model_name=model_name)
    jobs = [(index, row) for index, row in enumerate(rows) for _ in range(sampling.n)]
    episodes: list[Optional[AgentEpisode]] = [None] * len(jobs)
    state = _LoopState()
    at_once = limits.max_concurrency or max(len(jobs), 1)

    async def one(slot: int, semaphore: asyncio.Semaphore) -> None:
        index, row = jobs[slot]
        async with semaphore:
            key = endpoint.open_episode()
            client = AsyncOpenAI(base_url=endpoint.base_url(key), api_key=key, max_retries=0,
                                 timeout=limits.timeout_s, http_client=_http_client())
            started = time.monotonic()
            result, error, timed_out = None, None, False
            try:
                result, error, timed_out = await _run_agent(agent, client, dict(row), limits.timeout_s)
            finally:
                calls, counts = endpoint.close_episode(key)
                try:
                    await client.close()
                except Exception:  # the agent closed it, or its pool is in a state of its own: nothing to keep
                    pass
            episodes[slot] = _episode(index, row, calls, counts, result, error, timed_out, limits.on_mismatch,
                                      time.monotonic() - started)

    async def main() -> None:
        state.loop = asyncio.get_running_loop()
        state.loop.set_default_executor(endpoint.loop_executor())
        await endpoint.start()
        state.started.set()
        semaphore = asyncio.Semaphore(at_once)
        state.tasks = [asyncio.ensure_future(one(slot, semaphore)) for slot in range(len(jobs))]
        try:
            await asyncio.gather(*state.tasks, return_exceptions=True)
        finally:
            await endpoint.close()

    def loop_thread() -> None:
        try:
            if hasattr(asyncio, "Runner"):  # (3.11+) on a loop that tells the endpoint's batcher when it is idle
                with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(endpoint.loop_selector())) as run:
                    run.run(main())
            else:
                asyncio.run(main())
        except BaseException as exc:  # surfaces in the engine's thread
            state.failure = exc
        finally:
            state.started.set()

    thread = threading.Thread(target=loop_thread, name="grpo-agents", daemon=True)
    thread.start()
    state.started.wait()
    # every episode has had its time once this passes; only an agent that blocks the loop keeps it running
    deadline = time.monotonic() + limits.timeout_s * math.ceil(len(jobs) / at_once) + 30.0
    while thread.is_alive() and time.monotonic() < deadline:
        batch = endpoint.next_batch(0.05, limits.gather_s, limits.gather_max_s)
        if batch:
            try:
                endpoint.generate_batch(engine, batch)
            except BaseException:
                state.cancel_all()
                thread.join(timeout=10.0)
                raise
    if state.failure is not None:
        raise RuntimeError(f"the agent episodes' loop failed: {type(state.failure).__name__}: "
                           f"{state.failure}") from state.failure
    if thread.is_alive():
        logger.warning("agent episodes: %d of %d episodes had not ended %.0f s after their time was up: an agent "
                       "blocks the event loop (a synchronous wait inside `async def`?); they are scored as errors",
                       sum(e is None for e in episodes), len(episodes), 30.0)
        state.cancel_all()
    episodes = [e if e is not None else
                AgentEpisode(jobs[slot][0], jobs[slot][1], error="the agent blocked the event loop past its time "
                             "(a synchronous wait inside `async def`?)", timed_out=True)
                for slot, e in enumerate(episodes)]
    _log_failures(episodes)
    return episodes


class _LoopState:
    def __init__(self):
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.tasks: list = []
        self.started = threading.Event()
        self.failure: Optional[BaseException] = None

    def cancel_all(self) -> None:
        if self.loop is not None and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(lambda: [t.cancel() for t in self.tasks])
            except RuntimeError:  # the loop has just closed
                pass


_SSL_CONTEXT = None


def _http_client():
    """An HTTP client for one episode's AsyncOpenAI, as the openai package makes its own but sharing one SSL context:
    each default one loads the system's CA certificates again (~25 ms, on the agents' loop, per episode), none of
    which a plain-HTTP endpoint on this host needs. None (openai's own) where the package has no such client."""
    global _SSL_CONTEXT
    try:
        from openai import DefaultAsyncHttpxClient
    except ImportError:
        return None
    if _SSL_CONTEXT is None:
        import ssl
        _SSL_CONTEXT = ssl.create_default_context()
    return DefaultAsyncHttpxClient(verify=_SSL_CONTEXT)


async def _run_agent(agent: Callable, client, row: dict, timeout_s: float) -> tuple[Any, Optional[str], bool]:
    """(result, error, timed out): whatever the agent does, an answer."""
    try:
        run = agent(client, row)
        if not asyncio.iscoroutine(run) and not asyncio.isfuture(run):
            return None, f"the agent returned {type(run).__name__}, not an awaitable: write `async def`", False
        task = asyncio.ensure_future(run)
    except Exception as exc:
        return None, _describe(exc), False
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:  # the run is stopping (the engine failed): the agent with it
        task.cancel()
        raise
    if not done:
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)  # its own cleanup (an agent that ignores the cancel is left)
        return None, f"the agent did not finish within {timeout_s:g} s", True
    if task.cancelled():
        return None, "the agent was cancelled", False
    exc = task.exception()
    if exc is not None:
        return None, _describe(exc), False
    return task.result(), None, False


def _describe(exc: BaseException) -> str:
    where = traceback.extract_tb(exc.__traceback__)
    at = f" (at {where[-1].filename}:{where[-1].lineno})" if where else ""
    return f"{type(exc).__name__}: {exc}{at}"


def _episode(index: int, row: dict, calls: list[CallRecord], counts: dict, result, error, timed_out: bool,
             on_mismatch: str, seconds: float) -> AgentEpisode:
    assembled = assemble_calls(calls, on_mismatch)
    return AgentEpisode(index, row, assembled.prompt_ids, assembled.completion_ids, assembled.mask,
                        assembled.logprobs, calls, result, error, timed_out, assembled.mismatch, assembled.dropped,
                        assembled.calls_kept, assembled.finish_reason, counts["sampling_ignored"], counts["refused"],
                        seconds)


def _log_failures(episodes: list[AgentEpisode]) -> None:
    failed = [e for e in episodes if e.error is not None]
    if failed:
        logger.warning("agent episodes: %d of %d failed (scored 0), %d of them past their time; the first: %s",
                       len(failed), len(episodes), sum(e.timed_out for e in failed), failed[0].error)
    mismatched = [e for e in episodes if e.mismatch is not None]
    if mismatched:
        logger.warning("agent episodes: %d of %d made a call that does not continue their earlier calls (%s); the "
                       "first: %s", len(mismatched), len(episodes),
                       "not trained on" if mismatched[0].dropped else "trained on up to that call",
                       mismatched[0].mismatch)


def tool_calls_written(call: CallRecord) -> int:
    """The tool-call blocks the model wrote in a chat call's answer: those read (the answer's `tool_calls`) and those
    that could not be (left in its content), as the trainer's own episodes count every block (episodes/tool_calls)."""
    if call.kind != "chat":
        return 0
    message = (call.response.get("choices") or [{}])[0].get("message") or {}
    return len(message.get("tool_calls") or []) + call.unread_tool_calls


def agent_metrics(episodes: list[AgentEpisode]) -> dict:
    """The episodes' count, and per-episode means for logging: failures, timeouts, mismatches, calls, the calls'
    counts, and the tool calls the model wrote (per episode, and the share of episodes with at least one)."""
    n = max(1, len(episodes))
    written = [sum(tool_calls_written(c) for c in e.calls) for e in episodes]
    return {"agents/episodes": float(len(episodes)),
            "agents/errors": sum(e.error is not None for e in episodes) / n,
            "agents/timeouts": sum(e.timed_out for e in episodes) / n,
            "agents/mismatches": sum(e.mismatch is not None for e in episodes) / n,
            "agents/dropped": sum(e.dropped for e in episodes) / n,
            "agents/calls": sum(len(e.calls) for e in episodes) / n,
            "agents/calls_kept": sum(e.calls_kept for e in episodes) / n,
            "agents/refused_calls": sum(e.refused_calls for e in episodes) / n,
            "agents/sampling_ignored": sum(e.sampling_ignored for e in episodes) / n,
            "agents/rerender_differs": sum(c.rerender_differs for e in episodes for c in e.calls) / n,
            "agents/unread_tool_calls": sum(c.unread_tool_calls for e in episodes for c in e.calls) / n,
            "agents/tool_calls": sum(written) / n,
            "agents/called_a_tool": sum(w > 0 for w in written) / n,
            "agents/seconds": sum(e.seconds for e in episodes) / n}

