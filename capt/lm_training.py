"""train_lm(): a capsule trained on free text (a prompt -> its completion) with the backbone's own
language-modelling loss (capt.lm_loss), through transformers' Trainer and capt.CapsuleLM, in one call:

    from capt.lm_training import read_pairs, train_lm
    summary = train_lm(bb, read_pairs("qa.jsonl", "question", "answer"), "runs/qa")
    capsule, _ = capt.load_capsule("runs/qa/capsule", bb)          # then capt.generate(bb, prompt, capsule)

The pairs are split 90/10 (seeded) into train and dev; the dev loss, every `eval_every` steps, picks the capsule
kept and stops the run after `patience` evaluations without improvement. The completion is learned with an
end-of-sequence token after it (so the capsule also learns where to stop); the capsule reads the prompt
(capt.lm). OUT/capsule is an ordinary capsule folder, OUT/summary.json the outcome (training seconds and the
code and machine of every leg, resumed ones included), OUT/trainer Trainer's checkpoints (capsule, optimizer
and scheduler only: the backbone is never saved). `python -m train.lm` is its command line.
"""
from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path

import torch
from transformers import EarlyStoppingCallback, PrinterCallback, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from .backbones import Backbone
from .config import CapsuleConfig
from .errors import CaptError
from .lm import IGNORE, CapsuleLM, lm_loss
from .scoring import encode_prompts, pad
from .tasks import read_records
from .training import CODE, describe_machine


def check_options(out, max_steps: int = 500, eval_every: int = 50, patience: int = 10, batch_size: int = 8,
                  lr: float = 3e-2, resume: bool = False, max_minutes: float | None = None,
                  config: CapsuleConfig | None = None, flags: bool = False) -> None:
    """train_lm's options, checked before anything is loaded: a CaptError that names each bad one (flags=True:
    as the command line's flags, --max-steps for max_steps)."""
    if config is not None and config.head != "verbalizer":
        raise CaptError("free text is learned with the backbone's own language-modelling head: set head to "
                        "'verbalizer' (a linear head scores a task's labels)")
    name = (lambda k: "--" + k.replace("_", "-")) if flags else str
    bad = [f"{name(k)} {v!r} (valid: {want})" for k, v, ok, want in [
        ("max_steps", max_steps, isinstance(max_steps, int) and max_steps >= 1, "an integer >= 1"),
        ("eval_every", eval_every, isinstance(eval_every, int) and eval_every >= 1, "an integer >= 1"),
        ("patience", patience, isinstance(patience, int) and patience >= 1, "an integer >= 1"),
        ("batch_size", batch_size, isinstance(batch_size, int) and batch_size >= 1, "an integer >= 1"),
        ("lr", lr, isinstance(lr, (int, float)) and 0 < lr <= 1, "0 < lr <= 1"),
        ("max_minutes", max_minutes, max_minutes is None or isinstance(max_minutes, (int, float)) and max_minutes > 0,
         "a number > 0, or none for no time limit")] if not ok]
    if bad:
        raise CaptError("out of range: " + "; ".join(bad))
    used = [n for n in ("capsule", "summary.json") if (Path(out) / n).exists()]
    if used and not resume:
        raise CaptError(f"{out} already holds a run ({', '.join(used)}); continue it with {name('resume')}, or give "
                        "another folder")
    if resume and last_checkpoint(out) is None:
        raise CaptError(f"{name('resume')}: no checkpoint in {Path(out) / 'trainer'} to go on from; start without "
                        f"{name('resume')}")


def last_checkpoint(out) -> str | None:
    """Trainer's latest checkpoint folder under OUT/trainer (None when there is none)."""
    folder = Path(out) / "trainer"
    return get_last_checkpoint(str(folder)) if folder.is_dir() else None


