"""Scoring over the label set: log-scores (B, C), never free generation.

Decoder-only, verbalizer head: the score of a label is the log-probability of its continuation after
the prompt (summed over its tokens). When every label is one token the whole batch takes one forward
and the LM head runs only on the last real token; otherwise (COPA's sentences) each (example, label)
pair is a row and the head runs only on the continuation's positions. The capsule's instance mean is
always over the prompt alone, so no label ever sees another label's tokens.
T5: the encoder (with the capsule) runs once; the decoder scores each label's target tokens.
Linear head: a d x C classifier on the last real token (T5: the decoder's first step) of the prompt, or
where the choices are the example's own text (COPA) of the prompt followed by them (Rendered.head_prompt).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .backbones import Backbone
from .capsule import Capsule, run
from .errors import CaptError
from .tasks import Rendered


@dataclass
class Scores:
    logits: torch.Tensor     # (B, C) log-scores; softmax over C gives the label probabilities
    dropped: list[int]       # per example: prompt tokens cut to fit backbone.max_length (0 = none)


def score(backbone: Backbone, capsule: Capsule | None, rendered: list[Rendered],
          general: bool = False, head: torch.nn.Module | None = None) -> Scores:
    """Label log-scores for a batch. Differentiable w.r.t. the capsule and head. `head` (d -> C)
    defaults to the capsule's own; without one the LM head scores the label words (verbalizer).
    `general` forces the per-(example, label) path even when every label is one token (tests)."""
    n_choices = check_batch(rendered)
    if head is None and capsule is not None:
        head = capsule.head
    if head is not None and head.out_features != n_choices:
        raise CaptError(f"this head scores {head.out_features} labels but the task has "
                        f"{n_choices}; use the task the capsule was trained on")
    if head is not None:
        h, dropped = head_states(backbone, capsule, rendered)
        return Scores(head(h), dropped)
    if backbone.encoder_decoder:
        return _score_t5(backbone, capsule, rendered)
    return _score_decoder(backbone, capsule, rendered, general)


def check_batch(rendered: list[Rendered]) -> int:
    """The number of labels C every example of a batch shares; a clear error for an empty or mixed batch."""
    if not rendered:
        raise CaptError("nothing to score: the batch is empty")
    n_choices = {len(r.choices) for r in rendered}
    if len(n_choices) != 1:
        raise CaptError(f"examples in one batch must have the same number of labels, got {sorted(n_choices)}")
    return n_choices.pop()


# --- tokens ------------------------------------------------------------------------------------

def encode_prompts(backbone: Backbone, capsule: Capsule | None, prompts: list[str],
                   reserve: int = 0) -> tuple[list[list[int]], list[int]]:
    """Token ids per prompt, cut to fit the model's limit with room for the slots and `reserve`
    continuation tokens. Decoder-only models keep the end (the question and the answer cue) and a
    leading BOS; T5 keeps the start and its closing EOS."""
    tok = backbone.tokenizer
    limit = backbone.max_length - (capsule.config.n_slots if capsule is not None else 0) - reserve
    if limit < 2:
        raise CaptError(f"max_length={backbone.max_length} leaves no room for the input")
    out, dropped = [], []
    for ids in tok(list(prompts), add_special_tokens=True)["input_ids"]:
        n = len(ids)
        if n > limit:
            if backbone.encoder_decoder:
                ids = ids[:limit - 1] + ids[-1:] if ids[-1] == tok.eos_token_id else ids[:limit]
            elif ids[0] == tok.bos_token_id and tok.bos_token_id is not None:
                ids = ids[:1] + ids[-(limit - 1):]
            else:
                ids = ids[-limit:]
        if not ids:
            raise CaptError("an input is empty after tokenization; give non-empty text")
        out.append(ids)
        dropped.append(n - len(ids))
    return out, dropped


def pad(seqs: list[list[int]], pad_id: int, side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), each (B, T_max), padded on `side`."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        ids[i, sl] = torch.tensor(s, dtype=torch.long)
        mask[i, sl] = 1
    return ids, mask


def lm_logits(backbone: Backbone, h: torch.Tensor) -> torch.Tensor:
    """The backbone's own head on selected hidden states (..., d) -> (..., V)."""
    cfg = backbone.model.config
    if backbone.encoder_decoder and getattr(cfg, "scale_decoder_outputs", cfg.tie_word_embeddings):
        h = h * cfg.d_model ** -0.5  # T5 with tied embeddings rescales before its head
    logits = backbone.model.get_output_embeddings()(h)
    cap = getattr(cfg, "final_logit_softcapping", None)  # Gemma 2
    return torch.tanh(logits / cap) * cap if cap else logits


