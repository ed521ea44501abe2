"""Tests for capt.tasks: rendering, loading the local SuperGLUE files, label mapping, metrics, bad input."""

import json
import os
from pathlib import Path

import datasets
import pytest

from capt import tasks
from capt.errors import CaptError
from capt.tasks import TASKS, custom_task, get_task, load_examples, load_file, split_note

DATA = Path(os.environ.get("CAPT_DATA_DIR") or tasks.DEFAULT_DATA_DIR)
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"SuperGLUE data not found at {DATA}")

RTE_PREMISE = ("Dana Reeve, the widow of the actor Christopher Reeve, has died of lung cancer at age 44, "
               "according to the Christopher Reeve Foundation.")
RTE_HYPOTHESIS = "Christopher Reeve had an accident."


# ---- rendering -------------------------------------------------------------------------------------

@needs_data
@pytest.mark.parametrize("name", sorted(TASKS))
def test_first_val_example_renders_in_both_styles(name):
    task = TASKS[name]
    example = load_examples(name, "val", limit=1)[0]
    for style in ("t5", "lm"):
        rendered = task.render(example, style)
        assert rendered.prompt.strip()
        assert len(rendered.choices) == len(task.labels)
        assert rendered.label == example["label"] and rendered.label in range(len(task.labels))
        assert (rendered.head_prompt is not None) == (name == "copa" and style == "lm")  # per-example choices
    t5 = task.render(example, "t5")
    assert t5.prompt.startswith(name + " ") and t5.choices == task.t5_words
    assert (t5.group is not None) == (name == "multirc")


@needs_data
def test_rte_exact_strings():
    # RTE/val.jsonl line 1: {"premise": "Dana Reeve, ...", "hypothesis": "Christopher Reeve had an accident.",
    # "label": "not_entailment", "idx": 0}
    example = load_examples("rte", "val", limit=1)[0]
    lm = TASKS["rte"].render(example, "lm")
    assert lm.prompt == f"{RTE_PREMISE}\nQuestion: {RTE_HYPOTHESIS} True or False?\nAnswer:"
    assert lm.choices == (" True", " False") and lm.label == 1 and lm.text_for(head=True) == lm.prompt
    t5 = TASKS["rte"].render(example, "t5")
    assert t5.prompt == f"rte hypothesis: {RTE_HYPOTHESIS} premise: {RTE_PREMISE}"  # keys in alphabetical order
    assert t5.choices == ("entailment", "not_entailment") and t5.label == 1


@needs_data
def test_copa_exact_strings():
    # COPA/val.jsonl line 1: premise "The man turned on the faucet.", choice1 "The toilet filled with water.",
    # choice2 "Water flowed from the spout.", question "effect", label 1
    example = load_examples("copa", "val", limit=1)[0]
    lm = TASKS["copa"].render(example, "lm")
    assert lm.prompt == "The man turned on the faucet therefore"
    assert lm.choices == (" the toilet filled with water.", " water flowed from the spout.") and lm.label == 1
    # a d x C head reads the last token only, so its text lists the alternatives (the prompt above does not)
    assert lm.head_prompt == ("The man turned on the faucet therefore\nOption 1: the toilet filled with water."
                              "\nOption 2: water flowed from the spout.\nAnswer: Option")
    assert lm.text_for(head=True) == lm.head_prompt and lm.text_for(head=False) == lm.prompt
    t5 = TASKS["copa"].render(example, "t5")
    assert t5.prompt == ("copa choice1: The toilet filled with water. choice2: Water flowed from the spout. "
                         "premise: The man turned on the faucet. question: effect")
    assert t5.choices == ("choice1", "choice2") and t5.text_for(head=True) == t5.prompt  # it names both already
    cause = TASKS["copa"].render({**example, "question": "cause"}, "lm")
    assert cause.prompt == "The man turned on the faucet because"


