"""capt.lm: a capsule trained with the backbone's language-modelling loss, in a plain loop or transformers' Trainer."""
import re

import pytest
import torch

import capt
from capt.lm import CapsuleLM, lm_loss, prompt_mask
from capt.scoring import pad
from capt.tasks import Rendered
from conftest import ARCHS, OPTIONS, random_capsule, tiny

WORDS = ["cat", "dog", "sun", "tree", "sea", "sky", "hat", "cup", "pen", "box"]
PAIRS = [("the cat sat on the", " mat by the door"), ("a much longer prompt about dogs and the cats of", " town")]
DECODERS = [a for a in ARCHS if a != "tiny-t5"]
LM_OPTIONS = {k: v for k, v in OPTIONS.items() if k != "linear"}


def batch(bb, pairs, side="right"):
    """input_ids, attention_mask, labels for prompt + answer pairs: decoder-only, the answer scored in place;
    T5: the prompt into the encoder, the answer as the tokenizer gives it (as capt.score does) as the target."""
    tok = bb.tokenizer
    if bb.encoder_decoder:
        ids, mask = pad([tok(p)["input_ids"] for p, _ in pairs], tok.pad_token_id)
        tgt, tmask = pad([tok(a)["input_ids"] for _, a in pairs], tok.pad_token_id)
        return ids, mask, tgt.masked_fill(tmask == 0, -100)
    seqs = [(tok(p)["input_ids"], tok(a, add_special_tokens=False)["input_ids"]) for p, a in pairs]
    ids, mask = pad([p + a for p, a in seqs], tok.pad_token_id, side)
    labels = torch.full_like(ids, -100)
    for i, (p, a) in enumerate(seqs):
        end = ids.shape[1] if side == "left" else len(p) + len(a)
        labels[i, end - len(a):end] = torch.tensor(a)
    return ids, mask, labels


@pytest.mark.parametrize("arch", ARCHS)
def test_without_a_capsule_it_is_the_backbones_own_loss(arch):
    bb = tiny(arch)
    ids, mask, labels = batch(bb, PAIRS)
    ours = lm_loss(bb, None, ids, mask, labels)
    with torch.no_grad():
        theirs = bb.model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert ours.loss.item() == pytest.approx(theirs.item(), rel=1e-5)
    assert ours.n_scored == int((labels != -100).sum())


@pytest.mark.parametrize("option", LM_OPTIONS)
@pytest.mark.parametrize("arch", ARCHS)
def test_the_loss_is_the_answers_log_probability_as_classification_scores_it(arch, option):
    """Per token, lm_loss on prompt + answer is minus capt.score's log-probability of the answer as a label
    continuation (an independent path: its instance mean over the prompt alone), batched and padded on either
    side; and with return_logits the same loss."""
    bb = tiny(arch)
    capsule = random_capsule(bb, **LM_OPTIONS[option])
    for side in ("right",) if bb.encoder_decoder else ("right", "left"):
        ids, mask, labels = batch(bb, PAIRS, side)
        out = lm_loss(bb, capsule, ids, mask, labels)
        with torch.no_grad():
            logp = torch.cat([capt.score(bb, capsule, [Rendered(p, (a,), 0)]).logits[0] for p, a in PAIRS])
        assert out.loss.item() == pytest.approx(-logp.sum().item() / out.n_scored, rel=1e-4, abs=1e-6), side
        full = lm_loss(bb, capsule, ids, mask, labels, return_logits=True)
        assert full.loss.item() == pytest.approx(out.loss.item(), rel=1e-5)
        assert full.logits.shape[:2] == labels.shape


@pytest.mark.parametrize("arch", DECODERS)
def test_no_prediction_sees_the_token_it_predicts(arch):
    """Position t's logits do not change when any token after t changes: the capsule in front of every token
    reads the prompt alone. An instance mask that reaches the answer is refused, as it would leak it."""
    bb = tiny(arch)
    capsule = random_capsule(bb)
    ids, mask, labels = batch(bb, PAIRS[:1])
    ref = lm_loss(bb, capsule, ids, mask, labels, return_logits=True).logits
    answer = (labels[0] != -100).nonzero()[:, 0].tolist()
    for q in answer:
        changed = ids.clone()
        changed[0, q] = (changed[0, q] + 7) % bb.model.config.vocab_size
        logits = lm_loss(bb, capsule, changed, mask, labels, return_logits=True).logits
        assert torch.equal(logits[0, :q], ref[0, :q]), q
        assert not torch.equal(logits[0, q:], ref[0, q:])
    with pytest.raises(capt.CaptError, match="reaches a scored token in row"):
        lm_loss(bb, capsule, ids, mask, labels, instance_mask=mask)
    assert prompt_mask(labels, mask)[0].tolist() == [i < answer[0] for i in range(ids.shape[1])]


