"""SuperGLUE task definitions, data loading and metrics.

A `Task` is plain data: its label names, input fields and the words a model scores for each label, in
two prompt styles. "t5" is T5's `"<task> key: value ..."` format with keys in alphabetical order;
"lm" is lm-evaluation-harness's SuperGLUE prompt for decoder-only models. `TASKS` holds the six
built-in tasks; `custom_task` makes a user's own task without code.

Data comes from the local SuperGLUE files (`<data_dir>/<Task>/{train,val,test}.jsonl`) or, with
`source=`, from a Hugging Face hub dataset. Either way `load_examples` returns normalized dicts:
the task's fields as strings, "label" (index into `task.labels`, None when unlabeled) and "idx";
MultiRC examples also carry "group" (one id per question) and are flattened to one per answer option.

BoolQ's train file is not available offline, so when it is missing BoolQ is trained and tested on a
fixed split of its official val file (3,270 examples): examples with `idx % 10 < 3` (981) form the
split called "val" and the others (2,289) the split called "train". The split depends only on `idx`,
so it is the same on every machine and run. `split_note` says when this split is in effect.
"""

from __future__ import annotations

import os
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CaptError

# The repo lives at /work/main and the data at /work/shared/data/superglue; CAPT_DATA_DIR overrides it.
DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "superglue"

BOOLQ_OFFLINE_SPLIT = (
    "BoolQ has no train file offline: 'train' is the 2,289 examples of the official val file with "
    "idx % 10 >= 3 and 'val' the other 981 (idx % 10 < 3), which training scores as its test split; the "
    "official test file has no labels."
)

SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class Rendered:
    prompt: str  # the text the model reads; the capsule's instance mean is taken over it
    choices: tuple[str, ...]  # one continuation string per label, in label order, scored by the model
    label: int | None  # gold label index into task.labels, None if unlabeled
    group: str | None = None  # MultiRC: a question id, for exact match per question; else None
    # What a classifier head (d x C on the last token) reads instead of `prompt`, when the choices are the
    # example's own text (COPA): the prompt followed by the choices, so the head can see them. Else None.
    head_prompt: str | None = None

    def text_for(self, head: bool) -> str:
        """The text the backbone reads: `head_prompt` for a classifier head when there is one, else `prompt`."""
        return self.head_prompt if head and self.head_prompt is not None else self.prompt


