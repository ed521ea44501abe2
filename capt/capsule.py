"""The capsule: W (n_capsule_layers, d) plus optional fusion extras and head, and how it enters a backbone.

One place knows how a capsule enters a backbone (`run`): we build `inputs_embeds` ourselves with the
capsule slot inserted just before the first real token of every row (whatever the padding side),
extend the attention mask, derive position ids from the mask, and register forward pre-hooks on the
capsule layers that overwrite the slot with c_l. The hooks live for one call and are always removed:
a backbone object is never left modified.

`run` also takes a soft prompt instead of a capsule (`prefix`, (m, d) embeddings): it is put in front of
the input embeddings exactly as PEFT's PromptTuning does (see `build_inputs`), so the attention view can
compare a trained soft prompt with the capsule on the same code path.

Shapes: B batch, T tokens, S capsule slots (0, 1 or 2), d hidden size, C labels.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .backbones import Backbone
from .config import CapsuleConfig
from .errors import CaptError
from .seeding import seeded


class Capsule(nn.Module):
    """Trainable part of CaPT. With the defaults it holds exactly L*d numbers."""

    def __init__(self, config: CapsuleConfig, n_layers: int, hidden_size: int, n_labels: int | None = None,
                 meta: dict | None = None):
        super().__init__()
        self.config = config
        self.n_layers, self.hidden_size = n_layers, hidden_size
        self.layer_ids = config.layer_indices(n_layers)
        n, d = len(self.layer_ids), hidden_size
        self.weight = nn.Parameter(torch.randn(n, d) * config.init_std)  # W: one vector per capsule layer
        if config.fusion == "extract":  # depthwise kernel per layer, identity at start -> "add"
            kernel = torch.zeros(n, d, config.extract_kernel)
            kernel[:, :, config.extract_kernel // 2] = 1.0
            self.conv = nn.Parameter(kernel)
        if config.fusion == "project":  # residual low-rank map; B = 0 at start -> "add"
            r = config.project_rank
            self.proj_a = nn.Parameter(torch.randn(n, r, d) / d ** 0.5)
            self.proj_b = nn.Parameter(torch.zeros(n, d, r))
        self.head = None
        if config.head == "linear":
            if not n_labels:
                raise CaptError("head='linear' needs the number of labels (n_labels); give a task")
            self.head = nn.Linear(d, n_labels)
        self.meta = dict(meta or {})

    @classmethod
    def for_backbone(cls, backbone: Backbone, config: CapsuleConfig | None = None, n_labels: int | None = None,
                     seed: int | None = None, **meta) -> "Capsule":
        """A fresh capsule sized for `backbone`, on its device and dtype."""
        config = config or CapsuleConfig()
        with seeded(seed):
            capsule = cls(config, backbone.n_layers, backbone.hidden_size, n_labels,
                          meta={"backbone": backbone.describe(), **meta})
        return capsule.to(device=backbone.device, dtype=backbone.dtype)

    # --- counting -------------------------------------------------------------------------------

    def n_capsule_params(self) -> int:
        """W and fusion extras: the paper's "trainable parameters" (L*d with the defaults)."""
        return sum(p.numel() for n, p in self.named_parameters() if not n.startswith("head."))

    def n_head_params(self) -> int:
        return sum(p.numel() for p in self.head.parameters()) if self.head is not None else 0

    def param_report(self, backbone: Backbone) -> dict:
        total = backbone.n_params
        return {"capsule": self.n_capsule_params(), "head": self.n_head_params(), "backbone": total,
                "share_percent": 100.0 * self.n_capsule_params() / total}

    # --- the maths ------------------------------------------------------------------------------

    def fuse(self, j: int, h: torch.Tensor, call: "CallState") -> torch.Tensor:
        """Hidden states entering capsule layer self.layer_ids[j], with the slot(s) rewritten.

        h: (B, T, d). The slot rows of h itself are overwritten when autograd allows it (see `_writable`:
        the hooks hand over each layer's fresh input), else a new tensor is returned; either way autograd
        records every write, so scores and gradients are the same (tested).

        Written for few ops, because on a GPU a small backbone's step is bound by how many ops it launches,
        not by their arithmetic (README, Speed): every value stays (B, 1, d), the shape the mean's matrix
        product gives and the slot write takes (a scatter along T), so nothing is reshaped or indexed per
        layer. The default costs four ops per layer forward (product, division, addition, write) and six
        backward (tested), with masked_mean's arithmetic, so scores and gradients are bit for bit those of
        W[l] + masked_mean(h) written with index_put (tested).
        """
        w = call.rows_of(self.weight)[j]                                 # (d,)
        if w.dtype != h.dtype:
            w = w.to(h.dtype)
        writable = _writable(h)
        scatter = torch.Tensor.scatter_ if writable else torch.Tensor.scatter
        if call.pool_onehot:                                             # the training-free pooled slots
            pooled = segment_means(h, call.real_mask, len(call.pool_onehot))  # (B, k, d)
            for i in range(len(call.pool_onehot)):
                h = scatter(h, 1, call.slot_gather(h, "pool", i), pooled[:, i:i + 1])
        fusion = self.config.fusion
        if fusion == "none":
            capsule = w.expand(h.shape[0], 1, -1)
        elif fusion == "extract":
            x = (h * call.mean_mask[..., None]).transpose(1, 2)           # (B, d, T), pads zeroed
            x = F.conv1d(x, self.conv[j].unsqueeze(1).to(h.dtype), padding="same", groups=h.shape[-1])
            capsule = w + call.mean(x.transpose(1, 2))                    # (B, 1, d)
        else:
            mean = call.mean(h)                                          # (B, 1, d)
            if fusion == "project":
                low = mean @ self.proj_a[j].to(h.dtype).T                 # (B, 1, r)
                mean = mean + low @ self.proj_b[j].to(h.dtype).T
            if fusion == "prepend":                                       # slot0 = mean, slot1 = W[l]
                h = scatter(h, 1, call.slot_gather(h, "slot", 0), mean)
                return scatter(h, 1, call.slot_gather(h, "slot", 1), w.expand_as(mean))
            capsule = w + mean                                            # the paper's c_l = W[l] + mean
        # One write at one position per row (torch.where over the whole (B, T, d) would cost two more full
        # passes per layer). In place it also skips a copy of h per layer: between -1.7 % and +3.9 % of a
        # SmolLM2 step over five train.bench runs (run-to-run noise; train/BENCHMARKS.md).
        where = call.slot_gather(h, "slot", 0)
        if self.config.placement == "inplace":                            # add onto the first real token
            add = torch.Tensor.scatter_add_ if writable else torch.Tensor.scatter_add
            return add(h, 1, where, capsule)
        return scatter(h, 1, where, capsule)


