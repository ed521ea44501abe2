"""The paper's training-free probe: one instance-aware token helps, more tokens hurt.

With a trained capsule (the paper uses deep prompt-tuning, i.e. CapsuleConfig(fusion="none") from
`python -m train --method deep-prompt-1`), prepend k mean-pooled instance tokens before it at every
capsule layer - nothing is trained - and measure accuracy for each k (the paper: 1, 2, 3, 4, 10).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from .backbones import Backbone
from .capsule import Capsule
from .errors import CaptError
from .predict import predict
from .tasks import Task


def with_pooled_tokens(capsule: Capsule, k: int) -> Capsule:
    """The same trained capsule (shared weights, no copy) with k pooled instance slots before it."""
    probe = Capsule(replace(capsule.config, pooled_tokens=k), capsule.n_layers, capsule.hidden_size,
                    capsule.head.out_features if capsule.head is not None else None, meta=capsule.meta)
    probe.load_state_dict(capsule.state_dict())
    return probe.to(device=capsule.weight.device, dtype=capsule.weight.dtype)


def pooled_token_probe(backbone: Backbone, task: Task, examples: list[dict], capsule: Capsule,
                       ks=(0, 1, 2, 3, 4, 10), batch_size: int = 8) -> dict[int, float]:
    """Accuracy on labelled `examples` for each number k of pooled tokens (k=0: the capsule as trained)."""
    if not examples or any(e.get("label") is None for e in examples):
        raise CaptError("the probe needs labelled examples")
    golds = [task.label_index(e["label"]) if not isinstance(e["label"], int) else e["label"] for e in examples]
    result = {}
    with torch.no_grad():
        for k in ks:
            preds = predict(backbone, task, examples, capsule=with_pooled_tokens(capsule, int(k)),
                            batch_size=batch_size)
            result[int(k)] = sum(task.labels.index(p.label) == g for p, g in zip(preds, golds)) / len(golds)
    return result
