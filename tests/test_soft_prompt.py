"""Trained soft prompts (PEFT prompt tuning) in the attention view: our forward equals PEFT's own, the
adapter folder round-trips, the report's anchor is the soft prompt's span, and bad folders are refused."""
import json
import shutil

import numpy as np
import pytest
import torch
from conftest import random_capsule, tiny
from safetensors.torch import load_file, save_file

import capt
from capt.capsule import run
from capt.io import ADAPTER_CONFIG, ADAPTER_META, ADAPTER_WEIGHTS, PROMPT_KEY, find_soft_prompts
from capt.peft_baselines import PeftMethod

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers deprecations PEFT triggers

M = 5
TASK = capt.custom_task("toy", ["text"], {"a": " the", "b": " a"})
TEXT = "The cat sat on the mat near the door today."
TEXTS = ["The cat sat on the mat near the door today.", "Dogs bark.", "It rained all day in Paris."]
_methods = {}


def trained(bb_name: str, name: str = "prompt-tuning") -> PeftMethod:
    """One PEFT baseline per backbone, its prompt moved off PEFT's init so a mix-up would show."""
    key = (bb_name, name)
    if key not in _methods:
        method = PeftMethod(tiny(bb_name), TASK, name, num_virtual_tokens=M, seed=7)
        with torch.no_grad():
            w = method.prompt_encoder["default"].embedding.weight
            w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(3)))
        _methods[key] = method
    return _methods[key]


def saved(tmp_path, bb_name: str, name: str = "prompt-tuning", folder: str = "adapter"):
    method = trained(bb_name, name)
    return method.save(tmp_path / folder, {"steps": 3}, {"accuracy": 0.5}), method


class eager:
    """Eager attention on the shared model for one block (PEFT's own forward in the comparisons)."""

    def __init__(self, bb):
        self.model = bb.model

    def __enter__(self):
        self.previous = self.model.config._attn_implementation
        self.model.set_attn_implementation("eager")

    def __exit__(self, *exc):
        self.model.set_attn_implementation(self.previous)


def lm_head_input(bb, fn):
    """Call fn() and return what reached the LM head (the decoder's final hidden states)."""
    seen = {}
    handle = bb.model.get_output_embeddings().register_forward_pre_hook(lambda m, a: seen.__setitem__("h", a[0]))
    try:
        out = fn()
    finally:
        handle.remove()
    return out, seen["h"]


def batch(bb, texts, side):
    enc = bb.tokenizer(texts, padding=True, return_tensors="pt", padding_side=side)
    return enc["input_ids"], enc["attention_mask"]


# --- equivalence with PEFT ----------------------------------------------------------------------

@pytest.mark.parametrize("bb_name", ["tiny-llama", "tiny-qwen2", "tiny-gemma3", "tiny-t5"])
def test_attention_equals_peft_prompt_tuning(bb_name, tmp_path):
    bb = tiny(bb_name)
    folder, method = saved(tmp_path, bb_name)
    soft = capt.load_soft_prompt(folder, bb)
    rep = capt.attention(bb, TEXT, soft_prompt=soft)

    ids = torch.tensor([bb.tokenizer(TEXT)["input_ids"]])
    mask = torch.ones_like(ids)
    with torch.no_grad(), eager(bb):
        if bb.encoder_decoder:
            dec = ids[:, :3]
            ref = method.peft[0](input_ids=ids, attention_mask=mask, decoder_input_ids=dec, output_attentions=True,
                                 output_hidden_states=True)
            ref_maps = ref.encoder_attentions
            out, _ = run(bb, None, ids, mask, decoder_input_ids=dec, prefix=soft.embeddings)
            torch.testing.assert_close(out.last_hidden_state, ref.encoder_last_hidden_state, atol=1e-5, rtol=0)
            # the decoder cross-attends to the soft prompt too (the mask was extended for it)
            torch.testing.assert_close(out.decoder_last_hidden_state, ref.decoder_hidden_states[-1], atol=1e-5, rtol=0)
        else:
            ref, ref_h = lm_head_input(bb, lambda: method.peft[0](input_ids=ids, attention_mask=mask,
                                                                  output_attentions=True))
            ref_maps = ref.attentions
            out, _ = run(bb, None, ids, mask, prefix=soft.embeddings)
            torch.testing.assert_close(out.last_hidden_state, ref_h, atol=1e-5, rtol=0)
    ref_maps = torch.stack([a[0] for a in ref_maps]).numpy()
    assert rep.maps.shape == ref_maps.shape == (bb.n_layers, rep.maps.shape[1], ids.shape[1] + M, ids.shape[1] + M)
    np.testing.assert_allclose(rep.maps, ref_maps, atol=1e-5, rtol=0)
    assert bb.model.config._attn_implementation != "eager"


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("bb_name", ["tiny-llama", "tiny-gemma3", "tiny-t5"])
def test_padded_batch_equals_peft(bb_name, side, tmp_path):
    """run(prefix=) on a padded batch: PEFT puts the prompt before the pads and gives no position ids."""
    bb = tiny(bb_name)
    if bb.encoder_decoder and side == "left":
        pytest.skip("T5 is right-padded")
    folder, method = saved(tmp_path, bb_name)
    soft = capt.load_soft_prompt(folder, bb)
    ids, mask = batch(bb, TEXTS, side)
    real = torch.cat([torch.ones(len(TEXTS), M, dtype=torch.bool), mask.bool()], 1)
    with torch.no_grad():
        if bb.encoder_decoder:
            ref = method.peft[0](input_ids=ids, attention_mask=mask,
                                 decoder_input_ids=ids[:, :2]).encoder_last_hidden_state
            out, inp = run(bb, None, ids, mask, prefix=soft.embeddings)
            ours = out.last_hidden_state
        else:
            _, ref = lm_head_input(bb, lambda: method.peft[0](input_ids=ids, attention_mask=mask))
            out, inp = run(bb, None, ids, mask, prefix=soft.embeddings)
            ours = out.last_hidden_state
    torch.testing.assert_close(ours[real], ref[real], atol=1e-5, rtol=0)
    assert inp.attention_mask.tolist() == real.long().tolist()
    assert inp.real_index.tolist() == [list(range(M, M + ids.shape[1]))] * len(TEXTS)


