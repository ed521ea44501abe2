"""Turn a `python -m train compare ... --out RUN` folder into a shipped capsule with its model card.

    python -m train.card runs/cb --to capsules/smollm2-135m/cb
    python -m train.card runs/rte --to capsules/smollm2-135m/rte --seeds runs/rte-seeds   # + CaPT alone, 3 seeds
    python -m train.card capsules/smollm2-135m --table        # the README's cross-task table
    python -m train.card capsules/smollm2-135m/rte --baseline-seeds runs/rte-baselines   # + baselines' seeds
    python -m train.card runs/copa-text --to capsules/smollm2-135m/copa-text   # a `python -m train.lm` run

Copies RUN/capt/capsule (capsule.json + capsule.safetensors) and writes README.md beside it with the
exact command, the data split, the training time measured on this machine and the test metrics of every
method in RUN/compare.json. Every number in the card is read from the run's own files. For a free-text run
(`python -m train.lm --out RUN`: RUN/summary.json, no compare.json) the card gives the command, the split, the
settings, the training time and the dev loss at every evaluation beside the backbone alone's.

--baseline-seeds amends a shipped card of a one-seed compare (its run folder need not exist any more) with a
`python -m train compare --methods linear-head p-tuning-v2 --seeds 1 2 ...` run made with the compare's
settings: each baseline's score on every seed goes into the card, and its mean ± std over those seeds and the
compare's own into results.json and the README table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import sys
from pathlib import Path

import torch

from capt.errors import CaptError
from capt.files import atomic_folder
from capt.methods import TRAINABLE
from capt.training import DEFAULT_LR, TrainConfig, compare_metric_keys, metric_cell, percent, saved_config
from capt.training import _mean_std as seeds_mean_std   # metric -> mean, metric_std -> population std
from capt.viz import counts_text


def _primary(row: dict) -> str:
    """A compare row's main test metric: F1 over answers for MultiRC (the official one), else the first."""
    return "test_f1a" if "test_f1a" in row else compare_metric_keys(row)[0]


def _ref_name(ref: dict) -> str:
    """A training-free reference's name in prose: 'zero-shot', 'majority class'."""
    return ref["method"].replace("majority", "majority class")