# Ops whose backward does not read their own output: a layer output they produced may be overwritten in
# place (autograd then routes the overwritten rows' gradient to the capsule). Anything else -> a copy.
_SAFE_PRODUCERS = ("AddBackward", "SubBackward", "WhereBackward", "IndexPutBackward", "CopySlices",
                   "GatherBackward", "CloneBackward", "CatBackward", "ScatterBackward", "ScatterAddBackward")


def _writable(h: torch.Tensor) -> bool:
    """True when writing into h in place cannot disturb a saved tensor or a caller's view of it."""
    if h._is_view():
        return False
    if not h.requires_grad:
        return True
    return h.grad_fn is not None and type(h.grad_fn).__name__.startswith(_SAFE_PRODUCERS)


def masked_mean(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T, d), (B, T) in {0,1} -> (B, d): mean over the positions where mask is 1 (one batched
    matrix product: no (B, T, d) temporary)."""
    m, n = mean_operands(mask, h.dtype)
    return (torch.bmm(m, h) / n).squeeze(1)


def mean_operands(mask: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) in {0,1} -> what masked_mean multiplies by and divides by: the (B, 1, T) mask in `dtype` and its
    (B, 1, 1) counts (at least 1). The division comes after the product, as in torch.mean: weights 1/n
    made first would round 1/n itself (in bfloat16 to 8 bits) and give other last bits."""
    m = mask.to(dtype)[:, None, :]
    return m, m.sum(2, keepdim=True).clamp(min=1)


