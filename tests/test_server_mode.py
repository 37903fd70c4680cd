"""--rollout_mode server on CPU: the job's last rank generates (HF engine on a model of its own), the others train
with DeepSpeed; completions and the updated policy travel between them after every step."""
import json
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo.rollout.remote import _even_bounds
from grpo.runtime.failure_watch import GRACE_S, STALE_S

from .test_multiprocess import ROOT, launch, launch_command, setup  # noqa: F401  (setup is the module's fixture)
from .trainer_setup import child_env, train_rows

needs_launcher = pytest.mark.skipif(shutil.which("deepspeed") is None, reason="the deepspeed launcher is not on PATH")
SERVER = ("--rollout_mode", "server", "--rollout_gpus", "1", "--logprob_check_steps", "1")


def run_server(setup, name: str, port: int, *flags: str, reward: str = "rewards.py", **kw):  # noqa: F811
    """A server-mode job on the tiny model (the last rank generates); returns its output folder and process."""
    folder, model, registry = setup
    out = folder / name
    return out, launch(folder, model, registry, out, port, "--reward_module", str(folder / reward), *SERVER, *flags,
                       **kw)


def test_prompts_are_split_into_even_contiguous_shares():
    assert _even_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert _even_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]


def sequence_logprobs(model_dir, ids):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1], -1)
    return logprobs.gather(-1, ids[0, 1:, None]).squeeze(-1)


@needs_launcher
def test_the_rollout_rank_samples_the_policy_after_every_step(setup):  # noqa: F811
    model = setup[1]
    out, proc = run_server(setup, "out_server_full", 29541, "--tuning_strategy", "full", "--max_steps", "3")
    both = proc.stdout + proc.stderr
    assert proc.returncode == 0, both[-4000:]
    assert "1 rank(s)" in both and "waiting for 1 rollout rank(s)" in both  # one rank trained, one generated
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "memory/vllm_sleep_freed_gib" not in rows[0]  # rollout ranks never sleep: nothing to report
    # the engine's sampling log-probs equal the trainer's at every step: its weights are the policy's
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-4, rows
    # ... while the policy moved far from where the engine started: a stale engine would be off by this much
    ids = torch.arange(5, 45)[None]
    moved = (sequence_logprobs(model, ids) - sequence_logprobs(out / "model", ids)).abs().max().item()
    assert moved > 1e-2, moved


def start_two_nodes(setup, out, port: int, *flags: str) -> list:
    """Two nodes of one slot each from one hostfile, each started by its own launcher as on a cluster without ssh
    (`deepspeed --hostfile ... --no_ssh --node_rank N`): node 0 trains (full fine-tuning), node 1 generates."""
    folder, model, registry = setup
    hostfile = folder / f"two_nodes_{port}"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    nodes = []
    for node in (0, 1):
        where = ("--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node), "--master_addr", "127.0.0.1")
        cmd = launch_command(model, registry, out, port, "--reward_module", str(folder / "rewards.py"), *SERVER,
                             "--tuning_strategy", "full", *flags, where=where)
        nodes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                      env=child_env()))
    return nodes


@needs_launcher
def test_the_rollout_rank_may_sit_on_another_node(setup):  # noqa: F811
    """Two nodes of one slot each from one hostfile, each started by its own launcher as on a cluster without ssh
    (`deepspeed --hostfile ... --no_ssh --node_rank N`): the second node's only rank (job rank 1, local rank 0)
    generates, the first trains, and they meet at MASTER_ADDR:MASTER_PORT."""
    out = setup[0] / "out_server_two_nodes"
    nodes = start_two_nodes(setup, out, 29557, "--max_steps", "2")
    try:
        logs = [node.communicate(timeout=600)[0] for node in nodes]
    finally:  # a node left waiting for its peer must not outlive the test
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "waiting for 1 rollout rank(s)" in logs[0] and "1 rank(s)" in logs[0]  # node a trained
    assert "training " not in logs[1]  # node b only generated
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-4, rows  # the synced policy reached node b


