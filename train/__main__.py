"""Train a capsule (or a baseline) from the command line.

    python -m train --task rte --out runs/rte                         # CaPT on the embedded SmolLM2-135M
    python -m train --task cb --method p-tuning-v2 --max-steps 200
    python -m train --task rte --fusion project --layers odd --seeds 0 1 2
    python -m train compare --task cb --methods capt zero-shot majority linear-head p-tuning-v2
    python -m train --task sentiment --data-file reviews.csv --fields review --label-words pos=good neg=bad
    accelerate launch -m train --task boolq --backbone t5-base        # several GPUs, no code change
    python -m train probe --capsule runs/cb/capt/capsule --n-examples 56   # the paper's training-free probe
    python -m train evaluate --capsule capsules/smollm2-135m/cb           # score a capsule again, per label

Everything it does is capt.training.train / train_seeds / compare / evaluate_capsule and
capt.analysis.probe_on_val; this file only parses arguments.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

from capt.analysis import PAPER_KS, probe_on_val
from capt.backbones import load_backbone
from capt.errors import CaptError
from capt.io import load_capsule, read_config
from capt.methods import METHODS, OPTION_USERS, TRAINABLE
from capt.tasks import TASKS, get_task
from capt.training import Run, TrainConfig, compare, evaluate_capsule, format_table, percent, train_seeds
from capt.viz import one_label_sentence


def _pairs(items: list[str] | None, what: str) -> dict | None:
    if not items:
        return None
    bad = [i for i in items if "=" not in i]
    if bad:
        raise CaptError(f"{what} takes key=value pairs, got {bad}")
    return dict(i.split("=", 1) for i in items)


def _command(argv: list[str]) -> str:
    return "python -m train " + " ".join(shlex.quote(a) for a in argv)


def _record_command(out_dir: str | None, name: str, argv: list[str]) -> None:
    """Add the exact command to out_dir/name (written by the run; replaced atomically)."""
    if out_dir and (Path(out_dir) / name).exists():
        run = Run(out_dir)
        run.write_json(name, {**json.loads((run.dir / name).read_text()), "command": _command(argv)})


def parser(compare_mode: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train" + (" compare" if compare_mode else ""),
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", default=TrainConfig.backbone,
                   help="smollm2-135m (default, embedded), gemma3-270m, t5-base, a hub id or a local folder")
    p.add_argument("--task", default=TrainConfig.task,
                   help="boolq, cb, copa, multirc, rte, wic, or a name for --data-file")
    if compare_mode:
        p.add_argument("--methods", nargs="+", default=["capt", "zero-shot", "majority", "linear-head", "p-tuning-v2"],
                       help=f"any of: {', '.join(METHODS)}")
    else:
        p.add_argument("--method", default=TrainConfig.method, help=f"one of: {', '.join(METHODS)}")
    p.add_argument("--lr", type=float, help="default per method: capt 3e-2, linear-head 1e-3, prompt-tuning 3e-1, "
                                            "p-tuning-v2 1e-2")
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size, help="default %(default)s")
    p.add_argument("--epochs", type=int, default=TrainConfig.epochs,
                   help="default %(default)s, the paper's budget (early stopping usually ends sooner)")
    p.add_argument("--max-steps", type=int, help="stop after this many steps (default: no cap)")
    p.add_argument("--max-minutes", type=float, help="stop after this much training time (default: no cap)")
    p.add_argument("--eval-every", type=int, default=TrainConfig.eval_every,
                   help="steps between dev evaluations and checkpoints (default %(default)s)")
    p.add_argument("--patience", type=int, default=TrainConfig.patience,
                   help="dev evaluations without improvement before stopping (default %(default)s)")
    p.add_argument("--min-steps", type=int, default=TrainConfig.min_steps,
                   help="no early stopping before this step (default 0, the paper's protocol)")
    p.add_argument("--seeds", type=int, nargs="+", default=[TrainConfig.seed],
                   help="one run per seed, then the mean ± std (default: 0)")
    p.add_argument("--max-train", type=int,
                   help="cap on training examples: a fixed random subset, the same for every seed and method "
                        "(default: all)")
    p.add_argument("--max-dev", type=int, help="cap on the 10 %% dev split (default: all)")
    p.add_argument("--max-test", type=int, help="cap on the test split (default: all)")
    p.add_argument("--warmup-steps", type=int, default=TrainConfig.warmup_steps,
                   help="steps of linear learning-rate warm-up, then constant (default %(default)s)")
    p.add_argument("--num-virtual-tokens", type=int,
                   help=f"prompt-tuning, p-tuning-v2 only (default {TrainConfig.num_virtual_tokens})")
    p.add_argument("--fusion", help="add (default), prepend, extract, project, none")
    p.add_argument("--placement", help="slot (default), inplace")
    p.add_argument("--layers", help="all (default), odd, even, first_half, latter_half, or a comma list like 0,2,5")
    p.add_argument("--head", help="verbalizer (default), linear")
    p.add_argument("--dtype", default=TrainConfig.dtype, help="float32 (default, the paper's), bfloat16, float16")
    p.add_argument("--data-dir", help="the SuperGLUE files (default: $CAPT_DATA_DIR, else ../shared/data/superglue "
                                         "beside this checkout)")
    p.add_argument("--source", help="a hub dataset id, e.g. aps/super_glue")
    p.add_argument("--data-file", help="your CSV/JSONL training data")
    p.add_argument("--test-file", help="--data-file's test rows (default: a further 10 %% of --data-file held out)")
    p.add_argument("--fields", nargs="+", help="input fields of --data-file's task")
    p.add_argument("--columns", nargs="+", help="field=column pairs when the file's columns differ")
    p.add_argument("--label-column", help=f"--data-file's label column (default {TrainConfig.label_column!r})")
    p.add_argument("--label-words", nargs="+", help="label=word pairs, e.g. 1=yes 0=no")
    p.add_argument("--out", help="run folder: metrics.jsonl, summary.json, checkpoint/, capsule/")
    p.add_argument("--resume", action="store_true",
                   help="continue from --out's checkpoint (compare: each method's own, under --out/<method>)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


# Options that only some runs use: given where nothing would use them, they are refused, not ignored.
DATA_FILE_OPTIONS = ("fields", "columns", "label_column", "label_words", "test_file")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def refuse_unused_options(args) -> None:
    """An option the run would not use is an error, not a silent no-op. compare runs every method at one set
    of options (each method takes the ones it uses), so only the data-file options are checked there."""
    given = [n for n in DATA_FILE_OPTIONS if getattr(args, n) is not None]
    if given and not args.data_file:
        raise CaptError(f"{', '.join(map(_flag, given))} {'apply' if len(given) > 1 else 'applies'} only with "
                        "--data-file (your own CSV/JSONL file); "
                        f"the built-in task {args.task!r} has its own fields and label words")
    method = getattr(args, "method", None)   # None in compare mode
    unused = [n for n, users in OPTION_USERS.items() if method and getattr(args, n) is not None
              and method not in users]
    if unused:
        users = "; ".join(f"{_flag(n)} is used by {' and '.join(OPTION_USERS[n])} only" for n in unused)
        raise CaptError(f"{users}: method {method} would ignore {'them' if len(unused) > 1 else 'it'}")


def config_from(args) -> TrainConfig:
    refuse_unused_options(args)
    capsule = {k: getattr(args, k) for k in ("fusion", "placement", "head") if getattr(args, k)}
    if args.layers:
        capsule["layers"] = args.layers   # a preset or "0,2,5": CapsuleConfig parses and checks it
    return TrainConfig(
        task=args.task, method=getattr(args, "method", "capt"), backbone=args.backbone, lr=args.lr,
        batch_size=args.batch_size, epochs=args.epochs, max_steps=args.max_steps, max_minutes=args.max_minutes,
        eval_every=args.eval_every, patience=args.patience, min_steps=args.min_steps, max_train=args.max_train,
        max_dev=args.max_dev, max_test=args.max_test, warmup_steps=args.warmup_steps, capsule=capsule,
        dtype=args.dtype, data_dir=args.data_dir, source=args.source, data_file=args.data_file,
        test_file=args.test_file, fields=args.fields, columns=_pairs(args.columns, "--columns"),
        label_words=_pairs(args.label_words, "--label-words"), out_dir=args.out,
        **{k: getattr(args, k) for k in ("num_virtual_tokens", "label_column") if getattr(args, k) is not None})


def probe_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train probe", description=(
        "The paper's training-free probe: accuracy on a seeded random sample of a task's val split with k "
        "mean-pooled instance tokens prepended at every capsule layer of a trained capsule (the paper uses a "
        "deep prompt: python -m train --method deep-prompt-1), or of an untrained deep prompt without --capsule."))
    p.add_argument("--capsule", help="a capsule folder (e.g. runs/cb/capt/capsule or capsules/smollm2-135m/cb)")
    p.add_argument("--task", help="a built-in task (default: the capsule's own)")
    p.add_argument("--backbone", help="default: the capsule's own backbone, else smollm2-135m")
    p.add_argument("--n-examples", type=int, default=32, help="val examples in the sample (4..1000)")
    p.add_argument("--ks", type=int, nargs="+", default=list(PAPER_KS), help="numbers of pooled tokens (1..64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the result here")
    return p


def probe(argv: list[str]) -> int:
    args = probe_parser().parse_args(argv)
    try:
        if not args.capsule and not args.task:
            raise CaptError("give --capsule, --task, or both")
        own = read_config(args.capsule)["backbone"]["name"] if args.capsule else "smollm2-135m"
        bb = load_backbone(args.backbone or own)
        capsule, task = load_capsule(args.capsule, bb) if args.capsule else (None, None)
        task = get_task(args.task) if args.task else task
        if task is None:
            raise CaptError(f"{args.capsule} was saved without a task; give --task (one of {', '.join(TASKS)})")
        result = probe_on_val(bb, task, capsule, args.n_examples, args.ks, args.seed)
    except CaptError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.table())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**asdict(result), "capsule": args.capsule, "backbone": bb.name,
                                         "command": "python -m train probe " + shlex.join(argv)}, indent=2) + "\n")
    return 0


def evaluate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train evaluate", description=(
        "Score a saved capsule again on the split its training used (its capsule.json's data, caps and split), "
        "as training scored it: the metrics, what it answered for each gold label, and whether the metrics are "
        "the ones it recorded when it was saved (the same code, thread count and kind of CPU give the same)."))
    p.add_argument("--capsule", required=True, help="a capsule folder (e.g. capsules/smollm2-135m/cb)")
    p.add_argument("--split", choices=("test", "dev"), default="test")
    p.add_argument("--backbone", help="default: the capsule's own")
    p.add_argument("--json", type=Path, help="also write the result here")
    return p


def counts_table(counts: dict) -> str:
    """{gold: {predicted: n}} as a Markdown table, one row per gold label (with how many there are)."""
    labels = list(counts)
    lines = ["| gold / predicted | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    lines += [f"| {g} ({sum(row.values())}) | " + " | ".join(str(row[p]) for p in labels) + " |"
              for g, row in counts.items()]
    return "\n".join(lines)


def evaluate(argv: list[str]) -> int:
    args = evaluate_parser().parse_args(argv)
    try:
        bb = load_backbone(args.backbone) if args.backbone else None
        result = evaluate_capsule(args.capsule, args.split, bb)
    except CaptError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    scores = ", ".join(f"{k} {100 * v:.1f} %" for k, v in result["metrics"].items())
    verdict = {True: "the same as it recorded when it was saved", None: "no metrics recorded to compare",
               False: "recorded when it was saved: " + ", ".join(
                   f"{k} {100 * v:.1f} %" for k, v in (result["recorded"] or {}).items()
                   if not k.endswith("_std")) + " (other code, thread count or CPU)"}[result["same_as_recorded"]]
    where = f"{result['n']} examples; {result['data'].rstrip('.')}"
    bar = one_label_sentence(result["counts"]) if "accuracy" in result["metrics"] else ""
    print(f"{args.capsule} on {result['task']} {args.split} ({where}): {scores}; {verdict}.{bar}\n\n"
          f"{counts_table(result['counts'])}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**result, "command": "python -m train evaluate " + shlex.join(argv)},
                                        indent=2) + "\n")
    return 0


def report(summary: dict) -> str:
    """The run's outcome in one line: test (and dev) metrics in %, with ± their std over seeds, how it ended and
    where the capsule (or baseline artifact) went."""
    def metrics(d: dict) -> str:
        return ", ".join(f"{k} {percent(d, k)} %" for k in d if not k.endswith("_std"))
    seeds = summary.get("seeds")
    head = f"{summary['method']} on {summary['task']} ({summary['backbone']})"
    head += f", seeds {' '.join(map(str, seeds))}" if seeds else ""
    parts = [f"{head}: test {metrics(summary['test'])}", f"dev {metrics(summary['dev'])}"]
    if seeds:
        parts.append(f"steps {', '.join(map(str, summary['steps']))}; best seed on dev {summary['best_seed']}")
    elif summary.get("stopped_by") != "no training":
        parts.append(f"{summary['steps']} steps ({summary['stopped_by']}), kept step {summary['best_step']}")
    parts.append(f"{summary['n_trainable']:,} trainable, {summary['train_seconds']:.0f} s training")
    if summary.get("artifact"):
        parts.append(f"saved to {summary['artifact']}")
    elif summary["method"] in TRAINABLE:
        parts.append("nothing saved: give --out to keep the run and what it trained")
    return " · ".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "probe":
        return probe(argv[1:])
    if argv and argv[0] == "evaluate":
        return evaluate(argv[1:])
    compare_mode = bool(argv) and argv[0] == "compare"
    args = parser(compare_mode).parse_args(argv[1:] if compare_mode else argv)
    try:
        cfg = config_from(args)
        trains = set(args.methods if compare_mode else [cfg.method]) & set(TRAINABLE)
        if trains and not cfg.out_dir:   # said up front: the run may take hours
            print("note: no --out, so nothing this run trains will be saved (capsule, log, summary)", file=sys.stderr)
        if compare_mode:
            rows = compare(cfg, args.methods, args.seeds, resume=args.resume, progress=not args.quiet)
            print(format_table(rows))
            _record_command(cfg.out_dir, "compare.json", argv)   # the model card quotes the exact command
        else:
            summary = train_seeds(cfg, args.seeds, resume=args.resume, progress=not args.quiet)
            _record_command(cfg.out_dir, "summary.json", argv)   # quoted by train.card --seeds
            print(report(summary), file=sys.stderr)   # for people; stdout stays JSON, for jq and scripts
            print(json.dumps({k: summary[k] for k in ("method", "task", "backbone", "n_trainable", "test", "dev",
                                                      "train_seconds", "steps", "best_step", "stopped_by",
                                                      "seeds", "best_seed", "artifact") if k in summary}, indent=2))
    except CaptError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
