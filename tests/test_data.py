"""Dataset registry: every source kind, standard rows, splits, prompt rendering, and every error before a model."""
import importlib.util
import json
import os

import datasets
import pytest

from grpo.data import (DatasetSpec, build_messages, dataset_routes, extract_answer, first_rows_per_source,
                       load_dataset_registry, load_prompt_datasets, render_prompts)
from grpo.errors import DatasetError

from .tiny_models import make_tiny_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(ROOT, "configs", "dataset_config.json")
ROWS = [{"q": f"What is {i} + 1 ?", "a": f"so #### {i + 1:,}"} for i in range(995, 1015)]  # 20 rows


def write_registry(folder, entries, name="registry.json"):
    path = os.path.join(str(folder), name)
    with open(path, "w") as fh:
        json.dump(entries, fh)
    return path


def entry(path, **extra):
    return {"path": path, "prompt_field": "q", "answer_field": "a", "answer_extractor": "gsm8k",
            "rewards": {"gsm8k_accuracy": 1.0}, **extra}


def write_jsonl(path, rows):
    with open(path, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


def error_of(fn, *args):
    with pytest.raises(DatasetError) as err:
        fn(*args)
    return str(err.value)


@pytest.fixture
def jsonl(tmp_path):
    write_jsonl(tmp_path / "rows.jsonl", ROWS)
    return tmp_path


# ------------------------------------------------------------------------------------------------ registry
def test_registry_round_trip(tmp_path):
    (tmp_path / "configs").mkdir()
    entries = {
        "local": {"path": "../data/x.jsonl", "prompt_field": "q", "answer_field": "a", "system_prompt": "Be brief.",
                  "prompt_template": "{prompt} Answer in \\boxed{}.", "answer_extractor": "regex:= (\\d+)",
                  "rewards": {"boxed_accuracy": 1.0, "format": 0.2}, "reward_kwargs": {"format": {"pattern": "x"}},
                  "max_samples": 7},
        "hub": {"hub_id": "org/set", "split": "test", "messages_field": "chat", "answer_field": "gold",
                "rewards": {"boxed_accuracy": 1}, "max_samples": None, "system_prompt": None},
        "home": {"path": "~/sets/y.csv", "prompt_field": "q", "answer_field": "a", "rewards": {"format": 1}},
    }
    registry = load_dataset_registry(write_registry(tmp_path / "configs", entries))
    assert registry["local"] == DatasetSpec(
        name="local", path=str(tmp_path / "data" / "x.jsonl"), prompt_field="q", answer_field="a",
        system_prompt="Be brief.", prompt_template="{prompt} Answer in \\boxed{}.", answer_extractor="regex:= (\\d+)",
        rewards={"boxed_accuracy": 1.0, "format": 0.2}, reward_kwargs={"format": {"pattern": "x"}}, max_samples=7)
    # defaults fill what an entry leaves out; null means "not set"
    assert registry["hub"] == DatasetSpec(name="hub", hub_id="org/set", split="test", messages_field="chat",
                                          answer_field="gold", rewards={"boxed_accuracy": 1})
    assert registry["hub"].answer_extractor == "none" and registry["hub"].path is None
    assert registry["home"].path == os.path.join(os.path.expanduser("~"), "sets", "y.csv")
    routes, kwargs = dataset_routes(registry, ["local", "hub"])
    assert routes == {"local": {"boxed_accuracy": 1.0, "format": 0.2}, "hub": {"boxed_accuracy": 1}}
    assert kwargs == {"local": {"format": {"pattern": "x"}}, "hub": {}}
    kwargs["local"]["format"]["pattern"] = "changed"  # the router gets copies, not the registry's own dicts
    assert registry["local"].reward_kwargs["format"]["pattern"] == "x"


GOOD = '"path": "rows.jsonl", "prompt_field": "q", "answer_field": "a", "rewards": {"f": 1}'


@pytest.mark.parametrize("content, fragments", [
    ('{"toy": {"path": "rows.jsonl",\n  }', ["registry.json is not valid JSON", "line 2, column 3"]),
    ('[]', ["must hold a JSON object"]),
    ('{}', ["registers no dataset"]),
    ('{"toy": "rows.jsonl"}', ["dataset 'toy' in", "must be a JSON object"]),
    ('{"toy": {%s, "promt_template": "{prompt}"}}' % GOOD,
     ["unknown key(s) promt_template (did you mean prompt_template?)", "valid keys: path, hub_id, split"]),
    ('{"toy": {"path": "rows.jsonl", "prompt_field": "q", "answer_field": "a"}}', ["dataset 'toy'", "\"rewards\""]),
    ('{"toy": {%s, "rewards": {}}}' % GOOD.replace(', "rewards": {"f": 1}', ""), ["\"rewards\" must map"]),
    ('{"toy": {%s, "rewards": {"f": true}}}' % GOOD.replace(', "rewards": {"f": 1}', ""), ["numeric weights"]),
    ('{"toy": {"prompt_field": "q", "answer_field": "a", "rewards": {"f": 1}}}', ["exactly one of \"path\""]),
    ('{"toy": {%s, "hub_id": "a/b"}}' % GOOD, ["exactly one of \"path\"", "\"hub_id\""]),
    ('{"toy": {%s, "messages_field": "m"}}' % GOOD, ["exactly one of \"prompt_field\"", "\"messages_field\""]),
    ('{"toy": {"path": "rows.jsonl", "prompt_field": "q", "rewards": {"f": 1}}}', ["\"answer_field\" is required"]),
    ('{"toy": {%s, "system_prompt": 3}}' % GOOD, ["\"system_prompt\" must be a string, got 3"]),
    ('{"toy": {%s, "answer_extractor": "last"}}' % GOOD, ["unknown answer_extractor 'last'", "gsm8k, boxed"]),
    ('{"toy": {%s, "answer_extractor": "regex:(unclosed"}}' % GOOD, ["regex does not compile"]),
    ('{"toy": {%s, "answer_extractor": "regex:\\\\d+"}}' % GOOD, ["needs a capture group"]),
    ('{"toy": {%s, "prompt_template": "Solve: {question}"}}' % GOOD, ["placeholder {prompt}"]),
    ('{"toy": {%s, "max_samples": 0}}' % GOOD, ["\"max_samples\" must be a positive integer or null, got 0"]),
    ('{"toy": {%s, "max_samples": true}}' % GOOD, ["\"max_samples\" must be a positive integer"]),
    ('{"toy": {%s, "reward_kwargs": {"f": 2}}}' % GOOD, ["\"reward_kwargs\" must map reward names to objects"]),
])
def test_registry_errors(content, fragments, jsonl):
    path = jsonl / "registry.json"
    path.write_text(content)
    message = error_of(load_prompt_datasets, str(path), ["toy"], 1.0, 0)
    for fragment in fragments:
        assert fragment in message, message


def test_missing_registry_file(tmp_path):
    message = error_of(load_dataset_registry, "no/such/registry.json")
    assert message == f"--dataset_config_path: file not found: {os.path.abspath('no/such/registry.json')}"


# ------------------------------------------------------------------------------------------------- loading
@pytest.mark.parametrize("fmt", ["jsonl", "json", "json_array", "csv", "parquet", "save_to_disk"])
def test_every_source_kind_loads(fmt, tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "data").mkdir()
    ds = datasets.Dataset.from_list(ROWS)
    target = {"jsonl": "d.jsonl", "json": "d.json", "json_array": "d.json", "csv": "d.csv", "parquet": "d.parquet",
              "save_to_disk": "d"}[fmt]
    full = str(tmp_path / "data" / target)
    {"jsonl": lambda: ds.to_json(full), "json": lambda: ds.to_json(full),
     "json_array": lambda: (tmp_path / "data" / target).write_text(json.dumps(ROWS, indent=1)),
     "csv": lambda: ds.to_csv(full), "parquet": lambda: ds.to_parquet(full),
     "save_to_disk": lambda: ds.save_to_disk(full)}[fmt]()
    written = sorted(os.listdir(tmp_path / "data"))
    registry = write_registry(tmp_path / "configs", {"toy": entry(f"../data/{target}")})  # relative to the registry
    train, held_out = load_prompt_datasets(registry, ["toy"], 0.8, seed=1)
    assert (len(train), len(held_out)) == (16, 4)  # round(20 * 0.8) = 16 train rows
    assert set(train.column_names) == {"messages", "answer", "data_source"}
    assert set(train["data_source"]) == {"toy"}
    # "#### 1,000" -> "1000": every question keeps its own answer
    answers = {r["messages"][-1]["content"]: r["answer"] for r in list(train) + list(held_out)}
    assert answers == {f"What is {i} + 1 ?": str(i + 1) for i in range(995, 1015)}
    assert sorted(os.listdir(tmp_path / "data")) == written  # no cache files beside the user's data


def test_split_is_deterministic_by_seed(jsonl):
    registry = write_registry(jsonl, {"toy": entry("rows.jsonl")})
    train_a, eval_a = load_prompt_datasets(registry, ["toy"], 0.75, seed=1)
    _, eval_b = load_prompt_datasets(registry, ["toy"], 0.75, seed=1)
    _, eval_c = load_prompt_datasets(registry, ["toy"], 0.75, seed=2)
    assert (len(train_a), len(eval_a)) == (15, 5)  # round(20 * 0.75) = 15
    assert list(eval_a["answer"]) == list(eval_b["answer"]) and list(eval_a["answer"]) != list(eval_c["answer"])
    assert sorted(list(train_a["answer"]) + list(eval_a["answer"])) == sorted(str(i + 1) for i in range(995, 1015))
    train, held_out = load_prompt_datasets(registry, ["toy"], 1.0, seed=1)
    assert (len(train), len(held_out)) == (20, 0)
    # a ratio below 1 holds out at least one row: round(20 * 0.99) = 20 would leave none
    assert [len(p) for p in load_prompt_datasets(registry, ["toy"], 0.99, seed=1)] == [19, 1]


def test_mixing_keeps_data_source_and_templates(jsonl):
    write_jsonl(jsonl / "chat.jsonl", [{"conv": [{"role": "user", "content": f"hi {i}"}], "gold": str(i)}
                                       for i in range(4)])
    registry = write_registry(jsonl, {
        "plain": entry("rows.jsonl", max_samples=6),
        "templated": {"path": "rows.jsonl", "prompt_field": "q", "answer_field": "a",
                      "answer_extractor": "regex:#### ([\\d,]+)", "system_prompt": "Be brief.",
                      "prompt_template": "Q: {prompt} Put it in \\boxed{}.", "rewards": {"format": 0.5},
                      "reward_kwargs": {"format": {"pattern": ".*"}}},
        "chat": {"path": "chat.jsonl", "messages_field": "conv", "answer_field": "gold", "rewards": {"format": 1}},
    })
    train, held_out = load_prompt_datasets(registry, ["plain", "templated", "chat"], 0.5, seed=0)
    # each dataset is split on its own: plain 6 -> 3 + 3, templated 20 -> 10 + 10, chat 4 -> 2 + 2
    assert list(train["data_source"]) == ["plain"] * 3 + ["templated"] * 10 + ["chat"] * 2
    assert list(held_out["data_source"]) == ["plain"] * 3 + ["templated"] * 10 + ["chat"] * 2
    templated = train[3]
    assert templated["messages"][0] == {"role": "system", "content": "Be brief."}
    user = templated["messages"][1]["content"]
    assert user.startswith("Q: What is ") and user.endswith(" + 1 ? Put it in \\boxed{}.")
    # group 1 of "#### ([\d,]+)" keeps the thousands separator, unlike the gsm8k extractor
    templated_answers = [r["answer"] for r in list(train) + list(held_out) if r["data_source"] == "templated"]
    assert sorted(templated_answers) == sorted(f"{i + 1:,}" for i in range(995, 1015))
    assert train[13]["messages"] == [{"role": "user", "content": train[13]["messages"][0]["content"]}]
    assert train[13]["answer"] == train[13]["messages"][0]["content"].split()[1]


def test_messages_field_with_and_without_system_prompt(tmp_path):
    rows = [{"conv": [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
                      {"role": "user", "content": "half of 1?"}], "gold": r"the \boxed{\frac{1}{2}}"},
            {"conv": [{"role": "system", "content": "own system"}, {"role": "user", "content": "q"}],
             "gold": r"\boxed{3}"}]
    write_jsonl(tmp_path / "chat.jsonl", rows)
    base = {"path": "chat.jsonl", "messages_field": "conv", "answer_field": "gold", "answer_extractor": "boxed",
            "rewards": {"boxed_accuracy": 1}}
    registry = write_registry(tmp_path, {"bare": base, "sys": {**base, "system_prompt": "sys",
                                                               "prompt_template": "{prompt} (exact)"}})
    bare, _ = load_prompt_datasets(registry, ["bare"], 1.0, seed=0)
    assert bare[0]["messages"] == rows[0]["conv"] and bare[0]["answer"] == r"\frac{1}{2}"
    with_system, _ = load_prompt_datasets(registry, ["sys"], 1.0, seed=0)
    assert with_system[0]["messages"] == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "half of 1? (exact)"}]  # last user turn
    # a row with its own system message keeps it (no second system message)
    assert with_system[1]["messages"] == [{"role": "system", "content": "own system"},
                                          {"role": "user", "content": "q (exact)"}]
    assert with_system[1]["answer"] == "3"


