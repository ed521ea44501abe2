"""One training function for the CLI (`python -m train`) and the app's browser training.

The paper's protocol: the official train split is divided 90/10 (the 10 % picks the best checkpoint and
stops early), the official val split is the test set, float32, several seeds averaged. Short runs for
the browser: max_steps / max_minutes, a callback per step with loss, throughput and ETA, and a stop flag
honoured within one step that keeps the best state so far. Runs resume from their checkpoint.

The same code runs under `accelerate launch` on several GPUs: batches are sharded across processes and
the (tiny) gradients are averaged by hand, since the backbone is frozen and only a few thousand
numbers train (wrapping the capsule in DDP would buy nothing).
"""
from __future__ import annotations

import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import MISSING, asdict, dataclass, field, fields as dataclass_fields, replace
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file as load_tensors, save_file as save_tensors
from tqdm.auto import tqdm

from .backbones import Backbone, load_backbone
from .config import CapsuleConfig
from .errors import CaptError
from .files import atomic_folder
from .hub import check_repo_id
from .io import load_capsule, read_config
from .methods import METHODS, TRAINABLE, CaptMethod, Method, make_method
from .tasks import Task, custom_task, get_task, load_examples, load_file, split_note

DEFAULT_LR = {"capt": 3e-2, "deep-prompt-1": 3e-2, "linear-head": 1e-3, "prompt-tuning": 3e-1,
              "p-tuning-v2": 1e-2}
SPLIT_SEED = 20251  # the 90/10 split is the same for every method and training seed


