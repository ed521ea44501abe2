"""Shared fixtures: tiny random backbones of every supported architecture family, built from configs.

Adding an architecture to ARCHS gives it the whole capsule suite (the PEFT `testing_common` idea).
"""
import itertools
import os
import socket
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")   # tests never touch the network (set before any HF import)
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import pytest  # noqa: E402
import torch  # noqa: E402

import capt  # noqa: E402
torch.manual_seed(0)
# Tiny models are fastest on one thread (thread start-up costs more than their matmuls); the SmolLM2
# integration tests raise it again for their module.
torch.set_num_threads(1)

ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-gemma3", "tiny-mistral", "tiny-t5"]

# every option of DESIGN.md §1, each on every architecture
OPTIONS = {
    "default": dict(),
    "prepend": dict(fusion="prepend"),
    "extract": dict(fusion="extract"),
    "project": dict(fusion="project"),
    "none": dict(fusion="none"),
    "inplace": dict(placement="inplace"),
    "odd": dict(layers="odd"),
    "even": dict(layers="even"),
    "first_half": dict(layers="first_half"),
    "latter_half": dict(layers="latter_half"),
    "list": dict(layers=[1, 3]),
    "linear": dict(head="linear"),
    "pooled": dict(fusion="none", pooled_tokens=2),  # the training-free probe's slots
}

_cache = {}
_hooks_at_load = {}


def _count_hooks(model) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def tiny(name: str) -> capt.Backbone:
    """Tiny backbones are read-only, so one instance per architecture serves every test."""
    if name not in _cache:
        _cache[name] = capt.load_backbone(name, device="cpu")
        _hooks_at_load[name] = _count_hooks(_cache[name].model)
    return _cache[name]


def hooks_at_load(bb) -> int:
    """How many hooks the backbone had right after loading (transformers' own capture hooks)."""
    return _hooks_at_load[bb.name]


@pytest.fixture
def training_clock(monkeypatch):
    """capt.training's clock on a fixed pace, 7 ms a reading (a step reads it twice), whatever the machine: a
    test of time-boxed chunks gets the same chunks on a fast CPU (which ran 8 tiny steps inside one 50 ms chunk
    of the real clock) as on a slow one."""
    ticks = itertools.count()
    monkeypatch.setattr(capt.training, "time", SimpleNamespace(time=lambda: 0.007 * next(ticks)))


@pytest.fixture(params=ARCHS)
def backbone(request):
    return tiny(request.param)


def random_capsule(bb, n_labels=2, seed=1, **options):
    """A capsule with non-zero random values everywhere (a zero W would hide mistakes)."""
    cap = capt.Capsule.for_backbone(bb, capt.CapsuleConfig(**options), n_labels=n_labels, seed=seed)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in cap.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    return cap


RTE_EXAMPLES = [
    {"premise": "The cat sat on the mat near the door.", "hypothesis": "A cat sat.", "label": 0},
    {"premise": "It rained.", "hypothesis": "The ground in the garden was completely dry.", "label": 1},
    {"premise": "Paris is the capital of France, a country in Europe.", "hypothesis": "Paris is in Europe."},
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def serve():
    """serve(demo) -> URL: a Gradio app launched on a free local port in this process, closed after the test."""
    demos = []

    def launch(demo) -> str:
        demos.append(demo)
        _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=free_port(),
                                quiet=True)
        return url
    yield launch
    for demo in demos:
        demo.close()
