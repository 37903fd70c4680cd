"""Streamed rollouts, piece by piece: the staleness math, the requests kept ahead of training, and a rollout rank's
stream (grpo/rollout/stream.py) on an engine whose tokens say which weights sampled them."""
import pytest

from grpo.rollout.ahead import RequestsAhead, steps_to_post
from grpo.rollout.engine import Completion, RolloutEngine, SamplingSettings
from grpo.rollout.staleness import group_staleness, groups_over_bound, sampled_versions, staleness_metrics
from grpo.rollout.stream import RolloutStream

STOP = 0


class VersionedEngine(RolloutEngine):
    """Samples token 100 + its weights' number (log-prob minus that number); a prompt [length, ...] stops once its
    sequence (prompt included) holds `length` tokens, with the stop token. Records every call."""

    def __init__(self):
        self.weights = 0
        self.calls = []

    def generate(self, prompt_token_ids, sampling, images=None):
        self.calls.append(([list(p) for p in prompt_token_ids], sampling.max_new_tokens))
        out = []
        for i, prompt in enumerate(prompt_token_ids):
            for _ in range(sampling.n):
                room = prompt[0] - len(prompt)  # tokens until it stops (the stop token being the last)
                if room <= sampling.max_new_tokens:
                    tokens, finish = [100 + self.weights] * (room - 1) + [STOP], "stop"
                else:
                    tokens, finish = [100 + self.weights] * sampling.max_new_tokens, "length"
                out.append(Completion(i, tokens, [-float(self.weights)] * len(tokens), finish))
        return out


def sampling(n=2, max_new_tokens=8):
    return SamplingSettings(n=n, max_new_tokens=max_new_tokens)


# ---------------------------------------------------------------------------------------------- staleness math
def test_a_group_is_as_stale_as_its_oldest_token():
    versions = [[3, 3, 4], [4], [4, 5], [5], None, []]  # three groups of two
    assert group_staleness(versions, 2, current=5) == [2, 1, 0]  # a group without versions counts as fresh
    assert groups_over_bound([2, 1, 0], bound=1) == [0]
    with pytest.raises(ValueError):
        group_staleness(versions, 4, current=5)


def test_staleness_metrics_count_tokens_partial_completions_and_the_histogram():
    metrics = staleness_metrics([[3, 3, 4], [4], [5, 5]], current=5)
    assert metrics["stream/staleness_mean"] == pytest.approx((2 + 2 + 1 + 1 + 0 + 0) / 6)
    assert metrics["stream/staleness_max"] == 2.0
    assert metrics["stream/partial_share"] == pytest.approx(1 / 3)  # the first completion spans two versions
    assert [metrics[f"stream/tokens_version_{d}"] for d in range(3)] == [2.0, 2.0, 2.0]
    assert staleness_metrics([None, None], current=5) == {}


def test_each_tokens_staleness_rides_in_the_batch_and_sorts_the_engines_gap():
    import torch

    from grpo.train.step_data import build_rollout_batch
    from grpo.train.update import add_gap_by_staleness

    completions = [Completion(0, [7, 8, 9], [-1.0] * 3, "length", versions=[3, 3, 4]),
                   Completion(0, [7], [-1.0], "stop", versions=[5])]
    batch = build_rollout_batch([[1, 2]], completions, pad_id=0, version=5)
    assert batch.staleness.tolist() == [[2, 2, 1], [0, 0, 0]]  # version 5 trains: 5 - 3, 5 - 4; padding 0
    assert build_rollout_batch([[1, 2]], completions, pad_id=0).staleness is None  # no version given
    unversioned = [completions[0], Completion(0, [7], [-1.0], "stop")]  # (an episode may end without versions)
    assert build_rollout_batch([[1, 2]], unversioned, pad_id=0, version=5).staleness.tolist() == \
        [[2, 2, 1], [-1, 0, 0]]  # (padding 0, out of the loss)
    assert build_rollout_batch([[1, 2]], unversioned[1:], pad_id=0, version=5).staleness is None
    # gaps by versions behind, over the tokens in the loss (the padding's gap of 9 left out), across micro-batches
    gaps = {}
    add_gap_by_staleness(gaps, torch.tensor([[0.3, 0.1, 0.2], [0.01, 9.0, 9.0]]), batch.staleness,
                         batch.completion_mask)
    add_gap_by_staleness(gaps, torch.tensor([[0.5, 7.0]]), torch.tensor([[1, -1]]), torch.tensor([[1.0, 1.0]]))
    assert gaps == {0: [pytest.approx(0.01), 1], 1: [pytest.approx(0.7), 2], 2: [pytest.approx(0.4), 2]}