def test_wic_lm_uses_the_span_of_sentence1_when_given():
    example = {"word": "stripe", "sentence1": "They earned their stripes.", "sentence2": "A zebra's stripe.",
               "start1": 18, "end1": 25, "label": 0}
    assert "'stripes'" in TASKS["wic"].render(example, "lm").prompt
    without_span = {k: v for k, v in example.items() if k not in ("start1", "end1")}
    assert "'stripe'" in TASKS["wic"].render(without_span, "lm").prompt


def test_multirc_lm_prompt_holds_the_answer_and_choices_are_no_yes():
    example = {"paragraph": "P.", "question": "Q?", "answer": "A", "label": 1, "group": "0-0"}
    rendered = TASKS["multirc"].render(example, "lm")
    assert rendered.prompt == "P.\nQuestion: Q?\nAnswer: A\nIs the answer correct?"
    assert rendered.choices == (" no", " yes") and rendered.group == "0-0"


# ---- loading ---------------------------------------------------------------------------------------

@needs_data
@pytest.mark.parametrize("name,n_train,n_val", [
    ("cb", 250, 56), ("copa", 400, 100), ("multirc", 27243, 4848), ("rte", 2490, 277), ("wic", 5428, 638),
])
def test_train_and_val_sizes(name, n_train, n_val):
    train, val = load_examples(name, "train"), load_examples(name, "val")
    assert (len(train), len(val)) == (n_train, n_val)
    assert all(e["label"] in range(len(TASKS[name].labels)) for e in train + val)
    assert split_note(name) is None


@needs_data
def test_boolq_offline_split_partitions_the_val_file():
    assert split_note("boolq") == tasks.BOOLQ_OFFLINE_SPLIT
    train, val = load_examples("boolq", "train"), load_examples("boolq", "val")
    assert (len(train), len(val)) == (2289, 981)  # 3,270 val records, idx 0..3269: 3 in every 10 go to val
    train_ids, val_ids = {e["idx"] for e in train}, {e["idx"] for e in val}
    assert not train_ids & val_ids
    with open(DATA / "BoolQ" / "val.jsonl") as f:
        file_ids = {json.loads(line)["idx"] for line in f}
    assert train_ids | val_ids == file_ids
    assert all(i % 10 < 3 for i in val_ids)
    assert {type(e["label"]) for e in train} == {int}


@needs_data
def test_multirc_is_flattened_per_answer_option():
    val = load_examples("multirc", "val")
    assert len(val) == 4848 and len({e["group"] for e in val}) == 953
    first = val[0]  # passage 0, question 0, answer option 0 ("No", label 0)
    assert set(first) == {"paragraph", "question", "answer", "label", "idx", "group"}
    assert (first["answer"], first["label"], first["idx"], first["group"]) == ("No", 0, 0, "0-0")


@needs_data
def test_test_split_is_unlabeled_and_limit_applies():
    test = load_examples("cb", "test", limit=5)
    assert len(test) == 5 and all(e["label"] is None for e in test)


def test_missing_split_file_names_path_and_existing_splits(tmp_path):
    (tmp_path / "RTE").mkdir()
    (tmp_path / "RTE" / "val.jsonl").write_text(json.dumps(
        {"premise": "p", "hypothesis": "h", "label": "entailment", "idx": 0}) + "\n")
    assert load_examples("rte", "val", data_dir=tmp_path)[0]["label"] == 0
    with pytest.raises(CaptError, match=r"RTE/train\.jsonl.*found there: val"):
        load_examples("rte", "train", data_dir=tmp_path)


def test_boolq_train_file_present_means_no_offline_split(tmp_path):
    (tmp_path / "BoolQ").mkdir()
    row = {"question": "q", "passage": "p", "idx": 0, "label": True}
    for split in ("train", "val"):
        (tmp_path / "BoolQ" / f"{split}.jsonl").write_text(json.dumps(row) + "\n")
    assert split_note("boolq", tmp_path) is None
    assert load_examples("boolq", "val", data_dir=tmp_path)[0]["label"] == 1  # idx 0 would be "val" offline too
    assert len(load_examples("boolq", "train", data_dir=tmp_path)) == 1


