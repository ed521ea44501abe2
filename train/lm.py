"""Train a capsule on free text (a prompt -> its completion) with the backbone's own language-modelling loss,
through transformers' Trainer and capt.CapsuleLM: capt.lm_training.train_lm from the command line.

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
import shlex
import sys

import torch

from capt.backbones import load_backbone
from capt.config import CapsuleConfig
from capt.errors import CaptError
from capt.lm_training import check_options, read_pairs, train_lm


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.lm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-file", required=True, help="a .jsonl, .json or .csv file of prompts and completions")
    p.add_argument("--prompt-field", default="prompt", help="the column the capsule reads (default %(default)s)")
    p.add_argument("--completion-field", default="completion",
                   help="the column learned, with an end-of-sequence token after it (default %(default)s)")
    p.add_argument("--test-file", help="rows never trained on nor used to pick: the kept capsule's test loss, beside "
                                       "the backbone alone's (same fields as --data-file)")
    p.add_argument("--backbone", default="smollm2-135m", help="default %(default)s (embedded); a hub id or folder")
    p.add_argument("--out", required=True, help="the run's folder (capsule/, summary.json, trainer/)")
    p.add_argument("--max-steps", type=int, default=500, help="default %(default)s")
    p.add_argument("--max-minutes", type=float,
                   help="stop when the run's training clock, resumed legs included, reaches this (default: no limit)")
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    options = dict(max_steps=args.max_steps, eval_every=args.eval_every, patience=args.patience,
                   batch_size=args.batch_size, lr=args.lr, resume=args.resume, max_minutes=args.max_minutes)
    try:   # every check before the backbone is loaded
        check_options(args.out, **options, flags=True)
        config = CapsuleConfig(fusion=args.fusion, placement=args.placement, layers=args.layers)
        pairs = read_pairs(args.data_file, args.prompt_field, args.completion_field)
        test = read_pairs(args.test_file, args.prompt_field, args.completion_field, 1) if args.test_file else None
        bb = load_backbone(args.backbone, device="cuda" if torch.cuda.is_available() else "cpu")
        s = train_lm(bb, pairs, args.out, config, seed=args.seed, command="python -m train.lm " + shlex.join(argv),
                     test_pairs=test, **options)
    except CaptError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cut = s["n_prompts_cut"]
    print(f"{s['capsule_dir']}: {s['steps']} steps ({s['stopped_by']}), best dev loss {s['best_dev_loss']:.4f} at "
          f"step {s['best_step']}, the backbone alone {s['bare_dev_loss']:.4f} ({s['n_train']} train / {s['n_dev']} "
          "dev rows"
          + (f"; {cut} prompt(s) cut at the start to fit {bb.name}'s {bb.max_length} tokens" if cut else "")
          + ")" + (f"; test loss {s['test_loss']:.4f}, the backbone alone {s['bare_test_loss']:.4f} "
                   f"on {s['n_test']} test row(s)" if "test_loss" in s else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