def test_the_trainer_keeps_k_requests_ahead_and_none_past_the_last_step():
    assert steps_to_post(0, 1, step=0, total_steps=4) == 1  # --async_rollout: the next step's
    assert steps_to_post(0, 3, step=0, total_steps=10) == 3
    assert steps_to_post(2, 3, step=1, total_steps=10) == 1  # topped up
    assert steps_to_post(1, 3, step=7, total_steps=10) == 1  # steps 8 and 9 are the last
    assert steps_to_post(0, 2, step=9, total_steps=10) == 0
    ahead = RequestsAhead()
    ahead.push("step 1", (0, 4))
    ahead.push("step 2", (0, 8))
    assert ahead.position_before_oldest() == (0, 4)  # a checkpoint resumes from before the untrained prompts
    assert ahead.pop() == "step 1" and ahead.position_before_oldest() == (0, 8)


# ----------------------------------------------------------------------------------------- a rollout rank's stream
def test_whole_requests_generate_in_one_call_each_in_order_at_the_current_version():
    engine = VersionedEngine()
    stream = RolloutStream(engine)
    stream.add(7, [[5, 1], [6, 1]], sampling())
    stream.add(8, [[4, 1]], sampling())
    number, completions = stream.step()[0]
    assert number == 7 and len(engine.calls) == 1 and len(completions) == 4
    engine.weights = 1
    stream.mark_version(1)
    number, completions = stream.step()[0]
    assert number == 8 and [c.versions for c in completions] == [[1, 1], [1, 1]]
    assert not stream.has_work


def test_a_sequence_in_flight_goes_on_under_new_weights_and_each_token_keeps_its_version():
    engine = VersionedEngine()
    stream = RolloutStream(engine, segment_tokens=3)
    stream.add(1, [[10, 7]], sampling(n=2, max_new_tokens=20))  # 8 tokens to its stop token
    assert stream.step() == []  # 3 tokens each
    engine.weights = 1
    stream.mark_version(1)
    stream.add(2, [[4, 9]], sampling(n=1))  # joins the next piece
    finished = dict(stream.step())
    assert list(finished) == [2] and finished[2][0].versions == [1, 1]
    engine.weights = 2
    stream.mark_version(2)
    finished = dict(stream.step())
    (first, second) = finished[1]
    assert first.token_ids == [100] * 3 + [101] * 3 + [102, STOP] and first.finish_reason == "stop"
    assert first.versions == [0, 0, 0, 1, 1, 1, 2, 2]
    assert first.logprobs == [0.0] * 3 + [-1.0] * 3 + [-2.0] * 2  # the log-probs of the weights that sampled them
    assert second.versions == first.versions
    # each piece resubmitted prompt + the tokens so far
    assert engine.calls[1][0][0] == [10, 7, 100, 100, 100]
    assert engine.calls[2][0][0] == [10, 7, 100, 100, 100, 101, 101, 101]


def test_restart_begins_sequences_of_older_weights_again():
    engine = VersionedEngine()
    stream = RolloutStream(engine, segment_tokens=3, partial="restart")
    stream.add(1, [[7, 1]], sampling(n=1, max_new_tokens=20))  # 5 tokens to its stop token
    assert stream.step() == []
    engine.weights = 1
    stream.mark_version(1)
    assert stream.step() == []
    (number, (completion,)), = stream.step()
    assert completion.versions == [1] * 5 and completion.token_ids == [101] * 4 + [STOP]
    assert stream.running == [] and engine.calls[1][0][0] == [7, 1]  # back to the prompt