def _read_json(path: Path, hint: str) -> dict:
    """A run's or card's JSON file; a missing one is named, with what to give instead."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CaptError(f"{path} is missing: {hint}") from None


ROOT = Path(__file__).resolve().parents[1]


def shown_command(command: str) -> str:
    """A recorded command as a card shows it: an absolute --out inside this checkout becomes the relative path a
    reader types from its root (runs made from a git worktree record the main checkout's absolute path)."""
    words = shlex.split(command)
    outs = [i + 1 for i, w in enumerate(words[:-1]) if w == "--out" and Path(words[i + 1]).is_absolute()
            and Path(words[i + 1]).is_relative_to(ROOT)]
    for i in outs:
        words[i] = str(Path(words[i]).relative_to(ROOT))
    return shlex.join(words) if outs else command


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def card_text(compare: dict, summary: dict, command: str, steps: dict | None = None,
              extra: list | None = None, seeds_run: dict | None = None, counts: dict | None = None) -> str:
    rows = compare["rows"]
    steps = steps or {}
    metric_keys = compare_metric_keys(rows[0])
    head = "| method | trainable params | train time (s) | steps | " + " | ".join(k[5:] for k in metric_keys) + " |"
    table = [head, "|" + "---|" * (4 + len(metric_keys))]
    for r in rows:
        table.append(f"| {r['method']} | {r['trainable']:,} | {r['train_seconds']:.0f} | {_steps(steps.get(r['method']))} | "
                     + " | ".join(metric_cell(r, k) for k in metric_keys) + " |")
    seeds = summary.get("seeds")
    if seeds:   # several seeds: the shipped capsule is the one best on dev; its own run describes the training
        shipped = best_seed_run(summary)
        summary = {**shipped, "n_test": summary["n_test"], "seeds": seeds, "test_mean": summary["test"]}
    cfg = summary["config"]
    capt_row = next(r for r in rows if r["method"] == "capt")
    primary = _primary(rows[0])
    beats = [r["method"] for r in rows if r["method"] not in TRAINABLE
             and capt_row[primary] <= r[primary]]
    on = f" on {primary[5:]}" if primary != metric_keys[0] else ""
    free = " and ".join(r["method"].replace("majority", "majority class") for r in rows
                        if r["method"] not in TRAINABLE)
    verdict = (f"CaPT beats {free}{on} on this split." if not beats else
               f"CaPT does NOT beat {' and '.join(beats)}{on} on this split (see the notes below).")
    best_free = max((r for r in rows if r["method"] not in TRAINABLE), key=lambda r: r[primary],
                    default=None)
    if not beats and best_free is not None and primary == "test_accuracy":
        margin = round((capt_row[primary] - best_free[primary]) * summary["n_test"])
        if margin <= 2:   # a margin this small is within one seed's noise
            verdict += (f" The margin over {best_free['method']} is {margin} test example{'s' * (margin != 1)}"
                        + (" on average over the seeds" if seeds else "")
                        + ": within the noise of one seed, so read it as a tie.")
    options = {k: v for k, v in cfg["capsule"].items()} or "defaults (add fusion, slot, all layers, verbalizer)"
    per_seed = _per_seed_table(compare["seed_runs"], rows, primary) if compare.get("seed_runs") else ""
    notes = (([_seeds_run_note(seeds_run, rows, primary)] if seeds_run else [])
             + ([_counts_note(counts, summary["n_test"])] if counts else []) + (extra or []))
    return f"""---
library_name: capt
tags: [capt, capsule-prompt-tuning, peft, superglue]
base_model: {BASE_MODELS.get(summary['backbone'], summary['backbone'])}
---
# CaPT capsule: {summary['task']} on {summary['backbone']}

A Capsule Prompt-Tuning capsule ({summary['n_trainable']:,} trainable numbers, {100 * summary['n_trainable'] /
summary['backbone_params']:.4f} % of the backbone) for SuperGLUE **{summary['task']}** on
`{summary['backbone']}` ({summary['backbone_revision']}). Capsule options: {options}.

```python
import capt
bb = capt.load_backbone("{summary['backbone']}")
capsule, task = capt.load_capsule("capsules/{summary['backbone']}/{summary['task']}", bb)
capt.predict(bb, task, example, capsule=capsule)
```

## How it was made

```bash
{shown_command(command)}
```

- Data: {summary['data'].rstrip('.')}; {summary['n_train']} train, {summary['n_dev']} dev (model selection), {summary['n_test']}
  test examples.
- Training: {summary['steps']} steps (best dev at step {summary['best_step']}, stopped by: {summary['stopped_by']}),
  batch {cfg['batch_size']}, AdamW lr {cfg['lr'] if cfg['lr'] is not None else DEFAULT_LR[summary['method']]}, seed
  {cfg['seed']}, {cfg['dtype']}; {summary['train_seconds']:.0f} s of training on {_where_trained(summary)}.{_seeds(summary, primary)}{_code(summary)}

## Test results (same split, same loop, `python -m train compare`)

{chr(10).join(table)}

{verdict}

{per_seed}{_notes(rows, primary, cfg, summary, notes)}{CARD_TAIL} Majority class always predicts the most frequent
training label; zero-shot is the bare backbone scoring the label words with the same prompt.
"""


def lm_card_text(summary: dict, folder: str, extra: list | None = None) -> str:
    """The model card of a free-text capsule (a `python -m train.lm` run, capt.lm_training.train_lm): how it was
    made and its dev loss beside the backbone alone's at every evaluation, all read from the run's summary."""
    st = summary["settings"]
    losses = [("the backbone alone", summary["bare_dev_loss"])] + [
        (f"step {k}" + (" (kept)" if int(k) == summary["best_step"] else ""), v)
        for k, v in sorted(summary["dev_losses"].items(), key=lambda kv: int(kv[0]))]
    table = "\n".join(["| | dev loss |", "|---|---|"] + [f"| {k} | {v:.3f} |" for k, v in losses])
    test = (f"\n\nOn {summary['n_test']} test rows (never trained on nor used to pick): {summary['test_loss']:.3f} "
            f"with the capsule, {summary['bare_test_loss']:.3f} with the backbone alone." if "test_loss" in summary
            else "\n\nNo test rows were given (`--test-file`): the dev rows above also picked the capsule kept.")
    cut = summary["n_prompts_cut"]
    notes = "\n".join(f"- {n}" for n in extra or [])
    return f"""---
library_name: capt
tags: [capt, capsule-prompt-tuning, peft, text-generation]
base_model: {BASE_MODELS.get(summary['backbone'], summary['backbone'])}
---
# CaPT capsule: free text on {summary['backbone']} ({Path(folder).name})

A Capsule Prompt-Tuning capsule ({summary['n_trainable']:,} trainable numbers, {100 * summary['n_trainable'] /
summary['backbone_params']:.4f} % of the backbone) trained on free text, each prompt followed by its completion,
with the backbone's own language-modelling loss (`capt.lm_training.train_lm`), on `{summary['backbone']}`
({summary['backbone_revision']}). It has no task: it continues prompts. Capsule options:
{summary['capsule']}.

```python
import capt
bb = capt.load_backbone("{summary['backbone']}")
capsule, _ = capt.load_capsule("{folder}", bb)
capt.generate(bb, prompt, capsule=capsule, max_new_tokens=16).text
```

## How it was made

```bash
{shown_command(summary['command'] or '(command not recorded)')}
```

- Data: {summary['n_train']} train and {summary['n_dev']} dev rows (a seeded 90/10 split, seed {st['seed']}; the dev
  loss picks the capsule kept){f"; {cut} prompt(s) cut at the start to fit the backbone" if cut else ""}. Each
  completion is learned with an end-of-sequence token after it.
- Training: {summary['steps']} steps (best dev loss at step {summary['best_step']}, stopped by: {summary['stopped_by']}),
  batch {st['batch_size']}, AdamW lr {st['lr']} (constant), a dev evaluation every {st['eval_every']} steps, patience
  {st['patience']}, seed {st['seed']}, {st['dtype']}; {summary['train_seconds']:.0f} s of training on {_where_trained(summary)}.{_code(summary)}

## Dev loss

Mean loss per completion token (nats, the end token included; Trainer's evaluation), the backbone alone and
the capsule at every evaluation:

{table}{test}
{notes and chr(10) + "## Notes" + chr(10) * 2 + notes + chr(10)}"""


BASE_MODELS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",   # the embedded backbones' hub models
               "gemma3-270m": "google/gemma-3-270m"}