@pytest.mark.parametrize("option", ["default", "prepend", "inplace", "odd"])
@pytest.mark.parametrize("arch", ARCHS)
def test_what_it_trains_is_what_generate_continues(arch, option):
    """Teacher-forced on capt.generate's own greedy continuation, the loss's logits pick that continuation
    token for token: training and generation give the capsule the same instance mean (the prompt's)."""
    bb = tiny(arch)
    capsule = random_capsule(bb, **LM_OPTIONS[option])
    prompt = PAIRS[1][0]
    new = capt.generate(bb, prompt, capsule=capsule, max_new_tokens=4, min_new_tokens=4).token_ids
    tok = bb.tokenizer
    if bb.encoder_decoder:
        ids, target = torch.tensor([tok(prompt)["input_ids"]]), torch.tensor([new])
    else:
        p = tok(prompt)["input_ids"]
        ids = torch.tensor([p + new])
        target = torch.tensor([[-100] * len(p) + new])
    logits = lm_loss(bb, capsule, ids, torch.ones_like(ids), target, return_logits=True).logits[0]
    picked = logits.argmax(-1).tolist()
    assert (picked if bb.encoder_decoder else picked[len(ids[0]) - len(new) - 1:-1]) == new


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-t5"])
def test_gradients_reach_the_capsule_only(arch):
    bb = tiny(arch)
    capsule = random_capsule(bb)
    lm_loss(bb, capsule, *batch(bb, PAIRS)).loss.backward()
    assert capsule.weight.grad is not None and capsule.weight.grad.abs().sum() > 0
    assert all(p.grad is None and not p.requires_grad for p in bb.model.parameters())


def test_bad_input_is_refused_with_what_is_valid():
    bb = tiny("tiny-llama")
    ids, mask, labels = batch(bb, PAIRS)
    cases = [
        (dict(labels=None), "labels are needed"),
        (dict(labels=torch.full_like(labels, -100)), "no token to learn"),
        (dict(labels=labels[:, :-1]), "labels must have input_ids' shape"),
        (dict(attention_mask=mask[:, :-1]), "attention_mask .* must have input_ids' shape"),
        (dict(input_ids=ids[0]), r"input_ids must be a \(batch, length\) tensor"),
        (dict(instance_mask=mask[:, 1:]), "instance_mask .* must have input_ids' shape"),
        (dict(capsule=random_capsule(bb, head="linear")), "head='verbalizer'"),
        (dict(input_ids=ids.repeat(1, 200), attention_mask=mask.repeat(1, 200), labels=labels.repeat(1, 200)),
         "exceed the backbone's limit"),
    ]
    for change, message in cases:
        args = {**dict(capsule=random_capsule(bb), input_ids=ids, attention_mask=mask, labels=labels), **change}
        with pytest.raises(capt.CaptError, match=message):
            lm_loss(bb, **args)
    first_only = torch.full_like(labels, -100)
    first_only[:, 0] = ids[:, 0]                    # a row's first token: nothing before it to predict it
    with pytest.raises(capt.CaptError, match="no token to learn"):
        lm_loss(bb, None, ids, mask, first_only)