def _last_real(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B,) index of each row's last real token, either padding side."""
    return mask.shape[1] - 1 - mask.flip(1).argmax(1)


def _device(backbone: Backbone, *tensors):
    return [t.to(backbone.device) for t in tensors]


# --- the label set as tokens (shared with the PEFT baselines) -----------------------------------

def label_tokens(tokenizer, rendered: list[Rendered]) -> tuple[list[list[list[int]]], bool]:
    """Each example's label continuations as token ids, and whether every label is one token and all
    examples share them (then one row per example, read at its last real token, scores the batch)."""
    choice_ids = [[tokenizer(c, add_special_tokens=False)["input_ids"] for c in r.choices] for r in rendered]
    single = all(len(c) == 1 for row in choice_ids for c in row)
    return choice_ids, single and all(row == choice_ids[0] for row in choice_ids)


@dataclass
class LabelRows:
    """One row per (example, label), row-major: the prompt followed by the label's tokens, padded."""

    ids: torch.Tensor        # (N, T) N = B*C
    mask: torch.Tensor       # (N, T)
    prompt_mask: torch.Tensor  # (N, T) the prompt's tokens only (the capsule's instance mean)
    row_of: torch.Tensor     # (K,) for every label token: its row,
    pos_of: torch.Tensor     # (K,) the position whose next-token distribution predicts it (ascending per row),
    target: torch.Tensor     # (K,) and its id

    def totals(self, token_logp: torch.Tensor, n_examples: int) -> torch.Tensor:
        """(K,) log-probs of the label tokens -> (B, C): each label's continuation, summed."""
        totals = torch.zeros(self.ids.shape[0], device=token_logp.device, dtype=token_logp.dtype)
        return totals.index_add(0, self.row_of.to(token_logp.device), token_logp).view(n_examples, -1)


def label_rows(prompts: list[list[int]], choice_ids: list[list[list[int]]], pad_id: int, side: str) -> LabelRows:
    """Position len(prompt)-1+k of a row predicts the label's token k (either padding side)."""
    pairs = [(p, c) for p, row in zip(prompts, choice_ids) for c in row]
    ids, mask = pad([p + c for p, c in pairs], pad_id, side)
    offset = (mask.shape[1] - mask.sum(1)) if side == "left" else torch.zeros(len(pairs), dtype=torch.long)
    prompt_mask = torch.zeros_like(mask)
    row_of, pos_of, target = [], [], []
    for n, (p, c) in enumerate(pairs):
        o = int(offset[n])
        prompt_mask[n, o:o + len(p)] = 1
        for k, t in enumerate(c):
            row_of.append(n), pos_of.append(o + len(p) - 1 + k), target.append(t)
    return LabelRows(ids, mask, prompt_mask, *(torch.tensor(x, dtype=torch.long) for x in (row_of, pos_of, target)))


