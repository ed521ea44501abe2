"""CapsuleConfig: every choice the paper leaves open, as one validated dataclass (DESIGN.md §1)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from .errors import CaptError

FUSIONS = ("add", "prepend", "extract", "project", "none")
PLACEMENTS = ("slot", "inplace")
LAYER_PRESETS = ("all", "odd", "even", "first_half", "latter_half")
HEADS = ("verbalizer", "linear")


@dataclass
class CapsuleConfig:
    """How a capsule is built and where it enters the backbone.

    fusion: how instance and task information combine at a capsule layer l
        - "add" (paper default): c_l = W[l] + masked_mean([slot ; H])
        - "prepend": two slots, [masked_mean ; W[l]] side by side
        - "extract": W[l] + masked_mean(depthwise_conv1d_l(H)); extra d*k parameters per layer,
          the convolution starts as the identity so training starts from "add"
        - "project": W[l] + m + B_l A_l m with m the masked mean and rank-r A_l, B_l; extra 2*d*r per
          layer, B starts at zero so training starts from "add"
        - "none": c_l = W[l] (no instance mean: the paper's "deep prompt-tuning with a single prompt")
    placement: "slot" (an extra token before the first real token) or "inplace" (no extra token:
        the capsule is added onto the hidden state of the first real token).
    layers: "all", "odd", "even", "first_half", "latter_half", or a list of layer indices (0-based;
        "odd" means the paper's 1st, 3rd, 5th ... layer, i.e. indices 0, 2, 4 ...).
    head: "verbalizer" (score the label words with the backbone's own LM head, no extra parameters)
        or "linear" (a d x C classifier on the last real token's final hidden state).
    """

    fusion: str = "add"
    placement: str = "slot"
    layers: str | list[int] = "all"
    head: str = "verbalizer"
    project_rank: int = 8
    extract_kernel: int = 5
    init_std: float = 0.0  # W starts at zero: the untrained capsule is exactly the instance mean
    # The paper's training-free probe: k parameter-free slots before the capsule, refilled at every
    # capsule layer with the layer input's real tokens mean-pooled into k consecutive segments.
    pooled_tokens: int = 0
    extra: dict = field(default_factory=dict)  # free-form notes kept in the capsule file

    def __post_init__(self) -> None:
        _choose("fusion", self.fusion, FUSIONS)
        _choose("placement", self.placement, PLACEMENTS)
        _choose("head", self.head, HEADS)
        if isinstance(self.layers, str) and self.layers.strip()[:1].isdigit():   # "0, 2, 5" (CLI, app)
            try:
                self.layers = [int(x) for x in self.layers.replace(",", " ").split()]
            except ValueError:
                raise CaptError(f"layers={self.layers!r} is not valid; give one of {LAYER_PRESETS} "
                                "or layer indices like '0, 2, 5'") from None
        if isinstance(self.layers, str):
            _choose("layers", self.layers, LAYER_PRESETS + ("a list of layer indices",))
        else:
            try:
                self.layers = sorted({int(i) for i in self.layers})
            except (TypeError, ValueError):
                raise CaptError(f"layers={self.layers!r} is not valid; give one of {LAYER_PRESETS} "
                                "or a list of integer layer indices") from None
            if not self.layers:
                raise CaptError("layers=[] selects no layer; give at least one layer index")
        if self.placement == "inplace" and self.fusion == "prepend":
            raise CaptError("fusion='prepend' needs two slots and so placement='slot' "
                            "(placement='inplace' adds no token)")
        if not 0 <= int(self.pooled_tokens) <= 64:
            raise CaptError(f"pooled_tokens={self.pooled_tokens} is out of range; valid: 0..64")
        if self.pooled_tokens and self.placement == "inplace":
            raise CaptError("pooled_tokens adds slots and so needs placement='slot'")
        if not 1 <= int(self.project_rank) <= 4096:
            raise CaptError(f"project_rank={self.project_rank} is out of range; valid: 1..4096")
        if int(self.extract_kernel) < 1 or int(self.extract_kernel) % 2 == 0:
            raise CaptError(f"extract_kernel={self.extract_kernel} is not valid; give an odd number >= 1")
        if self.init_std < 0:
            raise CaptError(f"init_std={self.init_std} is negative; give 0 or more")

    @property
    def n_slots(self) -> int:
        """How many positions the capsule adds to the sequence."""
        if self.placement == "inplace":
            return 0
        return self.pooled_tokens + (2 if self.fusion == "prepend" else 1)

    def layer_indices(self, n_layers: int) -> list[int]:
        """The 0-based capsule layers for a backbone with n_layers layers."""
        spec = self.layers
        if spec == "all":
            return list(range(n_layers))
        if spec == "odd":  # 1st, 3rd, ... in the paper's 1-based counting
            return list(range(0, n_layers, 2))
        if spec == "even":
            return list(range(1, n_layers, 2))
        if spec == "first_half":
            return list(range(n_layers // 2))
        if spec == "latter_half":
            return list(range(n_layers // 2, n_layers))
        bad = [i for i in spec if not 0 <= i < n_layers]
        if bad:
            raise CaptError(f"layers {bad} do not exist; this backbone has layers 0..{n_layers - 1}")
        return list(spec)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CapsuleConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise CaptError(f"unknown capsule option(s) {unknown}; valid: {sorted(known)}")
        return cls(**d)


def _choose(name: str, value, valid: tuple) -> None:
    if value not in valid:
        raise CaptError(f"{name}={value!r} is not valid; choose one of: {', '.join(map(str, valid))}")