def test_capsule_and_soft_prompt_are_exclusive(tmp_path):
    bb = tiny("tiny-llama")
    soft = capt.load_soft_prompt(saved(tmp_path, "tiny-llama")[0], bb)
    with pytest.raises(capt.CaptError, match="capsule or a soft prompt, not both"):
        capt.attention(bb, TEXT, capsule=random_capsule(bb), soft_prompt=soft)
    ids, mask = batch(bb, TEXTS[:1], "right")
    with pytest.raises(capt.CaptError, match="cannot be combined"):
        run(bb, random_capsule(bb), ids, mask, prefix=soft.embeddings)
    with pytest.raises(capt.CaptError, match="must be a SoftPrompt"):
        capt.attention(bb, TEXT, soft_prompt=soft.embeddings)


# --- files --------------------------------------------------------------------------------------

@pytest.mark.parametrize("bb_name", ["tiny-llama", "tiny-t5"])
def test_save_load_round_trip(bb_name, tmp_path):
    bb = tiny(bb_name)
    folder, method = saved(tmp_path, bb_name)
    assert set(load_file(folder / ADAPTER_WEIGHTS)) == {PROMPT_KEY}   # the key PEFT 0.21 writes
    soft = capt.load_soft_prompt(folder, bb)
    assert isinstance(soft, capt.SoftPrompt) and soft.n_tokens == M
    assert torch.equal(soft.embeddings, method.prompt_encoder["default"].embedding.weight)
    assert soft.embeddings.device == bb.device and soft.embeddings.dtype == bb.dtype
    assert soft.meta["method"] == "prompt-tuning" and soft.meta["backbone"]["name"] == bb_name
    assert soft.meta["metrics"] == {"accuracy": 0.5} and soft.meta["folder"] == str(folder)


def test_adapter_zip_holds_only_the_adapter_and_round_trips(tmp_path):
    import zipfile

    from capt.io import export_zip

    bb = tiny("tiny-llama")
    folder, method = saved(tmp_path, "tiny-llama")
    (folder / "stray.log").write_text("not part of the adapter")
    archive = export_zip(folder, tmp_path / "out" / "pt.zip")
    with zipfile.ZipFile(archive) as z:
        assert sorted(z.namelist()) == [f"adapter/{n}" for n in sorted(("README.md", ADAPTER_CONFIG, ADAPTER_META,
                                                                         ADAPTER_WEIGHTS))]   # no stray.log
        z.extractall(tmp_path / "unzipped")
    soft = capt.load_soft_prompt(tmp_path / "unzipped" / "adapter", bb)
    assert torch.equal(soft.embeddings, method.prompt_encoder["default"].embedding.weight)
    (folder / ADAPTER_WEIGHTS).unlink()
    with pytest.raises(capt.CaptError, match="no adapter_model.safetensors: it is not a complete PEFT adapter"):
        export_zip(folder)


