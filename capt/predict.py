"""predict(): label probabilities for one example or a batch, with or without a capsule."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .backbones import Backbone
from .capsule import Capsule
from .scoring import score
from .tasks import Task, get_task


@dataclass
class Prediction:
    label: str                  # the most probable label name
    probs: dict[str, float]     # every label's probability (softmax over the label set only)
    truncated: bool             # the input was longer than the backbone's limit and was cut
    dropped_tokens: int         # how many prompt tokens were cut

    def to_dict(self) -> dict:
        return asdict(self)


def predict(backbone: Backbone, task: Task | str, examples: dict | list[dict], capsule: Capsule | None = None,
            batch_size: int = 8) -> Prediction | list[Prediction]:
    """Probabilities of every label for `examples` (a dict, or a list of dicts with the task's fields).

    capsule=None gives the bare backbone (zero-shot), so on and off can be shown side by side.
    """
    task = get_task(task) if isinstance(task, str) else task
    single = isinstance(examples, dict)
    batch = [examples] if single else list(examples)
    rendered = [task.render(ex, backbone.style) for ex in batch]  # validates every example first
    results: list[Prediction] = []
    with torch.no_grad():
        for i in range(0, len(rendered), batch_size):
            s = score(backbone, capsule, rendered[i:i + batch_size])
            probs = torch.softmax(s.logits.float(), -1).cpu()
            for p, dropped in zip(probs, s.dropped):
                results.append(Prediction(label=task.labels[int(p.argmax())],
                                          probs={name: float(v) for name, v in zip(task.labels, p)},
                                          truncated=dropped > 0, dropped_tokens=dropped))
    return results[0] if single else results