def read_pairs(path, prompt_field: str, completion_field: str, minimum: int = 2) -> list[tuple[str, str]]:
    """(prompt, completion) per row; a row with an empty or non-text value is refused with its number, a file of
    fewer than `minimum` rows too (training: 2, one for the dev split)."""
    pairs = []
    for row, r in enumerate(read_records(path, [prompt_field, completion_field]), start=1):
        p, c = r[prompt_field], r[completion_field]
        if not (isinstance(p, str) and p.strip() and isinstance(c, str) and c.strip()):
            raise CaptError(f"{Path(path).name} row {row}: {prompt_field!r} and {completion_field!r} must both be "
                            f"non-empty text, got {p!r} and {c!r}")
        pairs.append((p, c))
    if len(pairs) < minimum:
        raise CaptError(f"{path} has {len(pairs)} row(s); " + ("training needs at least 2 (90 % train, 10 % dev)"
                                                               if minimum == 2 else f"give at least {minimum}"))
    return pairs


def encode(bb: Backbone, capsule_slots: int, prompt: str, completion: str) -> dict:
    """One row: decoder-only, prompt + completion + EOS with the prompt's labels -100; T5, the prompt for the
    encoder and the completion with an EOS as the target. A long prompt is cut as capt.score cuts it
    (decoder-only keeps its end and BOS, T5 its start and EOS; "cut": how many tokens it lost); the completion
    never is."""
    tok = bb.tokenizer
    if bb.encoder_decoder:
        target = tok(completion)["input_ids"]
        eos = [] if target[-1:] == [tok.eos_token_id] else [tok.eos_token_id]
        (ids,), (cut,) = encode_prompts(bb, None, [prompt], reserve=capsule_slots)
        return {"input_ids": ids, "labels": target + eos, "cut": cut}
    c = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    limit = bb.max_length - capsule_slots
    if len(c) >= limit - 1:   # the prompt needs 2 tokens at least: a BOS and the last word of its cue
        raise CaptError(f"a completion of {len(c)} tokens (with its EOS) leaves no room for its prompt within "
                        f"{bb.name}'s limit of {limit} tokens; give a completion of at most {limit - 3} tokens: "
                        f"{completion[:60]!r}")
    (p,), (cut,) = encode_prompts(bb, None, [prompt], reserve=capsule_slots + len(c))
    return {"input_ids": p + c, "labels": [IGNORE] * len(p) + c, "cut": cut}


