"""lm_loss(): a capsule trained on free text with the backbone's own language-modelling loss, in your own loop
or in transformers' Trainer (`CapsuleLM`): what prompt tuning with PEFT does, with a capsule instead.

Labels follow transformers' convention: `labels` has input_ids' shape (decoder-only; T5: the target's), -100
marks a token that is not scored, and position t is predicted from the tokens before it. The one point
particular to CaPT: the capsule sits at the earliest position and every token attends to it, so its instance
mean must not read a token that is to be predicted, or each scored token would see itself (and every later
one) through the capsule. By default the mean is over each row's real tokens before its first scored token,
the prompt; a prompt marked with -100 is what the capsule reads (with everything scored, it reads the first
token alone). `capt.generate` takes the mean over the prompt too, so a capsule trained here generates as
it was trained. T5: the capsule reads the whole encoder input and the decoder's tokens are scored.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .backbones import Backbone
from .capsule import Capsule, run
from .config import CapsuleConfig
from .errors import CaptError
from .scoring import lm_logits

IGNORE = -100


@dataclass
class LMOutput:
    loss: torch.Tensor                 # mean cross-entropy over the scored tokens (transformers' reduction)
    n_scored: int                      # how many tokens were scored
    logits: torch.Tensor | None = None  # (B, T, V) if asked for; decoder-only: position t predicts token t+1


def prompt_mask(labels: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) the capsule's default instance tokens: each row's real tokens before its first scored token."""
    T = labels.shape[1]
    pos = torch.arange(T, device=labels.device).expand_as(labels)
    first = torch.where(labels != IGNORE, pos, T).min(1).values          # T when a row scores nothing
    return attention_mask.bool() & (pos < first[:, None])


def lm_loss(backbone: Backbone, capsule: Capsule | None, input_ids: torch.Tensor,
            attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
            instance_mask: torch.Tensor | None = None, return_logits: bool = False) -> LMOutput:
    """The backbone's language-modelling loss on `labels` with the capsule attached (capsule=None: the bare
    backbone, equal to transformers' own loss). Differentiable w.r.t. the capsule; the backbone stays frozen.

    input_ids, attention_mask: (B, T), either padding side. labels: decoder-only (B, T) aligned with
    input_ids, -100 where not scored (padding and a row's first real token are never scored: nothing real
    precedes the latter);
    T5: (B, T_dec) the target, decoded from the capsule-carrying encoder output. instance_mask (B, T): the
    tokens whose mean the capsule reads; by default the prompt (`prompt_mask`); one that reaches a scored
    token (which would let it see the answer) is refused.
    """
    input_ids, attention_mask = _check_inputs(backbone, capsule, input_ids, attention_mask, labels)
    if instance_mask is not None and instance_mask.shape != input_ids.shape:
        raise CaptError(f"instance_mask {tuple(instance_mask.shape)} must have input_ids' shape "
                        f"{tuple(input_ids.shape)}")
    labels = labels.to(input_ids.device).long()
    if backbone.encoder_decoder:
        dec_in = backbone.model._shift_right(labels)                       # start token in front, -100 -> pad
        inst = instance_mask.to(input_ids.device) if instance_mask is not None else None
        out, _ = run(backbone, capsule, input_ids, attention_mask, inst, decoder_input_ids=dec_in)
        logits = lm_logits(backbone, out.decoder_last_hidden_state).float()  # (B, T_dec, V)
        scored = labels != IGNORE
        loss = F.cross_entropy(logits[scored], labels[scored])
        return LMOutput(loss, int(scored.sum()), logits if return_logits else None)

    mask = attention_mask.bool()
    scored = (labels != IGNORE) & mask
    scored[:, 1:] &= mask[:, :-1]                # a token after a pad (a row's first real token) has no context
    scored[:, 0] = False
    if not scored.any():
        raise CaptError("no token to learn: every label is -100 (or marks a row's first real token, which "
                        "has nothing before it to predict it from); give the answer tokens their ids")
    prompt = prompt_mask(torch.where(scored, labels, IGNORE), mask)
    inst = prompt if instance_mask is None else instance_mask.to(mask.device).bool() & mask
    _check_no_peeking(inst, prompt)
    out, inputs = run(backbone, capsule, input_ids, attention_mask, instance_mask=inst)
    h = out.last_hidden_state
    if return_logits:                                          # every original position, the slot(s) left out
        idx = inputs.real_index.to(h.device)[..., None].expand(-1, -1, h.shape[-1])
        logits = lm_logits(backbone, h.gather(1, idx)).float()  # (B, T, V)
        loss = F.cross_entropy(logits[:, :-1][scored[:, 1:]], labels[scored])
        return LMOutput(loss, int(scored.sum()), logits)
    rows, cols = scored.nonzero(as_tuple=True)                 # the head runs only where a token is predicted
    h = h[rows, inputs.real_index.to(h.device)[rows, cols - 1]]
    loss = F.cross_entropy(lm_logits(backbone, h).float(), labels[rows, cols])
    return LMOutput(loss, len(rows))