def test_missing_data_dir_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPT_DATA_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(CaptError, match="nowhere.*CAPT_DATA_DIR"):
        load_examples("rte", "val")


def test_hub_rows_are_normalized(monkeypatch):
    hub = [{"paragraph": "P.", "question": "Q?", "answer": "A", "label": 1,
            "idx": {"paragraph": 3, "question": 7, "answer": 40}},
           {"paragraph": "P.", "question": "Q?", "answer": "B", "label": -1,
            "idx": {"paragraph": 3, "question": 7, "answer": 41}}]
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or hub)
    rows = load_examples("multirc", "val", source="aps/super_glue")
    assert calls == [(("aps/super_glue", "multirc"), {"split": "validation"})]
    assert rows[0] == {"paragraph": "P.", "question": "Q?", "answer": "A", "label": 1, "idx": 40, "group": "3-7"}
    assert rows[1]["label"] is None


def test_hub_failure_is_a_capt_error(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("no network")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(CaptError, match="unreachable.*Local data"):
        load_examples("rte", "train", source="aps/super_glue")


# ---- labels ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(TASKS))
def test_label_index_for_every_raw_label_name_and_index(name):
    task = TASKS[name]
    for i, (raw, label_name) in enumerate(zip(task.raw_labels, task.labels)):
        assert task.label_index(raw) == task.label_index(label_name) == task.label_index(str(raw)) == i
        assert task.label_index(i) == i
    with pytest.raises(CaptError, match="valid"):
        task.label_index("maybe")


def test_label_index_accepts_file_spellings():
    assert TASKS["boolq"].label_index("true") == 1 and TASKS["boolq"].label_index(False) == 0
    assert TASKS["copa"].label_index(1.0) == 1  # a CSV column with blanks parses as float
    with pytest.raises(CaptError, match="'entailment', 'contradiction', 'neutral'"):
        TASKS["cb"].label_index(5)


# ---- metrics ---------------------------------------------------------------------------------------

def test_accuracy():
    assert TASKS["rte"].metrics([0, 1, 1, 0], [0, 1, 0, 0]) == {"accuracy": 0.75}


def test_cb_macro_f1():
    # preds [0,0,1,2,2] vs golds [0,1,1,2,0]:
    # class 0: tp 1, fp 1 (item 1), fn 1 (item 4) -> F1 = 2/(2+2) = 1/2
    # class 1: tp 1, fp 0, fn 1 (item 1)          -> F1 = 2/(2+1) = 2/3
    # class 2: tp 1, fp 1 (item 4), fn 0          -> F1 = 2/3
    # macro = (1/2 + 2/3 + 2/3) / 3 = 11/18; accuracy 3/5
    scores = TASKS["cb"].metrics([0, 0, 1, 2, 2], [0, 1, 1, 2, 0])
    assert scores["accuracy"] == pytest.approx(3 / 5) and scores["macro_f1"] == pytest.approx(11 / 18)
    # classes 1 and 2 have neither predictions nor golds: they count 0 (sklearn zero_division=0)
    assert TASKS["cb"].metrics([0, 0], [0, 0])["macro_f1"] == pytest.approx(1 / 3)


def test_multirc_f1a_and_em():
    # question q1: both options right; q2: one wrong; q3: wrong.
    # positive class: tp 2 (items 0, 2), fp 1 (item 4), fn 1 (item 3) -> F1a = 4/6; EM = 1/3
    scores = TASKS["multirc"].metrics([1, 0, 1, 0, 1], [1, 0, 1, 1, 0], ["q1", "q1", "q2", "q2", "q3"])
    assert scores == pytest.approx({"accuracy": 3 / 5, "f1a": 2 / 3, "em": 1 / 3})
    with pytest.raises(CaptError, match="groups"):
        TASKS["multirc"].metrics([1], [1])


def test_metrics_reject_empty_and_mismatched_input():
    with pytest.raises(CaptError, match="no predictions"):
        TASKS["rte"].metrics([], [])
    with pytest.raises(CaptError, match="length"):
        TASKS["rte"].metrics([0, 1], [0])


# ---- bad input -------------------------------------------------------------------------------------

def test_missing_field_and_empty_text():
    with pytest.raises(CaptError, match="missing field 'hypothesis'; required fields: premise, hypothesis"):
        TASKS["rte"].render({"premise": "p"}, "lm")
    with pytest.raises(CaptError, match="empty text in field 'premise'"):
        TASKS["rte"].render({"premise": "  ", "hypothesis": "h"}, "t5")
    with pytest.raises(CaptError, match="style"):
        TASKS["rte"].render({"premise": "p", "hypothesis": "h"}, "gpt")


def test_unknown_task():
    assert get_task("RTE") is TASKS["rte"]
    with pytest.raises(CaptError, match="unknown task 'squad'; valid: boolq, cb, copa, multirc, rte, wic"):
        get_task("squad")


def test_csv_with_bad_label_names_value_row_and_valid_labels(tmp_path):
    path = tmp_path / "rte.csv"
    path.write_text("premise,hypothesis,label\np1,h1,entailment\np2,h2,maybe\n")
    with pytest.raises(CaptError, match=r"row 2.*'maybe'.*'entailment', 'not_entailment'"):
        load_file(path, TASKS["rte"])


def test_csv_with_missing_column_lists_the_file_columns(tmp_path):
    path = tmp_path / "rte.csv"
    path.write_text("sentence,hyp,label\np1,h1,entailment\n")
    with pytest.raises(CaptError, match=r"lacks columns \['premise', 'hypothesis'\]; it has: sentence, hyp, label"):
        load_file(path, TASKS["rte"])
    rows = load_file(path, TASKS["rte"], columns={"premise": "sentence", "hypothesis": "hyp"})
    assert rows == [{"premise": "p1", "hypothesis": "h1", "label": 0, "idx": 0}]


def test_empty_file(tmp_path):
    for name in ("empty.csv", "empty.jsonl"):
        (tmp_path / name).write_text("")
        with pytest.raises(CaptError, match="empty"):
            load_file(tmp_path / name, TASKS["rte"])
    (tmp_path / "header.csv").write_text("premise,hypothesis,label\n")
    with pytest.raises(CaptError, match="empty"):
        load_file(tmp_path / "header.csv", TASKS["rte"])


def test_custom_task_from_csv_end_to_end(tmp_path):
    path = tmp_path / "reviews.csv"
    path.write_text("review,stars\nGreat film.,1\nDull and long.,0\nLoved it.,1\n")
    task = custom_task("sentiment", ["review"], {"1": "good", 0: "bad"})  # "1" matches the CSV's parsed int 1
    assert task.labels == ("good", "bad") and task.lm_words == (" good", " bad")
    rows = load_file(path, task, label_column="stars")
    assert [r["label"] for r in rows] == [0, 1, 0]
    lm = task.render(rows[0], "lm")
    assert lm.prompt == "review: Great film.\nAnswer:" and lm.choices == (" good", " bad")
    t5 = task.render(rows[1], "t5")
    assert t5.prompt == "sentiment review: Dull and long." and t5.choices == ("good", "bad") and t5.label == 1
    assert task.metrics([0, 1, 1], [r["label"] for r in rows]) == pytest.approx({"accuracy": 2 / 3})


def test_custom_task_rejects_unknown_template_fields():
    with pytest.raises(CaptError, match="not fields"):
        custom_task("t", ["text"], {0: "no", 1: "yes"}, lm_template="{txt}\nAnswer:")