@needs_launcher
def test_a_rollout_rank_killed_on_another_node_stops_the_training_node(setup):  # noqa: F811
    """The rollout rank (node b) is killed after step 1, as the OOM killer would: training rank 0, waiting for its
    answer, hears nothing more from its heartbeat and stops the job with a message that names it, long before
    --ddp_timeout_minutes."""
    out = setup[0] / "out_server_rollout_killed"
    nodes = start_two_nodes(setup, out, 29561, "--max_steps", "50", "--save_steps", "0", "--eval_on_start", "false",
                            "--ddp_timeout_minutes", "10")
    try:
        deadline = time.time() + 400
        while not (out / "metrics.jsonl").is_file() or not train_rows(out):  # step 1 trained
            assert time.time() < deadline and nodes[0].poll() is None, "step 1 never ended"
            time.sleep(0.5)
        info = json.loads((out / "failures" / "rank1.pid").read_text())
        assert info["node"] == 1
        os.kill(info["pid"], signal.SIGKILL)
        killed = time.time()
        log = nodes[0].communicate(timeout=200)[0]
        stopped_after = time.time() - killed
    finally:  # a node left waiting for its peer must not outlive the test
        for node in nodes:
            node.kill()
    assert nodes[0].returncode != 0
    assert "rollout rank 0 (job rank 1, node 1, host " in log and "stopped without reporting an error" in log, \
        log[-4000:]
    assert stopped_after < STALE_S + GRACE_S + 60, stopped_after  # the heartbeat, not the 10-minute timeout
    record = json.loads((out / "failures" / "rank1.json").read_text())
    assert (record["rank"], record["node"], record["witness"]) == (1, 1, 0)


@needs_launcher
def test_two_training_ranks_share_one_rollout_rank_under_zero3_lora(setup):  # noqa: F811
    # (one eval prompt: rank 1 generates none, with rank 0)
    out, proc = run_server(setup, "out_server_lora", 29543, "--tuning_strategy", "lora", "--deepspeed", "zero3",
                           "--learning_rate", "1e-2", "--max_steps", "3", "--eval_max_prompts", "1", ranks=3)
    both = proc.stdout + proc.stderr
    assert proc.returncode == 0, both[-4000:]
    assert "2 rank(s)" in both
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # merged LoRA weights in fp32: exact up to the merge's rounding
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-3, rows
    seen = {}
    for rank in (0, 1):  # each training rank got the completions of its own prompts back
        with open(out / "completions" / f"rank{rank}.jsonl") as fh:
            seen[rank] = [json.loads(line)["index"] for line in fh]
        assert len(seen[rank]) == 3 * 2
    assert not set(seen[0]) & set(seen[1])
    assert not (out / "completions" / "rank2.jsonl").exists()  # the rollout rank trains nothing


@needs_launcher
def test_a_training_rank_that_fails_ends_the_rollout_rank_too(setup):  # noqa: F811
    out, proc = run_server(setup, "out_server_failing", 29545, "--eval_on_start", "false", "--tuning_strategy", "lora",
                           "--max_steps", "4", "--ddp_timeout_minutes", "10", ranks=3, timeout=300,
                           reward="failing_rewards.py")
    both = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "rank 1 failed at step 2 (rewards): reward 'says_seven' (dataset 'toy') raised ValueError: judge model " \
           "returned HTTP 503" in both, both[-4000:]


def prompts_by_step(out):
    steps = {}
    with open(out / "completions" / "rank0.jsonl") as fh:
        for line in fh:
            row = json.loads(line)
            steps.setdefault(row["step"], []).append(row["index"])
    return steps


@needs_launcher
def test_async_rollouts_run_one_step_behind_and_resume_on_the_same_prompts(setup):  # noqa: F811
    flags = ("--tuning_strategy", "full", "--max_steps", "4", "--save_steps", "2", "--async_rollout", "true")
    out, proc = run_server(setup, "out_server_async", 29547, *flags)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = train_rows(out)
    # the first step's rollouts come from the synced start, every later one from the policy a step behind
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    # ... which the truncated IS weights (on by default here) correct: they are logged, and at most the cap
    assert all(0.0 < r["rollout/is_weight_mean"] <= 2.0 for r in rows)
    # the engine's gap to the trainer: its mismatch on the first (on-policy) step, a step of policy change later
    assert rows[0]["rollout/logprob_diff_max"] < 1e-4 and "rollout/logprob_diff_mean" not in rows[2]
    assert rows[2]["rollout/offpolicy_logprob_diff_mean"] > 1e-3

    # a checkpoint saved while step 3's prompts were in flight resumes by drawing them again
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert (state["step"], state["position"]) == (2, 2 * 2)
    shutil.copytree(out / "checkpoint-2", setup[0] / "out_server_async_resumed" / "checkpoint-2")
    resumed, proc = run_server(setup, "out_server_async_resumed", 29549, *flags, "--resume_from_checkpoint", "latest")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    first, again = prompts_by_step(out), prompts_by_step(resumed)
    assert sorted(again) == [3, 4] and all(again[s] == first[s] for s in (3, 4)), (first, again)