def _check_inputs(backbone, capsule, input_ids, attention_mask, labels):
    if labels is None:
        raise CaptError("labels are needed: the token ids to learn, -100 where a token is not scored (the prompt, "
                        "the padding), as transformers' language-modelling loss takes them")
    if not (torch.is_tensor(input_ids) and input_ids.dim() == 2 and input_ids.shape[1] > 0):
        raise CaptError(f"input_ids must be a (batch, length) tensor of token ids, got "
                        f"{tuple(input_ids.shape) if torch.is_tensor(input_ids) else type(input_ids).__name__}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise CaptError(f"attention_mask {tuple(attention_mask.shape)} must have input_ids' shape "
                        f"{tuple(input_ids.shape)}")
    if not torch.is_tensor(labels) or labels.dim() != 2 or labels.shape[0] != input_ids.shape[0] or (
            not backbone.encoder_decoder and labels.shape != input_ids.shape):
        want = "(batch, target length)" if backbone.encoder_decoder else f"input_ids' shape {tuple(input_ids.shape)}"
        got = tuple(labels.shape) if torch.is_tensor(labels) else type(labels).__name__
        raise CaptError(f"labels must have {want}, got {got}")
    if backbone.encoder_decoder and not (labels != IGNORE).any():
        raise CaptError("no token to learn: every label is -100; give the target tokens their ids")
    if capsule is not None and (capsule.head is not None or capsule.config.head != "verbalizer"):
        raise CaptError("this capsule has a linear head, which scores a task's labels; the language-modelling "
                        "loss uses the backbone's own head: make the capsule with head='verbalizer' (the default)")
    n_slots = capsule.config.n_slots if capsule is not None else 0
    if input_ids.shape[1] + n_slots > backbone.max_length:
        raise CaptError(f"inputs of {input_ids.shape[1]} tokens (+{n_slots} capsule slot(s)) exceed the backbone's "
                        f"limit of {backbone.max_length}; cut them to at most {backbone.max_length - n_slots}")
    device = backbone.device
    return input_ids.to(device), attention_mask.to(device)


def _check_no_peeking(inst: torch.Tensor, prompt: torch.Tensor) -> None:
    """The instance tokens of a row must all be in its prompt, before its first scored token (the one whose
    prediction comes from position first-1 sees tokens < first only; a capsule reading token first or later
    leaks it)."""
    late = (inst & ~prompt).any(1)
    if late.any():
        rows = late.nonzero()[:, 0].tolist()
        raise CaptError(f"instance_mask reaches a scored token in row(s) {rows}: the capsule sits in front of "
                        "every token, so it would show the answer to its own prediction; keep the instance "
                        "tokens before each row's first scored one (the default, capt.lm.prompt_mask)")
    if not inst.any(1).all():
        raise CaptError("a row has no instance token for the capsule to read; give it a prompt (tokens with "
                        "label -100) before its first scored token")


class CapsuleLM(nn.Module):
    """A capsule as a model transformers' Trainer (or any PyTorch loop) trains: `forward(input_ids,
    attention_mask, labels)` returns {"loss": ...} from `lm_loss`. The backbone is frozen and kept outside the
    module's parameters, so `parameters()`, `state_dict()` and Trainer's checkpoints hold the capsule alone;
    `save(folder)` writes an ordinary capsule folder (`capt.load_capsule`); `generate` is `capt.generate` with it."""

    def __init__(self, backbone: Backbone, capsule: Capsule | None = None, config: CapsuleConfig | None = None,
                 seed: int | None = 0):
        super().__init__()
        if capsule is not None and config is not None:
            raise CaptError("give a capsule or a config for a new one, not both")
        self.capsule = capsule if capsule is not None else Capsule.for_backbone(backbone, config, seed=seed)
        self.__dict__["backbone"] = backbone     # not a submodule: never trained, moved or saved with the capsule

    def forward(self, input_ids, attention_mask=None, labels=None, instance_mask=None):
        return {"loss": lm_loss(self.backbone, self.capsule, input_ids, attention_mask, labels, instance_mask).loss}

    def save(self, folder, training: dict | None = None):
        from .io import save_capsule
        return save_capsule(self.capsule, folder, self.backbone, None, training=training)

    def generate(self, prompts, max_new_tokens: int = 32, **generate_kwargs):
        """`capt.generate` with this capsule: the backbone's continuation of each prompt."""
        from .generation import generate
        return generate(self.backbone, prompts, self.capsule, max_new_tokens, **generate_kwargs)