CARD_TAIL = "\n\nMetrics are percentages on the test split named above."   # the notes end here (--baseline-seeds)


def _notes(rows: list[dict], metric: str, cfg: dict, summary: dict, extra: list) -> str:
    """What a reader should know before trusting the table, derived from the run itself."""
    capt_score = next(r[metric] for r in rows if r["method"] == "capt")
    ahead = [f"{r['method']} ({_pct(r[metric])})" for r in rows
             if r["method"] in TRAINABLE and r["method"] != "capt" and r[metric] > capt_score]
    notes = []
    capped = cfg.get("max_minutes") or cfg.get("max_steps")   # a short budget, not the paper's early stopping
    if capped:
        budget = f"{cfg['max_minutes']:g} minutes" if cfg.get("max_minutes") else f"{cfg['max_steps']} steps"
        notes.append(f"Every trained method had the same short budget ({budget} on this CPU), far from the "
                     "paper's 50 epochs with early stopping; these are short-budget numbers, not converged ones.")
        if cfg.get("max_minutes"):
            notes.append("A wall-clock budget gives fewer steps to a method that ran while the machine was busy "
                         "with other work; see the steps column.")
    caps = [f"{part} to {cfg[f'max_{part}']}" for part in ("train", "dev", "test") if cfg.get(f"max_{part}")]
    if caps:
        notes.append(f"To fit the CPU budget the splits were capped ({', '.join(caps)} examples: a fixed random "
                     "subset, drawn by `--max-{train,dev,test}` with a fixed seed; whole questions for MultiRC); "
                     "numbers on the full split will differ.")
    if ahead:
        notes.append(f"{'At this budget' if capped else 'At these settings'} {', '.join(ahead)} scored higher "
                     f"than CaPT ({_pct(capt_score)}).")
    seeds = summary.get("seeds")
    notes.append(f"The test split has {summary['n_test']} examples: one example is "
                 f"{100 / summary['n_test']:.1f} points. "
                 + (f"Seeds {', '.join(map(str, seeds))}: the table gives mean ± standard deviation over them "
                    "(population, as numpy's std) and the train time of all of them together." if seeds
                    else f"One seed ({cfg['seed']})."))
    notes += extra   # what the person shipping it adds (--note): what was tried, what was not
    return "\n".join(f"- {n}" for n in notes)


SETTINGS_OF_A_RUN = ("seed", "out_dir")   # config keys that may differ between a compare and its seeds run


def seeds_record(seeds_dir: Path, run: Path, ref: dict) -> dict:
    """A `python -m train --seeds ... --out SEEDS_DIR` run of CaPT alone, checked to have the settings of the
    compare RUN's CaPT run (`ref`, its summary.json), as results.json keeps it ("capt_seeds"): each seed's test
    and dev metrics, the mean ± std, and whether the seed the compare trained came out bit for bit the same
    capsule."""
    path = seeds_dir / "summary.json"
    s = _read_json(path, "--seeds takes the --out folder of `python -m train --seeds 0 1 2 ...`")
    if s.get("method") != "capt" or len(s.get("seeds") or []) < 2:
        raise CaptError(f"{seeds_dir} is not a several-seed CaPT run (method {s.get('method')}, seeds "
                        f"{s.get('seeds')}); give the --out folder of `python -m train --seeds 0 1 2 ...`")
    if ref.get("seeds"):
        raise CaptError(f"the compare in {run} already has seeds {ref['seeds']}: its table gives their mean, "
                        "so --seeds adds nothing")
    want = saved_config(ref["config"])   # a setting added since either run: its default, what that run did
    for r in s["runs"]:
        got = saved_config(r["config"])
        keys = sorted(k for k in set(want) | set(got) if k not in SETTINGS_OF_A_RUN and want.get(k) != got.get(k))
        if keys:
            raise CaptError(f"{seeds_dir} (seed {got['seed']}) was not trained like the compare's CaPT run: "
                            + ", ".join(f"{k} {got.get(k)!r} there, {want.get(k)!r} in the compare" for k in keys))
    if not s.get("command"):
        raise CaptError(f"{path} records no command (made before `python -m train` recorded one): add "
                        '"command": "<the exact command>" to it, or rerun')
    same = seeds_dir / f"seed-{want['seed']}" / "capsule" / "capsule.safetensors"
    shipped = run / "capt" / "capsule" / "capsule.safetensors"
    return {"command": s["command"], "seeds": s["seeds"], "test": s["test"], "train_seconds": s["train_seconds"],
            "commit": (s["runs"][0].get("code") or {}).get("commit"),
            "runs": [_seed_entry(r) for r in s["runs"]],
            "reproduces_shipped": same.read_bytes() == shipped.read_bytes() if same.exists() else None,
            "shipped_seed": want["seed"]}


