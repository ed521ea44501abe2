"""The capsule on every architecture x option: equivalences, invariants and the maths."""
import pytest
import torch

import capt
from capt.capsule import masked_mean, run
from capt.scoring import pad, score
from conftest import ARCHS, OPTIONS, RTE_EXAMPLES, hooks_at_load, random_capsule, tiny

RTE = capt.get_task("rte")


def _batch(bb, texts, side="right"):
    ids = [bb.tokenizer(t)["input_ids"] for t in texts]
    return pad(ids, bb.tokenizer.pad_token_id, side)


def _hooks(bb):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in bb.model.modules())


def _clean(bb):
    """No hook beyond those the backbone had when it was loaded."""
    return _hooks(bb) == hooks_at_load(bb)


def _rendered(bb, examples=RTE_EXAMPLES):
    return [RTE.render(e, bb.style) for e in examples]


# --- every option on every architecture ---------------------------------------------------------

@pytest.mark.parametrize("option", OPTIONS)
def test_every_option_runs_and_trains(backbone, option):
    """Forward, backward and a step for each option: finite scores, gradients only on the capsule."""
    cap = random_capsule(backbone, **OPTIONS[option])
    s = score(backbone, cap, _rendered(backbone))
    assert s.logits.shape == (3, 2) and torch.isfinite(s.logits).all()
    loss = torch.nn.functional.cross_entropy(s.logits, torch.tensor([0, 1, 0]))
    loss.backward()
    assert all(p.grad is None for p in backbone.model.parameters())
    grads = {n: p.grad for n, p in cap.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), grads.keys()
    assert grads["weight"].abs().sum() > 0
    assert _clean(backbone)


def test_trainable_parameter_count_is_L_times_d(backbone):
    cap = capt.Capsule.for_backbone(backbone)
    L, d = backbone.n_layers, backbone.hidden_size
    assert cap.n_capsule_params() == L * d and cap.n_head_params() == 0
    if backbone.encoder_decoder:  # T5: the encoder's layers only
        assert L == len(backbone.model.encoder.block) != len(backbone.model.decoder.block)
    report = cap.param_report(backbone)
    assert report["share_percent"] == pytest.approx(100 * L * d / backbone.n_params)
    linear = capt.Capsule.for_backbone(backbone, capt.CapsuleConfig(head="linear"), n_labels=3)
    assert linear.n_capsule_params() == L * d and linear.n_head_params() == d * 3 + 3
    odd = capt.Capsule.for_backbone(backbone, capt.CapsuleConfig(layers="odd"))
    assert odd.layer_ids == list(range(0, L, 2)) and odd.n_capsule_params() == len(odd.layer_ids) * d


# --- equivalences -------------------------------------------------------------------------------

def test_no_capsule_is_the_bare_backbone(backbone):
    """capsule=None runs exactly the backbone's own forward (and a capsule call leaves nothing behind)."""
    ids, mask = _batch(backbone, ["The cat sat on the mat.", "Dogs bark loudly at night, always."])
    model = backbone.model
    with torch.no_grad():
        if backbone.encoder_decoder:
            bare = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        else:
            bare = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        ours = run(backbone, None, ids, mask)[0].last_hidden_state
        real = mask.bool()  # pad positions differ only in their (unused) position ids
        assert torch.equal(ours[real], bare[real])
        run(backbone, random_capsule(backbone), ids, mask)
        after = run(backbone, None, ids, mask)[0].last_hidden_state
    assert torch.equal(after, ours)
    assert _clean(backbone)