def test_transformers_trainer_trains_the_capsule_alone(tmp_path):
    """CapsuleLM under transformers' Trainer: a few dozen steps on a task the capsule can learn (answer the
    prompt's first word, which random prompts make impossible without it) lower the loss; only the capsule
    is trained and checkpointed; saved as a capsule folder it loads and gives the same loss."""
    from transformers import Trainer, TrainingArguments

    bb = tiny("tiny-llama")
    g = torch.Generator().manual_seed(0)
    words = ["cat", "dog", "sun", "tree"]
    pairs = [(" ".join(words[i] for i in torch.randint(4, (6,), generator=g).tolist()), " the end")
             for _ in range(32)]
    ids, mask, labels = batch(bb, pairs)
    data = [dict(input_ids=ids[i], attention_mask=mask[i], labels=labels[i]) for i in range(len(pairs))]
    model = CapsuleLM(bb, seed=0)
    assert [n for n, _ in model.named_parameters()] == ["capsule.weight"]
    before = lm_loss(bb, model.capsule, ids, mask, labels).loss.item()
    args = TrainingArguments(output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=8, max_steps=24,
                             learning_rate=3e-2, lr_scheduler_type="constant", report_to=[], use_cpu=True,
                             save_strategy="no", logging_steps=4, seed=0, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=data).train()
    after = lm_loss(bb, model.capsule, ids, mask, labels).loss.item()
    assert after < 0.9 * before, (before, after)
    assert list(model.state_dict()) == ["capsule.weight"]
    folder = model.save(tmp_path / "lm-capsule")
    loaded, task = capt.load_capsule(folder, bb)
    assert task is None and lm_loss(bb, loaded, ids, mask, labels).loss.item() == pytest.approx(after, rel=1e-6)
    assert model.generate(pairs[0][0], max_new_tokens=3) == capt.generate(bb, pairs[0][0], loaded, max_new_tokens=3)


