"""Every method the trainer compares, behind one small interface.

A Method owns its trainable parameters and turns a batch of rendered examples into (B, C) label
log-scores on a frozen backbone; the training loop never needs to know which method it trains.

    capt            CaPT (any CapsuleConfig)
    deep-prompt-1   one learnable token per layer at the earliest position, no instance mean
                    (the paper's single-prompt ablation: CapsuleConfig(fusion="none"))
    linear-head     frozen backbone + a d x C classifier on the last real token
    prompt-tuning   PEFT PromptTuning, m soft tokens on the input embeddings
    p-tuning-v2     PEFT PrefixTuning, an m-token K/V prefix at every layer
    zero-shot       the bare backbone scoring the label words
    majority        always the most frequent training label
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
import torch.nn as nn

from .backbones import Backbone
from .capsule import Capsule
from .config import CapsuleConfig
from .errors import CaptError
from .seeding import seeded
from .io import save_capsule
from .scoring import Scores, check_batch, head_states, score
from .tasks import Rendered, Task

METHODS = ("capt", "deep-prompt-1", "linear-head", "prompt-tuning", "p-tuning-v2", "zero-shot", "majority")
TRAINABLE = ("capt", "deep-prompt-1", "linear-head", "prompt-tuning", "p-tuning-v2")
# Which methods read which option (make_method below): deep-prompt-1 fixes fusion "none" and the slot itself,
# only the PEFT methods have virtual tokens; any other method ignores the option.
OPTION_USERS = {"fusion": ("capt",), "placement": ("capt",), "layers": ("capt", "deep-prompt-1"),
                "head": ("capt", "deep-prompt-1"), "num_virtual_tokens": ("prompt-tuning", "p-tuning-v2")}


class Method(nn.Module):
    """Base: no parameters. Subclasses set `name` and implement `scores`."""

    name = "method"
    artifact = "capsule"  # the run sub-folder save() writes

    def __init__(self, backbone: Backbone, task: Task):
        super().__init__()
        self.backbone, self.task = [backbone], task  # a list keeps the backbone out of state_dict()

    @property
    def bb(self) -> Backbone:
        return self.backbone[0]

    def scores(self, rendered: list[Rendered]) -> Scores:
        raise NotImplementedError

    def n_trainable(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def fit_labels(self, labels: list[int]) -> None:
        """Methods that learn from label counts alone (majority) look at the training labels here."""

    def save(self, folder: Path, training: dict, metrics: dict) -> Path | None:
        """Write the trained artifact; methods without one return None."""
        return None


class CaptMethod(Method):
    def __init__(self, backbone: Backbone, task: Task, config: CapsuleConfig | None = None, seed: int = 0,
                 name: str = "capt"):
        super().__init__(backbone, task)
        self.name = name
        self.capsule = Capsule.for_backbone(backbone, config or CapsuleConfig(), n_labels=len(task.labels),
                                            seed=seed)

    def scores(self, rendered):
        return score(self.bb, self.capsule, rendered)

    def save(self, folder, training, metrics):
        return save_capsule(self.capsule, folder, self.bb, self.task, training=training, metrics=metrics)


class LinearHeadMethod(Method):
    """A classifier on the frozen backbone's features. The backbone never changes and the features depend on
    the text it reads alone, so each text's features are computed once (the first batch that holds it, no graph)
    and kept: after the first epoch a training step or a dev evaluation is one d x C matmul, not a forward
    (`cache=False` runs the backbone on every call, as `score(..., head=)` does)."""

    name = "linear-head"

    def __init__(self, backbone: Backbone, task: Task, seed: int = 0, cache: bool = True):
        super().__init__(backbone, task)
        with seeded(seed):
            self.head = nn.Linear(backbone.hidden_size, len(task.labels))
        self.head.to(device=backbone.device, dtype=backbone.dtype)
        self.cache = {} if cache else None   # prompt -> ((d,) features, prompt tokens cut)

    def scores(self, rendered):
        if self.cache is None or check_batch(rendered) != self.head.out_features:  # (score's message)
            return score(self.bb, None, rendered, head=self.head)
        keys = [r.text_for(head=True) for r in rendered]   # what head_states reads
        new = {k: r for k, r in zip(keys, rendered) if k not in self.cache}
        if new:
            with torch.no_grad():
                h, dropped = head_states(self.bb, None, list(new.values()))
            self.cache.update((k, (h[i], dropped[i])) for i, k in enumerate(new))
        feats, dropped = zip(*(self.cache[k] for k in keys))
        return Scores(self.head(torch.stack(feats)), list(dropped))


class ZeroShotMethod(Method):
    name = "zero-shot"

    def scores(self, rendered):
        return score(self.bb, None, rendered)


class MajorityMethod(Method):
    name = "majority"

    def __init__(self, backbone: Backbone, task: Task):
        super().__init__(backbone, task)
        self.majority = 0

    def fit_labels(self, labels):
        if not labels:
            raise CaptError("majority class needs labelled training data")
        counts = Counter(labels)
        self.majority = min(counts, key=lambda k: (-counts[k], k))  # ties: the lower label index

    def scores(self, rendered):
        logits = torch.full((len(rendered), len(self.task.labels)), -1e4)
        logits[:, self.majority] = 0.0
        return Scores(logits, [0] * len(rendered))


def make_method(name: str, backbone: Backbone, task: Task, config: CapsuleConfig | None = None,
                seed: int = 0, num_virtual_tokens: int = 20) -> Method:
    """Build a method by name; unknown names list the valid ones."""
    if name == "capt":
        return CaptMethod(backbone, task, config, seed)
    if name == "deep-prompt-1":
        base = (config or CapsuleConfig()).to_dict()
        base.update(fusion="none", placement="slot")
        return CaptMethod(backbone, task, CapsuleConfig.from_dict(base), seed, name="deep-prompt-1")
    if name == "linear-head":
        return LinearHeadMethod(backbone, task, seed)
    if name in ("prompt-tuning", "p-tuning-v2"):
        from .peft_baselines import PeftMethod
        return PeftMethod(backbone, task, name, num_virtual_tokens=num_virtual_tokens, seed=seed)
    if name == "zero-shot":
        return ZeroShotMethod(backbone, task)
    if name == "majority":
        return MajorityMethod(backbone, task)
    raise CaptError(f"unknown method '{name}'; valid: {', '.join(METHODS)}")