def t5_targets(backbone: Backbone, rendered: list[Rendered]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """T5 teacher forcing, one row per (example, label): (targets, their mask, decoder inputs), (B*C, T_dec)."""
    tok = backbone.tokenizer
    targets = [tok(c, add_special_tokens=True)["input_ids"] for r in rendered for c in r.choices]
    tgt, tmask = pad(targets, tok.pad_token_id, "right")
    dec_in = torch.cat([torch.full_like(tgt[:, :1], backbone.model.config.decoder_start_token_id), tgt[:, :-1]], 1)
    return _device(backbone, tgt, tmask, dec_in)


def t5_totals(logp: torch.Tensor, tgt: torch.Tensor, tmask: torch.Tensor, n_examples: int) -> torch.Tensor:
    """(B*C, T_dec, V) decoder log-probs -> (B, C): each label's target tokens, summed."""
    return (logp.gather(2, tgt[..., None])[..., 0] * tmask).sum(1).view(n_examples, -1)


# --- what a linear head reads -------------------------------------------------------------------

def head_states(backbone: Backbone, capsule: Capsule | None, rendered: list[Rendered]) -> tuple[torch.Tensor, list[int]]:
    """What a linear head reads: (B, d) hidden states (the last real token; T5: the decoder's first step) of
    each example's text for a head (Rendered.text_for(head=True): COPA's lists its choices), and the tokens cut
    per example. Without a capsule they depend on that text alone."""
    texts = [r.text_for(head=True) for r in rendered]
    if backbone.encoder_decoder:
        prompts, dropped = encode_prompts(backbone, capsule, texts)
        ids, mask = _device(backbone, *pad(prompts, backbone.tokenizer.pad_token_id, "right"))
        dec_in = torch.full((len(rendered), 1), backbone.model.config.decoder_start_token_id, dtype=torch.long,
                            device=ids.device)
        out, _ = run(backbone, capsule, ids, mask, decoder_input_ids=dec_in)
        return out.decoder_last_hidden_state[:, -1], dropped
    return _last_states(backbone, capsule, texts)


def _last_states(backbone, capsule, texts: list[str]) -> tuple[torch.Tensor, list[int]]:
    """Decoder-only: one forward over the texts, the last real token's hidden state (B, d)."""
    prompts, dropped = encode_prompts(backbone, capsule, texts)
    ids, mask = _device(backbone, *pad(prompts, backbone.tokenizer.pad_token_id, backbone.tokenizer.padding_side))
    out, inp = run(backbone, capsule, ids, mask)
    rows = torch.arange(ids.shape[0], device=ids.device)
    return out.last_hidden_state[rows, inp.real_index[rows, _last_real(mask)]], dropped


# --- decoder-only ------------------------------------------------------------------------------

def _score_decoder(backbone, capsule, rendered, general) -> Scores:
    tok = backbone.tokenizer
    side = tok.padding_side
    choice_ids, one_token = label_tokens(tok, rendered)
    if one_token and not general:
        h, dropped = _last_states(backbone, capsule, [r.prompt for r in rendered])
        logp = torch.log_softmax(lm_logits(backbone, h).float(), -1)    # (B, V)
        return Scores(logp[:, [c[0] for c in choice_ids[0]]], dropped)

    reserve = max(len(c) for row in choice_ids for c in row)
    prompts, dropped = encode_prompts(backbone, capsule, [r.prompt for r in rendered], reserve)
    lr = label_rows(prompts, choice_ids, tok.pad_token_id, side)         # N = B*C rows
    ids, mask, inst, row_of, pos_of, target = _device(backbone, lr.ids, lr.mask, lr.prompt_mask, lr.row_of,
                                                      lr.pos_of, lr.target)
    out, inp = run(backbone, capsule, ids, mask, instance_mask=inst)     # mean over the prompt only
    h = out.last_hidden_state[row_of, inp.real_index[row_of, pos_of]]   # (K, d) continuation positions
    logp = torch.log_softmax(lm_logits(backbone, h).float(), -1).gather(1, target[:, None])[:, 0]
    return Scores(lr.totals(logp, len(rendered)), dropped)


# --- encoder-decoder ---------------------------------------------------------------------------

def _score_t5(backbone, capsule, rendered) -> Scores:
    tok, model = backbone.tokenizer, backbone.model
    prompts, dropped = encode_prompts(backbone, capsule, [r.prompt for r in rendered])
    ids, mask = _device(backbone, *pad(prompts, tok.pad_token_id, "right"))
    enc, inp = run(backbone, capsule, ids, mask)
    C = len(rendered[0].choices)
    tgt, tmask, dec_in = t5_targets(backbone, rendered)
    with backbone.lock:
        dec = model.decoder(input_ids=dec_in, attention_mask=tmask,
                            encoder_hidden_states=enc.last_hidden_state.repeat_interleave(C, 0),
                            encoder_attention_mask=inp.attention_mask.repeat_interleave(C, 0))
    logp = torch.log_softmax(lm_logits(backbone, dec.last_hidden_state).float(), -1)
    return Scores(t5_totals(logp, tgt, tmask, len(rendered)), dropped)