@dataclass
class TrainConfig:
    """Everything a run needs; validated before any model is loaded."""

    task: str = "rte"
    method: str = "capt"
    backbone: str = "smollm2-135m"
    lr: float | None = None            # None: DEFAULT_LR for the method
    batch_size: int = 8
    epochs: int = 50                   # the paper's budget; early stopping usually ends sooner
    max_steps: int | None = None
    max_minutes: float | None = None
    # Set by train_in_chunks when max_minutes ends only this call, one chunk of a longer run: the whole run's
    # max_minutes (0: none), which the ETA counts to instead. None: an ordinary run (max_minutes is the run's).
    run_minutes: float | None = None
    eval_every: int = 50               # steps between dev evaluations (and checkpoints)
    patience: int = 10                 # dev evaluations without improvement before stopping
    min_steps: int = 0                 # no early stopping before this step (0: the paper's protocol)
    seed: int = 0
    dev_fraction: float = 0.1
    max_train: int | None = None       # cap on training examples (documented for MultiRC / BoolQ)
    max_dev: int | None = None
    max_test: int | None = None
    warmup_steps: int = 0
    weight_decay: float = 0.0
    num_virtual_tokens: int = 20       # prompt-tuning / p-tuning-v2 only
    capsule: dict = field(default_factory=dict)  # CapsuleConfig fields (capt / deep-prompt-1)
    dtype: str = "float32"
    data_dir: str | None = None
    source: str | None = None          # a hub dataset id instead of the local files
    data_file: str | None = None       # a user's CSV/JSONL: needs fields and label_words
    test_file: str | None = None
    fields: list[str] | None = None
    columns: dict | None = None
    label_column: str = "label"
    label_words: dict | None = None
    out_dir: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise CaptError(f"unknown method '{self.method}'; valid: {', '.join(METHODS)}")
        if self.lr is not None and not 0 < self.lr <= 10:
            raise CaptError(f"lr={self.lr} is out of range; valid: 0 < lr <= 10")
        for name, lo, hi in (("batch_size", 1, 4096), ("epochs", 1, 10_000), ("max_steps", 1, 10_000_000),
                             ("eval_every", 1, 10_000_000), ("patience", 1, 10_000), ("min_steps", 0, 10_000_000),
                             ("num_virtual_tokens", 1, 1024), ("warmup_steps", 0, 10_000_000)):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and lo <= value <= hi):
                raise CaptError(f"{name}={value!r} is out of range; valid: an integer {lo}..{hi}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise CaptError(f"max_minutes={self.max_minutes} must be positive")
        if self.run_minutes is not None and not self.run_minutes >= 0:
            raise CaptError(f"run_minutes={self.run_minutes} must be 0 (no time limit) or positive")
        if not 0 < self.dev_fraction < 0.5:
            raise CaptError(f"dev_fraction={self.dev_fraction} is out of range; valid: 0 < f < 0.5")
        if self.data_file and not (self.fields and self.label_words):
            raise CaptError("a data_file needs fields (the input columns) and label_words (label -> word)")
        if self.source is not None:
            self.source = check_repo_id(self.source, "dataset")
        CapsuleConfig.from_dict(self.capsule)  # unknown or bad capsule options fail here, before loading

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR.get(self.method, 1e-3)


# --- data --------------------------------------------------------------------------------------

@dataclass
class Splits:
    task: Task
    train: list[dict]
    dev: list[dict]
    test: list[dict]
    note: str


def prepare_data(cfg: TrainConfig) -> Splits:
    """train 90 % / dev 10 % of the official train split (grouped, so no MultiRC passage is in both);
    test = the official val split. A user's file: its rows split the same way; test_file or a further
    10 % held out as test."""
    if cfg.data_file:
        task = custom_task(cfg.task, cfg.fields, cfg.label_words)
        rows = load_file(cfg.data_file, task, cfg.columns, cfg.label_column)
        if cfg.test_file:
            test = load_file(cfg.test_file, task, cfg.columns, cfg.label_column)
        else:
            rows, test = _split(rows, cfg.dev_fraction)
        note = f"user data {cfg.data_file}" + (f", test {cfg.test_file}" if cfg.test_file else ", test = held-out 10 %")
    else:
        task = get_task(cfg.task)
        rows = load_examples(task, "train", cfg.data_dir, cfg.source)
        test = load_examples(task, "val", cfg.data_dir, cfg.source)
        note = "train split 90/10 (train/dev), official val split as test"
        extra = split_note(task, cfg.data_dir) if not cfg.source else None
        note += f"; {extra}" if extra else ""
    train, dev = _split(rows, cfg.dev_fraction)
    train, dev, test = (_cap(x, n) for x, n in ((train, cfg.max_train), (dev, cfg.max_dev), (test, cfg.max_test)))
    for name, part in (("train", train), ("dev", dev), ("test", test)):
        if not part:
            raise CaptError(f"the {name} split of {task.name} is empty; give more data")
        if any(r.get("label") is None for r in part):
            raise CaptError(f"the {name} split of {task.name} has unlabelled examples")
    return Splits(task, train, dev, test, note)


def _group(row: dict):
    g = row.get("group")
    return str(g).split("-")[0] if g is not None else row.get("idx", id(row))  # MultiRC: the passage


def _split(rows: list[dict], fraction: float) -> tuple[list[dict], list[dict]]:
    groups = sorted({_group(r) for r in rows}, key=str)
    random.Random(SPLIT_SEED).shuffle(groups)
    held = set(groups[:max(1, round(len(groups) * fraction))])
    return [r for r in rows if _group(r) not in held], [r for r in rows if _group(r) in held]


def _cap(rows: list[dict], n: int | None) -> list[dict]:
    """A fixed random subset of about n examples (whole MultiRC questions, so exact match stays defined)."""
    if n is None or n >= len(rows):
        return rows
    if rows[0].get("group") is None:
        return random.Random(SPLIT_SEED).sample(rows, n)
    by_group: dict = {}
    for r in rows:
        by_group.setdefault(r["group"], []).append(r)
    groups = sorted(by_group)
    random.Random(SPLIT_SEED).shuffle(groups)
    out: list[dict] = []
    for g in groups:
        if len(out) >= n:
            break
        out += by_group[g]
    return out


def bucketed_batches(lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Shuffled batches of similar length (less padding on CPU): shuffle, sort within windows of
    50 batches, then shuffle the batch order. Deterministic in (seed, epoch), so resume can skip."""
    rng = random.Random(seed * 100_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = batch_size * 50
    batches = []
    for i in range(0, len(order), window):
        chunk = sorted(order[i:i + window], key=lambda j: lengths[j])
        batches += [chunk[k:k + batch_size] for k in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


# --- evaluation --------------------------------------------------------------------------------

def evaluate(method: Method, examples: list[dict], batch_size: int = 16, accelerator=None) -> dict:
    """Test metrics of `method` on labelled examples (sharded across processes when distributed)."""
    return evaluate_counted(method, examples, batch_size, accelerator)[0]


def evaluate_counted(method: Method, examples: list[dict], batch_size: int = 16,
                     accelerator=None) -> tuple[dict, dict]:
    """(metrics, counts) of `method` on labelled examples: `evaluate`'s metrics and what it answered for each
    gold label, {gold label: {predicted label: n}} in the task's label order (`label_counts`)."""
    task, bb = method.task, method.bb
    rendered = [task.render(e, bb.style) for e in examples]
    order = sorted(range(len(rendered)), key=lambda i: len(rendered[i].prompt))
    if accelerator is not None and accelerator.num_processes > 1:
        order = order[accelerator.process_index::accelerator.num_processes]
    preds = {}
    with torch.no_grad():
        for k in range(0, len(order), batch_size):
            idx = order[k:k + batch_size]
            logits = method.scores([rendered[i] for i in idx]).logits
            preds.update(zip(idx, logits.argmax(-1).tolist()))
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import gather_object
        preds = {i: p for part in gather_object([preds]) for i, p in part.items()}
    pred_list = [preds[i] for i in range(len(rendered))]
    golds = [r.label for r in rendered]
    groups = [r.group for r in rendered] if any(r.group for r in rendered) else None
    return task.metrics(pred_list, golds, groups), label_counts(task, pred_list, golds)


def label_counts(task: Task, preds: list[int], golds: list[int]) -> dict:
    """{gold label: {predicted label: n}} over every pair of the task's labels (zeros kept), so a method that
    never answers one label, or answers one label always, shows it at a glance."""
    pairs = Counter(zip(golds, preds))
    return {g: {p: pairs[(i, j)] for j, p in enumerate(task.labels)} for i, g in enumerate(task.labels)}


def evaluate_capsule(folder: str | Path, split: str = "test", backbone: Backbone | None = None) -> dict:
    """Score a saved capsule again on the split its training used, as training scored it: the data, caps and
    split from its capsule.json's training config (defaults for the capsule's task when it records none).
    Returns the metrics, what it answered for each gold label (`label_counts`), and the metrics it recorded
    when it was saved, to compare (equal with the same code, thread count and kind of CPU)."""
    if split not in ("test", "dev"):
        raise CaptError(f"split must be 'test' or 'dev', got {split!r}")
    saved = read_config(folder)
    training = saved.get("training") or {}
    trained = training.get("config")
    bb = backbone or load_backbone(trained["backbone"] if trained else saved["backbone"]["name"],
                                   dtype=trained["dtype"] if trained else "float32")
    capsule, task = load_capsule(folder, bb)
    if task is None:
        raise CaptError(f"{folder} was saved without a task, so there is no split to score it on")
    cfg = TrainConfig(**saved_config(trained)) if trained else TrainConfig(task=task.name, backbone=bb.name)
    data = prepare_data(cfg)
    method = CaptMethod(bb, task, capsule.config)
    method.capsule = capsule
    examples = data.test if split == "test" else data.dev
    metrics, counts = evaluate_counted(method, examples)
    recorded = saved.get("metrics") if split == "test" else training.get("dev")
    return {"folder": str(folder), "task": task.name, "backbone": bb.name, "split": split, "data": data.note,
            "n": len(examples), "metrics": metrics, "counts": counts,
            "recorded": recorded, "same_as_recorded": recorded == metrics if recorded else None}


def primary_metric(task: Task) -> str:
    return "f1a" if "f1a" in task.metric_names else "accuracy"


# --- training ----------------------------------------------------------------------------------

def _after(line: str, step: int) -> bool:
    """Whether a log line was written after `step`; a line cut short by a kill counts as after."""
    try:
        return json.loads(line).get("step", 0) > step
    except json.JSONDecodeError:
        return True


class Run:
    """Files of one run: metrics.jsonl, summary.json, checkpoint/, capsule/ (or artifact/)."""

    def __init__(self, out_dir: str | Path | None):
        self.dir = Path(out_dir) if out_dir else None
        if self.dir:
            self.dir.mkdir(parents=True, exist_ok=True)

    def log(self, record: dict) -> None:
        if self.dir:
            with open(self.dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def rewind(self, step: int) -> int:
        """Drop the log records written after `step` (a killed run logs steps its checkpoint does not keep;
        the resumed run logs them again); returns how many were dropped."""
        path = self.dir / "metrics.jsonl" if self.dir else None
        if not path or not path.exists():
            return 0
        lines = path.read_text().splitlines(keepends=True)
        keep = next((i for i, line in enumerate(lines) if _after(line, step)), len(lines))
        if keep < len(lines):
            self._replace("metrics.jsonl", "".join(lines[:keep]))
        return len(lines) - keep

    def write_json(self, name: str, data: dict) -> None:
        if self.dir:
            self._replace(name, json.dumps(data, indent=2, default=str) + "\n")

    def _replace(self, name: str, text: str) -> None:
        """Write the file whole or not at all (a kill leaves the old one)."""
        tmp = self.dir / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.dir / name)


def train(cfg: TrainConfig, backbone: Backbone | None = None, callback: Callable[[dict], None] | None = None,
          stop: threading.Event | None = None, resume: bool = False, progress: bool = True) -> dict:
    """Train (or, for zero-shot / majority, just evaluate) one method with one seed; returns the summary.

    callback(event) gets {"kind": "step" | "eval" | "done", ...} after every step and evaluation.
    stop: set it from another thread; the run ends within one step and keeps the best state so far.
    """
    from accelerate import Accelerator

    if resume and (done := _finished_run(cfg)):
        if progress:
            print(f"{cfg.out_dir}: already finished with these settings (stopped by {done['stopped_by']} at step "
                  f"{done['steps']}); kept as it is", file=sys.stderr)
        (callback or (lambda event: None))({"kind": "done", **done})
        return done
    if not resume:
        refuse_used_folders([cfg.out_dir])
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    data = prepare_data(cfg)   # bad data fails here, before the run's folder exists
    run = Run(cfg.out_dir if accelerator.is_main_process else None)
    bb = backbone or load_backbone(cfg.backbone, dtype=cfg.dtype, device=str(accelerator.device))
    method = make_method(cfg.method, bb, data.task, CapsuleConfig.from_dict(cfg.capsule), cfg.seed,
                         cfg.num_virtual_tokens)
    method.fit_labels([r["label"] for r in data.train])
    emit = callback or (lambda event: None)
    key = primary_metric(data.task)
    started = time.time()
    summary = {"config": asdict(cfg), "method": cfg.method, "task": data.task.name, "backbone": bb.name,
               "backbone_revision": bb.revision, "data": data.note, "n_train": len(data.train),
               "n_dev": len(data.dev), "n_test": len(data.test), "n_trainable": method.n_trainable(),
               "backbone_params": bb.n_params, "device": str(bb.device), "selection_metric": key,
               "code": {**CODE, "machine": describe_machine(bb.device)}}

    params = [p for p in method.parameters() if p.requires_grad]
    state = {"step": 0, "epoch": 0, "batch": 0, "best": -math.inf, "bad_evals": 0, "elapsed": 0.0,
             "best_step": 0, "stopped_by": None, "best_dev": None,
             "trained_on": [{"from_step": 0, "code": summary["code"]}]}   # which code and machine ran which steps
    best_params = {k: v.detach().clone() for k, v in method.state_dict().items()}
    if cfg.method in TRAINABLE:
        optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        if resume and run.dir and (run.dir / "checkpoint" / "state.json").exists():
            state["trained_on"] = [{"from_step": 0, "code": None}]   # what a checkpoint from before it knew
            best_params = _load_checkpoint(run.dir / "checkpoint", method, optimizer, state, cfg)
            written_by = state["trained_on"][-1]["code"]
            state["trained_on"] = state["trained_on"] + [{"from_step": state["step"], "from_seconds":
                                                          round(state["elapsed"], 1), "code": summary["code"]}]
            dropped = run.rewind(state["step"])
            run.log({"kind": "resume", "step": state["step"], "elapsed_s": round(state["elapsed"], 1),
                     "dropped_records": dropped, "code": summary["code"], "checkpoint_code": written_by})
        _train_loop(cfg, method, data, optimizer, accelerator, run, state, best_params, emit, stop, progress, key)
        method.load_state_dict(best_params)
    else:
        state["stopped_by"] = "no training"

    test, test_counts = evaluate_counted(method, data.test, accelerator=accelerator)
    # the kept state's dev metrics were measured when it was kept; only untrained methods need a pass
    dev = state["best_dev"] or evaluate(method, data.dev, accelerator=accelerator)
    summary.update(steps=state["step"], best_step=state["best_step"], stopped_by=state["stopped_by"],
                   trained_on=state["trained_on"],
                   train_seconds=round(state["elapsed"], 1), wall_seconds=round(time.time() - started, 1),
                   dev=dev, test=test, test_counts=test_counts)
    if run.dir:
        artifact = method.save(run.dir / method.artifact, training=summary, metrics=test)
        summary["artifact"] = str(artifact) if artifact else None
        run.write_json("summary.json", summary)
        run.log({"kind": "done", "test": test, "dev": dev})
    emit({"kind": "done", **summary})
    return summary


# What a run folder holds once a run has written to it (a compare folder: compare.json).
RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoint", "compare.json")


def refuse_used_folders(folders) -> None:
    """A new run (not resume) into a folder that already holds one would append to its log, replace its
    checkpoint and capsule: refused, before anything loads or trains, with what to do instead."""
    for folder in folders:
        held = sorted(n for n in RUN_FILES if folder and (Path(folder) / n).exists())
        if held:
            raise CaptError(f"{folder} already holds a run ({', '.join(held)}); a new run there would mix the two. "
                            "Continue it with --resume (resume=True), or give another --out, or delete the folder")


def _refuse_repeats(values: list, what: str) -> None:
    repeated = sorted({str(v) for v in values if values.count(v) > 1})
    if repeated:
        raise CaptError(f"{what} {', '.join(repeated)} given more than once ({values}); each {what} is one run "
                        "in its own folder: give each once")


def run_folders(cfg: TrainConfig, seeds, methods=None) -> list[str]:
    """Every folder train_seeds (or compare, over `methods`) writes run files to, itself included."""
    if not cfg.out_dir:
        return []
    if methods is not None:
        return [cfg.out_dir] + [f for m in methods
                                for f in run_folders(replace(cfg, out_dir=str(Path(cfg.out_dir) / m)), seeds)]
    seeds = list(seeds)
    return [cfg.out_dir] + ([str(Path(cfg.out_dir) / f"seed-{s}") for s in seeds] if len(seeds) > 1 else [])


# A run that ended by its own budget or criterion; resumed with the same settings it would do nothing more.
FINISHED = ("max_steps", "epochs", "early stopping", "no training")


def _finished_run(cfg: TrainConfig) -> dict | None:
    """The saved summary of cfg's run if it finished with exactly these settings (so `--resume` on a finished
    compare skips it instead of re-evaluating it); None if it has to train, or resume, or was stopped early."""
    path = Path(cfg.out_dir) / "summary.json" if cfg.out_dir else None
    if path is None or not path.exists():
        return None
    saved = json.loads(path.read_text())
    now = json.loads(json.dumps(asdict(cfg), default=str))
    same = "config" in saved and {**saved_config(saved["config"]), "out_dir": None} == {**now, "out_dir": None}
    artifact = path.parent / Path(saved["artifact"]).name if saved.get("artifact") else None
    if not (same and saved.get("stopped_by") in FINISHED and (artifact is None or artifact.exists())):
        return None
    saved["config"]["out_dir"] = cfg.out_dir      # where it is now; the files say where it was trained
    saved["artifact"] = str(artifact) if artifact else None
    return saved


def saved_config(config: dict) -> dict:
    """A config as a run's summary.json saved it, with any TrainConfig field added since at its default,
    which is what that run did (a run saved before `min_steps` existed has none)."""
    defaults = {f.name: f.default if f.default_factory is MISSING else f.default_factory()
                for f in dataclass_fields(TrainConfig)}
    return {**json.loads(json.dumps(defaults, default=str)), **config}


def code_revision() -> dict:
    """What produced a run, for rerunning it bit for bit: library versions, torch's thread count (CPU matrix
    products round differently with another count) and, in a git checkout, the commit and whether the
    library or CLI had uncommitted edits. Taken once, when this module is imported (the code this process
    runs). A later commit may change results in the last bits (an equivalent but reordered computation),
    and at lr 3e-2 a hundred steps carry such bits into a different capsule; so may another CPU, which
    `train` records beside this (describe_machine)."""
    import transformers

    from . import __version__

    out = {"capt": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
           "threads": torch.get_num_threads(), "commit": None, "dirty": None}
    root = Path(__file__).resolve().parent.parent
    try:
        git = ["git", "-C", str(root)]
        top, commit = subprocess.run(git + ["rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                                     text=True, timeout=10, check=True).stdout.split()
        if Path(top).resolve() != root:   # capt installed inside some other repository: not our commit
            return out
        out["commit"] = commit
        status = subprocess.run(git + ["status", "--porcelain", "--", "capt", "train"], capture_output=True,
                                text=True, timeout=10, check=True).stdout
        out["dirty"] = bool(status.strip())
    except (OSError, subprocess.SubprocessError):   # no git, or an installed copy outside a checkout
        pass
    return out


def describe_machine(device: torch.device | str | None = None) -> dict:
    """Where a run or a timing was made: CPU model, the vector instructions torch's CPU kernels use (AVX2,
    AVX512, ...), core count and, when `device` is a GPU, its name (asked only then: on ZeroGPU nothing may
    touch CUDA outside a GPU call). Training times, speed ratios and the last bits of a trained capsule depend
    on it (README, Speed and Train)."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):   # not Linux, or no model name: keep what platform says
        pass
    device = torch.device(device) if device is not None else None
    return {"cpu": cpu, "isa": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(device) if device is not None and device.type == "cuda" else None}


CODE = code_revision()


def train_in_chunks(cfg: TrainConfig, run_chunk: Callable[[TrainConfig, bool], dict], chunk_seconds: float,
                    callback: Callable[[dict], None] | None = None) -> dict:
    """One run as a series of time-boxed calls (e.g. ZeroGPU, which lends a GPU for one call of bounded length).

    run_chunk(chunk_cfg, resume) must call `train(chunk_cfg, ..., resume=resume)` (on whatever device the
    chunk gets) and return its summary. Chunk k gets max_minutes = k * chunk_seconds / 60 (the run's clock
    counts every chunk, so each adds chunk_seconds of training), capped by cfg.max_minutes, and run_minutes =
    cfg.max_minutes (0: none), so its progress records' ETA counts to the run's end, not the chunk's; every chunk
    after the first resumes from the checkpoint the one before left in cfg.out_dir. The loop ends when a
    chunk ends for any other reason (max_steps, early stopping, a stop) or reaches the run's own budget.
    Returns the last chunk's summary with "chunks": how many calls it took.
    """
    if not cfg.out_dir:
        raise CaptError("training in chunks needs an out_dir: each chunk resumes from the checkpoint kept there")
    run_minutes = cfg.max_minutes or 0
    return in_chunks(lambda budget, resume: run_chunk(replace(cfg, max_minutes=budget, run_minutes=run_minutes), resume),
                     cfg.max_minutes, chunk_seconds, callback)


def in_chunks(run_chunk: Callable[[float, bool], dict], total_minutes: float | None, chunk_seconds: float,
              callback: Callable[[dict], None] | None = None) -> dict:
    """`train_in_chunks` for any run whose max_minutes is its own clock, resumed legs included (train, and
    capt.lm_training.train_lm): run_chunk(max_minutes, resume) runs chunk k to k * chunk_seconds of that clock
    (capped by total_minutes) and returns its summary, which says how it ended ("stopped_by")."""
    if not chunk_seconds > 0:
        raise CaptError(f"chunk_seconds={chunk_seconds} must be positive")
    k = 0
    while True:
        k += 1
        budget = k * chunk_seconds / 60 if total_minutes is None else min(total_minutes, k * chunk_seconds / 60)
        summary = run_chunk(budget, k > 1)
        if summary["stopped_by"] != "max_minutes" or budget == total_minutes:
            return {**summary, "chunks": k}
        if callback:
            callback({"kind": "info", "text": f"chunk {k} done at step {summary['steps']}; continuing…"})


def _train_loop(cfg, method, data, optimizer, accelerator, run, state, best_params, emit, stop, progress, key):
    task, bb = data.task, method.bb
    rendered = [task.render(e, bb.style) for e in data.train]
    labels = torch.tensor([r.label for r in rendered], device=bb.device)
    lengths = [len(r.prompt) for r in rendered]  # characters: a cheap, monotone proxy for tokens
    world = accelerator.num_processes
    per_epoch = max(1, math.ceil(len(rendered) / cfg.batch_size) // world)  # steps per process and epoch
    total = min(cfg.max_steps or per_epoch * cfg.epochs, per_epoch * cfg.epochs)
    params = [p for p in method.parameters() if p.requires_grad]
    # this session's clock (a resumed run adds the elapsed time it brought from its checkpoint)
    session, before, seen, pace = time.time(), state["elapsed"], 0, Pace(cfg.eval_every)
    bar = tqdm(total=total, initial=state["step"], desc=f"{method.name} {task.name}", disable=not progress
               or not accelerator.is_main_process, dynamic_ncols=True)

    def evaluate_and_keep() -> bool:
        dev = evaluate(method, data.dev, accelerator=accelerator)
        improved = dev[key] > state["best"]
        if improved:
            state.update(best=dev[key], best_step=state["step"], bad_evals=0, best_dev=dev)
            best_params.update({k: v.detach().clone() for k, v in method.state_dict().items()})
        else:
            state["bad_evals"] += 1
        record = {"kind": "eval", "step": state["step"], "dev": dev, "best": state["best"], "improved": improved,
                  "elapsed_s": round(state["elapsed"], 1)}
        run.log(record)
        emit(record)
        if run.dir:
            _save_checkpoint(run.dir / "checkpoint", method, optimizer, state, best_params, cfg)
        return _patience_spent(cfg, state)

    if _patience_spent(cfg, state):   # resumed from the checkpoint of a run that stopped early
        state["stopped_by"] = "early stopping"
        bar.close()
        return
    while state["step"] < total:
        batches = bucketed_batches(lengths, cfg.batch_size, cfg.seed, state["epoch"])
        # every process takes the same number of steps (the gradient averaging pairs them up)
        batches = batches[accelerator.process_index:per_epoch * world:world]
        for b in batches[state["batch"]:]:
            reason = _stop_reason(cfg, stop, before + time.time() - session, accelerator)
            if reason:
                state["stopped_by"] = reason
                break
            lr = cfg.learning_rate * min(1.0, (state["step"] + 1) / max(1, cfg.warmup_steps))
            for group in optimizer.param_groups:
                group["lr"] = lr
            logits = method.scores([rendered[i] for i in b]).logits
            loss = torch.nn.functional.cross_entropy(logits.float(), labels[b])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if accelerator.num_processes > 1:  # average the few trainable gradients across processes
                for p in params:
                    p.grad = accelerator.reduce(p.grad, reduction="mean")
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            state["step"] += 1
            state["batch"] += 1
            seen += len(b)
            now = time.time() - session
            state["elapsed"] = before + now
            per_step = pace.tick(now)
            eta = (total - state["step"]) * per_step
            early = _early_stop_step(cfg, state, total)
            early_eta = None if early is None else (early - state["step"]) * per_step
            cap = cfg.max_minutes if cfg.run_minutes is None else cfg.run_minutes   # the run's budget, not a chunk's
            if cap:
                left = max(0.0, cap * 60 - state["elapsed"])
                eta = min(eta, left)
                early, early_eta = (early, early_eta) if early_eta is not None and early_eta < left else (None, None)
            record = {"kind": "step", "step": state["step"], "total_steps": total, "epoch": state["epoch"],
                      "loss": loss.item(), "lr": lr, "examples_per_s": round(seen / now, 3),
                      "eta_s": round(eta, 1), "elapsed_s": round(state["elapsed"], 1), "best": _finite(state["best"]),
                      "early_stop_step": early, "early_stop_eta_s": None if early_eta is None else round(early_eta, 1)}
            run.log(record)
            emit(record)
            bar.update(1)
            best = {f"best dev {key}": f"{100 * state['best']:.1f}%"} if math.isfinite(state["best"]) else {}
            best.update({"early stop at": early} if early is not None else {})   # unless dev improves
            bar.set_postfix(loss=f"{loss.item():.3f}", **best)   # no best before the first dev evaluation
            if state["step"] % cfg.eval_every == 0 and evaluate_and_keep():
                state["stopped_by"] = "early stopping"
                break
            if state["step"] >= total:
                break
        if state["stopped_by"]:
            break
        state["epoch"] += 1
        state["batch"] = 0
    state["stopped_by"] = state["stopped_by"] or ("max_steps" if cfg.max_steps and total == cfg.max_steps
                                                  else "epochs")
    if state["step"] % cfg.eval_every != 0 or state["best"] == -math.inf:
        evaluate_and_keep()  # the last steps count too
    bar.close()


class Pace:
    """Seconds per step over the last `window` steps, for the ETA. With window = eval_every each estimate holds
    at most one dev evaluation, like the run ahead, and it follows a run whose steps speed up (the linear head
    once its first epoch has cached every prompt's features) where a whole-session average would lag."""

    def __init__(self, window: int, start: float = 0.0):
        self.times = deque([start], maxlen=window + 1)

    def tick(self, now: float) -> float:
        """Record a step that ended at `now` (the clock `start` is on); the seconds per step of the window."""
        self.times.append(now)
        return (self.times[-1] - self.times[0]) / (len(self.times) - 1)


def _early_stop_step(cfg: TrainConfig, state: dict, total: int) -> int | None:
    """The step at which early stopping ends the run if no dev evaluation from the next one on improves (a step
    record comes before that step's evaluation); None when the run would reach `total` first."""
    e = cfg.eval_every   # evaluations left without improvement; the first one always improves (on no best yet)
    left = cfg.patience + 1 if state["best"] == -math.inf else max(1, cfg.patience - state["bad_evals"])
    stop = (-(-state["step"] // e) + left - 1) * e
    stop = max(stop, -(-cfg.min_steps // e) * e)   # not before min_steps: the first evaluation at or after it
    return stop if stop < total else None


def _patience_spent(cfg: TrainConfig, state: dict) -> bool:
    """Early stopping: `patience` dev evaluations in a row without improvement, once past `min_steps`."""
    return state["bad_evals"] >= cfg.patience and state["step"] >= cfg.min_steps


def _stop_reason(cfg: TrainConfig, stop, elapsed: float, accelerator) -> str | None:
    """Why to stop before the next step; all processes agree, so none waits for a step that never comes."""
    reason = None
    if stop is not None and stop.is_set():
        reason = "stop requested"
    elif cfg.max_minutes and elapsed > cfg.max_minutes * 60:
        reason = "max_minutes"
    if accelerator.num_processes > 1:
        flag = torch.tensor([0.0 if reason is None else 1.0], device=accelerator.device)
        if accelerator.reduce(flag, reduction="sum").item() > 0:
            reason = reason or "another process stopped"
    return reason


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no -Infinity


# --- checkpoints (safetensors + JSON; no pickle) -------------------------------------------------

# What a resumed run may change: its budget and bookkeeping. Anything else (task, method, lr, data caps,
# capsule options, ...) would silently continue a different run, so resuming with it changed is refused.
RESUMABLE_CHANGES = ("max_steps", "max_minutes", "run_minutes", "epochs", "patience", "min_steps", "eval_every",
                     "out_dir")


def _run_identity(cfg: TrainConfig) -> dict:
    return {k: v for k, v in asdict(cfg).items() if k not in RESUMABLE_CHANGES}


def _save_checkpoint(folder: Path, method: Method, optimizer, state: dict, best_params: dict,
                     cfg: TrainConfig) -> None:
    tensors = {f"param/{k}": v.detach().cpu().contiguous() for k, v in method.state_dict().items()}
    tensors.update({f"best/{k}": v.detach().cpu().contiguous() for k, v in best_params.items()})
    names = {id(p): n for n, p in method.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for k, v in optimizer.state.get(p, {}).items():
                tensors[f"opt/{names[id(p)]}/{k}"] = torch.as_tensor(v).detach().cpu().contiguous()
    with atomic_folder(folder) as tmp:
        save_tensors(tensors, str(tmp / "state.safetensors"))
        (tmp / "state.json").write_text(json.dumps({**state, "config": _run_identity(cfg)}))


def _load_checkpoint(folder: Path, method: Method, optimizer, state: dict, cfg: TrainConfig) -> dict:
    saved = json.loads((folder / "state.json").read_text())
    before = saved.pop("config", None)          # checkpoints written before this check carry none
    if before is not None:
        now = json.loads(json.dumps(_run_identity(cfg)))  # tuples -> lists, as the file has them
        changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
        if changed:
            diff = "; ".join(f"{k}: checkpoint {before.get(k)!r}, now {now.get(k)!r}" for k in changed)
            raise CaptError(f"cannot resume from {folder}: the run's settings differ ({diff}). Resume with the "
                            f"checkpoint's settings (only {', '.join(RESUMABLE_CHANGES[:-1])} may change) or "
                            f"give a new --out")
    tensors = load_tensors(str(folder / "state.safetensors"))
    state.update(saved)
    state["stopped_by"] = None
    method.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("param/")})
    params = dict(method.named_parameters())
    for k, v in tensors.items():
        if k.startswith("opt/"):
            name, slot = k[4:].rsplit("/", 1)
            optimizer.state[params[name]][slot] = v if slot == "step" else v.to(params[name].device)
    return {k[5:]: v.to(method.bb.device) for k, v in tensors.items() if k.startswith("best/")}


# --- several seeds, several methods ------------------------------------------------------------

def train_seeds(cfg: TrainConfig, seeds: list[int], backbone: Backbone | None = None, **kwargs) -> dict:
    """The paper's protocol: one run per seed, test metrics averaged. With several seeds each run
    lives in out_dir/seed-<s>/ and the seed with the best dev score is copied to out_dir/capsule."""
    if not seeds:
        raise CaptError("give at least one seed")
    _refuse_repeats(list(seeds), "seed")
    if not kwargs.get("resume"):
        refuse_used_folders(run_folders(cfg, seeds))
    bb = backbone or load_backbone(cfg.backbone, dtype=cfg.dtype)
    runs = []
    for s in seeds:
        out = cfg.out_dir if (len(seeds) == 1 or not cfg.out_dir) else str(Path(cfg.out_dir) / f"seed-{s}")
        runs.append(train(replace(cfg, seed=s, out_dir=out), bb, **kwargs))
    if len(seeds) == 1:
        return runs[0]
    summary = {k: runs[0][k] for k in ("method", "task", "backbone", "backbone_revision", "data", "n_train",
                                       "n_dev", "n_test", "n_trainable", "backbone_params", "selection_metric")}
    summary.update(seeds=list(seeds), runs=runs, test=_mean_std([r["test"] for r in runs]),
                   dev=_mean_std([r["dev"] for r in runs]),
                   train_seconds=round(sum(r["train_seconds"] for r in runs), 1),
                   steps=[r["steps"] for r in runs])
    key = runs[0]["selection_metric"]
    best = max(range(len(runs)), key=lambda i: runs[i]["dev"][key])
    summary["best_seed"] = seeds[best]
    if cfg.out_dir and runs[best].get("artifact"):
        target = Path(cfg.out_dir) / Path(runs[best]["artifact"]).name
        with atomic_folder(target) as tmp:
            shutil.copytree(runs[best]["artifact"], tmp, dirs_exist_ok=True)
        summary["artifact"] = str(target)
    if cfg.out_dir:
        Run(cfg.out_dir).write_json("summary.json", summary)
    return summary


def _mean_std(metrics: list[dict]) -> dict:
    out = {}
    for k in metrics[0]:
        values = [m[k] for m in metrics]
        mean = sum(values) / len(values)
        out[k] = mean
        out[k + "_std"] = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
    return out


def compare(cfg: TrainConfig, methods: list[str], seeds: list[int] = (0,), backbone: Backbone | None = None,
            **kwargs) -> list[dict]:
    """Several methods on one task, same data and loop; one row per method."""
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise CaptError(f"unknown method(s) {bad}; valid: {', '.join(METHODS)}")
    _refuse_repeats(list(methods), "method")
    _refuse_repeats(list(seeds), "seed")
    if not kwargs.get("resume"):
        refuse_used_folders(run_folders(cfg, seeds, methods))   # before the first method trains, not after it
    bb = backbone or load_backbone(cfg.backbone, dtype=cfg.dtype)
    rows = []
    for m in methods:
        out = str(Path(cfg.out_dir) / m) if cfg.out_dir else None
        s = train_seeds(replace(cfg, method=m, out_dir=out), list(seeds), bb, **kwargs)
        rows.append({"method": m, "trainable": s["n_trainable"],
                     "share_percent": 100 * s["n_trainable"] / s["backbone_params"],
                     "train_seconds": s["train_seconds"], **{f"test_{k}": v for k, v in s["test"].items()}})
    if cfg.out_dir:
        Run(cfg.out_dir).write_json("compare.json", {"task": cfg.task, "backbone": bb.name, "rows": rows})
    return rows


def compare_metric_keys(row: dict) -> list[str]:
    """A compare row's test metrics, in its order (test_accuracy, ...; not their _std companions)."""
    return [k for k in row if k.startswith("test_") and not k.endswith("_std")]


def format_table(rows: list[dict]) -> str:
    """A Markdown table of compare() rows (metrics as percentages)."""
    metric_keys = compare_metric_keys(rows[0])
    head = ["method", "trainable", "share %", "train s"] + [k[5:] for k in metric_keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["method"], f"{r['trainable']:,}", f"{r['share_percent']:.4f}", f"{r['train_seconds']:.0f}"]
        cells += [metric_cell(r, k) for k in metric_keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def metric_cell(row: dict, key: str) -> str:
    """A compare row's metric as a percentage, with ± its std over seeds when a trained method has one
    (zero-shot and majority: no seed enters them)."""
    return percent(row, key, with_std=row["method"] in TRAINABLE)


def percent(metrics: dict, key: str, with_std: bool = True) -> str:
    """metrics[key] as a percentage, with ± metrics[key + '_std'] when there is one (a mean over seeds)."""
    std = metrics.get(key + "_std") if with_std else None
    return f"{100 * metrics[key]:.1f}" + (f" ± {100 * std:.1f}" if std is not None else "")