def _seed_entry(r: dict) -> dict:
    """What results.json keeps of one seed's run."""
    return {"seed": r["config"]["seed"], "test": r["test"], "dev": r["dev"], "best_step": r["best_step"],
            "steps": r["steps"]}


def best_seed_run(summary: dict) -> dict:
    """A several-seed summary's run of the seed best on dev (for CaPT: the shipped capsule's)."""
    return next(r for r in summary["runs"] if r["config"]["seed"] == summary["best_seed"])


def answer_counts(summaries: dict) -> dict:
    """What each method but the majority class answered on the test split, from its summary.json (`summaries`, by
    method): {method: {"seed": s or None, "counts": {gold: {predicted: n}}}}, for several seeds the seed best on
    dev (CaPT's: the shipped capsule). Runs that predate the counts are left out."""
    out = {}
    for m, s in summaries.items():
        run = best_seed_run(s) if s.get("runs") else s
        if m != "majority" and run.get("test_counts"):
            out[m] = {"seed": run["config"]["seed"] if s.get("runs") else None, "counts": run["test_counts"]}
    return out


def _counts_note(counts: dict, n_test: int) -> str:
    """The card's line on what each method answered: gold label (its count) -> predicted label counts."""
    def one(m: str, c: dict) -> str:
        seed = f", seed {c['seed']}" + (" (shipped)" if m == "capt" else "") if c["seed"] is not None else ""
        return f"{m}{seed}: {counts_text(c['counts'])}"
    return (f"What each method answered on the {n_test} test examples, gold label (how many) → predicted labels"
            f"{' (several seeds: the seed best on dev)' if any(c['seed'] is not None for c in counts.values()) else ''}"
            ". " + ". ".join(one(m, c) for m, c in counts.items()) + ".")


def seed_runs(summaries: dict) -> dict:
    """A compare of several seeds: each trained method's seeds, from its summary.json (`summaries`, by method)."""
    return {m: [_seed_entry(r) for r in s["runs"]] for m, s in summaries.items() if m in TRAINABLE and s.get("runs")}


def _n_above(runs: list[dict], ref: dict, key: str) -> int:
    """How many seeds score strictly above a training-free reference's row on metric `key`."""
    return sum(r["test"][key] > ref["test_" + key] for r in runs)


def _per_seed_table(per_seed: dict, rows: list[dict], primary: str) -> str:
    """A compare of several seeds: every trained method's test score on each seed, and how many of its seeds
    beat each training-free reference (the table above gives only mean ± std)."""
    key = primary[5:]
    first = next(iter(per_seed.values()))
    metrics = [key] + [k for k in first[0]["test"] if k != key]
    refs = [r for r in rows if r["method"] not in TRAINABLE]
    n = len(first)
    lines = ["| method | metric | " + " | ".join(f"seed {r['seed']}" for r in first) + " | "
             + " | ".join(f"seeds above {_ref_name(r)}" for r in refs) + " |",
             "|---|---|" + "---:|" * (n + len(refs))]
    for m, runs in per_seed.items():
        for k in metrics:
            lines.append(f"| {m} | {k} | " + " | ".join(_pct(r["test"][k]) for r in runs) + " | " + " | ".join(
                f"{_n_above(runs, ref, k)} of {n} ({_pct(ref['test_' + k])})"
                for ref in refs) + " |")
    steps = "; ".join(f"{m} {', '.join(str(r['best_step']) for r in runs)}" for m, runs in per_seed.items())
    return ("Each seed on its own (test, percent; the table above gives their mean ± std):\n\n"
            + "\n".join(lines) + f"\n\nBest dev at steps: {steps}.\n\n")


def _scores(runs: list[dict], mean: dict, metrics: list[str]) -> str:
    """Every seed's test score on each metric, then the mean ± std: 'accuracy 52.7, 52.3, 57.0, mean 54.0 ± 2.1'."""
    return "; ".join(f"{k} {', '.join(_pct(r['test'][k]) for r in runs)}, mean {percent(mean, k)}" for k in metrics)