def test_the_lm_cli_trains_keeps_the_best_dev_loss_and_resumes(tmp_path, capsys):
    """`python -m train.lm`: prompt/completion rows -> a capsule folder and a summary (Trainer underneath, dev
    loss picks the capsule); --resume goes on from the last checkpoint; bad input is a message, exit 2."""
    import json

    from capt.lm_training import Collator, encode, split
    from train.lm import main

    g = torch.Generator().manual_seed(0)
    words = ["cat", "dog", "sun", "tree"]
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"q": " ".join(words[i] for i in torch.randint(4, (5,), generator=g).tolist()),
                                        "a": " the end"}) + "\n" for _ in range(20)))
    out = tmp_path / "run"
    common = ["--data-file", str(data), "--prompt-field", "q", "--completion-field", "a", "--backbone", "tiny-llama",
              "--eval-every", "3", "--batch-size", "4", "--out", str(out)]
    assert main(common + ["--max-steps", "6"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["steps"], summary["n_train"], summary["n_dev"], summary["n_prompts_cut"]) == (6, 18, 2, 0)
    assert sorted(summary["dev_losses"]) == ["3", "6"]
    assert summary["best_dev_loss"] == min(summary["dev_losses"].values())
    bb = tiny("tiny-llama")
    capsule, task = capt.load_capsule(out / "capsule", bb)
    assert task is None and capsule.meta["training"]["best_step"] == summary["best_step"]
    rows = [encode(bb, 1, r["q"], r["a"]) for r in map(json.loads, data.read_text().splitlines())]
    dev = Collator(bb.tokenizer.pad_token_id)(split(rows, 0)[1])   # one eval batch: Trainer's eval_loss is its loss
    with torch.no_grad():   # the capsule kept is the one with the best dev loss
        assert lm_loss(bb, capsule, **dev).loss.item() == pytest.approx(summary["best_dev_loss"], rel=1e-5)
    assert main(common + ["--max-steps", "6"]) == 2   # the folder holds a run
    assert "already holds a run" in capsys.readouterr().err
    assert summary["trained_on"] == [{"from_step": 0, "code": summary["code"]}]
    kept = json.loads((out / "trainer" / "checkpoint-6" / "capt_legs.json").read_text())   # what resuming reads
    assert kept["seconds"] > 0 and kept["trained_on"] == summary["trained_on"]
    assert kept["bare_dev_loss"] == summary["bare_dev_loss"]   # measured once; a resumed leg reads it back:
    (out / "trainer" / "checkpoint-6" / "capt_legs.json").write_text(json.dumps({**kept, "bare_dev_loss": 123.0}))
    assert main(common + ["--max-steps", "9", "--resume"]) == 0
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["bare_dev_loss"] == 123.0   # read, not measured again (the planted value shows it)
    assert resumed["steps"] == 9 and sorted(resumed["dev_losses"]) == ["3", "6", "9"]   # Trainer's log goes on
    first, then = resumed["trained_on"]   # every leg: the first run's seconds carried over from its checkpoint
    assert (first["from_step"], then["from_step"]) == (0, 6) and first == summary["trained_on"][0]
    assert then["from_seconds"] == round(kept["seconds"], 1) <= resumed["train_seconds"]
    (out / "trainer" / "checkpoint-9" / "capt_legs.json").unlink()   # a checkpoint that predates the file
    assert main(common + ["--max-steps", "10", "--resume"]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["trained_on"] == [
        {"from_step": 0, "code": None}, {"from_step": 9, "from_seconds": 0.0, "code": summary["code"]}]
    assert again["bare_dev_loss"] == pytest.approx(summary["bare_dev_loss"], rel=1e-6)   # nothing kept: measured
    legs = out / "trainer" / "checkpoint-10" / "capt_legs.json"   # kept for other dev rows: measured, not read
    legs.write_text(json.dumps({**json.loads(legs.read_text()), "bare_dev_loss": 123.0, "dev_digest": "other rows"}))
    assert main(common + ["--max-steps", "11", "--resume"]) == 0
    assert json.loads((out / "summary.json").read_text())["bare_dev_loss"] == pytest.approx(summary["bare_dev_loss"],
                                                                                          rel=1e-6)
    assert main(common[:-1] + [str(tmp_path / "none"), "--max-steps", "3", "--resume"]) == 2
    assert "--resume: no checkpoint in" in capsys.readouterr().err
    with data.open("a") as f:   # a prompt over the model's limit: cut, counted and said
        f.write(json.dumps({"q": "word " * 2 * bb.max_length, "a": " the end"}) + "\n")
    assert main(common[:-1] + [str(tmp_path / "long"), "--max-steps", "1"]) == 0
    assert json.loads((tmp_path / "long" / "summary.json").read_text())["n_prompts_cut"] == 1
    assert "1 prompt(s) cut at the start to fit tiny-llama's 512 tokens" in capsys.readouterr().err
    held_out = tmp_path / "test.jsonl"
    held_out.write_text(json.dumps({"q": "cat dog sun", "a": " the end"}) + "\n")   # one row is a test split
    assert main(common[:-1] + [str(tmp_path / "tested"), "--max-steps", "1", "--test-file", str(held_out)]) == 0
    tested = json.loads((tmp_path / "tested" / "summary.json").read_text())
    assert tested["n_test"] == 1 and re.search(r"; test loss \d+\.\d{4}, the backbone alone \d+\.\d{4} on 1 test row\(s\)",
                                               capsys.readouterr().err)
    for change, message in [(["--completion-field", "answer"], r"lacks columns \['answer'\]"),
                            (["--lr", "0"], "out of range: --lr 0.0"),
                            (["--max-steps", "0"], "out of range: --max-steps 0")]:
        assert main(common[:-1] + [str(tmp_path / "other")] + change) == 2
        assert re.search(message, capsys.readouterr().err), change


def test_a_free_text_run_ships_with_its_card(tmp_path, capsys):
    """`python -m train.card RUN --to FOLDER` on a `python -m train.lm` run: the capsule (task-less, loadable)
    and a card whose command, settings, machine and every dev loss are the run's own; the cross-task table
    passes it over; a summary of neither kind, or one from before runs recorded their settings, is refused."""
    import json

    from train.card import main as card
    from train.lm import main

    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"q": f"say {w}{i}:", "a": f" {w} {w}"}) + "\n" for i in range(2) for w in WORDS))
    run = tmp_path / "run"
    assert main(["--data-file", str(data), "--prompt-field", "q", "--completion-field", "a", "--backbone",
                 "tiny-llama", "--max-steps", "4", "--eval-every", "2", "--batch-size", "4", "--lr", "0.01",
                 "--out", str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    shipped = tmp_path / "capsules" / "tiny-llama" / "qa"
    assert card([str(run), "--to", str(shipped), "--note", "made for a test"]) == 0
    assert sorted(p.name for p in shipped.iterdir()) == ["README.md", "capsule.json", "capsule.safetensors"]
    capsule, task = capt.load_capsule(shipped, tiny("tiny-llama"))
    assert task is None and capsule.meta["training"]["best_dev_loss"] == summary["best_dev_loss"]
    text = (shipped / "README.md").read_text()
    flat = " ".join(text.split())   # the card's prose is wrapped
    assert summary["command"] in text and "python -m train.lm --data-file" in text
    assert f"{summary['n_train']} train and {summary['n_dev']} dev rows" in flat
    assert "batch 4, AdamW lr 0.01 (constant), a dev evaluation every 2 steps, patience 10, seed 0, float32" in flat
    assert f"| the backbone alone | {summary['bare_dev_loss']:.3f} |" in text
    best = summary["best_step"]
    for step, loss in summary["dev_losses"].items():
        assert f"| step {step}{' (kept)' * (int(step) == best)} | {loss:.3f} |" in text
    m = summary["code"]["machine"]
    assert f"s of training on {m['cores']} CPU cores ({m['cpu']}, {m['isa']})" in flat and "- made for a test" in text
    assert "No test rows were given" in flat
    capsys.readouterr()
    assert card([str(tmp_path / "capsules" / "tiny-llama"), "--table"]) == 0
    assert "no shipped capsules with results.json" in capsys.readouterr().out   # a free-text capsule has no row
    with pytest.raises(SystemExit):   # argparse: exit 2 with the reason
        card([str(run), "--to", str(tmp_path / "other"), "--seeds", str(run)])
    assert "RUN is a free-text run" in capsys.readouterr().err
    old = dict(summary)
    del old["settings"]
    (run / "summary.json").write_text(json.dumps(old))
    assert card([str(run), "--to", str(tmp_path / "other")]) == 2
    assert "predates runs recording their settings" in capsys.readouterr().err and not (tmp_path / "other").exists()
    (run / "summary.json").write_text(json.dumps({"command": "something else"}))
    assert card([str(run), "--to", str(tmp_path / "other")]) == 2
    assert "neither a compare run's" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-t5"])
def test_train_lm_in_one_call_from_the_library(tmp_path, arch):
    """capt.lm_training.train_lm, what python -m train.lm calls: pairs in, a loadable capsule folder and the
    summary out: the capsule kept scores the best dev loss (as Trainer evaluates it, over batches of unequal size:
    dev_loss), beside the backbone alone's; bad options are refused before any training, named as the library's
    parameters (the CLI names its flags)."""
    from capt.lm_training import check_options, dev_loss, encode, split, train_lm

    bb = tiny(arch)
    pairs = [(f"say {w}{i}:", f" {w} {w}") for i in range(3) for w in WORDS]
    test_pairs = [(f"tell {w}:", f" {w} {w}") for w in WORDS[:5]]
    summary = train_lm(bb, pairs, tmp_path / "run", capt.CapsuleConfig(layers="odd"), max_steps=4, eval_every=2,
                       batch_size=2, test_pairs=test_pairs)
    assert (summary["steps"], summary["n_train"], summary["n_dev"], summary["command"]) == (4, 27, 3, None)
    assert summary["settings"] == {"max_steps": 4, "eval_every": 2, "patience": 10, "batch_size": 2, "lr": 3e-2,
                                   "seed": 0, "max_minutes": None, "dtype": "float32"}   # what a card states
    capsule, task = capt.load_capsule(summary["capsule_dir"], bb)
    assert task is None and capsule.config.layers == "odd" and capsule.layer_ids == [0, 2]
    dev = [{k: v for k, v in r.items() if k != "cut"} for r in split([encode(bb, 1, p, c) for p, c in pairs], 0)[1]]
    assert dev_loss(bb, capsule, dev, 2) == pytest.approx(summary["best_dev_loss"], rel=1e-5)   # batches of 2 and 1
    assert dev_loss(bb, None, dev, 2) == pytest.approx(summary["bare_dev_loss"], rel=1e-6)
    assert summary["bare_dev_loss"] != pytest.approx(summary["best_dev_loss"], rel=1e-3)
    test = [{k: v for k, v in encode(bb, 1, p, c).items() if k != "cut"} for p, c in test_pairs]   # the kept capsule
    assert summary["n_test"] == 5 and summary["test_loss"] == pytest.approx(dev_loss(bb, capsule, test, 2), rel=1e-5)
    assert summary["bare_test_loss"] == pytest.approx(dev_loss(bb, None, test, 2), rel=1e-6)
    assert "test_loss" not in train_lm(bb, pairs, tmp_path / "no-test", max_steps=1, eval_every=1)   # none given
    for kwargs, message in [(dict(lr=0), r"out of range: lr 0 \(valid: 0 < lr <= 1\)"),
                            (dict(max_steps=0, patience=0), "max_steps 0 .*; patience 0"),
                            (dict(resume=True), "resume: no checkpoint in"),
                            (dict(config=capt.CapsuleConfig(head="linear")), "set head to 'verbalizer'")]:
        with pytest.raises(capt.CaptError, match=message):
            train_lm(bb, pairs, tmp_path / "other", **kwargs)
    with pytest.raises(capt.CaptError, match=r"out of range: --lr 0"):
        check_options(tmp_path / "other", lr=0, flags=True)
    with pytest.raises(capt.CaptError, match="already holds a run"):
        train_lm(bb, pairs, tmp_path / "run")
    with pytest.raises(capt.CaptError, match="1 pair"):
        train_lm(bb, pairs[:1], tmp_path / "one")
    assert not (tmp_path / "other").exists() and not (tmp_path / "one").exists()   # refused before anything


def test_train_lm_reports_each_step_and_stops_within_one(tmp_path, capsys):
    """train_lm's callback: one "step" event per step (loss, ETA, best dev loss so far) and one "eval" per dev
    evaluation, nothing printed; stop() ends the run after the step it is set in, a time budget likewise, and
    each says so in the summary ("stopped_by"), keeping the best dev loss's capsule."""
    from capt.lm_training import train_lm

    bb = tiny("tiny-llama")
    pairs = [(f"say {w}:", f" {w} {w}") for w in WORDS]
    events = []
    summary = train_lm(bb, pairs, tmp_path / "all", max_steps=6, eval_every=2, batch_size=3, callback=events.append)
    steps, evals = [e for e in events if e["kind"] == "step"], [e for e in events if e["kind"] == "eval"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4, 5, 6] and all(e["total_steps"] == 6 for e in steps)
    assert [e["step"] for e in evals] == [2, 4, 6] and summary["stopped_by"] == "max_steps"
    assert [e["dev"]["loss"] for e in evals] == [summary["dev_losses"][s] for s in (2, 4, 6)]
    assert evals[-1]["best"] == summary["best_dev_loss"] and steps[-1]["eta_s"] == 0
    assert [e["improved"] for e in evals] == [True] + [b["dev"]["loss"] < min(a["dev"]["loss"] for a in evals[:i + 1])
                                                      for i, b in enumerate(evals[1:])]
    assert "{'loss'" not in capsys.readouterr().out   # Trainer's own log lines are left out when events go out
    seen = []
    stopped = train_lm(bb, pairs, tmp_path / "stop", max_steps=50, eval_every=2, batch_size=3,
                       callback=seen.append, stop=lambda: len([e for e in seen if e["kind"] == "step"]) >= 3)
    assert (stopped["steps"], stopped["stopped_by"]) == (4, "stop requested")   # set at step 4's end: it ends there
    assert stopped["best_dev_loss"] == min(stopped["dev_losses"].values())
    timed = train_lm(bb, pairs, tmp_path / "time", max_steps=50, eval_every=2, batch_size=3, max_minutes=1e-9)
    assert (timed["steps"], timed["stopped_by"]) == (1, "max_minutes")
    assert list(timed["dev_losses"]) == [1] and timed["best_step"] == 1   # ended before any evaluation: measured
    with pytest.raises(capt.CaptError, match="out of range: max_minutes 0 "):
        train_lm(bb, pairs, tmp_path / "zero", max_minutes=0)


def test_train_lm_in_time_boxed_pieces_is_one_run(tmp_path):
    """A time budget ends a run with a checkpoint of its last step, and resume=True goes on from exactly there (as
    ZeroGPU's time-boxed calls do): the pieces together take steps 1..6 once each, the clock counts every piece,
    and the capsule is the same as one uninterrupted run's."""
    from capt.lm_training import train_lm

    bb = tiny("tiny-llama")
    pairs = [(f"say {w}:", f" {w} {w}") for w in WORDS]
    whole = train_lm(bb, pairs, tmp_path / "whole", max_steps=6, eval_every=4, batch_size=3)
    steps, pieces, budget = [], [], 1e-9
    while True:
        events = []
        s = train_lm(bb, pairs, tmp_path / "pieces", max_steps=6, eval_every=4, batch_size=3, max_minutes=budget,
                     resume=bool(pieces), callback=events.append)
        steps += [e["step"] for e in events if e["kind"] == "step"]
        pieces.append(s["stopped_by"])
        if s["stopped_by"] != "max_minutes":
            break
        budget = s["train_seconds"] / 60 + 1e-9   # the run's clock: what it has spent, plus next to nothing
    assert steps == [1, 2, 3, 4, 5, 6] and len(pieces) >= 2 and pieces == ["max_minutes"] * (len(pieces) - 1) + [
        "max_steps"]
    starts = [t["from_step"] for t in s["trained_on"]]   # each piece from where the one before ended
    assert len(starts) == len(pieces) and starts[0] == 0 and starts == sorted(set(starts))
    assert s["dev_losses"] == pytest.approx(whole["dev_losses"]) and s["best_step"] == whole["best_step"]
    a, _ = capt.load_capsule(whole["capsule_dir"], bb)
    b, _ = capt.load_capsule(s["capsule_dir"], bb)
    assert torch.allclose(a.weight, b.weight, atol=1e-6)


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-t5"])
def test_the_lm_cli_batches_are_what_transformers_scores(arch):
    """train.lm's rows and batches: the completion (and an EOS after it) scored, the prompt and pads not; without
    a capsule their loss is transformers' own; a long prompt is cut to fit, the completion never."""
    from capt.lm_training import Collator, encode

    bb = tiny(arch)
    rows = [encode(bb, 1, p, a) for p, a in PAIRS]
    batch = Collator(bb.tokenizer.pad_token_id)(rows)
    eos = bb.tokenizer.eos_token_id
    for r, (p, a) in zip(rows, PAIRS):
        scored = [t for t in r["labels"] if t != -100]
        assert scored[-1] == eos and bb.tokenizer.decode(scored[:-1]).strip() == a.strip()
    with torch.no_grad():
        assert lm_loss(bb, None, **batch).loss.item() == pytest.approx(bb.model(**batch).loss.item(), rel=1e-5)
    long = encode(bb, 1, " ".join(["word"] * 2 * bb.max_length), " the end")
    assert len(long["input_ids"]) == bb.max_length - 1   # room for the capsule's slot
    short = encode(bb, 1, "a prompt", " the end")
    completion = len(short["input_ids"]) - len(bb.tokenizer("a prompt")["input_ids"])   # 0 on T5: the target
    kept = len(long["input_ids"]) - completion
    n_long = len(bb.tokenizer(" ".join(["word"] * 2 * bb.max_length))["input_ids"])
    assert short["cut"] == 0 and long["cut"] == n_long - kept
    scored = [t for t in short["labels"] if t != -100]
    assert [t for t in long["labels"] if t != -100] == scored and long["labels"][-len(scored):] == scored
    if not bb.encoder_decoder:
        if short["input_ids"][0] == bb.tokenizer.bos_token_id:   # the prompt lost its start, not its BOS
            assert long["input_ids"][0] == short["input_ids"][0]
        with pytest.raises(capt.CaptError, match="leaves no room for its prompt"):
            encode(bb, 1, "a prompt", " word" * bb.max_length)


def test_the_lm_cli_keeps_two_prompt_tokens_or_refuses():
    """The edge of train.lm's room check: a completion (with its EOS) that leaves exactly 2 tokens keeps the
    prompt's last 2; one that leaves 1 is refused, naming the longest completion that fits (one token shorter); never cut."""
    import dataclasses

    from capt.lm_training import encode

    bb = tiny("tiny-llama")
    tok = bb.tokenizer
    completion = " word" * 5
    c = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    prompt = "a much longer prompt about dogs and the cats of"
    p = tok(prompt)["input_ids"]
    fits = dataclasses.replace(bb, max_length=1 + len(c) + 2)           # 1 capsule slot + completion + 2
    row = encode(fits, 1, prompt, completion)
    assert row["input_ids"] == (p[:1] + p[-1:] if p[0] == tok.bos_token_id else p[-2:]) + c
    assert row["labels"] == [-100, -100] + c
    tight = dataclasses.replace(bb, max_length=1 + len(c) + 1)
    with pytest.raises(capt.CaptError, match=f"at most {len(c) - 2} tokens"):
        encode(tight, 1, prompt, completion)