def test_bare_scores_match_the_models_own_logits():
    """The verbalizer path reproduces the full model's log-softmax at the answer position."""
    bb = tiny("tiny-llama")
    task = capt.custom_task("toy", ["text"], {"a": " the", "b": " a"})
    r = task.render({"text": "The cat sat on"}, "lm")
    ids = torch.tensor([bb.tokenizer(r.prompt)["input_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(bb.model(input_ids=ids).logits[0, -1], -1)
        ours = score(bb, None, [r]).logits[0]
    words = [bb.tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in (" the", " a")]
    assert torch.allclose(ours, logp[words], atol=1e-5)


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "tiny-t5"])
def test_single_token_fast_path_equals_general_path(arch):
    bb = tiny(arch)
    cap = random_capsule(bb)
    task = capt.custom_task("toy", ["text"], {"a": " the", "b": " a", "c": " was"})
    rendered = [task.render({"text": t}, "lm") for t in ["The cat sat on", "It rained all day and"]]
    with torch.no_grad():
        fast = score(bb, cap, rendered).logits
        general = score(bb, cap, rendered, general=True).logits
    assert torch.allclose(fast, general, atol=1e-5)


@pytest.mark.parametrize("side", ["right", "left"])
def test_label_rows_golden(side):
    """One row per (example, label); each label token is read where the previous token sits."""
    from capt.scoring import label_rows

    lr = label_rows([[1, 2, 3], [4]], [[[7], [8, 9]], [[7], [8, 9]]], 0, side)
    rows = [[1, 2, 3, 7], [1, 2, 3, 8, 9], [4, 7], [4, 8, 9]]
    for n, row in enumerate(rows):
        real = lr.ids[n][lr.mask[n].bool()].tolist()
        assert real == row and lr.ids[n][~lr.mask[n].bool()].tolist() == [0] * (5 - len(row))
        assert lr.ids[n][lr.prompt_mask[n].bool()].tolist() == row[:3 if n < 2 else 1]
    assert lr.row_of.tolist() == [0, 1, 1, 2, 3, 3] and lr.target.tolist() == [7, 8, 9, 7, 8, 9]
    assert lr.pos_of.tolist() == ([2, 2, 3, 0, 0, 1] if side == "right" else [3, 2, 3, 3, 2, 3])
    assert torch.equal(lr.ids[lr.row_of, lr.pos_of + 1], lr.target)  # the next token is the label token
    assert lr.totals(torch.arange(6.0), 2).tolist() == [[0.0, 3.0], [3.0, 9.0]]


@pytest.mark.parametrize("option", ["default", "prepend", "inplace", "extract", "linear"])
def test_left_and_right_padding_agree(backbone, option):
    cap = random_capsule(backbone, **OPTIONS[option])
    rendered = _rendered(backbone)
    tok = backbone.tokenizer
    results = {}
    with torch.no_grad():
        for side in ("left", "right"):
            tok.padding_side = side
            try:
                results[side] = score(backbone, cap, rendered).logits
            finally:
                tok.padding_side = "right"
            one_by_one = torch.cat([score(backbone, cap, [r]).logits for r in rendered])
            assert torch.allclose(results[side], one_by_one, atol=1e-4)
    assert torch.allclose(results["left"], results["right"], atol=1e-4)


def test_hooks_are_removed_when_the_forward_fails(backbone):
    cap = random_capsule(backbone)
    ids, mask = _batch(backbone, ["Some text here."])
    broken = backbone.layers[-1].register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("x")))
    try:
        with pytest.raises(RuntimeError):
            run(backbone, cap, ids, mask)
    finally:
        broken.remove()
    assert _clean(backbone)


# --- the maths: golden values -------------------------------------------------------------------

def test_fuse_golden_values():
    """c = W + mean over the slot and real tokens, pads excluded: checked on numbers by hand."""
    cap = capt.Capsule(capt.CapsuleConfig(), n_layers=1, hidden_size=2)
    with torch.no_grad():
        cap.weight.copy_(torch.tensor([[10.0, 20.0]]))
    h = torch.tensor([[[0.0, 0.0], [1.0, 2.0], [3.0, 4.0], [99.0, 99.0]]])   # slot, tok, tok, pad
    slot = torch.tensor([[True, False, False, False]])
    call = capt.capsule.CallState([slot], torch.tensor([[1, 1, 1, 0]]))
    out = cap.fuse(0, h.clone(), call)
    # mean of (0,0), (1,2), (3,4) = (4/3, 2); plus W
    assert torch.allclose(out[0, 0], torch.tensor([10 + 4 / 3, 22.0]))
    assert torch.equal(out[0, 1:], h[0, 1:])