def _above(runs: list[dict], rows: list[dict], key: str) -> str:
    """How many seeds beat each training-free reference on `key`: '1 of 3 above zero-shot's 55.6, ...'."""
    return ", ".join(f"{_n_above(runs, ref, key)} of {len(runs)} above "
                     f"{_ref_name(ref)}'s {_pct(ref['test_' + key])}"
                     for ref in rows if ref["method"] not in TRAINABLE)


def _seeds_run_note(rec: dict, rows: list[dict], primary: str) -> str:
    """The card's line for a seeds run: every seed's score, the mean, how many seeds pass each reference."""
    key = primary[5:]
    metrics = [key] + [k for k in rec["runs"][0]["test"] if k != key]
    scores = _scores(rec["runs"], rec["test"], metrics)
    refs = "; ".join(f"on {k}, " + _above(rec["runs"], rows, k) for k in dict.fromkeys([key, "accuracy"]) if k in metrics)
    commit = f", commit {rec['commit'][:7]}" if rec.get("commit") else ""
    repro = {True: f" Seed {rec['shipped_seed']} reproduced the shipped capsule bit for bit.",
             False: f" Seed {rec['shipped_seed']} trained a capsule that differs from the shipped one in its bits "
                    "(other code or thread count).", None: ""}[rec["reproduces_shipped"]]
    return (f"Seeds {', '.join(map(str, rec['seeds']))}, CaPT alone, same settings "
            f"({shown_command(rec['command'])}{commit}): "
            f"test {scores} (best dev at steps {', '.join(str(r['best_step']) for r in rec['runs'])}); "
            f"{refs}.{repro} The table above compares methods on seed {rec['shipped_seed']}; the README's "
            "seeds column is this mean.")


# compare options that may differ between a shipped one-seed compare and its baselines' seeds run
BASELINE_SEEDS_HINT = ("give a shipped card's folder and the --out folder of "
                       "`python -m train compare --methods linear-head p-tuning-v2 --seeds 1 2 ...`")
FREE_IN_A_SEEDS_RUN = ("methods", "seeds", "out", "resume", "quiet")


def _compare_args(command: str, where: str) -> argparse.Namespace:
    """A recorded `python -m train compare ...` command, parsed by the CLI's own parser."""
    from train.__main__ import parser

    words = shlex.split(command or "")
    if words[:4] != ["python", "-m", "train", "compare"]:
        raise CaptError(f"{where} records no `python -m train compare` command (got {command!r})")
    try:
        return parser(True).parse_args(words[4:])
    except SystemExit:
        raise CaptError(f"{where}: its recorded command does not parse: {command!r}") from None


def baseline_seeds_record(results: dict, shipped: Path, seeds_dir: Path) -> dict:
    """A `python -m train compare --methods <baselines> --seeds ... --out SEEDS_DIR` run, checked to have the
    settings of the shipped card's one-seed compare (both recorded commands parsed alike; only methods, seeds,
    out, resume and quiet may differ), as results.json keeps it ("baseline_seeds"): per method, every seed's
    test metrics (the compare's own seed first, from its row) and the mean ± std over all of them. `results`
    is the shipped card's results.json."""
    new = _read_json(seeds_dir / "compare.json", BASELINE_SEEDS_HINT)
    if results.get("baseline_seeds"):
        raise CaptError(f"{shipped} already has baselines' seeds ({results['baseline_seeds']['command']})")
    ours = _compare_args(results.get("command"), f"{shipped}/results.json")
    theirs = _compare_args(new.get("command"), f"{seeds_dir}/compare.json")
    if len(ours.seeds) != 1:
        raise CaptError(f"the compare of {shipped} already has seeds {ours.seeds}: its table gives their mean")
    rows = {r["method"]: r for r in results["rows"]}
    baselines = [m for m in rows if m in TRAINABLE and m != "capt"]
    bad = [r["method"] for r in new["rows"] if r["method"] not in baselines]
    if bad:
        raise CaptError(f"{seeds_dir} ran {', '.join(bad)}: it may hold only the compare's trained baselines "
                        f"({', '.join(baselines)}); CaPT's seeds go in with --seeds when the card is written")
    if ours.seeds[0] in theirs.seeds:
        raise CaptError(f"{seeds_dir} ran seed {ours.seeds[0]}, the compare's own: give the other seeds")
    diff = [k for k in vars(ours) if k not in FREE_IN_A_SEEDS_RUN and getattr(ours, k) != getattr(theirs, k)]
    if diff:
        raise CaptError(f"{seeds_dir} was not run like the compare of {shipped}: "
                        + ", ".join(f"{k} {getattr(theirs, k)!r} there, {getattr(ours, k)!r} in the compare"
                                    for k in diff))
    methods, code = {}, None
    for r in new["rows"]:
        s = _read_json(seeds_dir / r["method"] / "summary.json",
                       f"{seeds_dir}/compare.json lists {r['method']}, but its run is gone")
        runs = s.get("runs") or [s]
        code = code or runs[0].get("code") or {}
        row = rows[r["method"]]
        entries = [{"seed": ours.seeds[0], "test": {k[5:]: row[k] for k in compare_metric_keys(row)}}]
        entries += [_seed_entry(x) for x in runs]
        methods[r["method"]] = {"runs": entries, "test": seeds_mean_std([e["test"] for e in entries]),
                                "train_seconds": s["train_seconds"]}
    return {"command": new["command"], "seeds": [ours.seeds[0], *theirs.seeds], "commit": code.get("commit"),
            "machine": code.get("machine"), "torch": code.get("torch"), "methods": methods}