@needs_launcher
def test_a_failure_while_the_trainer_starts_stops_the_rollout_rank(setup):  # noqa: F811
    out, proc = run_server(setup, "out_server_bad_resume", 29551, "--resume_from_checkpoint",
                           str(setup[0] / "no_such_checkpoint"), timeout=240)
    both = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "error: --resume_from_checkpoint" in both, both[-3000:]
    assert "stopped without a word" not in both  # the rollout rank was told, not left to find out


@needs_launcher
def test_a_vision_language_model_gets_its_images_and_weights_on_the_rollout_rank(tmp_path):
    from .tiny_vl_models import make_tiny_vl_model_dir

    model = make_tiny_vl_model_dir(str(tmp_path / "vl"))
    out = tmp_path / "out"
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", "29553", os.path.join(ROOT, "train_grpo.py"),
           "--model_name_or_path", model, "--dataset_names", "shapes", "--output_dir", str(out),
           "--per_device_train_batch_size", "2", "--k_samples", "4", "--rollout_max_new_tokens", "6",
           "--max_prompt_length", "96", "--max_seq_length", "104", "--max_steps", "2", "--save_steps", "0",
           "--eval_max_prompts", "2", "--train_split_ratio", "0.99", "--tuning_strategy", "full", *SERVER]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, env=child_env())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = train_rows(out)
    # every weight (vision tower included) found its place under the checkpoint names, and the rollout rank
    # scored with the same pixels as the trainer
    assert len(rows) == 2 and all(r["sync/bytes"] > 0 for r in rows)
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-4, rows


@needs_launcher
def test_async_without_is_correction_asks_for_logprobs_on_the_steps_that_train_on_them(setup):  # noqa: F811
    out, proc = run_server(setup, "out_server_async_every2", 29555, "--tuning_strategy", "full", "--max_steps", "4",
                           "--async_rollout", "true", "--rollout_is_correction", "false", "--eval_on_start", "false",
                           "--eval_max_prompts", "1", "--logprob_check_steps", "2")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = train_rows(out)
    with_logprobs = [r["step"] for r in rows if any(k.endswith("logprob_diff_mean") for k in r)]
    assert with_logprobs == [1, 3] and "rollout/is_weight_mean" not in rows[1]


def test_a_rollout_rank_building_a_trainer_is_told_what_to_run(monkeypatch):
    """A script that builds GRPOTrainer on every rank of a server-mode job: the rollout ranks learn what to call."""
    from grpo import ConfigError, GRPOConfig, GRPOTrainer

    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    config = GRPOConfig(rollout_mode="server", rollout_gpus=1)
    with pytest.raises(ConfigError, match=r"rollout rank 0 \(job rank 2\).*grpo.serve_rollouts\(config\)"):
        GRPOTrainer(config)


RANK_LOGGING_ASK_AGAIN = '''
import os

from grpo.tools import EnvironmentStep, register_environment


@register_environment("ask_again")
def ask_again(messages, **fields):
    with open(os.path.join(os.path.dirname(__file__), "environment_ranks.txt"), "a") as log:
        log.write(os.environ.get("RANK", "?") + "\\n")
    return EnvironmentStep([{"role": "user", "content": "What is 2 + 2 ?"}])
'''


def environment_ranks(tmp_path) -> set[str]:
    """The job ranks whose processes ran the environment."""
    return set((tmp_path / "data" / "environment_ranks.txt").read_text().split())


def launch_episodes(tmp_path, port: int, *flags: str, ranks: int):
    """A server-mode lora job whose prompts run as episodes: the `ask_again` environment (from a --tool_module, so
    the rollout rank must import it too) answers every model turn, up to 3 turns, and notes the rank it ran on."""
    from .test_tool_training import CALC_ROWS, make_quick_stopping_model_dir
    from .trainer_setup import add_dataset, write_prompt_registry

    model = make_quick_stopping_model_dir(str(tmp_path / "model"))
    registry = write_prompt_registry(str(tmp_path / "data"))
    add_dataset(registry, "ask_toy", CALC_ROWS, environment="ask_again", rewards={"length_penalty": 1.0},
                reward_kwargs={"length_penalty": {"target_chars": 2, "max_chars": 30}})
    module = tmp_path / "data" / "ask_again.py"
    module.write_text(RANK_LOGGING_ASK_AGAIN)
    out = tmp_path / "out"
    proc = launch(tmp_path, model, registry, out, port, *SERVER, "--dataset_names", "ask_toy", "--tool_module",
                  str(module), "--tuning_strategy", "lora", "--lora_dropout", "0", "--max_turns", "3",
                  "--rollout_max_new_tokens", "16", "--max_seq_length", "128", "--eval_on_start", "false",
                  "--eval_max_prompts", "1", "--train_split_ratio", "0.9", *flags, ranks=ranks)
    return out, proc