def split(rows: list, seed: int) -> tuple[list, list]:
    """(train, dev): a seeded 90/10 split, at least one dev row."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_dev = max(1, len(rows) // 10)
    return [rows[i] for i in order[n_dev:]], [rows[i] for i in order[:n_dev]]


class Legs(TrainerCallback):
    """A Trainer callback that keeps, in each checkpoint, the training seconds so far (Trainer's state has no
    time) and which code and machine trained from which step ("trained_on", as `python -m train` records it),
    so that a resumed run's summary covers every leg, a killed one's included; and `kept` (the backbone alone's
    dev loss and the digest of the dev rows it was measured on), so that a resumed leg (each of ZeroGPU's
    time-boxed calls) need not measure it again."""

    FILE = "capt_legs.json"

    def __init__(self, code: dict, resume_from: Path | None):
        kept = resume_from / self.FILE if resume_from else None
        prev = json.loads(kept.read_text()) if kept and kept.exists() else None
        self.prev, self.kept = prev or {}, {}   # what the checkpoint kept; what this leg's checkpoints will keep
        self.before = prev["seconds"] if prev else 0.0
        if resume_from is None:
            self.trained_on = [{"from_step": 0, "code": code}]
        else:   # a checkpoint written without the file: its steps' code and time unknown
            self.trained_on = (prev["trained_on"] if prev else [{"from_step": 0, "code": None}]) + [
                {"from_step": int(resume_from.name.rsplit("-", 1)[1]), "from_seconds": round(self.before, 1),
                 "code": code}]
        self.started = time.time()

    def seconds(self) -> float:
        return self.before + time.time() - self.started

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.time()

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"   # Trainer's PREFIX_CHECKPOINT_DIR
        (folder / self.FILE).write_text(json.dumps({"seconds": self.seconds(), "trained_on": self.trained_on,
                                                    **self.kept}))


class Events(TrainerCallback):
    """`callback(event)` per step and per dev evaluation, shaped as capt.training.train's events ("step": loss,
    throughput, ETA, best dev loss so far; "eval": {"dev": {"loss": ...}}); `stop()` and a time budget on the
    run's clock (`clock()`: seconds of training, resumed legs included) honoured after each step: the run then
    ends, keeping the best capsule so far, with a checkpoint of the step it ended at, so that a resumed run (the
    next of ZeroGPU's time-boxed calls) goes on from there."""

    def __init__(self, callback=None, stop=None, batch_size: int = 8, max_seconds: float | None = None,
                 clock=None):
        self.callback, self.stop, self.batch_size = callback or (lambda event: None), stop, batch_size
        self.max_seconds, self.stopped_by = max_seconds, None
        self.started = time.time()
        self.clock = clock or (lambda: time.time() - self.started)

    def on_train_begin(self, args, state, control, **kwargs):
        self.started, self.first_step = time.time(), state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        if self.stop is not None and self.stop():
            self.stopped_by = "stop requested"
        elif self.max_seconds is not None and self.clock() >= self.max_seconds:
            self.stopped_by = "max_minutes"
        if self.stopped_by is not None:
            control.should_training_stop = control.should_save = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs:
            return
        spent, done = time.time() - self.started, state.global_step - self.first_step
        rate = done / spent if spent > 0 else 0.0
        self.callback({"kind": "step", "step": state.global_step, "total_steps": state.max_steps,
                       "loss": logs["loss"], "lr": logs.get("learning_rate"),
                       "examples_per_s": round(rate * self.batch_size, 3),
                       "eta_s": round((state.max_steps - state.global_step) / rate, 1) if rate else 0.0,
                       "elapsed_s": round(spent, 1), "best": state.best_metric})

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        loss = (metrics or {}).get("eval_loss")
        if loss is not None:
            self.callback({"kind": "eval", "step": state.global_step, "dev": {"loss": loss},
                           "best": min(loss, state.best_metric) if state.best_metric is not None else loss,
                           "improved": state.best_metric is None or loss < state.best_metric})


class Collator:
    """Pads a batch of `encode` rows on the right: pads masked out and never scored."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[dict]) -> dict:
        ids, mask = pad([r["input_ids"] for r in rows], self.pad_id)
        labels, lmask = pad([r["labels"] for r in rows], IGNORE)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels.masked_fill(lmask == 0, IGNORE)}


def dev_loss(backbone: Backbone, capsule, rows: list[dict], batch_size: int = 8) -> float:
    """The dev loss as Trainer's evaluation gives it (each batch's mean token loss, weighted by its rows), for
    any capsule or none (capsule=None: the backbone alone, the bar a trained capsule is measured against)."""
    collate, total = Collator(backbone.tokenizer.pad_token_id), 0.0
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            batch = rows[i:i + batch_size]
            total += lm_loss(backbone, capsule, **collate(batch)).loss.item() * len(batch)
    return total / len(rows)


def train_lm(backbone: Backbone, pairs: list[tuple[str, str]], out, config: CapsuleConfig | None = None,
             max_steps: int = 500, eval_every: int = 50, patience: int = 10, batch_size: int = 8,
             lr: float = 3e-2, seed: int = 0, resume: bool = False, command: str | None = None,
             callback=None, stop=None, max_minutes: float | None = None,
             test_pairs: list[tuple[str, str]] | None = None) -> dict:
    """Train a capsule on (prompt, completion) pairs; writes OUT/capsule, OUT/summary.json and OUT/trainer, and
    returns the summary. Constant learning rate (AdamW, no weight decay), the dev loss's best capsule kept;
    resume=True goes on from OUT/trainer's last checkpoint (to a larger max_steps, or after a kill).
    callback(event): each step and dev evaluation (`Events`); stop(): checked after each step, True ends the run
    with the best capsule so far, as does max_minutes on the run's training clock, resumed legs included (summary
    "stopped_by": "stop requested", "max_minutes", "early stopping" or "max_steps"); either leaves a checkpoint
    of the step it ended at, so resume=True goes on from exactly there. test_pairs: rows never used to train or
    pick, whose loss (summary "test_loss", and "bare_test_loss" for the backbone alone) the kept capsule gets."""
    config = config or CapsuleConfig()
    check_options(out, max_steps, eval_every, patience, batch_size, lr, resume, max_minutes, config)
    if len(pairs) < 2:
        raise CaptError(f"{len(pairs)} pair(s); training needs at least 2 (90 % train, 10 % dev)")
    rows = [encode(backbone, config.n_slots, p, c) for p, c in pairs]
    test = [encode(backbone, config.n_slots, p, c) for p, c in test_pairs or []]
    n_cut = sum(r.pop("cut") > 0 for r in rows + test)
    train, dev = split(rows, seed)
    out = Path(out)
    last = last_checkpoint(out) if resume else None
    code = {**CODE, "machine": describe_machine(backbone.device)}
    legs = Legs(code, Path(last) if last else None)
    digest = hashlib.sha256(json.dumps([batch_size, dev]).encode()).hexdigest()   # what the bare loss depends on
    bare = (legs.prev["bare_dev_loss"] if legs.prev.get("dev_digest") == digest
            else dev_loss(backbone, None, dev, batch_size))   # resumed on the same dev rows: measured already
    legs.kept = {"bare_dev_loss": bare, "dev_digest": digest}
    model = CapsuleLM(backbone, config=config, seed=seed)
    on_gpu = backbone.device.type == "cuda"
    targs = TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=max_steps, per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size, learning_rate=lr, lr_scheduler_type="constant",
        weight_decay=0.0, eval_strategy="steps", eval_steps=min(eval_every, max_steps),
        save_strategy="steps", save_steps=min(eval_every, max_steps), save_total_limit=2,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss", greater_is_better=False,
        logging_steps=1 if callback else min(10, eval_every), disable_tqdm=callback is not None,
        report_to=[], seed=seed, use_cpu=not on_gpu)
    events = Events(callback, stop, batch_size, max_minutes * 60 if max_minutes else None, clock=legs.seconds)
    trainer = Trainer(model=model, args=targs, train_dataset=train, eval_dataset=dev,
                      data_collator=Collator(backbone.tokenizer.pad_token_id),
                      callbacks=[EarlyStoppingCallback(early_stopping_patience=patience), legs, events])
    if callback is not None:   # the events carry the progress: no log lines on stdout
        trainer.remove_callback(PrinterCallback)
    started = time.time()
    result = trainer.train(resume_from_checkpoint=last)
    if not any("eval_loss" in h for h in trainer.state.log_history):   # stopped before the first evaluation
        trainer.evaluate()                                              # the capsule it has, measured
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    best = min(evals, key=lambda h: h["eval_loss"]) if evals else None
    summary = {"command": command, "backbone": backbone.name, "backbone_revision": backbone.revision,
               "backbone_params": backbone.n_params, "n_train": len(train), "n_dev": len(dev),
               "n_prompts_cut": n_cut, "steps": trainer.state.global_step, "max_steps": max_steps,
               "settings": {"max_steps": max_steps, "eval_every": eval_every, "patience": patience,
                            "batch_size": batch_size, "lr": lr, "seed": seed, "max_minutes": max_minutes,
                            "dtype": str(next(backbone.model.parameters()).dtype).removeprefix("torch.")},
               "stopped_by": "max_steps" if trainer.state.global_step >= max_steps   # done, whatever else said so
               else events.stopped_by or "early stopping",
               "best_step": best and best["step"], "best_dev_loss": best and best["eval_loss"],
               "bare_dev_loss": bare,
               "dev_losses": {h["step"]: h["eval_loss"] for h in evals}, "train_loss": result.training_loss,
               "train_seconds": round(legs.seconds(), 1), "trained_on": legs.trained_on,
               "wall_seconds": round(time.time() - started, 1), "n_trainable": model.capsule.n_capsule_params(),
               "capsule": config.to_dict(), "code": code}
    if test:   # the kept capsule (load_best_model_at_end) on rows it never saw
        summary.update(n_test=len(test), test_loss=dev_loss(backbone, model.capsule, test, batch_size),
                       bare_test_loss=dev_loss(backbone, None, test, batch_size))
    summary["capsule_dir"] = str(model.save(out / "capsule", training=summary))   # the best dev loss's capsule
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