def _baseline_seeds_note(rec: dict, rows: list[dict], primary: str) -> str:
    """The card's line for the baselines' added seeds: every seed's score, the mean, how many pass each reference."""
    key = primary[5:]
    n = len(rec["seeds"])
    parts = []
    for m, mr in rec["methods"].items():
        metrics = [key] + [k for k in mr["runs"][0]["test"] if k != key]
        scores = _scores(mr["runs"], mr["test"], metrics)
        above = _above(mr["runs"], rows, key)
        parts.append(f"{m}: {scores} (best dev at steps {', '.join(str(r['best_step']) for r in mr['runs'][1:])}"
                     f"{'; ' + above if above else ''}; the added seeds trained in {mr['train_seconds']:,.0f} s)")
    commit = f", commit {rec['commit'][:7]}" if rec.get("commit") else ""
    where = f" on {_machine({'code': {'machine': rec['machine'], 'torch': rec['torch']}})}" if rec.get("machine") else ""
    added = ", ".join(map(str, rec["seeds"][1:]))
    return (f"Baselines, seeds {', '.join(map(str, rec['seeds']))}: seed {rec['seeds'][0]} is the table above; seeds "
            f"{added} were added by the same compare for the baselines alone "
            f"({shown_command(rec['command'])}{commit}{where}). "
            f"Test, seeds in that order: {'. '.join(parts)}. The README table gives these means, marked ({n}).")


def add_baseline_seeds(shipped: Path, seeds_dir: Path) -> dict:
    """Amend a shipped card (README.md and results.json, replaced together) with a baselines' seeds run."""
    results = _read_json(shipped / "results.json", BASELINE_SEEDS_HINT)
    rec = baseline_seeds_record(results, shipped, seeds_dir)
    text = (shipped / "README.md").read_text()
    if CARD_TAIL not in text:
        raise CaptError(f"{shipped}/README.md was not written by train.card (no '{CARD_TAIL.strip()}' line)")
    note = _baseline_seeds_note(rec, results["rows"], _primary(results["rows"][0]))
    with atomic_folder(shipped) as tmp:
        for f in shipped.iterdir():
            if f.is_file():
                shutil.copy(f, tmp / f.name)
        (tmp / "README.md").write_text(text.replace(CARD_TAIL, f"\n- {note}" + CARD_TAIL, 1))
        (tmp / "results.json").write_text(json.dumps({**results, "baseline_seeds": rec}, indent=2) + "\n")
    return rec


def _steps(steps) -> str:
    """A run's step count, or each seed's when they differ (early stopping)."""
    if isinstance(steps, list):
        return str(steps[0]) if len(set(steps)) == 1 else "/".join(map(str, steps))
    return "-" if steps is None else str(steps)


def _seeds(summary: dict, primary: str) -> str:
    """With several seeds: which one is shipped and what it scored alone."""
    if not summary.get("seeds"):
        return ""
    key = primary[5:]
    return (f"\n- Seeds {', '.join(map(str, summary['seeds']))} trained alike; shipped: seed {summary['config']['seed']}, "
            f"the best on dev ({_pct(summary['dev'][key])}), which scored {_pct(summary['test'][key])} on test "
            f"(mean over the seeds {_pct(summary['test_mean'][key])}, the number in the table).")


def _code(summary: dict) -> str:
    """The code that trained it (runs made before summaries recorded it have no line); for a run resumed at
    other commits ("trained_on"), which steps ran at which."""
    code = summary.get("code")
    if not code:
        return ""
    parts = _parts(summary, lambda c: _commit(c) if c else "a commit its checkpoint did not record")
    if len(parts) < 2:
        return (f"\n- Code: capt {code['capt']} ({_commit(code)}), transformers {code['transformers']}, torch "
                f"threads: {code['threads']}. " + REPRODUCE)
    where = ", ".join(f"steps {step}-{end} at {at}" for step, end, _, _, at in parts)
    return (f"\n- Code: capt {code['capt']} ({where}: resumed from checkpoints, which continue the same batches and "
            f"optimizer state), transformers {code['transformers']}, torch threads: {code['threads']}. "
            + REPRODUCE_PARTS)


def _commit(code: dict) -> str:
    if not code.get("commit"):
        return "outside a git checkout"
    return f"commit {code['commit'][:10]}" + (" with uncommitted edits to capt/ or train/" if code["dirty"] else "")