def test_a_sequences_last_piece_is_what_its_budget_leaves():
    """No generate call asks for more than a sequence may still take (vLLM refuses prompt + max_tokens past its
    max_model_len): the last piece of each is its own length."""
    engine = VersionedEngine()
    stream = RolloutStream(engine, segment_tokens=4)
    stream.add(1, [[50, 1]], sampling(n=1, max_new_tokens=3))
    stream.add(2, [[50, 1]], sampling(n=1, max_new_tokens=6))
    finished = dict(stream.step())
    assert finished[1][0].token_ids == [100] * 3 and finished[1][0].finish_reason == "length"
    finished = dict(stream.step())
    assert len(finished[2][0].token_ids) == 6 and finished[2][0].finish_reason == "length"
    assert [asked for _, asked in engine.calls] == [3, 4, 2]


def test_episodes_run_whole_when_they_come_up():
    engine = VersionedEngine()
    stream = RolloutStream(engine, segment_tokens=2)
    stream.add(1, [[4, 1]], sampling(n=1))
    stream.add_episodes(2, lambda engine: ["episode", stream.version])
    stream.add(3, [[4, 1]], sampling(n=1))
    assert [n for n, _ in stream.step()] == [1]  # the sequences ahead of the episodes first
    assert stream.step() == [(2, ["episode", 0])]
    assert [n for n, _ in stream.step()] == [3]


# ------------------------------------------------------------------------------------------- with the HF engine
def teacher_forced_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """log p(token | everything before it) under `model`, for each of `tokens` after `prompt`."""
    import torch

    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), -1)
    return logprobs.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()


def test_an_update_mid_sequence_with_the_hf_engine_keeps_each_tokens_version_and_log_prob(tmp_path):
    """Pieces of 3 tokens; new weights land after the first piece: the first 3 tokens of every sequence are version
    0's, sampled and scored by the old weights, the rest version 1's, under the new ones."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from grpo.model.loading import load_tokenizer
    from grpo.rollout.hf import HFRolloutEngine

    from .tiny_models import make_tiny_model_dir

    path = make_tiny_model_dir(str(tmp_path / "tiny"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    old = copy.deepcopy(model)
    engine = HFRolloutEngine(model, load_tokenizer(path), owns_model=True)
    stream = RolloutStream(engine, segment_tokens=3)
    prompt = load_tokenizer(path)("What is 2 + 3 ?", add_special_tokens=False)["input_ids"]
    torch.manual_seed(0)
    stream.add(1, [prompt], SamplingSettings(n=3, max_new_tokens=9, temperature=1.0))
    assert stream.step() == []
    with torch.no_grad():  # the update: every weight moves
        engine.load_weights((name, tensor + 0.05 * torch.randn_like(tensor))
                            for name, tensor in model.state_dict().items())
    stream.mark_version(1)
    finished = []
    while stream.has_work:
        finished += stream.step()
    (_, completions), = finished
    spanning = [c for c in completions if len(c.token_ids) > 3]
    assert spanning, "every sequence stopped in the first piece"
    for c in completions:
        assert c.versions == [0] * min(3, len(c.token_ids)) + [1] * (len(c.token_ids) - 3)
        under_old = teacher_forced_logprobs(old, prompt, c.token_ids)
        under_new = teacher_forced_logprobs(model, prompt, c.token_ids)
        sampled_by = [under_old[t] if v == 0 else under_new[t] for t, v in enumerate(c.versions)]
        assert c.logprobs == pytest.approx(sampled_by, abs=1e-4)
    # ... which differ: the rollout correction weighs each token by the weights that really sampled it
    c = spanning[0]
    assert c.logprobs[3:] != pytest.approx(teacher_forced_logprobs(old, prompt, c.token_ids)[3:], abs=1e-3)


def test_an_episode_spanning_an_update_keeps_each_turns_version():
    """New weights land between the two turns of a tool episode: its first turn is version 0's, its second version
    1's; the environment's tokens between them (out of the loss) carry the version of the turn they answer."""
    from grpo.rollout.episodes import EpisodeLimits, run_episodes

    from .test_episodes import AFTER_CALL, CALL, ScriptedEngine, calls_then_answers, encode, make_tool_tokenizer, \
        prompt

    tokenizer = make_tool_tokenizer()
    turns_begun = []

    def between_turns():  # the rank takes its messages: before the second turn, a whole sync
        turns_begun.append(stream.version)
        if len(turns_begun) == 2:
            stream.mark_version(1)

    stream = RolloutStream(ScriptedEngine(tokenizer, calls_then_answers), between_turns=between_turns)
    limits = EpisodeLimits(max_turns=4, max_episode_tokens=200)
    stream.add_episodes(5, lambda engine: run_episodes(engine, tokenizer, [prompt(tokenizer)],
                                                       SamplingSettings(n=2, max_new_tokens=64), limits))
    (number, episodes), = stream.step()
    im_end = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    turn1, env, turn2 = encode(tokenizer, CALL) + im_end, encode(tokenizer, AFTER_CALL), \
        encode(tokenizer, "The answer is 42.") + im_end
    assert number == 5 and turns_begun == [0, 0]
    for episode in episodes:
        assert episode.completion_ids == turn1 + env + turn2
        assert episode.versions == [0] * len(turn1) + [0] * len(env) + [1] * len(turn2)
        assert episode.as_completion().versions == episode.versions
    assert staleness_metrics([sampled_versions(e.versions, e.mask) for e in episodes], current=1)[
        "stream/partial_share"] == 1.0


# ----------------------------------------------------------------------------------------- a rollout rank's loop
GAP = object()  # in a script: nothing more has come for now (a poll finds nothing)


class ScriptedBridge:
    """Training rank 0's side of the link, played from a script of messages and gaps; records every reply."""

    def __init__(self, script):
        self.script, self.replies, self.number = list(script), {}, 0

    def _next(self, skip_gaps: bool):
        while skip_gaps and self.script and self.script[0] is GAP:
            self.script.pop(0)
        assert self.script, "the rank waited for a message past the script's end"
        item = self.script.pop(0)
        if item is GAP:
            return None
        self.number += 1
        return item, self.number - 1

    def receive(self, index):
        return self._next(skip_gaps=True)

    def poll(self, index):
        return self._next(skip_gaps=False)

    def reply(self, index, number, message):
        self.replies.setdefault(number, []).append(message)

    def receive_weights(self, layout):
        return iter([])

    def close(self):
        pass