_NORM = {"t5": lambda layer: layer.layer[0].layer_norm}  # the first module to read a layer's input


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("side", ["left", "right"])
def test_slot_holds_W_plus_masked_mean_at_every_layer(arch, side):
    """At each capsule layer the slot entering the layer is W[l] + mean(slot and real tokens of the
    previous layer's output); at layer 0 that is W[0] + mean(E); other positions are untouched."""
    bb = tiny(arch)
    cap = random_capsule(bb, layers=[0, 2, 3])  # layer 1 has no capsule: its slot passes through
    ids, mask = _batch(bb, ["The cat sat on the mat.", "Dogs bark."], side)
    before, after = {}, {}
    handles = []
    for i, layer in enumerate(bb.layers):
        norm = _NORM.get(bb.model_type, lambda layer: layer.input_layernorm)(layer)
        handles.append(layer.register_forward_pre_hook(
            lambda m, a, k, i=i: before.__setitem__(i, (a[0] if a else k["hidden_states"]).clone()),
            with_kwargs=True))
        handles.append(norm.register_forward_pre_hook(lambda m, a, i=i: after.__setitem__(i, a[0].clone())))
    try:
        with torch.no_grad():
            _, inp = run(bb, cap, ids, mask)
            E = bb.embed(ids)
    finally:
        for h in handles:
            h.remove()
    first = mask.argmax(1)
    for b in range(ids.shape[0]):
        real = [t for t in range(ids.shape[1]) if mask[b, t]]
        slot = int(first[b])  # the slot sits just before the first real token
        expect0 = sum(E[b, t] for t in real) / len(real)
        assert torch.allclose(before[0][b, slot], expect0, atol=1e-5)
        for j, layer_id in enumerate(cap.layer_ids):
            h_in = before[layer_id][b]
            positions = [slot] + [t + 1 for t in real]
            mean = sum(h_in[p] for p in positions) / len(positions)
            assert torch.allclose(after[layer_id][b, slot], cap.weight[j] + mean, atol=1e-4), (layer_id, b)
            others = [p for p in range(h_in.shape[0]) if p != slot]
            assert torch.equal(after[layer_id][b, others], h_in[others])
        assert torch.equal(after[1][b], before[1][b])  # no capsule at layer 1
    assert inp.anchor.tolist() == first.tolist()


@pytest.mark.parametrize("option", OPTIONS)
def test_in_place_slot_writes_give_the_copys_scores_and_gradients(backbone, option, monkeypatch):
    """The hooks overwrite the slot rows of each layer input in place (no copy of h); forcing the
    copying write must give the same scores and the same gradient on every capsule parameter."""
    import capt.capsule as C

    cap = random_capsule(backbone, **OPTIONS[option])
    rendered = _rendered(backbone)
    y = torch.tensor([0, 1, 0])
    writable, decisions = C._writable, []
    monkeypatch.setattr(C, "_writable", lambda h: decisions.append(writable(h)) or decisions[-1])
    results = {}
    for mode in ("in place", "copy"):
        if mode == "copy":
            monkeypatch.setattr(C, "_writable", lambda h: False)
        cap.zero_grad(set_to_none=True)
        logits = score(backbone, cap, rendered).logits
        torch.nn.functional.cross_entropy(logits, y).backward()
        results[mode] = (logits.detach(), {n: p.grad.clone() for n, p in cap.named_parameters()})
    assert decisions and all(decisions), "every capsule layer of these backbones can be written in place"
    (l1, g1), (l2, g2) = results["in place"], results["copy"]
    assert torch.allclose(l1, l2, atol=1e-6)
    for name in g1:
        assert torch.allclose(g1[name], g2[name], atol=1e-6, rtol=1e-5), name


