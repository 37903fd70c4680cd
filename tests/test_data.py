"""Dataset registry: loading every source kind, rendering prompts, and every error before a model loads."""
import json
import os

import datasets
import pytest

from grpo.data import (dataset_routes, extract_answer, load_dataset_registry, load_prompt_datasets,
                       render_prompts, DatasetSpec)
from grpo.errors import DatasetError

from .tiny_models import make_tiny_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = [{"q": f"What is {i} + 1 ?", "a": f"so #### {i + 1:,}"} for i in range(995, 1015)]


def write_registry(folder, entries):
    path = os.path.join(folder, "registry.json")
    with open(path, "w") as fh:
        json.dump(entries, fh)
    return path


def entry(path, **extra):
    return {"path": path, "prompt_field": "q", "answer_field": "a", "answer_extractor": "gsm8k",
            "rewards": {"gsm8k_accuracy": 1.0}, **extra}


@pytest.fixture
def jsonl(tmp_path):
    with open(tmp_path / "rows.jsonl", "w") as fh:
        for row in ROWS:
            fh.write(json.dumps(row) + "\n")
    return tmp_path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet", "save_to_disk"])
def test_every_source_kind_loads(fmt, tmp_path):
    ds = datasets.Dataset.from_list(ROWS)
    target = {"jsonl": "d.jsonl", "json": "d.json", "csv": "d.csv", "parquet": "d.parquet", "save_to_disk": "d"}[fmt]
    full = str(tmp_path / target)
    {"jsonl": lambda: ds.to_json(full), "json": lambda: ds.to_json(full), "csv": lambda: ds.to_csv(full),
     "parquet": lambda: ds.to_parquet(full), "save_to_disk": lambda: ds.save_to_disk(full)}[fmt]()
    registry = write_registry(str(tmp_path), {"toy": entry(target)})  # relative to the registry's folder
    train, held_out = load_prompt_datasets(registry, ["toy"], 0.8, seed=1)
    assert (len(train), len(held_out)) == (16, 4)
    assert set(train.column_names) == {"messages", "answer", "data_source"}
    assert all(r["data_source"] == "toy" for r in train)
    # "#### 1,000" -> "1000"
    answers = {r["messages"][-1]["content"]: r["answer"] for r in list(train) + list(held_out)}
    assert answers["What is 999 + 1 ?"] == "1000"


def test_split_is_deterministic_by_seed(jsonl):
    registry = write_registry(str(jsonl), {"toy": entry("rows.jsonl")})
    a = [r["answer"] for r in load_prompt_datasets(registry, ["toy"], 0.75, seed=1)[1]]
    b = [r["answer"] for r in load_prompt_datasets(registry, ["toy"], 0.75, seed=1)[1]]
    c = [r["answer"] for r in load_prompt_datasets(registry, ["toy"], 0.75, seed=2)[1]]
    assert a == b and a != c and len(a) == 5
    train, held_out = load_prompt_datasets(registry, ["toy"], 1.0, seed=1)
    assert (len(train), len(held_out)) == (20, 0)


def test_mixing_keeps_data_source_and_templates(jsonl):
    registry = write_registry(str(jsonl), {
        "plain": entry("rows.jsonl", max_samples=6),
        "chat": {"path": "rows.jsonl", "prompt_field": "q", "answer_field": "a", "answer_extractor": "regex:#### ([\\d,]+)",
                 "system_prompt": "Be brief.", "prompt_template": "Q: {prompt}\nA:", "rewards": {"format": 0.5},
                 "reward_kwargs": {"format": {"pattern": ".*"}}},
    })
    train, _ = load_prompt_datasets(registry, ["plain", "chat"], 1.0, seed=0)
    assert [r["data_source"] for r in train].count("plain") == 6
    chat = [r for r in train if r["data_source"] == "chat"][0]
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    assert chat["messages"][1]["content"].startswith("Q: What is") and chat["messages"][1]["content"].endswith("\nA:")
    routes, kwargs = dataset_routes(load_dataset_registry(registry), ["plain", "chat"])
    assert routes == {"plain": {"gsm8k_accuracy": 1.0}, "chat": {"format": 0.5}}
    assert kwargs["chat"] == {"format": {"pattern": ".*"}}