class LoadingEngine(VersionedEngine):
    def load_weights(self, named, complete=True):
        list(named)
        self.weights += 1


def serve_script(monkeypatch, tmp_path, script, engine, segment_tokens=0, episodes=None):
    from types import SimpleNamespace

    from grpo.entry import serve

    monkeypatch.setattr(serve, "_build_engine", lambda *args: engine)
    monkeypatch.setattr(serve.EpisodeHost, "for_run", classmethod(lambda cls, config, names: episodes))
    config = SimpleNamespace(rollout_segment_tokens=segment_tokens, partial_rollouts="continue",
                             output_dir=str(tmp_path))
    bridge = ScriptedBridge(script)
    code = serve.RolloutServer(bridge, config, 0, 1, None, 1).run()
    return code, bridge.replies


def message(kind, payload=None):
    return (kind, payload)


def test_the_rank_takes_weights_between_two_requests_and_answers_each_once_generated(monkeypatch, tmp_path):
    """Two requests queued; new weights come while the first generates: the second is the new version's."""
    script = [message("start", {}), message("version", 0), message("generate", ([[5, 1]], sampling(n=1), None)),
              message("generate", ([[5, 1]], sampling(n=1), None)), GAP,
              message("weights", []), message("version", 1), GAP, GAP, message("stop")]
    code, replies = serve_script(monkeypatch, tmp_path, script, LoadingEngine())
    assert code == 0
    assert [c.versions for c in replies[2][0]["ok"]] == [[0, 0, 0]]
    assert [c.token_ids for c in replies[3][0]["ok"]] == [[101, 101, STOP]]  # the new weights sampled it
    assert [c.versions for c in replies[3][0]["ok"]] == [[1, 1, 1]]
    assert all(len(r) == 1 for r in replies.values()) and "idle_s" in replies[2][0]