def test_seq2seq_adapter_with_two_submodules_feeds_the_first_m(tmp_path):
    """PEFT's seq2seq default stores 2m rows; its forward puts only the first m before the encoder input."""
    bb = tiny("tiny-t5")
    folder, _ = saved(tmp_path, "tiny-t5")
    rows = torch.randn(2 * M, bb.hidden_size, generator=torch.Generator().manual_seed(0))
    save_file({PROMPT_KEY: rows}, str(folder / ADAPTER_WEIGHTS))
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    (folder / ADAPTER_CONFIG).write_text(json.dumps({**config, "num_transformer_submodules": 2}))
    assert torch.equal(capt.load_soft_prompt(folder, bb).embeddings, rows[:M])


# --- the report ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bb_name", ["tiny-llama", "tiny-t5"])
def test_report_anchor_is_the_soft_prompt_span(bb_name, tmp_path):
    bb = tiny(bb_name)
    soft = capt.load_soft_prompt(saved(tmp_path, bb_name)[0], bb)
    rep = capt.attention(bb, TEXT, soft_prompt=soft)
    words = [bb.tokenizer.decode([i]) for i in bb.tokenizer(TEXT)["input_ids"]]
    assert rep.tokens == [f"⟨soft:{i}⟩" for i in range(1, M + 1)] + words
    assert (rep.anchor, rep.anchor_span, rep.anchor_label, rep.truncated) == (0, M, "soft prompt", False)
    L, H, T, _ = rep.maps.shape
    assert T == len(words) + M and np.abs(rep.maps.sum(-1) - 1).max() < 1e-5
    np.testing.assert_allclose(rep.to_anchor, rep.maps[..., :M].sum(-1), rtol=1e-6)
    np.testing.assert_array_equal(rep.from_anchor, rep.maps[:, :, 0, :])
    by_hand = np.array([[sum(rep.maps[l, h, q, k] for k in range(M)) for q in range(M, T)] for l in range(L)
                        for h in range(H)]).mean(-1).reshape(L, H)
    np.testing.assert_allclose(rep.anchor_mass(), by_hand, rtol=1e-5, atol=1e-7)
    if not bb.encoder_decoder:  # causal: the first soft token sees only itself
        assert np.abs(rep.from_anchor[:, :, 0] - 1).max() < 1e-6
    # the capsule and bare reports keep a one-position anchor
    assert capt.attention(bb, TEXT).anchor_span == 1
    assert capt.attention(bb, TEXT, capsule=random_capsule(bb)).anchor_span == 1


def test_long_input_leaves_room_for_the_soft_prompt(tmp_path):
    bb = tiny("tiny-llama")
    soft = capt.load_soft_prompt(saved(tmp_path, "tiny-llama")[0], bb)
    rep = capt.attention(bb, "word " * 2000, soft_prompt=soft)
    assert rep.truncated and len(rep.tokens) == bb.max_length and rep.tokens[M - 1] == f"⟨soft:{M}⟩"


# --- refusals -----------------------------------------------------------------------------------

def test_folders_that_are_not_prompt_tuning_adapters_are_refused(tmp_path):
    bb = tiny("tiny-llama")
    with pytest.raises(capt.CaptError, match="not a PEFT adapter folder: it has no adapter_config.json"):
        capt.load_soft_prompt(tmp_path / "nowhere", bb)
    capsule = capt.save_capsule(random_capsule(bb), tmp_path / "capsule", bb)
    with pytest.raises(capt.CaptError, match="not a PEFT adapter folder.*load_capsule"):
        capt.load_soft_prompt(capsule, bb)
    prefix, _ = saved(tmp_path, "tiny-llama", "p-tuning-v2", "prefix")
    with pytest.raises(capt.CaptError, match="P-tuning v2.*not input tokens.*Only prompt-tuning soft prompts"):
        capt.load_soft_prompt(prefix, bb)

    folder, _ = saved(tmp_path, "tiny-llama")
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    (folder / ADAPTER_CONFIG).write_text(json.dumps({**config, "peft_type": "LORA"}))
    with pytest.raises(capt.CaptError, match="type 'LORA', not a prompt-tuning soft prompt"):
        capt.load_soft_prompt(folder, bb)
    (folder / ADAPTER_CONFIG).write_text("{not json")
    with pytest.raises(capt.CaptError, match="adapter_config.json is corrupt: not valid JSON"):
        capt.load_soft_prompt(folder, bb)
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config))
    (folder / ADAPTER_META).unlink()
    with pytest.raises(capt.CaptError, match="no capt.json, so the backbone it was trained for is unknown"):
        capt.load_soft_prompt(folder, bb)


