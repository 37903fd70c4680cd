"""A step's rollouts: prompts -> k completions each (vLLM, the HF engine, or the rollout ranks of server mode) ->
their rewards, with the engine woken before and put to sleep after; and the same path for evaluation.

`RolloutCollector` holds what the rollout needs (engine, tokenizer, rewards, prompts and their order) and the one piece
of state it owns: with streamed rollouts (--max_staleness, --async_rollout), the requests in flight ahead of
training (ahead.py). The trainer passes its `TrainerState` in
(the step and the resumable data position, which drawing prompts advances) and gives a `sync_weights` callable, the
one way back into training: an engine whose weights were dropped gets the policy again before it generates.

Rows of a dataset with tools or an environment (`episode_datasets`) run as multi-turn episodes
(grpo.rollout.episodes): their completion is the whole episode, model and environment tokens with a mask that keeps
the environment's out of the loss; their rewards read the model's last message (and get the conversation as
`messages`). Other rows of the same step generate as usual. An engine that `runs_episodes` (server mode) runs them
where it generates; for the others the collector runs them turn by turn through `generate`. Rows of a dataset that
names an agent are played by that agent against an OpenAI-compatible endpoint over this engine: the trainer passes
them in as `agents` (grpo.agents.rollouts.AgentRollouts, a layer above this package); each episode's calls become its
completion, and an episode whose agent failed scores 0.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from grpo.rollout.ahead import RequestsAhead, steps_to_post
from grpo.rollout.dynamic_sampling import PendingRollouts, RolloutRound, dynamic_rollouts
from grpo.rollout.engine import RolloutEngine, SamplingSettings
from grpo.rollout.episodes import Episode, EpisodeLimits, EpisodePrompt, episode_metrics, run_episodes
from grpo.runtime import distributed as dist_utils
from grpo.runtime.failures import phase
from grpo.runtime.sequence_parallel import rollout_groups
from grpo.rollout.turn_timing import TimedEngine, TurnTimes
from grpo.rollout.staleness import group_staleness, groups_over_bound, sampled_versions, staleness_metrics

logger = logging.getLogger("grpo")


@dataclass
class RolloutTickets:
    """One request to the rollout engine: prompts that generate in one turn and prompts that run as episodes, each
    with the engine's ticket (grpo.rollout.remote.Ticket in server mode; a deferred request otherwise)."""
    single: list[int]                      # indices of the one-turn prompts
    multi: list[int]                       # indices of the episode prompts
    completions: object = None             # the engine's ticket for the one-turn prompts
    episodes: object = None                # ... for the episodes (or, run here when collected: prompts, sampling)
    agents: list[int] = field(default_factory=list)  # indices of the prompts agents play (run here when collected)
    agent_sampling: object = None          # ... and their sampling settings