def test_a_failing_request_is_answered_with_its_error_and_so_is_everything_after(monkeypatch, tmp_path):
    class FailingSecond(LoadingEngine):
        def generate(self, prompt_token_ids, sampling, images=None):
            if self.calls:
                raise ValueError("out of memory")
            return super().generate(prompt_token_ids, sampling, images)

    script = [message("start", {}), message("version", 0), message("generate", ([[5, 1]], sampling(n=1), None)),
              message("generate", ([[5, 1]], sampling(n=1), None)),
              message("generate", ([[5, 1]], sampling(n=1), None)), GAP, GAP, GAP,
              message("weights", []), message("stop")]
    code, replies = serve_script(monkeypatch, tmp_path, script, FailingSecond())
    assert code == 1
    assert "ok" in replies[2][0]
    for number in (3, 4, 5):  # the failing request, the one queued behind it, the weights sent after
        assert "ValueError: out of memory" in replies[number][0]["error"], replies


def test_episodes_take_weights_between_two_turns_with_pieces(monkeypatch, tmp_path):
    class TwoTurns:
        def run(self, engine, prompts, sampling_settings, limits):
            first = engine.generate(prompts, sampling_settings)
            second = engine.generate(prompts, sampling_settings)
            return [c.versions for c in first + second]

    script = [message("start", {}), message("version", 0), message("episodes", ([[9, 1]], sampling(n=1), None)),
              GAP, GAP, message("weights", []), message("version", 1), GAP, GAP, message("stop")]
    code, replies = serve_script(monkeypatch, tmp_path, list(script), LoadingEngine(), segment_tokens=4,
                                 episodes=TwoTurns())
    assert code == 0
    assert replies[2][0]["ok"] == [[0] * 7, [1] * 7]  # the second turn sampled by the new weights
    # without pieces the episodes run under one version, as --async_rollout's always did; the update waits
    code, replies = serve_script(monkeypatch, tmp_path, script, LoadingEngine(), episodes=TwoTurns())
    assert code == 0 and replies[2][0]["ok"] == [[0] * 7, [0] * 7]


# ------------------------------------------------------------------------------------- the trainer's guard of K
def test_a_group_over_the_bound_is_generated_again_in_place(monkeypatch):
    """Step 5 with K = 2: the second of three groups holds a token of version 2 (3 behind): it alone is asked for
    again, on the current policy, and takes its place; the others stay as they were."""
    from grpo import GRPOConfig
    from grpo.rollout.collect import RolloutCollector
    from grpo.rollout.dynamic_sampling import PendingRollouts

    config = GRPOConfig(k_samples=2)
    config.max_staleness = 2  # (server mode's option; the guard does not depend on the engine)
    rollouts = RolloutCollector(config, VersionedEngine(), None, None, None, None, None, 10, lambda: 0.0)
    asked = []
    fresh = [Completion(0, [9], [-0.5], "stop", versions=[5]), Completion(0, [9, 9], [-0.5, -0.5], "stop",
                                                                           versions=[5, 5])]
    monkeypatch.setattr(rollouts, "_request", lambda prompts, step: asked.append((prompts, step)) or "again")
    monkeypatch.setattr(rollouts, "_receive", lambda pending: (list(fresh), ["new", "new"], [["m"], ["m"]],
                                                               {"rollout": 1.0, "rollout_generate": 1.0}))
    prompts = [{"index": i} for i in range(3)]
    completions = [Completion(g, [1], [-1.0], "stop", versions=[v]) for g, v in
                   ((0, 4), (0, 5), (1, 2), (1, 5), (2, 3), (2, 3))]
    texts, messages, times = ["old"] * 6, [["o"]] * 6, {"rollout": 2.0, "rollout_generate": 2.0}
    pending = PendingRollouts(prompts, None, SamplingSettings(n=2, max_new_tokens=4), policy_step=2)
    rollouts._regenerate_stale(pending, 5, completions, texts, messages, times)
    assert asked == [([{"index": 1}], 5)]
    assert [c.versions for c in completions] == [[4], [5], [5], [5, 5], [3], [3]]
    assert [c.prompt_index for c in completions] == [0, 0, 1, 1, 2, 2]
    assert texts == ["old", "old", "new", "new", "old", "old"] and times == {"rollout": 3.0, "rollout_generate": 3.0}
    assert rollouts.stream_counts["groups_regenerated"] == 1
    asked.clear()
    rollouts._regenerate_stale(pending, 5, completions, texts, messages, times)  # now within the bound
    assert asked == []