def test_soft_prompt_for_another_backbone_is_refused_naming_both(tmp_path):
    llama, qwen = tiny("tiny-llama"), tiny("tiny-qwen2")
    folder, _ = saved(tmp_path, "tiny-llama")
    with pytest.raises(capt.CaptError, match="soft prompt was trained for backbone.*name=tiny-llama.*name=tiny-qwen2"):
        capt.load_soft_prompt(folder, qwen)
    soft = capt.load_soft_prompt(folder, llama)
    with pytest.raises(capt.CaptError, match="name=tiny-llama.*name=tiny-qwen2"):   # loaded, then used elsewhere
        capt.attention(qwen, TEXT, soft_prompt=soft)
    # same name, another width: the hidden size is checked against the adapter and the tensor
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    (folder / ADAPTER_CONFIG).write_text(json.dumps({**config, "token_dim": 64}))
    save_file({PROMPT_KEY: torch.zeros(M, 64)}, str(folder / ADAPTER_WEIGHTS))
    with pytest.raises(capt.CaptError, match="token_dim=64 but 'tiny-llama' has hidden size 32"):
        capt.load_soft_prompt(folder, llama)
    with pytest.raises(capt.CaptError, match="64-dimensional embeddings but 'tiny-llama' has hidden size 32"):
        capt.attention(llama, TEXT, soft_prompt=capt.SoftPrompt(torch.zeros(M, 64)))


def test_missing_corrupt_and_inconsistent_weights_are_refused(tmp_path):
    bb = tiny("tiny-llama")
    folder, _ = saved(tmp_path, "tiny-llama")
    data = (folder / ADAPTER_WEIGHTS).read_bytes()
    (folder / ADAPTER_WEIGHTS).write_bytes(data[: len(data) // 2])
    with pytest.raises(capt.CaptError, match="adapter_model.safetensors is corrupt or truncated"):
        capt.load_soft_prompt(folder, bb)
    (folder / ADAPTER_WEIGHTS).write_bytes(b"\x00" * 16)
    with pytest.raises(capt.CaptError, match="corrupt or truncated"):
        capt.load_soft_prompt(folder, bb)
    (folder / ADAPTER_WEIGHTS).unlink()
    with pytest.raises(capt.CaptError, match="has no adapter_model.safetensors"):
        capt.load_soft_prompt(folder, bb)
    (folder / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(capt.CaptError, match="has no adapter_model.safetensors.*pickled adapter_model.bin"):
        capt.load_soft_prompt(folder, bb)
    save_file({"something_else": torch.zeros(M, 32)}, str(folder / ADAPTER_WEIGHTS))
    with pytest.raises(capt.CaptError, match="holds no 'prompt_embeddings' tensor.*something_else"):
        capt.load_soft_prompt(folder, bb)
    save_file({PROMPT_KEY: torch.zeros(M + 1, 32)}, str(folder / ADAPTER_WEIGHTS))
    with pytest.raises(capt.CaptError, match=r"shape \(6, 32\).*says \(5, 32\)"):
        capt.load_soft_prompt(folder, bb)
    save_file({PROMPT_KEY: torch.full((M, 32), float("nan"))}, str(folder / ADAPTER_WEIGHTS))
    with pytest.raises(capt.CaptError, match="NaN or infinite"):
        capt.load_soft_prompt(folder, bb)


# --- finding them -------------------------------------------------------------------------------

def test_find_soft_prompts(tmp_path):
    root = tmp_path / "root"
    llama_rte, _ = saved(root / "tiny-llama", "tiny-llama", folder="rte-soft")
    llama_cb = shutil.copytree(llama_rte, root / "tiny-llama" / "cb" / "runs" / "adapter")   # any depth
    qwen, _ = saved(root / "tiny-qwen2", "tiny-qwen2", folder="rte-soft")
    saved(root / "tiny-llama", "tiny-llama", "p-tuning-v2", folder="prefix")                 # not prompt tuning
    capt.save_capsule(random_capsule(tiny("tiny-llama")), root / "tiny-llama" / "rte", tiny("tiny-llama"))
    shutil.copytree(llama_rte, root / "tiny-llama" / ".rte-soft.tmp-1")                      # unfinished write
    broken = root / "tiny-llama" / "broken"
    broken.mkdir()
    (broken / ADAPTER_META).write_text("{not json")
    (root / "notes.txt").write_text("a file")

    assert find_soft_prompts(root, "tiny-llama") == [llama_cb, llama_rte]
    assert find_soft_prompts(root, "tiny-qwen2") == [qwen]
    assert find_soft_prompts(root) == sorted([llama_cb, llama_rte, qwen])
    for name in ("smollm2-135m", "..", ""):
        assert find_soft_prompts(root, name) == []
    assert find_soft_prompts(tmp_path / "nowhere") == []
    for folder in find_soft_prompts(root):   # every one it lists loads
        capt.load_soft_prompt(folder, tiny(json.loads((folder / ADAPTER_META).read_text())["backbone"]["name"]))