def _key(value) -> str:
    """A label value as a comparable string: True/"true", 1/1.0/"1" compare equal."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value).strip().lower()


@dataclass(frozen=True)
class Task:
    name: str  # "rte"
    labels: tuple[str, ...]  # human-readable label names in index order
    fields: tuple[str, ...]  # input fields an example must have (non-empty strings)
    t5_words: tuple[str, ...]  # T5 target per label
    lm_template: str  # decoder-only prompt, str.format over the example fields
    lm_words: tuple[str, ...]  # decoder-only continuation per label, including the leading space
    raw_labels: tuple = ()  # how labels appear in the data files, in label order
    metric_names: tuple[str, ...] = ("accuracy",)
    description: str = ""
    # Optional keys kept from the data when present and passed to lm_render (WiC's word span).
    extras: tuple[str, ...] = ()
    # Fields that may be empty text: the official MultiRC files hold 4 empty answer options (3 train, 1 test).
    allow_empty: tuple[str, ...] = ()
    # For prompts or choices that depend on the example (COPA, WiC): (task, values) -> (prompt, choices).
    lm_render: Callable[[Task, dict], tuple[str, tuple[str, ...]]] | None = field(
        default=None, repr=False, compare=False
    )

    def render(self, example: dict, style: str) -> Rendered:
        """Turn one example (a dict with the task's fields; "label" an index as load_examples gives,
        a raw label, or absent) into the prompt and per-label choices for style "t5" or "lm"."""
        values = {f: self._text(example, f) for f in self.fields}
        label = example.get("label")
        if label is not None and not (isinstance(label, int) and not isinstance(label, bool)):
            label = self.label_index(label)
        if label is not None and not 0 <= label < len(self.labels):
            raise CaptError(f"label index {label} out of range for {self.name}: valid 0..{len(self.labels) - 1}")
        group = None if example.get("group") is None else str(example["group"])
        if style == "t5":
            prompt = " ".join([self.name] + [f"{f}: {values[f]}" for f in sorted(self.fields)])
            return Rendered(prompt, self.t5_words, label, group)
        if style == "lm":
            if self.lm_render:
                extras = {k: example[k] for k in self.extras if example.get(k) is not None}
                prompt, choices = self.lm_render(self, {**extras, **values})
            else:
                prompt, choices = self.lm_template.format(**values), self.lm_words
            head_prompt = None
            if tuple(choices) != tuple(self.lm_words):  # the example's own choices: list them for a head
                head_prompt = prompt + "".join(f"\nOption {i}: {c.strip()}" for i, c in enumerate(choices, 1))
                head_prompt += "\nAnswer: Option"
            return Rendered(prompt, tuple(choices), label, group, head_prompt)
        raise CaptError(f"unknown prompt style {style!r}; valid: t5, lm")

    def _text(self, example: dict, name: str) -> str:
        """One input field as non-empty text (CSV readers may hand over numbers, so str() them)."""
        required = ", ".join(self.fields)
        if example.get(name) is None:
            raise CaptError(f"{self.name} example is missing field {name!r}; required fields: {required}")
        text = str(example[name])
        if not text.strip() and name not in self.allow_empty:
            raise CaptError(f"{self.name} example has empty text in field {name!r}; required fields: {required}")
        return text

    def label_index(self, raw) -> int:
        """A label as found in a data file or the hub (raw value, label name, or int index) -> index."""
        key = _key(raw)
        for i, (raw_label, name) in enumerate(zip(self.raw_labels or self.labels, self.labels)):
            if key in (_key(raw_label), _key(name)):
                return i
        if isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw < len(self.labels):
            return raw
        valid = ", ".join(repr(v) for v in self.raw_labels or self.labels)
        raise CaptError(f"bad {self.name} label {raw!r}; valid: {valid} (or an index 0..{len(self.labels) - 1})")

    def metrics(self, preds: list[int], golds: list[int], groups: list | None = None) -> dict[str, float]:
        """Score predicted label indices against gold ones: {metric name: value in 0..1}.
        `groups` (one question id per example) is needed for MultiRC's exact match "em"."""
        if not preds:
            raise CaptError("no predictions to score")
        if len(preds) != len(golds) or (groups is not None and len(groups) != len(preds)):
            raise CaptError(f"preds, golds and groups differ in length: {len(preds)}, {len(golds)}, "
                            f"{None if groups is None else len(groups)}")
        if any(g is None for g in golds):
            raise CaptError("some gold labels are missing (unlabeled data cannot be scored)")
        if "em" in self.metric_names and groups is None:
            raise CaptError(f"{self.name} exact match needs groups (one question id per example)")
        return {m: _METRICS[m](list(preds), list(golds), groups, len(self.labels)) for m in self.metric_names}


# Metrics: a few lines; avoids a heavy dependency (sklearn / evaluate).
def _f1(preds: list[int], golds: list[int], cls: int) -> float:
    """F1 of one class; 0 when it has no predictions and no golds (sklearn's zero_division=0)."""
    tp = sum(p == g == cls for p, g in zip(preds, golds))
    wrong = sum((p == cls) != (g == cls) for p, g in zip(preds, golds))  # false positives + false negatives
    return 2 * tp / (2 * tp + wrong) if tp or wrong else 0.0


def _exact_match(preds, golds, groups) -> float:
    right: dict = {}
    for p, g, q in zip(preds, golds, groups):
        right[q] = right.get(q, True) and p == g
    return sum(right.values()) / len(right)


