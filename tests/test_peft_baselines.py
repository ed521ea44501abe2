"""The PEFT baselines (prompt tuning, P-tuning v2) on tiny backbones: scores, gradients, parameter
counts, padding, training, saving, and above all that the shared backbone is left exactly as it was."""
import gc
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny
from safetensors.torch import load_file

import capt
from capt.methods import make_method
from capt.peft_baselines import PeftMethod
from capt.tasks import Rendered

BACKBONES = ["tiny-llama", "tiny-qwen2", "tiny-gemma3", "tiny-t5"]
NAMES = ["prompt-tuning", "p-tuning-v2"]
M = 5
TASK = capt.custom_task("toy", ["text"], {"a": " the", "b": " a"})
TOY = [("cat one", "a"), ("dog two", "b"), ("cat three", "a"), ("dog four", "b")]
UNEVEN = [("cat", "a"), ("dog two and some more words", "b"), ("cat three of them", "a")]

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers deprecations PEFT triggers


def render(bb, examples=TOY):
    return [TASK.render({"text": t, "label": y}, bb.style) for t, y in examples]


def labels(rendered):
    return torch.tensor([r.label for r in rendered])


def expected_n_trainable(bb, name, m):
    """What PEFT allocates, from the model config: prompt tuning m*d; prefix tuning m*L*2*(K/V width),
    where the K/V width is kv_heads*head_dim under grouped-query attention (PEFT's GQA rule), else d."""
    cfg = bb.model.config
    if name == "prompt-tuning":
        return m * bb.hidden_size
    kv_heads = getattr(cfg, "num_key_value_heads", None)
    if kv_heads is None:  # T5: PEFT uses d_model and num_hidden_layers (= encoder layers)
        return m * cfg.num_hidden_layers * 2 * cfg.d_model
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return m * cfg.num_hidden_layers * 2 * kv_heads * head_dim


@pytest.fixture
def padding_side():
    """Set the shared tokenizers' padding side for one test, then put it back."""
    saved = {n: tiny(n).tokenizer.padding_side for n in BACKBONES}
    yield lambda bb, side: setattr(bb.tokenizer, "padding_side", side)
    for n, side in saved.items():
        tiny(n).tokenizer.padding_side = side


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bb_name", BACKBONES)
def test_scores_gradients_and_count(bb_name, name, padding_side):
    bb = tiny(bb_name)
    padding_side(bb, "right")
    method = PeftMethod(bb, TASK, name, num_virtual_tokens=M)
    assert [n for n, _ in method.named_parameters()] == ["prompt_encoder.default.embedding.weight"]
    assert method.n_trainable() == expected_n_trainable(bb, name, M)

    rendered = render(bb)
    s = method.scores(rendered)
    assert s.logits.shape == (4, 2) and torch.isfinite(s.logits).all()
    F.cross_entropy(s.logits, labels(rendered)).backward()
    grad = method.prompt_encoder["default"].embedding.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    assert all(p.grad is None for p in bb.model.parameters())

    if not bb.encoder_decoder:  # the per-(example, label) path agrees with the single-token fast path
        torch.testing.assert_close(method.scores(rendered, general=True).logits, s.logits, atol=1e-5, rtol=0)
        multi = [Rendered(r.prompt, (" the cat sat", " a"), r.label) for r in rendered]  # COPA-like choices
        s2 = method.scores(multi)
        assert s2.logits.shape == (4, 2) and torch.isfinite(s2.logits).all()
        torch.testing.assert_close(s2.logits[:, 1], s.logits[:, 1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bb_name", BACKBONES)
def test_padding(bb_name, name, padding_side):
    bb = tiny(bb_name)
    method = PeftMethod(bb, TASK, name, num_virtual_tokens=M)
    rendered = render(bb, UNEVEN)
    with torch.no_grad():
        padding_side(bb, "right")
        batched = method.scores(rendered).logits
        alone = torch.cat([method.scores([r]).logits for r in rendered])
        # right padding keeps every real token at its unpadded position, virtual tokens or prefix first
        torch.testing.assert_close(batched, alone, atol=1e-4, rtol=0)
        if not bb.encoder_decoder:
            # left padding: PEFT puts its virtual tokens/prefix before the pads, so positions shift; it must run
            padding_side(bb, "left")
            left = method.scores(rendered).logits
            assert left.shape == (3, 2) and torch.isfinite(left).all()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bb_name", [b for b in BACKBONES if b != "tiny-t5"])
def test_multi_token_labels_sum_each_continuation(bb_name, name, padding_side):
    """COPA-like labels of several tokens: each label's score is the sum of its tokens' log-probs after the
    prompt, computed here by hand from PEFT's own forward on one unpadded row at a time."""
    bb = tiny(bb_name)
    method = PeftMethod(bb, TASK, name, num_virtual_tokens=M)
    choices = (" the cat sat", " a")
    rendered = [Rendered(r.prompt, choices, r.label) for r in render(bb, UNEVEN)]
    tok = bb.tokenizer
    expected = []
    with torch.no_grad():
        for r in rendered:
            prompt = tok(r.prompt)["input_ids"]
            row = []
            for c in choices:
                cont = tok(c, add_special_tokens=False)["input_ids"]
                ids = torch.tensor([prompt + cont])
                logits = method.peft[0](input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
                logp = torch.log_softmax(logits[-ids.shape[1]:].float(), -1)  # drop prompt tuning's m positions
                row.append(sum(logp[len(prompt) - 1 + k, t] for k, t in enumerate(cont)))
            expected.append(row)
        padding_side(bb, "right")
        got = method.scores(rendered).logits
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-4, rtol=0)


def _snapshot(bb):
    model = bb.model
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    with torch.no_grad():
        kw = dict(decoder_input_ids=ids[:, :2]) if bb.encoder_decoder else {}
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), **kw).logits
    hooks = sum(len(getattr(m, h)) for m in model.modules() for h in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
        "_load_state_dict_pre_hooks"))
    return dict(out=out, names=[n for n, _ in model.named_parameters()], hooks=hooks,
                state={k: v.clone() for k, v in model.state_dict().items()},
                grad=[p.requires_grad for p in model.parameters()], training=[m.training for m in model.modules()],
                config=model.config.to_dict(), attrs=set(vars(model)))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bb_name", BACKBONES)