@needs_launcher
def test_two_training_ranks_run_multi_turn_episodes_on_one_rollout_rank(tmp_path):
    """Tool episodes in server mode: the rollout rank runs both training ranks' episodes whole (its engine, their
    environment, turn by turn), and the sampled log-probs of the model's tokens equal the trainer's (fp32)."""
    out, proc = launch_episodes(tmp_path, 29545, "--max_steps", "2", ranks=3)
    both = proc.stdout + proc.stderr
    assert proc.returncode == 0, both[-4000:]
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["episodes/turns"] > 1.5, row  # multi-turn, as a rule
        assert row["rollout/logprob_diff_mean"] < 1e-4 and row["rollout/logprob_diff_max"] < 1e-3, row
    assert environment_ranks(tmp_path) == {"2"}  # the rollout rank (the last of 3) ran every environment turn
    evals = [json.loads(line) for line in open(out / "metrics.jsonl") if '"eval/' in line]
    assert evals and evals[-1]["eval/episodes/turns"] >= 1  # evaluation episodes too (one rank has no eval row)


@needs_launcher
def test_async_rollouts_run_the_next_steps_episodes_while_this_step_trains(tmp_path):
    """--async_rollout with episodes: the next step's episodes run on the rollout rank while the trainer trains,
    so every step after the first trains on episodes of the policy one step behind, IS-corrected on model tokens."""
    out, proc = launch_episodes(tmp_path, 29553, "--max_steps", "3", "--async_rollout", "true", ranks=2)
    both = proc.stdout + proc.stderr
    assert proc.returncode == 0, both[-4000:]
    rows = train_rows(out)
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["episodes/turns"] > 1.5 for r in rows), rows
    assert rows[0]["rollout/logprob_diff_max"] < 1e-3  # the first step's episodes came from the synced start
    assert all(0.0 < r["rollout/is_weight_mean"] <= 2.0 for r in rows)
    assert rows[2]["rollout/offpolicy_logprob_diff_mean"] > 1e-4  # later ones from the policy a step behind
    assert environment_ranks(tmp_path) == {"1"}  # on the rollout rank


STREAM = ("--tuning_strategy", "full", "--max_staleness", "2", "--rollout_segment_tokens", "3",
          "--rollout_max_new_tokens", "12", "--max_seq_length", "48")


@needs_launcher
def test_a_stream_two_steps_deep_trains_no_group_over_the_bound_and_resumes_on_the_same_prompts(setup):  # noqa: F811
    """--max_staleness 2 with partial rollouts in pieces of 3 tokens: every token carries its version, no step trains
    on a token more than 2 versions behind, the bound is reached, and no prompt is trained twice or skipped. A
    checkpoint saved with two requests in flight records them; the resumed run draws their prompts again."""
    flags = (*STREAM, "--max_steps", "5", "--save_steps", "2", "--eval_on_start", "false")
    out, proc = run_server(setup, "out_server_stream", 29563, *flags)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["stream/staleness_max"] <= 2 for r in rows), rows
    assert rows[0]["stream/staleness_max"] == 0 and max(r["stream/staleness_max"] for r in rows) == 2
    assert all(r["stream/groups_regenerated"] == 0 for r in rows)  # the requests ahead keep the bound
    assert all(0.0 < r["rollout/is_weight_mean"] <= 2.0 for r in rows)  # each token weighed by its own policy
    # the engine sampled each token from the version it reported: the tokens of the trained version itself score
    # alike on both sides (fp32); the older ones differ by the updates since
    fresh = [r["rollout/logprob_diff_behind_0"] for r in rows if "rollout/logprob_diff_behind_0" in r]
    assert fresh and max(fresh) < 1e-4, fresh
    older = [r[key] for r in rows for key in ("rollout/logprob_diff_behind_1", "rollout/logprob_diff_behind_2")
             if key in r]
    assert older and max(older) > 1e-3, older
    for key in ("stream/partial_share", "stream/rollout_idle_s", "stream/trainer_wait_s", "stream/staleness_mean"):
        assert all(key in r for r in rows), key
    first = prompts_by_step(out)
    drawn = [i for s in sorted(first) for i in first[s]]
    assert len(drawn) == len(set(drawn)) == 5 * 2  # nothing trained twice

    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert (state["step"], state["position"]) == (2, 2 * 2)  # before the prompts in flight
    assert state["extra"]["stream"]["requests_in_flight"] == 2 and state["extra"]["stream"]["groups_in_flight"] == 4
    shutil.copytree(out / "checkpoint-2", setup[0] / "out_server_stream_resumed" / "checkpoint-2")
    resumed, proc = run_server(setup, "out_server_stream_resumed", 29565, *flags, "--resume_from_checkpoint", "latest")
    both = proc.stdout + proc.stderr
    assert proc.returncode == 0, both[-4000:]
    assert "resuming a stream at step 2: the checkpoint had 2 request(s) in flight" in both, both[-4000:]
    again = prompts_by_step(resumed)
    assert sorted(again) == [3, 4, 5] and all(again[s] == first[s] for s in (3, 4, 5)), (first, again)
    assert all(r["stream/staleness_max"] <= 2 for r in train_rows(resumed))