_METRICS = {
    "accuracy": lambda p, g, q, n: sum(a == b for a, b in zip(p, g)) / len(p),
    # Mean over every class, like sklearn's f1_score(average="macro", labels=range(n), zero_division=0).
    "macro_f1": lambda p, g, q, n: sum(_f1(p, g, c) for c in range(n)) / n,
    "f1a": lambda p, g, q, n: _f1(p, g, 1),  # MultiRC: F1 of "True" over all answer options
    "em": lambda p, g, q, n: _exact_match(p, g, q),
}


def _copa_lm(task: Task, v: dict) -> tuple[str, tuple[str, ...]]:
    """lm-eval's COPA: "<premise without its period> because|therefore", choices " <choice, lower-cased>"."""
    connectors = {"cause": " because", "effect": " therefore"}
    if v["question"] not in connectors:
        raise CaptError(f"copa question must be 'cause' or 'effect', got {v['question']!r}")
    premise = v["premise"].strip().removesuffix(".")
    return premise + connectors[v["question"]], tuple(" " + c[0].lower() + c[1:] for c in (v["choice1"], v["choice2"]))


def _wic_lm(task: Task, v: dict) -> tuple[str, tuple[str, ...]]:
    """lm-eval's WiC asks about the word as written in sentence 1 (its span), not the lemma."""
    word = v["sentence1"][v["start1"]:v["end1"]] if "start1" in v and "end1" in v else v["word"]
    return task.lm_template.format(**{**v, "word": word}), task.lm_words


TF, NO_YES = ("False", "True"), (" no", " yes")
TASKS: dict[str, Task] = {t.name: t for t in [
    Task("boolq", TF, ("passage", "question"), TF, "{passage}\nQuestion: {question}?\nAnswer:", NO_YES,
         (False, True), description="Yes/no questions about a Wikipedia passage."),
    Task("cb", ("entailment", "contradiction", "neutral"), ("premise", "hypothesis"),
         ("entailment", "contradiction", "neutral"),
         "{premise}\nQuestion: {hypothesis}. True, False, or Neither?\nAnswer:", (" True", " False", " Neither"),
         ("entailment", "contradiction", "neutral"), ("accuracy", "macro_f1"),
         "CommitmentBank: does the premise commit to the (embedded) hypothesis?"),
    Task("copa", ("choice1", "choice2"), ("premise", "choice1", "choice2", "question"), ("choice1", "choice2"),
         "", (), (0, 1), description="Choice of plausible alternatives: the cause or effect of a premise.",
         lm_render=_copa_lm),
    # lm-eval scores "{answer}\nIs the answer correct? yes|no" after a shared "...Answer:" prompt, and lists
    # "yes" first although label 0 is False. Moving the shared part into the prompt gives the same label
    # probabilities (the shared prefix's log-probs cancel in a softmax over the label set) and fixes the order.
    Task("multirc", TF, ("paragraph", "question", "answer"), TF,
         "{paragraph}\nQuestion: {question}\nAnswer: {answer}\nIs the answer correct?", NO_YES, (0, 1),
         ("accuracy", "f1a", "em"), "Multi-sentence reading comprehension: is this answer option correct?",
         allow_empty=("answer",)),
    Task("rte", ("entailment", "not_entailment"), ("premise", "hypothesis"), ("entailment", "not_entailment"),
         "{premise}\nQuestion: {hypothesis} True or False?\nAnswer:", (" True", " False"),
         ("entailment", "not_entailment"), description="Recognizing textual entailment."),
    Task("wic", TF, ("sentence1", "sentence2", "word"), TF,
         "Sentence 1: {sentence1}\nSentence 2: {sentence2}\nQuestion: Is the word '{word}' used in the same way"
         " in the two sentences above?\nAnswer:", NO_YES, (False, True),
         description="Word in context: is the word used with the same meaning in both sentences?",
         extras=("start1", "end1"), lm_render=_wic_lm),
]}
_DIR_NAMES = {"boolq": "BoolQ", "cb": "CB", "copa": "COPA", "multirc": "MultiRC", "rte": "RTE", "wic": "WiC"}