def test_messages_field(tmp_path):
    rows = [{"conv": [{"role": "user", "content": "hi"}], "gold": r"the \boxed{\frac{1}{2}}"}] * 3
    with open(tmp_path / "chat.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    registry = write_registry(str(tmp_path), {"c": {"path": "chat.jsonl", "messages_field": "conv",
                                                    "answer_field": "gold", "answer_extractor": "boxed",
                                                    "system_prompt": "sys", "rewards": {"boxed_accuracy": 1}}})
    train, _ = load_prompt_datasets(registry, ["c"], 1.0, seed=0)
    assert train[0]["messages"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    assert train[0]["answer"] == r"\frac{1}{2}"


def test_extractors():
    spec = DatasetSpec(name="x", rewards={}, answer_field="a")
    assert extract_answer(spec, " 12 ") == "12"
    spec.answer_extractor = "gsm8k"
    assert extract_answer(spec, "work\n#### 1,000") == "1000"
    spec.answer_extractor = "boxed"
    assert extract_answer(spec, r"\boxed{\frac{3}{4}}") == r"\frac{3}{4}"
    spec.answer_extractor = r"regex:answer: (\w+)"
    assert extract_answer(spec, "answer: a, answer: b") == "b"


def test_render_prompts_with_and_without_chat_template(jsonl):
    registry = write_registry(str(jsonl), {"toy": entry("rows.jsonl", system_prompt="Be brief .")})
    train, _ = load_prompt_datasets(registry, ["toy"], 1.0, seed=0)
    with_template = render_prompts(train, make_tiny_tokenizer(True), max_prompt_length=64)
    text = with_template[0]["prompt_text"]
    assert text.startswith("<|im_start|>system\nBe brief .<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    tok = make_tiny_tokenizer(True)
    assert with_template[0]["prompt_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    plain = render_prompts(train, make_tiny_tokenizer(False), max_prompt_length=64)
    assert plain[0]["prompt_text"] == "Be brief .\n\n" + train[0]["messages"][1]["content"] + "\n"
    with pytest.raises(DatasetError, match=r"toy: 20 prompt\(s\) are longer than --max_prompt_length 5"):
        render_prompts(train, make_tiny_tokenizer(True), max_prompt_length=5)


@pytest.mark.parametrize("content, fragments", [
    ('{"toy": {"path": "rows.jsonl",\n}', ["not valid JSON", "line 2"]),
    ('{"toy": {"path": "rows.jsonl", "prompt_field": "q", "answer_field": "a", "rewards": {"f": 1}, "promt": 1}}',
     ["unknown key(s) promt", "prompt_template"]),
    ('{"toy": {"path": "rows.jsonl", "prompt_field": "q", "answer_field": "a"}}', ["toy", "rewards"]),
    ('{"toy": {"prompt_field": "q", "answer_field": "a", "rewards": {"f": 1}}}', ["exactly one of \"path\""]),
    ('{"toy": {"path": "rows.jsonl", "prompt_field": "q", "answer_field": "a", "rewards": {"f": 1},'
     ' "answer_extractor": "last"}}', ["unknown answer_extractor 'last'", "gsm8k"]),
])
def test_registry_errors(content, fragments, jsonl):
    path = jsonl / "registry.json"
    path.write_text(content)
    with pytest.raises(DatasetError) as err:
        load_prompt_datasets(str(path), ["toy"], 1.0, 0)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_data_errors(jsonl):
    registry = write_registry(str(jsonl), {"toy": entry("rows.jsonl"), "gsm8k": entry("absent/train.jsonl"),
                                           "wrong": entry("rows.jsonl", prompt_field="question"),
                                           "empty": entry("empty.jsonl"), "bad": entry("bad.jsonl")})
    (jsonl / "empty.jsonl").write_text("")
    (jsonl / "bad.jsonl").write_text('{"q": "1", "a": "2"}\n{"q": oops}\n')
    cases = {"nope": ["unknown dataset 'nope'", "toy", "gsm8k"],
             "gsm8k": ["data file not found", str(jsonl / "absent" / "train.jsonl"), "grade-school-math"],
             "wrong": ["'question' is not a column", "columns present: q, a"],
             "empty": ["empty"],
             "bad": ["bad.jsonl line 2 is not valid JSON"]}
    for name, fragments in cases.items():
        with pytest.raises(DatasetError) as err:
            load_prompt_datasets(registry, [name], 1.0, 0)
        for fragment in fragments:
            assert fragment in str(err.value), (name, str(err.value))
    with pytest.raises(DatasetError, match="training split is empty"):
        load_prompt_datasets(write_registry(str(jsonl), {"two": entry("rows.jsonl", max_samples=2)}), ["two"], 0.1, 0)


def test_missing_registry_file(tmp_path):
    with pytest.raises(DatasetError, match="--dataset_config_path: file not found"):
        load_dataset_registry(str(tmp_path / "none.json"))


def test_shipped_registry_arith_and_gsm8k(gsm8k_dir, tmp_path):
    shipped = os.path.join(ROOT, "configs", "dataset_config.json")
    train, held_out = load_prompt_datasets(shipped, ["arith"], 0.95, seed=0)
    assert len(train) == 1900 and len(held_out) == 100
    assert "\\boxed{}" in train[0]["messages"][-1]["content"]
    # the shipped gsm8k entry, pointed at the GSM8K copy beside the repository
    spec = json.load(open(shipped))["gsm8k"]
    spec["path"] = os.path.join(gsm8k_dir, "train.jsonl")
    spec["max_samples"] = 200
    registry = write_registry(str(tmp_path), {"gsm8k": spec})
    train, held_out = load_prompt_datasets(registry, ["gsm8k"], 0.9, seed=0)
    assert (len(train), len(held_out)) == (180, 20)
    assert all(a.lstrip("-").replace(".", "").isdigit() for a in train["answer"])