def segment_means(h: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """(B, T, d), (B, T) -> (B, k, d): the masked positions cut into k consecutive, nearly equal
    segments (real token r of n goes to segment floor(r*k/n)), each mean-pooled; empty -> zeros."""
    m = mask.long()
    n = m.sum(1, keepdim=True).clamp(min=1)
    seg = ((m.cumsum(1) - 1).clamp(min=0) * k) // n                   # (B, T) segment of each position
    onehot = F.one_hot(seg, k).to(h.dtype) * m[..., None].to(h.dtype)  # (B, T, k)
    return onehot.transpose(1, 2) @ h / onehot.sum(1)[..., None].clamp(min=1)


# --- entering the backbone ---------------------------------------------------------------------

@dataclass
class CallState:
    """What the hooks of one call need; created per call, never shared."""

    slot_onehot: list[torch.Tensor]  # per capsule slot, (B, T') bool: where that slot sits in each row
    mean_mask: torch.Tensor          # (B, T') which positions the instance mean is taken over
    pool_onehot: list[torch.Tensor] = field(default_factory=list)  # pooled slots (pooled_tokens), in order
    real_mask: torch.Tensor | None = None  # (B, T') the instance's real tokens (what pooling reads)

    def __post_init__(self) -> None:   # per capsule slot and per pooled slot, (B,) its position in each row
        self.slot_index = [onehot.long().argmax(1) for onehot in self.slot_onehot]
        self.pool_index = [onehot.long().argmax(1) for onehot in self.pool_onehot]
        self._cache: dict = {}
        self.fired: set[int] = set()   # the capsule layers whose hook has acted in this call

    # What every capsule layer of one call shares, made once per call rather than once per layer: on a GPU
    # each is a kernel launch or autograd node per layer, and small batches are launch-bound. Same values
    # and the same arithmetic as making them per layer, so scores and gradients are bit for bit the same.
    def slot_gather(self, h: torch.Tensor, kind: str, i: int) -> torch.Tensor:
        """(B, 1, d) index of capsule slot i (kind 'slot') or pooled slot i ('pool') along h's T, for
        scatter / gather: each row's position, repeated over d (a broadcast view: no copy)."""
        where = (self.slot_index if kind == "slot" else self.pool_index)[i]
        return self._cached((kind, i, h.device, h.shape[-1]),
                            lambda: where.to(h.device).view(-1, 1, 1).expand(-1, 1, h.shape[-1]))

    def mean(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, 1, d): masked_mean over mean_mask, its operands made once per call."""
        m, n = self._cached(("mean", h.device, h.dtype), lambda: mean_operands(self.mean_mask.to(h.device), h.dtype))
        return torch.bmm(m, h) / n

    def rows_of(self, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """weight's rows, split once per call: one autograd node (a single stack in backward) instead of a
        select per layer, each of whose backward writes a zero-filled (n, d) gradient to be summed."""
        return self._cached(("rows_of", id(weight)), lambda: weight.unbind(0))

    def _cached(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]


@dataclass
class Inputs:
    """A batch ready for the backbone, in extended coordinates (slots included)."""

    embeds: torch.Tensor             # (B, T', d)
    attention_mask: torch.Tensor     # (B, T')
    position_ids: torch.Tensor       # (B, T') from the mask, so padding side never shifts positions
                                     # (with a soft prompt: 0..T'-1, as PEFT leaves them)
    real_index: torch.Tensor         # (B, T) where each original position went
    call: CallState | None
    anchor: torch.Tensor             # (B,) the capsule slot, the first soft token (0) with a prefix, or
                                     # the first real token without either


def build_inputs(backbone: Backbone, capsule: Capsule | None, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor, instance_mask: torch.Tensor | None = None,
                 prefix: torch.Tensor | None = None) -> Inputs:
    """Embed, then insert the capsule slot(s) just before each row's first real token.

    input_ids, attention_mask: (B, T), either padding side. instance_mask (B, T): the tokens whose mean
    is the instance information (default: all real tokens; scoring a continuation excludes it).
    prefix: a soft prompt's (m, d) or (B, m, d) embeddings instead of a capsule (see `_prefixed`).
    """
    if not capturing() and not attention_mask.any(1).all():   # reading a GPU value waits for the GPU
        raise CaptError("an input has no tokens; give non-empty text")
    if prefix is not None:
        if capsule is not None:
            raise CaptError("a capsule and a soft prompt cannot be combined in one call; give one of them")
        return _prefixed(backbone, prefix, input_ids, attention_mask)
    embeds = backbone.embed(input_ids)                                   # (B, T, d)
    B, T = input_ids.shape
    mask = attention_mask.long()
    inst = mask if instance_mask is None else (instance_mask.long() * mask)
    first = mask.argmax(1)                                               # (B,) first real token
    pos = torch.arange(T, device=mask.device).expand(B, T)
    if capsule is None or capsule.config.n_slots == 0:
        slots = [pos == first[:, None]] if capsule is not None else []
        call = CallState(slots, inst) if capsule is not None else None
        return Inputs(embeds, mask, _positions(mask), pos, call, first)

    S, K = capsule.config.n_slots, capsule.config.pooled_tokens          # K pooled slots come first
    new = torch.arange(T + S, device=mask.device).expand(B, T + S)
    src = torch.where(new < first[:, None], new, (new - S).clamp(min=0))  # old index of each new spot
    every = [new == (first + s)[:, None] for s in range(S)]
    pools, is_slot = every[:K], every[K:]
    any_slot = torch.stack(every).any(0)
    start = masked_mean(embeds, inst)                                    # (B, d) instance mean of E
    pooled = segment_means(embeds, inst, K) if K else None               # (B, K, d)
    embeds = embeds.gather(1, src[..., None].expand(-1, -1, embeds.shape[-1]))
    mask2 = torch.where(any_slot, 1, mask.gather(1, src))
    inst2 = torch.where(any_slot, 0, inst.gather(1, src))
    real2 = inst2.clone()
    for i, where in enumerate(pools):
        embeds = torch.where(where[..., None], pooled[:, i:i + 1], embeds)
    fusion = capsule.config.fusion
    if fusion != "none":
        # The instance slot starts as mean(E), so the mean over [slot ; E] at layer 0 is mean(E),
        # exactly the paper's c_0 = W[0] + mean(E); later layers include the slot in the mean.
        inst2 = inst2 | is_slot[0].long()
        embeds = torch.where(is_slot[0][..., None], start[:, None, :], embeds)
    for s in range(1 if fusion != "none" else 0, len(is_slot)):          # task-only slots start at zero
        embeds = torch.where(is_slot[s][..., None], 0.0, embeds)
    real_index = (pos + S * (pos >= first[:, None]))
    call = CallState(is_slot, inst2, pools, real2)
    return Inputs(embeds, mask2, _positions(mask2), real_index, call, first + K)


def capturing() -> bool:
    """True while a CUDA graph is being captured (train.bench --cuda-graphs). A capture records kernels
    without running them and refuses any host read of a GPU value (a check like `if tensor.any()`), so
    value checks are skipped there; whoever replays the graph checks what it feeds it."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _prefixed(backbone: Backbone, prefix: torch.Tensor, input_ids: torch.Tensor,
              attention_mask: torch.Tensor) -> Inputs:
    """A soft prompt exactly as PEFT's PromptTuning (0.21) feeds it: the m embeddings go in front of every
    row (before BOS, and before the pads of a left-padded row), the mask gets m ones in front, and the
    position ids are the model's default, 0..m+T-1 for every row (PEFT passes none). For T5 the prefix
    goes in front of the encoder input. The embeddings are used as they are (Gemma's sqrt(d) scaling
    applies to the token embeddings only, as in PEFT)."""
    embeds = backbone.embed(input_ids)                                   # (B, T, d)
    B, T = input_ids.shape
    p = prefix.to(device=embeds.device, dtype=embeds.dtype)
    if p.dim() == 2:
        p = p.unsqueeze(0).expand(B, -1, -1)
    if p.dim() != 3 or p.shape[0] != B or p.shape[1] < 1 or p.shape[2] != embeds.shape[2]:
        raise CaptError(f"a soft prompt must be (m, d={embeds.shape[2]}) embeddings, got shape "
                        f"{tuple(prefix.shape)}")
    m = p.shape[1]
    mask = torch.cat([attention_mask.new_ones(B, m), attention_mask], 1).long()
    pos = torch.arange(m + T, device=mask.device).expand(B, m + T)
    real_index = torch.arange(m, m + T, device=mask.device).expand(B, T)
    return Inputs(torch.cat([p, embeds], 1), mask, pos, real_index, None,
                  torch.zeros(B, dtype=torch.long, device=mask.device))


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(1) - 1).clamp(min=0)