def get_task(name: str) -> Task:
    """A built-in task by name, case-insensitive ("RTE" -> TASKS["rte"])."""
    task = TASKS.get(str(name).strip().lower())
    if task is None:
        raise CaptError(f"unknown task {name!r}; valid: {', '.join(TASKS)}")
    return task


def custom_task(name: str, fields, label_words: dict, lm_template: str | None = None, t5_words=None) -> Task:
    """A user's own classification task. `label_words` maps each raw label value, as found in the data
    file, to the word the model scores for it, in label order, e.g. {0: "negative", 1: "positive"}."""
    fields = tuple(fields)
    if not fields or not label_words:
        raise CaptError("a custom task needs at least one field and at least one label in label_words")
    raw = tuple(label_words)
    if len({_key(r) for r in raw}) < len(raw):
        raise CaptError(f"label values {raw} collide when compared as text; give distinct values")
    words = tuple(str(w).strip() for w in label_words.values())
    template = lm_template or "\n".join(f"{f}: {{{f}}}" for f in fields) + "\nAnswer:"
    unknown = {n for _, n, _, _ in string.Formatter().parse(template) if n} - set(fields)
    if unknown:
        raise CaptError(f"lm_template names {sorted(unknown)}, which are not fields; fields: {', '.join(fields)}")
    t5 = tuple(t5_words) if t5_words else words
    if len(t5) != len(words):
        raise CaptError(f"t5_words has {len(t5)} entries but there are {len(words)} labels")
    return Task(name, words, fields, t5, template, tuple(" " + w for w in words), raw, description="custom task")


def _data_dir(data_dir) -> Path:
    path = Path(data_dir or os.environ.get("CAPT_DATA_DIR") or DEFAULT_DATA_DIR)
    if not path.is_dir():
        raise CaptError(f"no SuperGLUE data directory at {path}; pass data_dir= or set CAPT_DATA_DIR")
    return path


def split_note(task: Task | str, data_dir=None) -> str | None:
    """How the split names differ from the official ones for this task and data_dir (BoolQ offline), else None."""
    task = get_task(task) if isinstance(task, str) else task
    if task.name != "boolq" or (_data_dir(data_dir) / "BoolQ" / "train.jsonl").exists():
        return None
    return BOOLQ_OFFLINE_SPLIT


def load_examples(task: Task | str, split: str, data_dir=None, source: str | None = None,
                  limit: int | None = None) -> list[dict]:
    """Normalized examples of a built-in task's split ("train", "val", "test"), from the local files or,
    with `source` (e.g. "aps/super_glue"), from the hub. `limit` keeps the first N (for MultiRC, N answer
    options). See the module docstring for the dict layout and BoolQ's offline split."""
    task = get_task(task) if isinstance(task, str) else task
    split = {"validation": "val"}.get(split, split)
    if split not in SPLITS:
        raise CaptError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    if limit is not None and limit < 0:
        raise CaptError(f"limit must be a positive number of examples or None, got {limit}")
    rows = _hub_rows(task, split, source) if source else _local_rows(task, split, data_dir)
    return rows[:limit] if limit is not None else rows


def _local_rows(task: Task, split: str, data_dir) -> list[dict]:
    folder = _data_dir(data_dir) / _DIR_NAMES[task.name]
    offline_boolq = split != "test" and split_note(task, data_dir) is not None
    path = folder / f"{'val' if offline_boolq else split}.jsonl"
    if not path.is_file():
        found = sorted(p.stem for p in folder.glob("*.jsonl"))
        raise CaptError(f"no {task.name} {split} file at {path}; splits found there: {', '.join(found) or 'none'}")
    import datasets  # imported on first use: it costs ~1.7 s, and most callers never read data
    records = datasets.load_dataset("json", data_files=str(path), split="train").to_list()
    if offline_boolq:
        records = [r for r in records if (r["idx"] % 10 < 3) == (split == "val")]
    if task.name != "multirc":
        return [_normalize(task, r, r.get("label"), r["idx"]) for r in records]
    return [  # nested passage -> questions -> answers, flattened to one example per answer option
        _normalize(task, {"paragraph": r["passage"]["text"], "question": q["question"], "answer": a["text"]},
                   a.get("label"), a["idx"], f"{r['idx']}-{q['idx']}")
        for r in records for q in r["passage"]["questions"] for a in q["answers"]
    ]