def test_backbone_untouched(bb_name, name):
    bb = tiny(bb_name)
    before = _snapshot(bb)
    method = PeftMethod(bb, TASK, name, num_virtual_tokens=M)
    method.train()  # must not reach the shared model
    opt = torch.optim.AdamW(method.parameters(), lr=0.1)
    rendered = render(bb)
    F.cross_entropy(method.scores(rendered).logits, labels(rendered)).backward()
    opt.step()
    method.eval()
    del method, opt
    gc.collect()
    after = _snapshot(bb)
    assert torch.equal(before["out"], after["out"])
    assert after["hooks"] == before["hooks"]
    assert all(torch.equal(v, after["state"][k]) for k, v in before["state"].items())
    assert not any(after["grad"]) and not any(after["training"])
    for key in ("names", "config", "attrs"):
        assert before[key] == after[key], key
    assert all(p.grad is None for p in bb.model.parameters())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bb_name", BACKBONES)
def test_training_lowers_loss(bb_name, name):
    bb = tiny(bb_name)
    method = PeftMethod(bb, TASK, name, num_virtual_tokens=M)
    opt = torch.optim.AdamW(method.parameters(), lr=0.3 if name == "prompt-tuning" else 0.05)
    rendered = render(bb)
    y = labels(rendered)
    losses = []
    for _ in range(20):
        loss = F.cross_entropy(method.scores(rendered).logits, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        final = F.cross_entropy(method.scores(rendered).logits, y).item()
    assert final < losses[0] - 0.05, (losses[0], final)


def test_seeded_init_and_rng_untouched():
    bb = tiny("tiny-llama")
    state = torch.random.get_rng_state()
    a, b, c = (PeftMethod(bb, TASK, "prompt-tuning", num_virtual_tokens=M, seed=s) for s in (0, 0, 1))
    assert torch.equal(torch.random.get_rng_state(), state)
    w = [m.prompt_encoder["default"].embedding.weight for m in (a, b, c)]
    assert torch.equal(w[0], w[1]) and not torch.equal(w[0], w[2])
    assert isinstance(make_method("p-tuning-v2", bb, TASK, num_virtual_tokens=M), PeftMethod)
    with pytest.raises(capt.CaptError):
        PeftMethod(bb, TASK, "lora")


@pytest.mark.parametrize("name", NAMES)
def test_save(tmp_path, name):
    bb = tiny("tiny-llama")
    method = PeftMethod(bb, TASK, name, num_virtual_tokens=M)
    folder = tmp_path / "run" / "adapter"
    method.save(folder, {"lr": 0.3}, {"accuracy": 0.5})
    with torch.no_grad():
        method.prompt_encoder["default"].embedding.weight.add_(1.0)
    assert method.save(folder, {"lr": 0.3}, {"accuracy": 0.75}) == folder  # replaces the older one
    assert sorted(p.name for p in folder.parent.iterdir()) == ["adapter"]  # no temp folders left behind
    tensors = load_file(folder / "adapter_model.safetensors")
    assert torch.equal(tensors["prompt_embeddings"], method.prompt_encoder["default"].embedding.weight)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["num_virtual_tokens"] == M
    meta = json.loads((folder / "capt.json").read_text())
    assert meta["method"] == name and meta["metrics"] == {"accuracy": 0.75}