@contextmanager
def attached(backbone: Backbone, capsule: Capsule | None, call: CallState | None):
    """Register the capsule's pre-hooks for the duration of one call; always remove them."""
    handles = []
    try:
        if capsule is not None:
            _check_fits(backbone, capsule)
            for j, layer_id in enumerate(capsule.layer_ids):
                handles.append(backbone.layers[layer_id].register_forward_pre_hook(
                    _make_hook(capsule, j, call), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


def _make_hook(capsule: Capsule, j: int, call: CallState):
    def hook(module, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        # A call's first pass through the layer is the one the capsule belongs to; any later pass of the same
        # call is a KV-cache decoding step (capt.generate), whose new tokens the capsule leaves alone whatever
        # their length (a one-token prompt's steps have the prompt's length). Nothing here recomputes a forward
        # (no gradient checkpointing), so training and scoring pass each layer once per call.
        if j in call.fired:
            return None
        call.fired.add(j)
        h = capsule.fuse(j, h, call)
        if args:
            return (h, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": h}
    return hook


def _check_fits(backbone: Backbone, capsule: Capsule) -> None:
    if (capsule.n_layers, capsule.hidden_size) != (backbone.n_layers, backbone.hidden_size):
        raise CaptError(f"this capsule is for a backbone with {capsule.n_layers} layers x d={capsule.hidden_size}; "
                        f"'{backbone.name}' has {backbone.n_layers} layers x d={backbone.hidden_size}")


def run(backbone: Backbone, capsule: Capsule | None, input_ids: torch.Tensor, attention_mask: torch.Tensor,
        instance_mask: torch.Tensor | None = None, decoder_input_ids: torch.Tensor | None = None,
        output_attentions: bool = False, prefix: torch.Tensor | None = None):
    """One forward of the backbone's base stack (no LM head) with the capsule attached, or with a soft
    prompt's (m, d) embeddings `prefix` in front of the input instead (PEFT prompt tuning's forward).

    Returns (outputs, inputs): for decoder-only models `outputs.last_hidden_state` is (B, T', d) after
    the final norm; for T5 it is the encoder's output and, when decoder_input_ids is given, the
    decoder's (B, T_dec, d) hidden states in `outputs.decoder_last_hidden_state`.
    """
    inputs = build_inputs(backbone, capsule, input_ids, attention_mask, instance_mask, prefix)
    model = backbone.model
    with backbone.lock, attached(backbone, capsule, inputs.call):
        if backbone.encoder_decoder:
            enc = model.encoder(inputs_embeds=inputs.embeds, attention_mask=inputs.attention_mask,
                                output_attentions=output_attentions)
            if decoder_input_ids is None:
                return enc, inputs
            dec = model.decoder(input_ids=decoder_input_ids, encoder_hidden_states=enc.last_hidden_state,
                                encoder_attention_mask=inputs.attention_mask)
            enc.decoder_last_hidden_state = dec.last_hidden_state
            return enc, inputs
        out = model.model(inputs_embeds=inputs.embeds, attention_mask=inputs.attention_mask,
                          position_ids=inputs.position_ids, output_attentions=output_attentions,
                          use_cache=False)
        return out, inputs