@pytest.mark.parametrize("option", ["default", "prepend", "project", "inplace", "odd", "pooled"])
def test_per_call_shared_values_give_the_per_layer_scores_and_gradients_bit_for_bit(backbone, option, monkeypatch):
    """The batch rows, the mean's mask and counts and the capsule's rows are made once per call and shared by
    every capsule layer; making them afresh at each layer must give exactly the same scores and gradients."""
    import capt.capsule as C

    cap = random_capsule(backbone, **OPTIONS[option])
    rendered = _rendered(backbone)
    y = torch.tensor([0, 1, 0])
    cached, fuse, made, fused = C.CallState._cached, C.Capsule.fuse, [], []

    def counting(self, key, make):
        made.append(key[0]) if key not in self._cache else None
        return cached(self, key, make)
    monkeypatch.setattr(C.Capsule, "fuse", lambda *a: fused.append(1) or fuse(*a))
    results = {}
    for mode in ("once per call", "per layer"):
        monkeypatch.setattr(C.CallState, "_cached", counting if mode == "once per call"
                            else (lambda self, key, make: make()))
        cap.zero_grad(set_to_none=True)
        logits = score(backbone, cap, rendered).logits
        torch.nn.functional.cross_entropy(logits, y).backward()
        results[mode] = (logits.detach(), {n: p.grad.clone() for n, p in cap.named_parameters()})
    calls = made.count("rows_of")                    # one per call of run()
    means = calls if cap.config.fusion != "none" else 0
    assert calls and made.count("mean") == means and len(fused) == 2 * calls * len(cap.layer_ids), made
    (l1, g1), (l2, g2) = results.values()
    assert torch.equal(l1, l2)
    assert all(torch.equal(g1[name], g2[name]) for name in g1)


def _formula_fuse(self, j, h, call):
    """Capsule.fuse as the paper's formula reads, op by op: c_l = W[l] + masked_mean(h) (the mean a product
    of the 0/1 mask, then divided), written at each row's slot with index_put; every value made at each
    layer, nothing shared, nothing in place."""
    from capt.capsule import segment_means

    w = self.weight[j].to(h.dtype)
    rows = torch.arange(h.shape[0])
    m = call.mean_mask.to(h.dtype)

    def mean(x):
        return (m[:, None, :] @ x).squeeze(1) / m.sum(1, keepdim=True).clamp(min=1)
    if call.pool_onehot:
        pooled = segment_means(h, call.real_mask, len(call.pool_onehot))
        for i, where in enumerate(call.pool_onehot):
            h = h.index_put((rows, where.long().argmax(1)), pooled[:, i])
    slot = [onehot.long().argmax(1) for onehot in call.slot_onehot]
    fusion = self.config.fusion
    if fusion == "none":
        capsule = w.expand(h.shape[0], -1)
    elif fusion == "extract":
        x = (h * call.mean_mask[..., None]).transpose(1, 2)
        x = torch.nn.functional.conv1d(x, self.conv[j].unsqueeze(1).to(h.dtype), padding="same", groups=h.shape[-1])
        capsule = w + mean(x.transpose(1, 2))
    else:
        capsule = mean(h)
        if fusion == "project":
            capsule = capsule + (capsule @ self.proj_a[j].T) @ self.proj_b[j].T
        if fusion == "prepend":
            h = h.index_put((rows, slot[0]), capsule)
            return h.index_put((rows, slot[1]), w.expand_as(capsule))
        capsule = w + capsule
    return h.index_put((rows, slot[0]), capsule, accumulate=self.config.placement == "inplace")