def _hub_rows(task: Task, split: str, source: str) -> list[dict]:
    try:
        import datasets  # imported on first use: it costs ~1.7 s, and most callers never read data
        records = datasets.load_dataset(source, task.name, split={"val": "validation"}.get(split, split))
    except Exception as e:  # network, auth and missing-dataset errors come in many types
        raise CaptError(f"could not load {source!r} ({task.name}, {split}) from the Hugging Face hub, which may be "
                        f"unreachable: {e}. Local data (data_dir / CAPT_DATA_DIR) is the default") from e
    rows = []
    for r in records:  # hub labels are ClassLabel ints in our label order; the test split has -1
        label = None if r["label"] == -1 else r["label"]
        if task.name == "multirc":  # already flat; idx = {paragraph, question, answer}
            idx = r["idx"]
            rows.append(_normalize(task, r, label, idx["answer"], f"{idx['paragraph']}-{idx['question']}"))
        else:
            rows.append(_normalize(task, r, label, r["idx"]))
    return rows


def _normalize(task: Task, record: dict, raw_label, idx, group: str | None = None) -> dict:
    example = {f: record[f] for f in task.fields}
    example.update({k: record[k] for k in task.extras if record.get(k) is not None})
    example["label"] = None if raw_label is None else task.label_index(raw_label)
    example["idx"] = idx
    if group is not None:
        example["group"] = str(group)
    return example


def load_file(path, task: Task, columns: dict[str, str] | None = None,
              label_column: str | None = "label") -> list[dict]:
    """Normalized examples from a user's CSV, JSONL or JSON (a list of records) file. `columns` maps a
    task field to the file's column name where they differ; `label_column=None` reads unlabeled data.
    A "group" column, if present, is kept (MultiRC-style exact match); "idx" defaults to the row number."""
    path = Path(path)
    columns = {**{f: f for f in task.fields}, **(columns or {})}
    records = read_records(path, [columns[f] for f in task.fields] + ([label_column] if label_column else []))
    examples = []
    for row, record in enumerate(records, start=1):
        record = {**record, **{f: record[columns[f]] for f in task.fields}}
        try:
            if label_column and record[label_column] is None:
                raise CaptError(f"the {label_column!r} value is empty")
            example = _normalize(task, record, record[label_column] if label_column else None,
                                 record.get("idx", row - 1), record.get("group"))
            for f in task.fields:
                task._text(example, f)  # fail here, with the row number, rather than at render time
        except CaptError as e:
            raise CaptError(f"{path.name} row {row}: {e}") from e
        examples.append(example)
    return examples


def read_records(path, needed: list[str]) -> list[dict]:
    """The rows of a user's CSV, JSONL or JSON (a list of records) file, as dicts; a clear message for a file
    that is missing, empty, unreadable or lacks one of the `needed` columns."""
    path = Path(path)
    kind = {".csv": "csv", ".jsonl": "json", ".json": "json"}.get(path.suffix.lower())
    if kind is None:
        raise CaptError(f"cannot read {path.name}: use a .csv, .jsonl or .json file")
    if not path.is_file():
        raise CaptError(f"no such file: {path}")
    # An empty file (or a header-only CSV) makes datasets raise unhelpful errors; say it plainly.
    if len([line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]) <= (kind == "csv"):
        raise CaptError(f"{path} is empty: it has no data rows")
    try:
        import datasets  # imported on first use: it costs ~1.7 s, and most callers never read data
        records = datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as e:  # parse errors come from pandas, pyarrow or json, each with its own types
        raise CaptError(f"could not read {path} as {path.suffix[1:]}: {e}") from e
    missing = [c for c in needed if c not in records.column_names]
    if missing:
        raise CaptError(f"{path.name} lacks columns {missing}; it has: {', '.join(records.column_names)}")
    return records.to_list()