def test_extractors():
    assert extract_answer("none", " 12 ") == "12"
    assert extract_answer("none", 7) == "7"  # numbers from csv / parquet columns become strings
    assert extract_answer("gsm8k", "48 / 2 = 24\n#### 1,000") == "1000"
    assert extract_answer("gsm8k", "#### 1\n#### -2,500.5 ") == "-2500.5"  # the last marker wins
    assert extract_answer("boxed", r"so \boxed{1} then \boxed{\frac{3}{4}}") == r"\frac{3}{4}"  # last, nested
    assert extract_answer(r"regex:answer: (\w+)", "answer: a, answer: b") == "b"  # group 1 of the last match
    for extractor, value in [("gsm8k", "no marker"), ("boxed", "none here"), (r"regex:= (\d+)", "x"), ("none", " ")]:
        assert extract_answer(extractor, value) is None


def test_build_messages_uses_replace_not_format():
    spec = DatasetSpec(name="s", prompt_field="q", answer_field="a", prompt_template="{prompt} in \\boxed{} {x}")
    assert build_messages(spec, {"q": "1+1", "a": "2"}) == [{"role": "user", "content": "1+1 in \\boxed{} {x}"}]


# -------------------------------------------------------------------------------------------- data errors
def test_data_errors(jsonl, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (jsonl / "empty.jsonl").write_text("\n")
    (jsonl / "bad.jsonl").write_text('{"q": "1", "a": "#### 2"}\n\n{"q": oops}\n')
    (jsonl / "list.jsonl").write_text('{"q": "1", "a": "#### 2"}\n[1, 2]\n')
    (jsonl / "bad.json").write_text('[{"q": "1", "a": "#### 2"},\n {"q": }]')
    (jsonl / "notes.txt").write_text("hello")
    (jsonl / "folder").mkdir()
    write_jsonl(jsonl / "null.jsonl", [{"q": "1", "a": "#### 2"}, {"q": "2", "a": None}])
    write_jsonl(jsonl / "chat.jsonl", [{"m": "not a list", "a": "#### 1"}])
    registry = write_registry(jsonl, {
        "toy": entry("rows.jsonl"), "gsm8k": entry("absent/train.jsonl"), "other": entry("absent/o.jsonl"),
        "wrong": entry("rows.jsonl", prompt_field="question"), "empty": entry("empty.jsonl"),
        "bad": entry("bad.jsonl"), "list": entry("list.jsonl"), "bad_json": entry("bad.json"),
        "txt": entry("notes.txt"), "folder": entry("folder"), "null": entry("null.jsonl"),
        "no_marker": entry("rows.jsonl", answer_extractor="boxed"),
        "chat": {"path": "chat.jsonl", "messages_field": "m", "answer_field": "a", "answer_extractor": "gsm8k",
                 "rewards": {"f": 1}},
        "hub": {"hub_id": "org/set", "prompt_field": "q", "answer_field": "a", "rewards": {"f": 1}}})
    (jsonl / "chat_ok.jsonl").write_text(json.dumps({"m": [{"role": "system", "content": "s"}], "a": "1"}) + "\n")
    cases = {
        "nope": ["unknown dataset 'nope'", f"registered in {registry}: bad, bad_json, chat, empty"],
        "gsm8k": ["data file not found", str(jsonl / "absent" / "train.jsonl"),
                  "https://github.com/openai/grade-school-math", "grade_school_math/data/train.jsonl"],
        "other": [f"data file not found: {jsonl / 'absent' / 'o.jsonl'}; fix \"path\" in the registry"],
        "wrong": ["prompt_field 'question' is not a column", "columns present: q, a"],
        "empty": ["dataset 'empty'", "empty.jsonl has no rows"],
        "bad": ["bad.jsonl line 3 is not valid JSON"],
        "list": ["list.jsonl line 2 is not a JSON object"],
        "bad_json": ["bad.json is not valid JSON (line 2, column 8"],
        "txt": ["unsupported file type '.txt'", ".parquet"],
        "folder": ["is a folder but not one written by datasets' save_to_disk"],
        "null": ["record 2 of", "has no value in 'a'"],
        "no_marker": ["answer_extractor 'boxed' finds no answer in 20 of 20 rows", "record 1"],
        "chat": ["record 1 of", "'m' must hold a non-empty list of"],
        "hub": ["hub_id 'org/set' needs the network", "give its local file as \"path\""],
    }
    for name, fragments in cases.items():
        message = error_of(load_prompt_datasets, registry, [name], 1.0, 0)
        for fragment in fragments:
            assert fragment in message, (name, message)
    registry_ok = write_registry(jsonl, {"sys_only": {"path": "chat_ok.jsonl", "messages_field": "m",
                                                      "answer_field": "a", "rewards": {"f": 1},
                                                      "prompt_template": "{prompt}!"}}, name="r2.json")
    assert "has no user message to apply prompt_template to" in error_of(
        load_prompt_datasets, registry_ok, ["sys_only"], 1.0, 0)
    assert "listed more than once" in error_of(load_prompt_datasets, registry, ["toy", "toy"], 1.0, 0)
    assert "--dataset_names: no dataset given" in error_of(load_prompt_datasets, registry, [], 1.0, 0)
    two = write_registry(jsonl, {"two": entry("rows.jsonl", max_samples=2)}, name="r3.json")
    # max_samples 2, ratio 0.1: round(2 * 0.1) = 0 rows left for training
    assert "dataset 'two': the training split is empty (2 rows" in error_of(load_prompt_datasets, two, ["two"], 0.1, 0)


def test_unknown_name_is_reported_before_any_file_is_read(jsonl):
    registry = write_registry(jsonl, {"broken": entry("missing.jsonl"), "toy": entry("rows.jsonl")})
    assert "unknown dataset 'typo'" in error_of(load_prompt_datasets, registry, ["broken", "typo"], 1.0, 0)


# ------------------------------------------------------------------------------------------ eval datasets
def test_eval_datasets_are_loaded_whole_after_the_held_out_rows(jsonl):
    write_jsonl(jsonl / "test.jsonl", [{"q": f"What is {i} * 2 ?", "a": f"#### {2 * i}"} for i in range(7)])
    registry = write_registry(jsonl, {"toy": entry("rows.jsonl"), "broken": entry("missing.jsonl"),
                                      "toy_test": entry("test.jsonl", rewards={"format": 1.0})})
    train, evaluation = load_prompt_datasets(registry, ["toy"], 1.0, 0, eval_names=["toy_test"])
    assert len(train) == 20 and set(train["data_source"]) == {"toy"}
    assert list(evaluation["data_source"]) == ["toy_test"] * 7
    assert list(evaluation["answer"]) == [str(2 * i) for i in range(7)]  # every row, in file order
    # a split as well: the held-out rows come first, and every row names its dataset
    train, evaluation = load_prompt_datasets(registry, ["toy"], 0.75, 0, eval_names="toy_test")
    assert len(train) == 15 and list(evaluation["data_source"]) == ["toy"] * 5 + ["toy_test"] * 7
    assert list(first_rows_per_source(evaluation, 3)["data_source"]) == ["toy"] * 3 + ["toy_test"] * 3
    assert list(first_rows_per_source(evaluation, 3)["answer"])[3:] == ["0", "2", "4"]
    assert first_rows_per_source(evaluation, -1) is evaluation
    # the eval dataset is scored by its own registry entry's rewards
    routes, _ = dataset_routes(load_dataset_registry(registry), ["toy", "toy_test"])
    assert routes == {"toy": {"gsm8k_accuracy": 1.0}, "toy_test": {"format": 1.0}}
    # name errors come before any file is read ("broken" has no file)
    for eval_names, fragment in [(["typo"], "unknown dataset 'typo'"),
                                 (["broken"], "--eval_dataset_names: broken is also in --dataset_names"),
                                 (["toy_test", "toy_test"], "--eval_dataset_names: toy_test listed more than once")]:
        message = error_of(load_prompt_datasets, registry, ["broken"], 1.0, 0, eval_names)
        assert fragment in message, message
    assert "dataset 'broken': data file not found" in error_of(load_prompt_datasets, registry, ["toy"], 1.0, 0,
                                                                ["broken"])


# ---------------------------------------------------------------------------------------------- rendering
def test_render_prompts_with_chat_template(jsonl):
    registry = write_registry(jsonl, {"toy": entry("rows.jsonl", system_prompt="Give the answer .")})
    train, _ = load_prompt_datasets(registry, ["toy"], 1.0, seed=0)
    tokenizer = make_tiny_tokenizer(with_chat_template=True)
    rendered = render_prompts(train, tokenizer, max_prompt_length=64)
    question = train[0]["messages"][1]["content"]
    expected = (f"<|im_start|>system\nGive the answer .<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
                f"<|im_start|>assistant\n")
    assert rendered[0]["prompt_text"] == expected
    ids = rendered[0]["prompt_ids"]
    assert ids == tokenizer(expected, add_special_tokens=False)["input_ids"]
    # the template's special tokens stay single ids (not split into "<", "|", ...)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == im_start and ids.count(im_start) == 3
    assert rendered.column_names == ["messages", "answer", "data_source", "prompt_text", "prompt_ids"]


def test_render_prompts_without_chat_template(jsonl):
    registry = write_registry(jsonl, {"toy": entry("rows.jsonl", system_prompt="Give the answer .")})
    train, _ = load_prompt_datasets(registry, ["toy"], 1.0, seed=0)
    tokenizer = make_tiny_tokenizer(with_chat_template=False)
    rendered = render_prompts(train, tokenizer, max_prompt_length=64)
    question = train[0]["messages"][1]["content"]
    assert rendered[0]["prompt_text"] == f"Give the answer .\n\n{question}\n"
    # "Give the answer ." (4 tokens) + "What is N + 1 ?" (6 tokens) = 10
    assert rendered[0]["prompt_ids"] == tokenizer(rendered[0]["prompt_text"])["input_ids"]
    assert len(rendered[0]["prompt_ids"]) == 10


def test_too_long_prompts_name_datasets_counts_and_fix(jsonl):
    registry = write_registry(jsonl, {"toy": entry("rows.jsonl"),
                                      "long": entry("rows.jsonl", max_samples=3, system_prompt="Give the answer .")})
    train, _ = load_prompt_datasets(registry, ["toy", "long"], 1.0, seed=0)
    tokenizer = make_tiny_tokenizer(with_chat_template=False)
    # toy prompts are 6 tokens ("What is N + 1 ?"), long ones 4 + 6 = 10: a limit of 8 rejects the 3 long ones
    message = error_of(render_prompts, train, tokenizer, 8)
    assert message.startswith("dataset(s) long: 3 prompt(s) are longer than --max_prompt_length 8 tokens")
    assert "the longest has 10" in message and "--max_prompt_length 10" in message and "max_samples" in message
    message = error_of(render_prompts, train, tokenizer, 5)
    assert "dataset(s) long, toy: 23 prompt(s)" in message
    assert "(3 in 'long', 20 in 'toy', the longest has 10)" in message
    assert len(render_prompts(train, tokenizer, 10)) == 23


def test_filter_overlong_prompts_drops_reports_and_refuses_an_emptied_dataset(jsonl, grpo_log):
    write_jsonl(jsonl / "mixed.jsonl", [{"q": "What is 1 + 1 ?", "a": "#### 2"}] * 3 +
                [{"q": "What is 1 + 1 + 1 + 1 ?", "a": "#### 4"}] * 2)
    registry = write_registry(jsonl, {"toy": entry("rows.jsonl"), "mixed": entry("mixed.jsonl"),
                                      "long": entry("rows.jsonl", max_samples=3, system_prompt="Give the answer .")})
    train, _ = load_prompt_datasets(registry, ["toy", "mixed"], 1.0, seed=0)
    tokenizer = make_tiny_tokenizer(with_chat_template=False)
    # without the flag an overlong prompt stays an error, which names the flag that drops them
    message = error_of(render_prompts, train, tokenizer, 8)
    assert message.startswith("dataset(s) mixed: 2 prompt(s)") and "--filter_overlong_prompts" in message
    # 6-token prompts are kept, the two 10-token ones ("What is 1 + 1 + 1 + 1 ?") dropped
    kept = render_prompts(train, tokenizer, 8, filter_overlong=True)
    assert len(kept) == 23 and max(len(ids) for ids in kept["prompt_ids"]) == 6
    assert list(kept["data_source"]) == ["toy"] * 20 + ["mixed"] * 3
    assert grpo_log == [
        "train dataset 'toy': dropped 0 of 20 prompts longer than --max_prompt_length 8; the longest kept has 6 tokens",
        "train dataset 'mixed': dropped 2 of 5 prompts longer than --max_prompt_length 8; the longest kept has 6 "
        "tokens"]
    # a dataset that would lose every row is an error naming it
    everything_long, _ = load_prompt_datasets(registry, ["toy", "long"], 1.0, seed=0)
    message = error_of(render_prompts, everything_long, tokenizer, 8, True, "eval")
    assert message.startswith("dataset 'long' (eval): all 3 prompts are longer than --max_prompt_length 8 tokens "
                              "(the shortest has 10)"), message


# ----------------------------------------------------------------------------------------- shipped data
def test_shipped_registry_and_arith_rows():
    registry = load_dataset_registry(SHIPPED)
    assert set(registry) >= {"arith", "gsm8k", "gsm8k_test"}
    assert registry["arith"].path == os.path.join(ROOT, "data", "arith", "train.jsonl")
    assert registry["gsm8k"].path == os.path.join(ROOT, "data", "gsm8k", "train.jsonl")
    assert registry["gsm8k_test"].path == os.path.join(ROOT, "data", "gsm8k", "test.jsonl")
    # the test entry renders and scores exactly as the train entry does
    assert {k: v for k, v in vars(registry["gsm8k_test"]).items() if k not in ("name", "path")} == \
        {k: v for k, v in vars(registry["gsm8k"]).items() if k not in ("name", "path")}
    train, held_out = load_prompt_datasets(SHIPPED, ["arith"], 0.95, seed=0)
    assert (len(train), len(held_out)) == (1900, 100)
    assert "\\boxed{}" in train[0]["messages"][-1]["content"]
    for row in list(train.select(range(50))) + list(held_out):  # every answer is the arithmetic of its question
        a, op, b = row["messages"][-1]["content"].split("?")[0].split()[-3:]
        assert int(row["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def test_shipped_arith_rewards_pay_one_box_only():
    """arith's weights 1.0 boxed-right + 0.5 right number + 0.2 format, the format paid for exactly one box: a
    repeated box is how a policy games a pattern that pays a box anywhere."""
    from grpo.rewards import RewardRouter

    routes, reward_kwargs = dataset_routes(load_dataset_registry(SHIPPED), ["arith"])
    completions = [r"12 + 30 = \boxed{42}.",                      # right, one box: 1.0 + 0.5 + 0.2
                   r"\boxed{42} and so \boxed{42}",                # right, two boxes: no format reward
                   r"It is \boxed{41}, since 12 + 30 = 41 or so",  # wrong, one box with text after it: format only
                   "12 + 30 = 42"]                                 # right number, no box: 0.5
    result = RewardRouter(routes, reward_kwargs)(completions, ["42"] * 4, ["arith"] * 4, prompts=["p"] * 4)
    assert result.per_function["format"] == [1.0, 0.0, 1.0, 0.0]
    assert result.total == pytest.approx([1.7, 1.5, 0.2, 0.5])


def test_arith_file_is_what_the_script_generates():
    spec = importlib.util.spec_from_file_location("make_arith", os.path.join(ROOT, "scripts", "make_arith_dataset.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with open(os.path.join(ROOT, "data", "arith", "train.jsonl")) as fh:
        assert fh.read() == script.to_jsonl(script.make_rows(2000, seed=1234))
    assert script.make_rows(5, seed=7) == script.make_rows(5, seed=7) != script.make_rows(5, seed=8)


def test_shipped_gsm8k_entries(gsm8k_dir, tmp_path):
    shipped = json.load(open(SHIPPED))
    entries = {name: {**shipped[name], "path": os.path.join(gsm8k_dir, f"{split}.jsonl"), "max_samples": 200}
               for name, split in (("gsm8k", "train"), ("gsm8k_test", "test"))}
    registry = write_registry(tmp_path, entries)
    train, held_out = load_prompt_datasets(registry, ["gsm8k"], 0.9, seed=0)
    assert (len(train), len(held_out)) == (180, 20)
    # the train / test pair: nothing held out of train, the test file is the eval set
    train, test = load_prompt_datasets(registry, ["gsm8k"], 1.0, seed=0, eval_names=["gsm8k_test"])
    assert (len(train), len(test)) == (200, 200) and set(test["data_source"]) == {"gsm8k_test"}
    assert not set(train["messages"][i][-1]["content"] for i in range(200)) & \
        set(test["messages"][i][-1]["content"] for i in range(200))
    assert all(a.lstrip("-").replace(".", "", 1).isdigit() for a in test["answer"])
    assert all(a.lstrip("-").replace(".", "", 1).isdigit() for a in list(train["answer"]) + list(held_out["answer"]))
    assert "####" in train[0]["messages"][-1]["content"]