ODD_LENGTH_REWARD = '''
from grpo import register_reward

@register_reward("says_seven")  # (the registry's name) rewards that differ within most groups
def says_seven(completions, answers, **row):
    return [float(len(c) % 2) for c in completions]
'''


@needs_launcher
def test_dynamic_sampling_fills_its_steps_from_the_stream(setup):  # noqa: F811
    """--filter_zero_std_groups with --max_staleness 2: the extra rounds a step needs come from the requests already
    in flight, and the stream still keeps every group within the bound and every prompt trained at most once."""
    (setup[0] / "odd_rewards.py").write_text(ODD_LENGTH_REWARD)
    out, proc = run_server(setup, "out_server_stream_dynamic", 29567, *STREAM, "--max_steps", "3",
                           "--filter_zero_std_groups", "true", "--max_generation_rounds", "3",
                           "--eval_on_start", "false", "--save_steps", "0", reward="odd_rewards.py")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["dynamic_sampling/rounds"] >= 1 and r["stream/staleness_max"] <= 2 for r in rows), rows
    assert all(r["dynamic_sampling/groups_kept"] > 0 for r in rows), rows
    seen = prompts_by_step(out)
    trained = [i for s in sorted(seen) for i in seen[s]]
    assert len(trained) == len(set(trained)) == 3 * 2


@needs_launcher
def test_max_staleness_one_is_async_rollout(setup):  # noqa: F811
    """K = 1 is today's --async_rollout to the last digit: the same flags through either spelling train the same."""
    flags = ("--tuning_strategy", "full", "--max_steps", "3", "--save_steps", "0", "--eval_on_start", "false")
    a, proc = run_server(setup, "out_server_k1_async", 29569, *flags, "--async_rollout", "true")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    b, proc = run_server(setup, "out_server_k1_stream", 29571, *flags, "--max_staleness", "1")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    measured = ("time/", "stream/rollout_idle_s", "stream/trainer_wait_s", "memory/", "throughput/")
    for x, y in zip(train_rows(a), train_rows(b), strict=True):
        assert {k: v for k, v in x.items() if not k.startswith(measured)} == \
               {k: v for k, v in y.items() if not k.startswith(measured)}
    assert [r["rollout/staleness"] for r in train_rows(b)] == [0.0, 1.0, 1.0]


@needs_launcher
def test_episodes_stream_two_steps_ahead_beside_pieces_of_one_turn_prompts(tmp_path):
    """--max_staleness 2 in pieces with episodes: the rollout rank runs them turn by turn, taking updates between two
    turns (each turn's tokens carry their version), and no step trains on a token more than 2 versions behind."""
    out, proc = launch_episodes(tmp_path, 29573, "--max_steps", "4", "--max_staleness", "2",
                                "--rollout_segment_tokens", "4", ranks=2)
    both = proc.stdout + proc.stderr
    assert proc.returncode == 0, both[-4000:]
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["episodes/turns"] > 1.5 for r in rows), rows
    assert rows[0]["stream/staleness_max"] == 0.0 and max(r["stream/staleness_max"] for r in rows) >= 1
    assert all(r["stream/staleness_max"] <= 2 and 0.0 <= r["stream/partial_share"] <= 1.0 for r in rows), rows
    assert environment_ranks(tmp_path) == {"1"}