# What a card promises about rerunning its command (README, Train: a COPA capsule rerun at the same commit on
# an AVX2 machine came out different in its bits, and scored 63.0 on test against the shipped 60.0).
REPRODUCE = ("Rerunning the command with this code and thread count on the same kind of CPU gives this capsule bit "
             "for bit; other code or another CPU (other vector instructions) may round differently and, over many "
             "steps, train a different capsule.")
REPRODUCE_PARTS = ("Rerunning the command in the same parts at the same commits, with this thread count on the same kind "
                   "of CPU, gives this capsule bit for bit; other code or another CPU (other vector instructions) may "
                   "round differently and, over many steps, train a different capsule.")


def _machine(summary: dict) -> str:
    """The machine that trained, as summary.json recorded it (runs from before it did: the one writing the card,
    which for every shipped card was the one that trained)."""
    code = summary.get("code") or {}
    m = code.get("machine")
    if not m:
        return f"{os.cpu_count()} CPU cores ({platform.machine()}), torch {torch.__version__}" + (
            ", CUDA" if torch.cuda.is_available() else ", no GPU")
    return (f"{m['cores']} CPU cores ({m['cpu']}, {m['isa']}), torch {code['torch']}"
            + (f", GPU {m['gpu']}" if m["gpu"] else ", no GPU"))


def _where_trained(summary: dict) -> str:
    """`_machine`, or for a run resumed on another machine or torch ("trained_on": each part's first step, seconds so far
    and code) which steps and seconds ran where."""
    parts = _parts(summary, lambda c: _machine({"code": c}) if c else "a machine its checkpoint did not record")
    if len(parts) < 2:
        return _machine(summary)
    return f"{len(parts)} set-ups in turn (resumed from checkpoints): " + "; ".join(
        f"steps {step}-{end} ({end_s - sec:.0f} s) on {where}" for step, end, sec, end_s, where in parts)


def _parts(summary: dict, describe) -> list[tuple]:
    """The summary's "trained_on" legs as (first step, end step, seconds at start, seconds at end, describe(code)),
    consecutive legs that describe alike merged into one."""
    parts = []
    for seg in summary.get("trained_on") or []:
        where = describe(seg["code"])
        if not parts or parts[-1][2] != where:
            parts.append((seg["from_step"], seg.get("from_seconds", 0.0), where))
    if not parts:
        return []
    ends = [(step, sec) for step, sec, _ in parts[1:]] + [(summary["steps"], summary.get("train_seconds"))]
    return [(step, end, sec, end_s, where) for (step, sec, where), (end, end_s) in zip(parts, ends)]


def results_table(folder: Path) -> str:
    """One Markdown table across the shipped capsules under `folder` (capsules/<backbone>): the main
    test metric of every method per task, read from each capsule's results.json."""
    runs = sorted(p.parent for p in Path(folder).glob("*/results.json"))
    if not runs:
        return f"(no shipped capsules with results.json under {folder})"
    methods = ["capt", "zero-shot", "majority", "linear-head", "p-tuning-v2"]
    lines = ["| task | metric | " + " | ".join(methods[:1] + ["capt, seeds"] + methods[1:])
             + " | budget per method | CaPT training |", "|" + "---|" * (len(methods) + 5)]
    for run in runs:
        compare = json.loads((run / "results.json").read_text())
        rows = {r["method"]: r for r in compare["rows"]}
        metric = _primary(rows["capt"])[5:]
        cells = [_method_cell(compare, rows, m, metric) for m in methods]
        cells.insert(1, _seeds_cell(compare, rows["capt"], metric))
        minutes = rows["capt"]["train_seconds"] / 60
        lines.append(f"| {compare['task']} | {metric} | " + " | ".join(cells) + f" | {_budget(compare)} | "
                     f"{minutes:.0f} min |")
    return "\n".join(lines)


def _budget(compare: dict) -> str:
    """A compare's budget per method, from its command: '100 steps', '12 min', or, with neither cap, the
    paper's protocol: 'early stopping, ≤ 50 epochs'."""
    command = compare.get("command", "")
    cap = re.search(r"--max-(steps|minutes) (\S+)", command)
    if cap:
        return f"{cap.group(2)} {'steps' if cap.group(1) == 'steps' else 'min'}"
    epochs = re.search(r"--epochs (\d+)", command)
    return f"early stopping, ≤ {epochs.group(1) if epochs else TrainConfig.epochs} epochs"


def _method_cell(compare: dict, rows: dict, method: str, metric: str) -> str:
    """A method's cell: its compare row (mean ± std when the compare had seeds), or, for a baseline whose
    seeds were added with --baseline-seeds, the mean ± std over them (how many)."""
    added = (compare.get("baseline_seeds") or {}).get("methods", {}).get(method)
    if added:
        return f"{percent(added['test'], metric)} ({len(added['runs'])})"
    return metric_cell(rows[method], "test_" + metric) if method in rows else "-"