@pytest.mark.parametrize("option", ["default", "prepend", "extract", "project", "none", "inplace", "odd", "pooled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_capsule_write_is_the_formula_bit_for_bit(backbone, option, dtype, monkeypatch):
    """Capsule.fuse (shared per-call values, (B, 1, d) throughout, scatter writes, in place) gives the scores
    and gradients of the formula written plainly, bit for bit, in float32 and bfloat16 alike."""
    import capt.capsule as C

    if dtype != backbone.dtype:   # a backbone of its own: casting the shared one back would not restore it
        backbone = capt.load_backbone(backbone.name, dtype="bfloat16", device="cpu")
    cap = random_capsule(backbone, **OPTIONS[option])
    rendered = _rendered(backbone)
    y = torch.tensor([0, 1, 0])
    fuse, results = C.Capsule.fuse, {}
    for name, f in (("fuse", fuse), ("formula", _formula_fuse)):
        monkeypatch.setattr(C.Capsule, "fuse", f)
        cap.zero_grad(set_to_none=True)
        logits = score(backbone, cap, rendered).logits
        torch.nn.functional.cross_entropy(logits.float(), y).backward()
        results[name] = (logits.detach(), {n: p.grad.clone() for n, p in cap.named_parameters()})
    assert cap.weight.dtype == dtype
    (l1, g1), (l2, g2) = results.values()
    assert torch.equal(l1, l2)
    assert all(torch.equal(g1[name], g2[name]) for name in g1), [n for n in g1 if not torch.equal(g1[n], g2[n])]


def _ops_per_layer(option: str) -> tuple[list[str], list[str]]:
    """The ops (not views) Capsule.fuse dispatches per capsule layer, forward and backward: two layers' count
    minus one layer's, on (B, T, d) = (3, 6, 8) with the slot at another position in each row."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from capt.capsule import Capsule, CallState
    from capt.config import CapsuleConfig

    class Record(TorchDispatchMode):
        def __init__(self, names):
            super().__init__()
            self.names = names

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.names.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    counts = []
    for k in (1, 2):
        torch.manual_seed(0)
        cap = Capsule(CapsuleConfig(layers=list(range(k)), **OPTIONS[option]), n_layers=2, hidden_size=8)
        slot = torch.tensor([0, 2, 1])
        call = CallState([torch.arange(6)[None] == slot[:, None]], torch.ones(3, 6, dtype=torch.long))
        x = torch.randn(3, 6, 8, requires_grad=True)
        fwd, bwd = [], []
        h = x + 0                                  # a layer's fresh output, as the hooks receive it
        with Record(fwd):
            for j in range(k):
                h = cap.fuse(j, h, call)
        loss = h.sum()
        with Record(bwd):
            loss.backward()
        counts.append((Counter(fwd), Counter(bwd)))
    (f1, b1), (f2, b2) = counts
    return sorted((f2 - f1).elements()), sorted((b2 - b1).elements())


def test_a_capsule_layer_costs_four_ops_forward_and_at_most_six_backward():
    """On a GPU a small backbone's step is bound by how many ops it launches (README, Speed), so the default
    write's op count is held: forward the mean's product and division, + W[l], one scatter; backward their
    gradients (division, product, W's sum over the batch), the slot's gather, the rest's zeroed scatter
    and the sum of the two gradients reaching h. (ae1fd28's (B, d) values and index_put: 5 and 7 here, plus
    the reshapes and autograd nodes that went with them; train/BENCHMARKS.md.)"""
    fwd, bwd = _ops_per_layer("default")
    assert fwd == ["add", "bmm", "div", "scatter_"], fwd
    assert len(bwd) <= 6, bwd
    fwd, bwd = _ops_per_layer("inplace")
    assert fwd == ["add", "bmm", "div", "scatter_add_"], fwd


def test_writable_refuses_views_and_outputs_their_op_saves():
    from capt.capsule import _writable

    x = torch.randn(2, 3, 4, requires_grad=True)
    assert _writable((x + 1)) and _writable(torch.zeros(2, 3))
    assert not _writable(x)                     # a leaf that requires grad
    assert not _writable(torch.tanh(x))         # tanh's backward reads its output
    assert not _writable((x + 1)[:, 1:])        # a view: the write would reach its base


def test_masked_mean_ignores_padding():
    h = torch.arange(12.0).view(1, 4, 3)
    assert torch.equal(masked_mean(h, torch.tensor([[0, 1, 1, 0]])), h[0, 1:3].mean(0, keepdim=True))


# --- attention ----------------------------------------------------------------------------------

@pytest.mark.parametrize("option", ["default", "prepend", "inplace"])
def test_attention_rows_sum_to_one_and_slot_is_labelled(backbone, option):
    cap = random_capsule(backbone, **OPTIONS[option])
    text = RTE.render(RTE_EXAMPLES[0], backbone.style).prompt
    rep = capt.attention(backbone, text, capsule=cap)
    L, H, T, T2 = rep.maps.shape
    n_tok = len(backbone.tokenizer(text)["input_ids"])
    assert (L, T, T2) == (backbone.n_layers, len(rep.tokens), len(rep.tokens))
    assert T == n_tok + cap.config.n_slots
    assert abs(rep.maps.sum(-1) - 1).max() < 1e-4
    assert rep.tokens[rep.anchor].startswith(capt.CAPSULE_TOKEN)
    assert rep.anchor_label == "capsule" and rep.anchor_mass().shape == (L, H)
    assert rep.to_anchor.shape == (L, H, T) and rep.from_anchor.shape == (L, H, T)
    if not backbone.encoder_decoder:  # causal: the slot at position 0 can only attend to itself
        assert abs(rep.from_anchor[:, :, 0] - 1).max() < 1e-5
    assert backbone.model.config._attn_implementation != "eager" and _clean(backbone)

    bare = capt.attention(backbone, text)
    assert bare.maps.shape[-1] == n_tok and bare.anchor_label in ("BOS", "position 0")
    assert capt.CAPSULE_TOKEN not in " ".join(bare.tokens)


# --- bad input ----------------------------------------------------------------------------------

def test_bad_options_name_the_valid_ones():
    with pytest.raises(capt.CaptError, match="fusion='sum'.*add, prepend"):
        capt.CapsuleConfig(fusion="sum")
    with pytest.raises(capt.CaptError, match="layers"):
        capt.CapsuleConfig(layers="middle")
    with pytest.raises(capt.CaptError, match="placement='slot'"):
        capt.CapsuleConfig(fusion="prepend", placement="inplace")
    with pytest.raises(capt.CaptError, match=r"layers \[7\] do not exist.*0..3"):
        capt.Capsule.for_backbone(tiny("tiny-llama"), capt.CapsuleConfig(layers=[1, 7]))
    with pytest.raises(capt.CaptError, match="unknown capsule option"):
        capt.CapsuleConfig.from_dict({"fusion": "add", "colour": "red"})
    with pytest.raises(capt.CaptError, match=r"layers='0, x' is not valid.*like '0, 2, 5'"):
        capt.CapsuleConfig(layers="0, x")


def test_layer_indices_as_text_are_parsed_once_for_cli_and_app():
    """The CLI's --layers 0,2,5 and the app's "0, 2 5" box reach CapsuleConfig as text; it parses them."""
    assert capt.CapsuleConfig(layers="0,2,5").layers == [0, 2, 5]
    assert capt.CapsuleConfig(layers=" 5, 0 2 ").layers == [0, 2, 5]
    assert capt.CapsuleConfig(layers="odd").layers == "odd"


def test_unknown_backbone_lists_the_valid_ones():
    with pytest.raises(capt.CaptError, match="unknown backbone 'gpt5'.*smollm2-135m"):
        capt.load_backbone("gpt5")


def test_empty_and_missing_input():
    bb = tiny("tiny-llama")
    with pytest.raises(capt.CaptError, match="missing field 'hypothesis'"):
        capt.predict(bb, "rte", {"premise": "x"})
    with pytest.raises(capt.CaptError, match="empty text"):
        capt.predict(bb, "rte", {"premise": "  ", "hypothesis": "y"})
    with pytest.raises(capt.CaptError, match="non-empty"):
        capt.attention(bb, "   ")


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-t5"])
def test_long_input_is_truncated_and_says_so(arch):
    bb = tiny(arch)
    cap = random_capsule(bb)
    long = {"premise": "word " * 2000, "hypothesis": "A short claim."}
    pred = capt.predict(bb, "rte", long, capsule=cap)
    assert pred.truncated and pred.dropped_tokens > 0
    assert abs(sum(pred.probs.values()) - 1) < 1e-5
    short = capt.predict(bb, "rte", RTE_EXAMPLES[0], capsule=cap)
    assert not short.truncated and short.dropped_tokens == 0


# --- the training-free pooled-token probe -------------------------------------------------------

def test_segment_means_golden():
    from capt.capsule import segment_means

    h = torch.arange(10.0).view(1, 5, 2)          # rows (0,1) (2,3) (4,5) (6,7) (8,9)
    mask = torch.tensor([[0, 1, 1, 1, 1]])        # 4 real tokens: (2,3) (4,5) (6,7) (8,9)
    two = segment_means(h, mask, 2)
    assert torch.equal(two[0], torch.tensor([[3.0, 4.0], [7.0, 8.0]]))
    five = segment_means(h, mask, 5)              # more segments than tokens: empty ones are zero
    assert five.shape == (1, 5, 2) and torch.equal(five[0].sum(0), torch.tensor([20.0, 24.0]))


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-t5"])
def test_pooled_slots_hold_segment_means_and_precede_the_capsule(arch):
    bb = tiny(arch)
    cap = random_capsule(bb, fusion="none", pooled_tokens=3)
    ids, mask = _batch(bb, ["The cat sat on the mat today.", "Dogs bark."], "left")
    seen = {}
    norm = _NORM.get(bb.model_type, lambda layer: layer.input_layernorm)(bb.layers[2])
    handle = norm.register_forward_pre_hook(lambda m, a: seen.__setitem__("h", a[0].clone()))
    try:
        with torch.no_grad():
            _, inp = run(bb, cap, ids, mask)
    finally:
        handle.remove()
    h = seen["h"]
    first = mask.argmax(1)
    for b in range(2):
        f = int(first[b])
        real = [t for t in range(f + 4, h.shape[1])]  # after 3 pooled slots and the capsule slot
        n = len(real)
        for i in range(3):  # real token r goes to segment floor(r*3/n)
            members = [real[r] for r in range(n) if (r * 3) // n == i]
            expected = sum(h[b, t] for t in members) / len(members)
            assert torch.allclose(h[b, f + i], expected, atol=1e-5)  # the layer input's real tokens, pooled
        assert torch.allclose(h[b, f + 3], cap.weight[2])  # the deep prompt slot holds W[l]
    assert inp.anchor.tolist() == (first + 3).tolist()
    rep = capt.attention(bb, "The cat sat on the mat today.", capsule=cap)
    assert rep.tokens[:4] == ["⟨pool:1⟩", "⟨pool:2⟩", "⟨pool:3⟩", capt.CAPSULE_TOKEN] and rep.anchor == 3


def test_pooled_token_probe_reports_each_k():
    from capt.analysis import pooled_token_probe

    bb = tiny("tiny-llama")
    cap = random_capsule(bb, fusion="none")
    examples = [dict(e, label=e.get("label", 0)) for e in RTE_EXAMPLES]
    result = pooled_token_probe(bb, RTE, examples, cap, ks=(0, 1, 2, 10))
    assert list(result) == [0, 1, 2, 10] and all(0 <= v <= 1 for v in result.values())
    plain = capt.predict(bb, RTE, examples, capsule=cap)
    assert result[0] == sum(RTE.labels.index(p.label) == e["label"] for p, e in zip(plain, examples)) / 3
    assert cap.config.pooled_tokens == 0  # the trained capsule is not changed


def test_probe_on_val_samples_the_val_split_and_checks_its_input():
    import random

    from capt.analysis import pooled_token_probe, probe_on_val

    bb = tiny("tiny-llama")
    cap = random_capsule(bb, fusion="none")
    r = probe_on_val(bb, RTE, cap, n_examples=5, ks=[3, 1, 1], seed=7)
    sample = random.Random(7).sample(capt.load_examples(RTE, "val"), 5)  # the same seeded sample, k sorted, once
    assert r.n_examples == 5 and r.task == "rte" and r.seed == 7 and r.subject == "the given deep prompt (fusion='none')"
    assert r.accuracy == pooled_token_probe(bb, RTE, sample, cap, ks=(0, 1, 3))
    bare = probe_on_val(bb, RTE, None, n_examples=4, ks=[1])
    assert "untrained deep prompt" in bare.subject and list(bare.accuracy) == [0, 1]
    for kwargs, message in [(dict(n_examples=3), "sample size 3 is out of range; valid: 4..1000"),
                            (dict(ks=[]), "choose one or more numbers of pooled tokens in 1..64"),
                            (dict(ks=[65]), "in 1..64")]:
        with pytest.raises(capt.CaptError, match=message):
            probe_on_val(bb, RTE, cap, **kwargs)
    with pytest.raises(capt.CaptError, match="built-in task's val split"):
        probe_on_val(bb, capt.custom_task("mine", ["text"], {"a": " yes", "b": " no"}), cap)
    with pytest.raises(capt.CaptError, match=r"in 0\.\.64"):
        pooled_token_probe(bb, RTE, sample, cap, ks=(0, 100))
