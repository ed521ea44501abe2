"""Train a capsule on free text (a prompt -> its completion) with the backbone's own language-modelling loss,
through transformers' Trainer and capt.CapsuleLM: capt.lm_loss from the command line.

    python -m train.lm --data-file qa.jsonl --prompt-field question --completion-field answer --out runs/qa
    python -m train.lm --data-file qa.jsonl --max-steps 400 --out runs/qa --resume     # go on to 400 steps

The rows are split 90/10 (seeded) into train and dev; the dev loss, every --eval-every steps, picks the capsule
kept and stops the run after --patience evaluations without improvement. The completion is learned with an
end-of-sequence token after it (so the capsule also learns where to stop); the capsule reads the prompt
(capt.lm). OUT/capsule is an ordinary capsule folder (capt.load_capsule, capt.generate), OUT/summary.json the
outcome (training seconds and the code and machine of every leg, resumed ones included), OUT/trainer Trainer's
checkpoints (capsule, optimizer and scheduler only: the backbone is never saved).
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from pathlib import Path

import torch
from transformers import EarlyStoppingCallback, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from capt.backbones import Backbone, load_backbone
from capt.config import CapsuleConfig
from capt.errors import CaptError
from capt.lm import IGNORE, CapsuleLM
from capt.scoring import encode_prompts, pad
from capt.tasks import read_records
from capt.training import CODE, describe_machine


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.lm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-file", required=True, help="a .jsonl, .json or .csv file of prompts and completions")
    p.add_argument("--prompt-field", default="prompt", help="the column the capsule reads (default %(default)s)")
    p.add_argument("--completion-field", default="completion",
                   help="the column learned, with an end-of-sequence token after it (default %(default)s)")
    p.add_argument("--backbone", default="smollm2-135m", help="default %(default)s (embedded); a hub id or folder")
    p.add_argument("--out", required=True, help="the run's folder (capsule/, summary.json, trainer/)")
    p.add_argument("--max-steps", type=int, default=500, help="default %(default)s")
    p.add_argument("--eval-every", type=int, default=50,
                   help="steps between dev-loss evaluations and checkpoints (default %(default)s)")
    p.add_argument("--patience", type=int, default=10,
                   help="evaluations without improvement before stopping (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="default %(default)s")
    p.add_argument("--lr", type=float, default=3e-2, help="constant, AdamW (default %(default)s, as python -m train)")
    p.add_argument("--seed", type=int, default=0, help="the capsule's initialisation, the split and the order")
    p.add_argument("--fusion", default="add", help="add (default), prepend, extract, project, none")
    p.add_argument("--placement", default="slot", help="slot (default), inplace")
    p.add_argument("--layers", default="all",
                   help="all (default), odd, even, first_half, latter_half, or a comma list like 0,2,5")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in OUT/trainer")
    return p


def check_args(args) -> None:
    bad = [f"--{k.replace('_', '-')} {v!r} (valid: {want})" for k, v, ok, want in [
        ("max_steps", args.max_steps, args.max_steps >= 1, "an integer >= 1"),
        ("eval_every", args.eval_every, args.eval_every >= 1, "an integer >= 1"),
        ("patience", args.patience, args.patience >= 1, "an integer >= 1"),
        ("batch_size", args.batch_size, args.batch_size >= 1, "an integer >= 1"),
        ("lr", args.lr, 0 < args.lr <= 1, "0 < lr <= 1")] if not ok]
    if bad:
        raise CaptError("out of range: " + "; ".join(bad))
    used = [n for n in ("capsule", "summary.json") if (Path(args.out) / n).exists()]
    if used and not args.resume:
        raise CaptError(f"{args.out} already holds a run ({', '.join(used)}); continue it with --resume, or give "
                        "another --out")
    if args.resume and _last_checkpoint(args) is None:
        raise CaptError(f"--resume: no checkpoint in {Path(args.out) / 'trainer'} to go on from; start without "
                        "--resume")


def _last_checkpoint(args) -> str | None:
    folder = Path(args.out) / "trainer"
    return get_last_checkpoint(str(folder)) if folder.is_dir() else None


def read_pairs(path, prompt_field: str, completion_field: str) -> list[tuple[str, str]]:
    """(prompt, completion) per row; a row with an empty or non-text value is refused with its number."""
    pairs = []
    for row, r in enumerate(read_records(path, [prompt_field, completion_field]), start=1):
        p, c = r[prompt_field], r[completion_field]
        if not (isinstance(p, str) and p.strip() and isinstance(c, str) and c.strip()):
            raise CaptError(f"{Path(path).name} row {row}: {prompt_field!r} and {completion_field!r} must both be "
                            f"non-empty text, got {p!r} and {c!r}")
        pairs.append((p, c))
    if len(pairs) < 2:
        raise CaptError(f"{path} has {len(pairs)} row(s); training needs at least 2 (90 % train, 10 % dev)")
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
    so that a resumed run's summary covers every leg, a killed one's included."""

    FILE = "capt_legs.json"

    def __init__(self, code: dict, resume_from: Path | None):
        kept = resume_from / self.FILE if resume_from else None
        prev = json.loads(kept.read_text()) if kept and kept.exists() else None
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
        (folder / self.FILE).write_text(json.dumps({"seconds": self.seconds(), "trained_on": self.trained_on}))