class RolloutCollector:
    def __init__(self, config, engine: RolloutEngine, tokenizer, rewards, vision, train_set, order,
                 total_steps: int, sync_weights: Callable[[], float], episode_datasets: Optional[dict] = None,
                 agents=None):
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.rewards = rewards            # grpo.rewards.RewardRouter
        self.vision = vision              # grpo.model.vision.VisionProcessor or None
        self.train_set = train_set        # rendered prompt rows
        self.order = order                # grpo.data.sampler.PromptOrder
        self.total_steps = total_steps
        self.sync_weights = sync_weights
        self.ahead = RequestsAhead()  # streamed rollouts: the next steps' requests, in flight
        self.stream_counts = {"groups_regenerated": 0, "idle_seen": 0.0, "resume_noted": False}
        self.sizes: dict = {}                          # the step's sizes, for an out-of-memory message
        self.episode_datasets = episode_datasets or {}  # {dataset: grpo.data.episode_datasets.EpisodeDataset}
        # every dataset of the run plays episodes: no rank ever has a one-turn prompt, so a collective engine is
        # spared the empty one-turn request every rank would otherwise make together
        self.only_episodes = bool(self.episode_datasets) and \
            set(config.dataset_names + config.eval_dataset_names) <= set(self.episode_datasets)
        self.episodes_drawn: list[Episode] = []         # this step's episodes, every round (for their metrics)
        self.eval_episodes: list[Episode] = []          # the last evaluation's, on this rank
        self.eval_agent_episodes: list = []            # ... its agents' (grpo.agents.runner.AgentEpisode)
        # this step's multi-turn loops run here, per model turn: in the engine's generate or around it (turn_timing.py)
        self.turn_times = {"episodes": TurnTimes(), "agents": TurnTimes()}
        # rows of datasets that name an agent (grpo.agents.rollouts.AgentRollouts over this engine, or None): played
        # against the OpenAI-compatible endpoint
        self.agents = agents
        # --sequence_parallel_size N > 1: the N ranks of a group train on the same rollouts (None without)
        self.rollout_group = rollout_groups(getattr(config, "sequence_parallel_size", 1))
        # ... which their engines generate in shares (--sequence_parallel_rollout share), unless the engine generates
        # collectively (tensor parallel: every rank the same request), or its forward gathers ZeRO-3 weights and some
        # rank would have no share (k < N: that rank could not take part in every forward)
        group = self.rollout_group
        self.shares_generation = group is not None and config.sequence_parallel_rollout == "share" \
            and not engine.collective_generate and not (engine.gathers_weights and config.k_samples < group.size)

    @property
    def first_in_group(self) -> bool:
        """Whether this rank speaks for its rollouts (writes its completions): always, except on the other ranks of a
        sequence-parallel group, which hold the same rollouts as its first rank."""
        return self.rollout_group is None or self.rollout_group.generates

    # ------------------------------------------------------------------------------------------- training
    def collect(self, state) -> tuple[RolloutRound, RolloutRound]:
        """The step's prompts with k scored completions each: one round, or with --filter_zero_std_groups as many
        rounds as it takes to fill the step with groups whose rewards differ (see dynamic_sampling.py).
        Returns (kept, drawn): what the step trains on, and every completion sampled (for reward metrics)."""
        cfg = self.config
        if not self.stream_counts["resume_noted"]:
            self._note_resumed_stream(state)
        wake = self._switch_engine(awake=True)  # once for all rounds: each sleep drops the KV cache and weights
        self.episodes_drawn = []
        self.turn_times = {"episodes": TurnTimes(), "agents": TurnTimes()}
        if self.agents:
            self.agents.start_step(state.step)
        prompts_per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
        if not cfg.filter_zero_std_groups:
            kept = drawn = self._round(state)
        else:
            kept, drawn = dynamic_rollouts(lambda: self._round(state), cfg.k_samples, prompts_per_step,
                                           cfg.max_generation_rounds, dist_utils.any_rank)
        sleep = self._switch_engine(awake=False)
        if self.episodes_drawn:
            kept.stats.update(episode_metrics(self.episodes_drawn))
        if self.agents:
            kept.stats.update(self.agents.metrics())
        for kind, times in self.turn_times.items():  # episodes/turn_s, agents/turn_overhead_s, ...
            kept.stats.update(times.metrics(kind))
        if cfg.rollout_staleness:
            kept.stats.update(self._stream_metrics(kept, state))
        kept.times.update(rollout=kept.times["rollout"] + wake + sleep, rollout_wake=wake, rollout_sleep=sleep)
        return kept, drawn

    def trained_position(self, state) -> tuple[int, int]:
        """The data position a checkpoint saves: prompts drawn for a request still in flight are not trained yet,
        so a resume draws them again."""
        return self.ahead.position_before_oldest() or (state.epoch, state.position)

    def stream_record(self) -> dict:
        """What a checkpoint records of the stream (in its trainer state): the requests in flight and how many of
        their groups were already generated. A resume draws their prompts again (see trained_position), so those
        groups are generated again, by the restored policy; none is trained on twice."""
        if not self.config.rollout_staleness:
            return {}
        in_flight = self.ahead.pending()
        groups = [len(p.prompts) for p in in_flight]
        done = [n for p, n in zip(in_flight, groups)
                if p.ticket.completions is not None and self.engine.request_done(p.ticket.completions)]
        return {"stream": {"requests_in_flight": len(in_flight), "groups_in_flight": sum(groups),
                           "groups_finished_not_trained": sum(done)}}

    def close(self) -> None:
        self.engine.close()

    @phase("rollout")
    def _switch_engine(self, awake: bool) -> float:
        """Wake the rollout engine (or put it to sleep); returns the seconds it took."""
        start = time.perf_counter()
        if awake:
            self.restore_engine_weights()
            self.engine.wake()
        else:
            self.engine.sleep()
        return time.perf_counter() - start

    def restore_engine_weights(self) -> None:
        """If the engine's last sleep dropped its weights and no whole sync followed (a step stopped between its
        rollout and its sync, e.g. interrupted in a notebook), sync again. Every rank takes part and they agree first:
        under ZeRO-3 the sync gathers parameters collectively. Only engines that drop weights (`needs_every_weight`,
        the same on every rank: one engine kind per job) pay for that agreement."""
        if self.engine.needs_every_weight and dist_utils.any_rank(self.engine.weights_dropped):
            self.sync_weights()

    def _round(self, state) -> RolloutRound:
        # --async_rollout: this step's request went out during the previous step; the next step's goes out now, so
        # the rollout ranks generate it while this step trains (one step off policy)
        # (--max_staleness K: the next K steps' requests are in flight; K = 1 is --async_rollout)
        pending = self.ahead.pop() or self._request(self._next_prompts(state), state.step)
        for _ in range(steps_to_post(len(self.ahead), self.config.rollout_staleness, state.step, self.total_steps)):
            position = (state.epoch, state.position)
            self.ahead.push(self._request(self._next_prompts(state), state.step, steps_ahead=len(self.ahead) + 1),
                            position)
        completions, texts, messages, times = self._receive(pending)
        if self.config.rollout_staleness:
            self._regenerate_stale(pending, state.step, completions, texts, messages, times)
        # in-place mode: the adapter leaves the shared base while the CPU scores (with more rounds to come it stays,
        # and the sleep takes it out); its launches count as rollout time
        if self.engine.merges_in_place and not self.config.filter_zero_std_groups:
            start = time.perf_counter()
            self.engine.release_base()
            times["rollout_release"] = time.perf_counter() - start
            times["rollout"] += times["rollout_release"]
        result, times["reward"] = self._score(pending.prompts, texts, completions, self.config.k_samples, messages)
        stats = {"rollout/staleness": float(state.step - pending.policy_step)} if self.config.rollout_staleness else {}
        return RolloutRound(pending.prompts, completions, texts, result, pending.images, times, stats)

    def _regenerate_stale(self, pending: PendingRollouts, step: int, completions: list, texts: list, messages: list,
                          times: dict) -> None:
        """Groups whose oldest token is more than --max_staleness versions behind the policy that trains on them are
        generated again now, in place (every rank takes part: the request is collective). Regenerated, not dropped: the
        step keeps its k completions of every prompt drawn, and no prompt goes untrained. The requests ahead are
        bounded so that this cannot happen (see docs/server_mode.md); it guards the bound all the same."""
        k = pending.sampling.n
        stale = groups_over_bound(group_staleness([sampled_versions(c.versions, c.mask) for c in completions], k,
                                                  step), self.config.rollout_staleness)
        if not dist_utils.any_rank(bool(stale)):
            return
        self.stream_counts["groups_regenerated"] += len(stale)
        again = self._request([pending.prompts[g] for g in stale], step)
        fresh, fresh_texts, fresh_messages, fresh_times = self._receive(again)
        for j, g in enumerate(stale):
            rows = slice(g * k, (g + 1) * k)
            completions[rows] = [replace(c, prompt_index=g) for c in fresh[j * k:(j + 1) * k]]
            texts[rows], messages[rows] = fresh_texts[j * k:(j + 1) * k], fresh_messages[j * k:(j + 1) * k]
        for key in ("rollout", "rollout_generate"):
            times[key] += fresh_times[key]

    def _stream_metrics(self, kept: RolloutRound, state) -> dict:
        """The step's view of the stream: its tokens' staleness (staleness.py), groups regenerated, the seconds the
        rollout ranks waited with nothing to generate (mean over them, since the last step) and the seconds this
        rank waited for its rollouts."""
        metrics = staleness_metrics([sampled_versions(c.versions, c.mask) for c in kept.completions], state.step)
        idle = self.engine.idle_seconds
        if idle:
            total = sum(idle) / len(idle)
            metrics["stream/rollout_idle_s"] = total - self.stream_counts["idle_seen"]
            self.stream_counts["idle_seen"] = total
        metrics["stream/groups_regenerated"] = float(self.stream_counts["groups_regenerated"])
        self.stream_counts["groups_regenerated"] = 0
        metrics["stream/trainer_wait_s"] = kept.times.get("rollout_generate", 0.0)
        return metrics

    def _note_resumed_stream(self, state) -> None:
        """Once, on the first step of a resumed run: what became of the stream the checkpoint recorded."""
        self.stream_counts["resume_noted"] = True
        record = state.extra.get("stream") if state.step else None
        if record and record.get("requests_in_flight") and dist_utils.is_main():
            logger.info(f"resuming a stream at step {state.step}: the checkpoint had {record['requests_in_flight']} "
                        f"request(s) in flight ({record['groups_in_flight']} group(s) per rank, "
                        f"{record['groups_finished_not_trained']} of them generated but not trained on); their prompts "
                        f"are drawn again and generated by the restored policy, so none is skipped or trained on twice")

    @phase("data")
    def _next_prompts(self, state) -> list[dict]:
        """This rank's prompts for the step (different on every rank), advancing the resumable position."""
        indices, state.epoch, state.position = self.order.next(state.epoch, state.position)
        rows = self.train_set.select(indices)
        return [dict(row, index=i) for row, i in zip(rows, indices)]

    @phase("rollout")
    def _request(self, prompts: list[dict], step: int, steps_ahead: int = 0) -> PendingRollouts:
        """Ask for k completions per prompt: posted at once to server-mode rollout ranks, generated on collection by
        a colocated engine. `steps_ahead`: 1 for the next step's prompts (--async_rollout)."""
        cfg = self.config
        start = time.perf_counter()
        # the engine's log-probs serve the IS correction (every step) and the mismatch metric (every N steps, counted
        # by the step that trains on them)
        logprobs = cfg.is_correction or (step + steps_ahead) % cfg.logprob_check_steps == 0
        sampling = SamplingSettings(n=cfg.k_samples, max_new_tokens=cfg.rollout_max_new_tokens,
                                    temperature=cfg.temperature, top_p=cfg.top_p, logprobs=logprobs)
        images = self.prompt_images(prompts)  # each prompt's pixels once, shared by its k samples
        pending = PendingRollouts(prompts, images, sampling, policy_step=step)
        images_done = time.perf_counter()
        # a sequence-parallel group's ranks each generate their share of every prompt's k completions
        mine = replace(sampling, n=self.rollout_group.share_of(cfg.k_samples)) if self.shares_generation else sampling
        # posted now in server mode; else on collection
        pending.ticket = self._submit(prompts, mine, images) if mine.n else RolloutTickets(single=[], multi=[])
        pending.seconds = {"rollout_images": images_done - start, "rollout_submit": time.perf_counter() - images_done}
        return pending

    @phase("rollout")
    def _receive(self, pending: PendingRollouts):
        """The k completions per prompt (grouped by prompt), their texts (an episode's: the model's last message), each
        completion's conversation, and where the time went."""
        cfg = self.config
        self.sizes = {"prompts per rank": len(pending.prompts),
                      "completions per rank": len(pending.prompts) * cfg.k_samples,
                      **({"generated per rank (its share)": len(pending.prompts) *
                          self.rollout_group.share_of(cfg.k_samples)} if self.shares_generation else {}),
                      "--rollout_max_new_tokens": cfg.rollout_max_new_tokens}
        start = time.perf_counter()
        # server mode: waits; engine_tokens: what this rank's own engine generated (its share, under shares)
        completions, episodes, engine_tokens = self._collect_in_group(pending.prompts, pending.ticket)
        self.episodes_drawn += [e for e in episodes if isinstance(e, Episode)]  # (agents' have metrics of their own)
        generated = time.perf_counter()
        texts, messages = self._texts_and_messages(pending.prompts, completions, episodes, pending.sampling.n)
        # time/rollout_images, _submit, _generate (the wait, in server mode), _decode (+ _wake, _sleep)
        parts = {**pending.seconds, "rollout_generate": generated - start,
                 "rollout_decode": time.perf_counter() - generated}
        return completions, texts, messages, {"rollout": sum(parts.values()), **parts, "_rollout_tokens": engine_tokens}

    def _generate(self, prompts: list[dict], sampling: SamplingSettings, images: Optional[list]):
        """`sampling.n` completions per prompt, grouped by prompt, and per completion its Episode (None for a row
        that generates in one turn)."""
        return self._collect(prompts, self._submit(prompts, sampling, images))

    def _submit(self, prompts: list[dict], sampling: SamplingSettings, images: Optional[list]) -> RolloutTickets:
        """Ask the engine for the prompts' completions: rows of episode datasets as episodes, the others in one
        request. An engine that runs episodes itself (server mode) gets them now; for the others they run turn by
        turn when collected. With an engine that generates in step every rank takes part in both, rows of its own or
        not. Rows that agents play run when collected."""
        runs_episode = [p.get("data_source") in self.episode_datasets for p in prompts]
        played = [bool(self.agents) and self.agents.plays(p) for p in prompts]
        tickets = RolloutTickets(single=[i for i, (e, a) in enumerate(zip(runs_episode, played)) if not (e or a)],
                                 multi=[i for i, e in enumerate(runs_episode) if e],
                                 agents=[i for i, a in enumerate(played) if a], agent_sampling=sampling)
        in_step = self.engine.generates_in_step
        if tickets.single or (in_step and not self.only_episodes):
            pick = [images[i] for i in tickets.single] if images else None
            tickets.completions = self.engine.submit([prompts[i]["prompt_ids"] for i in tickets.single], sampling, pick)
        if tickets.multi or (in_step and self.episode_datasets):
            episode_prompts = [self._episode_prompt(prompts[i]) for i in tickets.multi]
            tickets.episodes = self.engine.submit_episodes(episode_prompts, sampling, self._episode_limits()) \
                if self.engine.runs_episodes else (episode_prompts, sampling)
        return tickets

    def _collect_in_group(self, prompts: list[dict], tickets: RolloutTickets):
        """`_collect`, except under sequence parallelism, where every rank of the group ends with the same completions
        and episodes before any reward is computed: each rank's share of every prompt's, gathered in rank order
        (`shares_generation`), or the first rank's (every rank generates when the engine's generate is collective),
        handed to the others. In the latter case their engines still wake, sleep and take weights with everyone's
        (and, under ZeRO-3 with the HF engine, generate too: its forward gathers weights collectively).
        Returns (completions, episodes, the tokens this rank's engine generated: the throughput metric's count)."""
        group = self.rollout_group
        if group is None:
            completions, episodes = self._collect(prompts, tickets)
            return completions, episodes, completion_tokens(completions)
        if self.shares_generation:
            mine = self._collect(prompts, tickets)
            merged = merge_group_shares(group.gather(mine), len(prompts))
            return *merged, completion_tokens(mine[0])
        takes_part = group.generates or self.engine.generates_in_step
        generated = self._collect(prompts, tickets) if takes_part else None
        return *group.share(generated), completion_tokens(generated[0]) if generated else 0

    def _collect(self, prompts: list[dict], tickets: RolloutTickets):
        """What `_submit` asked for: the completions grouped by prompt, and per completion its Episode or None."""
        by_prompt: list[list] = [[] for _ in prompts]
        if tickets.completions is not None:
            for c in self.engine.collect(tickets.completions):
                by_prompt[tickets.single[c.prompt_index]].append((c, None))
        if tickets.episodes is not None:
            if self.engine.runs_episodes:
                found = self.engine.collect_episodes(tickets.episodes)
            else:
                timed, start = TimedEngine(self.engine), time.perf_counter()
                found = run_episodes(timed, self.tokenizer, *tickets.episodes, self._episode_limits(),
                                     any_rank=dist_utils.any_rank)
                self.turn_times["episodes"].add(time.perf_counter() - start, timed, sum(e.turns for e in found))
            for e in found:
                by_prompt[tickets.multi[e.prompt_index]].append((e.as_completion(), e))
        if tickets.agents:  # (their rows' prompt_ids become the ids their episodes' first prompts share)
            timed, start = TimedEngine(self.engine), time.perf_counter()
            played = self.agents.run(timed, self.tokenizer, [prompts[i] for i in tickets.agents],
                                     tickets.agent_sampling)
            # a model turn of an agent episode: a call the endpoint answered
            self.turn_times["agents"].add(time.perf_counter() - start, timed, sum(len(e.calls) for _, _, e in played))
            for index, completion, episode in played:
                by_prompt[tickets.agents[index]].append((completion, episode))
        completions, episodes = [], []
        for index, group in enumerate(by_prompt):
            for completion, episode in group:
                completions.append(replace(completion, prompt_index=index))  # (its versions and mask kept)
                episodes.append(episode)
        return completions, episodes

    def _episode_prompt(self, row: dict) -> EpisodePrompt:
        dataset = self.episode_datasets[row["data_source"]]
        fields = {"tools": list(dataset.tools), "answer": row["answer"], "data_source": row["data_source"]}
        return EpisodePrompt(list(row["prompt_ids"]), [dict(m) for m in row["messages"]], fields,
                             environment=dataset.environment)

    def _episode_limits(self) -> EpisodeLimits:
        return EpisodeLimits(max_turns=self.config.max_turns, max_episode_tokens=self.config.episode_token_budget)

    def _texts_and_messages(self, prompts: list[dict], completions: list, episodes: list, per_prompt: int):
        """What rewards read: the completion's text (an episode's final message), and the conversation (the prompt's
        messages, then every turn; a one-turn completion is one assistant message)."""
        decoded = iter(self._decode([c for c, e in zip(completions, episodes) if e is None]))
        texts, messages = [], []
        for i, (completion, episode) in enumerate(zip(completions, episodes)):
            if episode is not None:
                texts.append(episode.final_text)
                messages.append(episode.messages)
            else:
                text = next(decoded)
                texts.append(text)
                prompt_messages = prompts[i // per_prompt].get("messages") or []
                messages.append([dict(m) for m in prompt_messages] + [{"role": "assistant", "content": text}])
        return texts, messages

    @phase("rewards")
    def _score(self, prompts: list[dict], texts: list[str], completions: list, per_prompt: int, messages: list):
        """The reward of each completion (grouped by prompt, `per_prompt` each), and the seconds it took."""
        start = time.perf_counter()
        rows = [p for p in prompts for _ in range(per_prompt)]
        result = self.rewards(texts, [p["answer"] for p in rows], [p["data_source"] for p in rows],
                              prompts=[p["prompt_text"] for p in rows],
                              completion_ids=[c.token_ids for c in completions],
                              prompt_messages=[p.get("messages") for p in rows], messages=messages,
                              **({"agent_results": self.agents.results(prompts, per_prompt)} if self.agents else {}))
        if self.agents:  # an episode whose agent failed scores 0
            result = self.agents.zero_failed(result, prompts, per_prompt)
        return result, time.perf_counter() - start

    def _decode(self, completions: list) -> list[str]:
        return self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)

    def prompt_images(self, prompts: list[dict]) -> Optional[list]:
        """Per prompt, its processed images (vision-language models; None for a text prompt); None without any."""
        if self.vision is None or not any(p.get("images") for p in prompts):
            return None
        return [self.vision.prompt_images(p.get("images") or []) for p in prompts]

    # ------------------------------------------------------------------------------------------- evaluation
    def evaluate(self, rows: list[dict]):
        """One completion per eval prompt (greedy with --eval_greedy) through the rollout path, scored.
        Returns (completions, texts, rewards); every rank calls it, with or without rows of its own."""
        cfg = self.config
        self.restore_engine_weights()  # on every rank, with or without eval rows
        completions: list = []
        self.eval_episodes, self.eval_agent_episodes = [], []
        if rows or self.engine.generates_in_step:  # all ranks generate together
            self.engine.wake()
            sampling = SamplingSettings(n=1, max_new_tokens=cfg.rollout_max_new_tokens, temperature=cfg.temperature,
                                        top_p=cfg.top_p, greedy=cfg.eval_greedy, logprobs=False)
            if self.episode_datasets or self.agents:
                completions, episodes = self._generate(rows, sampling, self.prompt_images(rows))
                self.eval_episodes = [e for e in episodes if isinstance(e, Episode)]
                self.eval_agent_episodes = [e for e in episodes if e is not None and not isinstance(e, Episode)]
            else:
                completions = self.engine.generate([r["prompt_ids"] for r in rows], sampling, self.prompt_images(rows))
                episodes = [None] * len(completions)
            self.engine.sleep(keep_weights=True)  # no sync follows: the next rollout needs these weights
        if not rows:
            return [], [], None
        texts, messages = self._texts_and_messages(rows, completions, episodes, per_prompt=1)
        result, _ = self._score(rows, texts, completions, per_prompt=1, messages=messages)
        return completions, texts, result


def completion_tokens(completions: list) -> int:
    return sum(len(c.token_ids) for c in completions)


def merge_group_shares(shares: list[tuple[list, list]], prompt_count: int) -> tuple[list, list]:
    """The (completions, episodes) of a sequence-parallel group's ranks, each its share of every prompt's, as one
    rollout grouped by prompt: prompt 0's completions from rank 0, then rank 1, ..., then prompt 1's."""
    by_prompt: list[list] = [[] for _ in range(prompt_count)]
    for completions, episodes in shares:  # rank order
        for completion, episode in zip(completions, episodes):
            by_prompt[completion.prompt_index].append((completion, episode))
    pairs = [pair for group in by_prompt for pair in group]
    return [c for c, _ in pairs], [e for _, e in pairs]
