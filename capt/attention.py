"""Attention analysis for one input: the paper's "attention anchor" vs the "attention sink".

With a capsule, the anchor is the capsule slot; without one it is position 0 (BOS when the tokenizer
adds one), the classic attention sink. With a trained soft prompt (prompt tuning) instead, the anchor is
the span of its m tokens, fed exactly as PEFT feeds them (in front of everything, BOS included). The maps
come from the stack the capsule lives in (T5: the encoder's self-attention; decoder-only: every decoder
layer). Eager attention is switched on for this call only (under the backbone's lock) because fused
kernels do not return attention weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .backbones import Backbone
from .capsule import Capsule, run
from .errors import CaptError
from .io import SoftPrompt
from .scoring import encode_prompts

CAPSULE_TOKEN = "⟨capsule⟩"
SOFT_TOKEN = "⟨soft:{}⟩"   # soft prompt token i (1-based)


@dataclass
class AttentionReport:
    tokens: list[str]        # (T,) token strings in model order; capsule slots / soft tokens are labelled
    anchor: int              # index of the capsule slot, of the first soft token, or of position 0 / BOS
    anchor_label: str        # "capsule", "soft prompt", "BOS" or "position 0"
    maps: np.ndarray         # (L, H, T, T) attention probabilities; row = query, column = key
    truncated: bool
    anchor_span: int = 1     # anchor positions from `anchor` on: 1, or a soft prompt's m tokens

    @property
    def anchor_positions(self) -> range:
        return range(self.anchor, self.anchor + self.anchor_span)

    @property
    def to_anchor(self) -> np.ndarray:
        """(L, H, T): attention each token sends to the anchor (summed over the anchor's positions)."""
        return self.maps[..., self.anchor:self.anchor + self.anchor_span].sum(-1)

    @property
    def from_anchor(self) -> np.ndarray:
        """(L, H, T): attention the (first) anchor position sends to each token (causal models: only to
        itself, when the anchor is position 0)."""
        return self.maps[:, :, self.anchor, :]

    def anchor_mass(self) -> np.ndarray:
        """(L, H): attention each non-anchor token pays to all anchor positions together, averaged over
        those tokens, per layer and head."""
        span = self.anchor_positions
        others = [i for i in range(len(self.tokens)) if i not in span]
        return self.to_anchor[:, :, others].mean(-1) if others else np.zeros(self.maps.shape[:2])

    def mean_map(self, layer: int | None = None, head: int | None = None) -> np.ndarray:
        """(T, T): one layer/head, or the mean over whichever of them is None."""
        m = self.maps if layer is None else self.maps[layer:layer + 1]
        m = m if head is None else m[:, head:head + 1]
        return m.mean((0, 1))


def attention(backbone: Backbone, text: str, capsule: Capsule | None = None,
              soft_prompt: SoftPrompt | None = None) -> AttentionReport:
    """Per-layer, per-head attention for one prompt (a task's rendered prompt, or any text), bare, with a
    capsule, or with a trained soft prompt (capt.load_soft_prompt) in front, as PEFT's prompt tuning feeds it."""
    if not isinstance(text, str) or not text.strip():
        raise CaptError("attention needs a non-empty input text")
    if capsule is not None and soft_prompt is not None:
        raise CaptError("give a capsule or a soft prompt, not both: each is compared with the bare backbone "
                        "in its own attention call")
    prefix = None
    if soft_prompt is not None:
        if not isinstance(soft_prompt, SoftPrompt):
            raise CaptError(f"soft_prompt must be a SoftPrompt (capt.load_soft_prompt), got "
                            f"{type(soft_prompt).__name__}")
        soft_prompt.check(backbone)
        prefix = soft_prompt.embeddings
    tok, model = backbone.tokenizer, backbone.model
    m = prefix.shape[0] if prefix is not None else 0
    (ids,), (dropped,) = encode_prompts(backbone, capsule, [text], reserve=m)
    input_ids = torch.tensor([ids], device=backbone.device)
    mask = torch.ones_like(input_ids)
    with backbone.lock, torch.no_grad():
        previous = model.config._attn_implementation
        model.set_attn_implementation("eager")
        try:
            out, inp = run(backbone, capsule, input_ids, mask, output_attentions=True, prefix=prefix)
        finally:
            model.set_attn_implementation(previous)
    layers = list(out.attentions)   # L tensors (1, H, T', T')
    del out
    maps = np.empty((len(layers), *layers[0].shape[1:]), np.float32)   # filled layer by layer, each layer's
    for i in range(len(layers)):                                        # tensor dropped: no second full copy
        maps[i] = layers[i][0].float().cpu().numpy()
        layers[i] = None

    words = [tok.decode([i]) for i in ids]
    if prefix is not None:
        return AttentionReport(tokens=[SOFT_TOKEN.format(i + 1) for i in range(m)] + words, anchor=0,
                               anchor_label="soft prompt", maps=maps, truncated=dropped > 0, anchor_span=m)
    config = capsule.config if capsule is not None else None
    pooled = [f"⟨pool:{i + 1}⟩" for i in range(config.pooled_tokens)] if config else []
    slots = config.n_slots - len(pooled) if config else 0
    if slots == 2:
        tokens = pooled + [CAPSULE_TOKEN + ":mean", CAPSULE_TOKEN + ":W"] + words
    elif slots == 1:
        tokens = pooled + [CAPSULE_TOKEN] + words
    else:  # no extra token: inplace capsule on the first real token, or no capsule at all
        tokens = words[:]
        if capsule is not None:
            tokens[0] = CAPSULE_TOKEN + "+" + tokens[0]
    if capsule is not None:
        label = "capsule"
    else:
        label = "BOS" if tok.bos_token_id is not None and ids[0] == tok.bos_token_id else "position 0"
    return AttentionReport(tokens=tokens, anchor=len(pooled), anchor_label=label, maps=maps, truncated=dropped > 0)