def _seeds_cell(compare: dict, row: dict, metric: str) -> str:
    """CaPT's mean ± std over seeds (how many): the compare's own seeds (`row`, its capt row), else its seeds
    run's, else '-'."""
    rec = compare.get("capt_seeds")
    seeds = re.search(r"--seeds((?: \d+)+)", compare.get("command", ""))
    if row.get(f"test_{metric}_std") is not None and seeds:
        return f"{metric_cell(row, 'test_' + metric)} ({len(seeds.group(1).split())})"
    if rec:
        return f"{percent(rec['test'], metric)} ({len(rec['seeds'])})"
    return "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.card", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="the --out folder of a `python -m train compare` run that included capt (or of a "
                               "`python -m train.lm` run), or "
                               "with --table a folder of shipped capsules (capsules/<backbone>)")
    p.add_argument("--to", help="the shipped capsule folder to write")
    p.add_argument("--table", action="store_true", help="print the cross-task results table instead")
    p.add_argument("--note", action="append", default=[], help="a note for the card (repeatable), e.g. what "
                                                                "else was tried")
    p.add_argument("--seeds", metavar="SEEDS_RUN", help="the --out folder of `python -m train --seeds 0 1 2 ...`, "
                   "CaPT alone with the compare's settings: every seed's score goes into the card and its mean "
                   "into the README table's seeds column (for a compare of one seed)")
    p.add_argument("--baseline-seeds", metavar="SEEDS_RUN", help="amend the shipped card RUN (a capsule folder written "
                   "by train.card from a one-seed compare) with the --out folder of `python -m train compare --methods "
                   "linear-head p-tuning-v2 --seeds 1 2 ...` at the compare's settings")
    args = p.parse_args(argv)
    if args.table:
        print(results_table(Path(args.run)))
        return 0
    if args.baseline_seeds:
        if args.to or args.seeds or args.note:
            p.error("--baseline-seeds amends the shipped card given as RUN; it takes no --to, --seeds or --note")
        try:
            rec = add_baseline_seeds(Path(args.run), Path(args.baseline_seeds))
        except CaptError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"added seeds {', '.join(map(str, rec['seeds'][1:]))} of {', '.join(rec['methods'])} to {args.run}")
        return 0
    if not args.to:
        p.error("--to is required unless --table is given")
    run = Path(args.run)
    if not (run / "compare.json").exists() and (run / "summary.json").exists():   # a free-text run (train.lm)
        if args.seeds:
            p.error("--seeds adds a classification task's seeds to a compare run's card; RUN is a free-text run")
        return write_lm_card(run, Path(args.to), args.note)
    try:
        compare = json.loads((run / "compare.json").read_text())
        summary = json.loads((run / "capt" / "summary.json").read_text())
    except FileNotFoundError as e:
        print(f"error: {e.filename} is missing: give the --out folder of a compare run that included capt",
              file=sys.stderr)
        return 2
    command = compare.get("command", "(command not recorded)")
    try:
        seeds_run = seeds_record(Path(args.seeds), run, summary) if args.seeds else None
    except CaptError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if seeds_run:
        compare = {**compare, "capt_seeds": seeds_run}
    summaries = {r["method"]: summary if r["method"] == "capt" else json.loads(path.read_text())
                 for r in compare["rows"] if (path := run / r["method"] / "summary.json").exists()}
    if summary.get("seeds"):   # a compare of several seeds: keep every seed of every trained method
        compare = {**compare, "seed_runs": seed_runs(summaries)}
    steps = {m: s.get("steps") for m, s in summaries.items()}
    counts = answer_counts(summaries)
    if counts:
        compare = {**compare, "test_counts": counts}
    target = Path(args.to)
    with atomic_folder(target) as tmp:
        for f in (run / "capt" / "capsule").iterdir():
            shutil.copy(f, tmp / f.name)
        (tmp / "README.md").write_text(card_text(compare, summary, command, steps, args.note, seeds_run, counts))
        (tmp / "results.json").write_text(json.dumps(compare, indent=2) + "\n")
    print(f"wrote {target}")
    return 0


def write_lm_card(run: Path, target: Path, notes: list) -> int:
    """RUN/capsule and its card into TARGET, for a `python -m train.lm --out RUN` run."""
    summary = json.loads((run / "summary.json").read_text())
    if "bare_dev_loss" not in summary:
        print(f"error: {run / 'summary.json'} is neither a compare run's (no compare.json beside it) nor a "
              "`python -m train.lm` run's", file=sys.stderr)
        return 2
    if "settings" not in summary:
        print(f"error: {run / 'summary.json'} predates runs recording their settings (batch, lr, seed); rerun its "
              f"command: {summary.get('command')}", file=sys.stderr)
        return 2
    with atomic_folder(target) as tmp:
        for f in (run / "capsule").iterdir():
            shutil.copy(f, tmp / f.name)
        shown = target.resolve().relative_to(ROOT) if target.resolve().is_relative_to(ROOT) else target
        (tmp / "README.md").write_text(lm_card_text(summary, shown.as_posix(), notes))
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