class Collator:
    """Pads a batch of `encode` rows on the right: pads masked out and never scored."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[dict]) -> dict:
        ids, mask = pad([r["input_ids"] for r in rows], self.pad_id)
        labels, lmask = pad([r["labels"] for r in rows], IGNORE)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels.masked_fill(lmask == 0, IGNORE)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    try:
        check_args(args)
        config = CapsuleConfig(fusion=args.fusion, placement=args.placement, layers=args.layers)
        pairs = read_pairs(args.data_file, args.prompt_field, args.completion_field)
        bb = load_backbone(args.backbone, device="cuda" if torch.cuda.is_available() else "cpu")
        rows = [encode(bb, config.n_slots, p, c) for p, c in pairs]
    except CaptError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n_cut = sum(r.pop("cut") > 0 for r in rows)
    train, dev = split(rows, args.seed)
    n_dev = len(dev)
    model = CapsuleLM(bb, config=config, seed=args.seed)
    out = Path(args.out)
    targs = TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, learning_rate=args.lr, lr_scheduler_type="constant",
        weight_decay=0.0, eval_strategy="steps", eval_steps=min(args.eval_every, args.max_steps),
        save_strategy="steps", save_steps=min(args.eval_every, args.max_steps), save_total_limit=2,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss", greater_is_better=False, logging_steps=min(10, args.eval_every),
        report_to=[], seed=args.seed, use_cpu=not torch.cuda.is_available())
    last = _last_checkpoint(args) if args.resume else None
    code = {**CODE, "machine": describe_machine(bb.device)}
    legs = Legs(code, Path(last) if last else None)
    trainer = Trainer(model=model, args=targs, train_dataset=train, eval_dataset=dev,
                      data_collator=Collator(bb.tokenizer.pad_token_id),
                      callbacks=[EarlyStoppingCallback(early_stopping_patience=args.patience), legs])
    started = time.time()
    result = trainer.train(resume_from_checkpoint=last)
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    best = min(evals, key=lambda h: h["eval_loss"]) if evals else None
    summary = {"command": "python -m train.lm " + shlex.join(argv), "backbone": bb.name, "n_train": len(train),
               "n_dev": n_dev, "n_prompts_cut": n_cut, "steps": trainer.state.global_step, "max_steps": args.max_steps,
               "best_step": best and best["step"], "best_dev_loss": best and best["eval_loss"],
               "dev_losses": {h["step"]: h["eval_loss"] for h in evals}, "train_loss": result.training_loss,
               "train_seconds": round(legs.seconds(), 1), "trained_on": legs.trained_on,
               "wall_seconds": round(time.time() - started, 1), "n_trainable": model.capsule.n_capsule_params(),
               "capsule": config.to_dict(), "code": code}
    folder = model.save(out / "capsule", training=summary)   # the best dev loss's capsule (load_best_model_at_end)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{folder}: {summary['steps']} steps, best dev loss {summary['best_dev_loss']:.4f} at step "
          f"{summary['best_step']} ({len(train)} train / {n_dev} dev rows"
          + (f"; {n_cut} prompt(s) cut at the start to fit {bb.name}'s {bb.max_length} tokens" if n_cut else "")
          + ")", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
