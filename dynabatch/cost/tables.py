"""Dense cost tables loaded from a profile, stage costs, and model-state bytes.

``CostTables.load(path)`` reads a profile written by ``dynabatch profile`` into float64 arrays
(missing points are NaN) and answers ``stage_cost(stage, b, E, D)`` through the numba kernels of
``dynabatch.cost._kernels`` -- the same kernels the planner calls inside its own ``@njit`` loops with
``kernel_arrays()`` and ``stage_counts(stage)``. Interpolation is log-log along lengths and linear
along b (see ``_kernels``). Measured with 1 CPU thread on a shared 2-core VM:

* leaving out every non-power-of-two point of a dense ``gpt2-mini`` grid, the median error of block
  time was 5-7 % and of stored bytes < 0.5 % (plain bilinear: 5.5-8 % and up to 1.1 %; log-log in
  both axes: the same as the chosen scheme, which is also exact for power laws on the x4 D axis);
* ``dynabatch profile --check`` on 20 random off-grid shapes, whole model as one stage against the
  sum of its layers: forward + backward time median 4 % / p90 8-9 % (gpt2-mini and t5-mini), stored
  bytes 0.0 % / 1.4 % median, peak bytes 0.3 % / 1.1 % median.

Out of range: a length or b above the grid raises ``ValueError`` here (``+inf`` in the kernel); below
the grid it is clamped to the first grid value (an upper bound). A cell with a corner that was not
profiled (beyond ``max_tokens``) or ran out of memory gives a ``StageCost`` of ``+inf``
(``feasible`` is False). Nothing is extrapolated.

A stage is a ``StageSpec``: layer kinds with counts. ``CostTables.stage_spec(start, stop)`` builds it
from a range of transformer blocks (T5: encoder blocks, then decoder blocks) with the embedding,
context, final-norm and head kinds that the range implies.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

from dynabatch.cost import _kernels
from dynabatch.core.sequence import is_seq2seq, sequence_kind

FORMAT, FORMAT_VERSION = "dynabatch.profile", 1
METRICS = ("fwd_s", "bwd_s", "stored_bytes", "peak_bytes")

BYTES_PER_PARAM: dict[str, int] = {
    "adam": 16,
    "adamw": 16,
    "adam_mixed": 16,
    "sgd": 8,
    "sgd_momentum": 12,
}
"""Model-state bytes per parameter. fp32 Adam/AdamW: param 4 + grad 4 + two moments 8. Mixed precision
Adam (bf16/fp16 params and grads, fp32 master copy and moments): 2 + 2 + 4 + 8. SGD: param + grad;
with momentum + 4."""


PROFILE_CONFIG_KEYS = (
    "model_type", "vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads",
    "feed_forward_proj", "relative_attention_num_buckets", "relative_attention_max_distance", "tie_word_embeddings",
    "n_embd", "n_layer", "n_head", "n_inner", "n_positions", "activation_function",
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size", "head_dim",
    "hidden_act",
)
"""Architecture fields a profile's (or a calibration file's) model config must share with the trained model (those
present in either); the widths and depths of every family's HF config."""


def check_profile_config(profile_config: dict, model_config: dict, path: str = "the profile", model: str = "",
                         profile_model: str = "") -> None:
    """Raise ``ValueError`` naming every architecture field where the profile's model config differs; a profile of
    another model family (``model_type``) is said in those words alone, not as every field of both families.
    ``model`` (the run's ``--model``) and ``profile_model`` (the profiled model's name) make the line name them."""
    fix = f"profile this model with `dynabatch profile --model {model or '...'}`"
    kinds = profile_config.get("model_type"), model_config.get("model_type")
    if all(kinds) and kinds[0] != kinds[1]:
        named = f" ({profile_model})" if profile_model else ""
        run = f" ({model})" if model else ""
        raise ValueError(f"cost profile {path} was measured on a {kinds[0]} model{named}, and this run's model{run} "
                         f"is a {kinds[1]}; {fix}")
    diffs = [f"{k}: profile {profile_config.get(k)!r} != model {model_config.get(k)!r}"
             for k in PROFILE_CONFIG_KEYS
             if (k in profile_config or k in model_config) and profile_config.get(k) != model_config.get(k)]
    if diffs:
        raise ValueError(f"cost profile {path} was measured on a different model config ({'; '.join(diffs)}); {fix}")


def model_state_bytes(num_params: int, optimizer: str = "adam") -> int:
    """Bytes of parameters, gradients and optimizer state for ``num_params`` parameters."""
    if optimizer not in BYTES_PER_PARAM:
        raise ValueError(f"unknown optimizer {optimizer!r}; valid: {', '.join(BYTES_PER_PARAM)}")
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    return int(num_params) * BYTES_PER_PARAM[optimizer]


@dataclass(frozen=True)
class StageCost:
    """Cost of one micro-batch on one stage."""

    fwd_s: float
    """Forward seconds."""
    bwd_s: float
    """Backward seconds."""
    stored_bytes: float
    """Activation bytes kept from forward until backward."""
    peak_bytes: float
    """Activation high-water mark during this micro-batch's forward and backward (>= stored_bytes)."""

    @property
    def feasible(self) -> bool:
        """False when the shape falls in a cell that was not profiled or ran out of memory."""
        return all(math.isfinite(v) for v in (self.fwd_s, self.bwd_s, self.stored_bytes, self.peak_bytes))


@dataclass(frozen=True)
class LayerUse:
    """``count`` copies of layer kind ``kind`` in a stage."""

    kind: str
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"count must be >= 0, got {self.count} for {self.kind!r}")


@dataclass(frozen=True)
class StageSpec:
    """The layers of one pipeline stage."""

    uses: tuple[LayerUse, ...]

    @classmethod
    def of(cls, **counts: int) -> "StageSpec":
        """``StageSpec.of(gpt2_embedding=1, gpt2_block=3)``."""
        return cls(tuple(LayerUse(k, c) for k, c in counts.items()))

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for use in self.uses:
            out[use.kind] = out.get(use.kind, 0) + use.count
        return out


@dataclass(frozen=True)
class KindTable:
    """One layer kind's table."""

    dims: tuple[str, ...]
    values: np.ndarray
    """float64 ``(4, nb, n_len[, nD])``: FWD, BWD, STORED, PEAK; NaN where not measured."""
    num_params: int
    tied_params: int


@dataclass(frozen=True)
class KernelArrays:
    """Raw arrays for ``_kernels._stage_cost`` / ``_evaluate_stages``: axes (float64) and packed tables
    ``(K, 8, nb, nE)``, ``(K, 8, nb, nD)``, ``(K, 8, nb, nE, nD)`` (FWD, BWD, STORED, PEAK, then their logs).
    Kinds in each table follow ``kinds_*``; GPT-2 has no D kinds and a dummy D axis."""

    axis_b: np.ndarray
    axis_e: np.ndarray
    axis_d: np.ndarray
    tab_be: np.ndarray
    tab_bd: np.ndarray
    tab_bed: np.ndarray
    kinds_be: tuple[str, ...]
    kinds_bd: tuple[str, ...]
    kinds_bed: tuple[str, ...]


GPT2_ANALYTIC_KINDS = {"embedding": ("gpt2_embedding",), "gpt": ("gpt2_block",), "lm_head": ("gpt2_head",)}
T5_ANALYTIC_KINDS = {"embedding": ("t5_encoder_embedding",), "t5_encoder": ("t5_encoder_block",),
                     "decoder_embedding": ("t5_encoder_final", "t5_decoder_embedding"),
                     "t5_decoder": ("t5_decoder_block",), "lm_head": ("t5_head",)}
"""Analytic layer kind -> profiled kinds, for GPT-2 and T5 (also the reading of profiles written before
the profile recorded its mapping)."""


def _array(nested, shape: tuple[int, ...]) -> np.ndarray:
    a = np.array(nested, dtype=object)
    out = np.where(a == None, np.nan, a).astype(np.float64)  # noqa: E711 - elementwise None test
    if out.shape != shape:
        raise ValueError(f"table shape {out.shape} does not match axes {shape}")
    return out


@dataclass(frozen=True)
class CostTables:
    """Profiled per-layer costs of one model on one device."""

    family: str
    """Sequence kind of the profiled model, ``causal`` or ``seq2seq`` (its family name is in ``meta``)."""
    axis_b: np.ndarray
    axis_e: np.ndarray
    axis_d: np.ndarray
    kinds: dict[str, KindTable]
    num_layers: tuple[int, int]
    """(encoder or GPT-2 blocks, decoder blocks (0 for GPT-2))."""
    p2p_sizes: np.ndarray | None = None
    p2p_times: np.ndarray | None = None
    meta: dict = field(default_factory=dict)
    """device, versions, num_threads, settings, model name and config of the profile."""

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CostTables":
        """The tables of the profile file at ``path``; a missing, unreadable or malformed file is one line naming it."""
        hint = "pass a file written by `dynabatch profile`"
        try:
            with open(path, encoding="utf-8") as f:
                profile = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"cost profile {str(path)!r} not found; {hint}") from None
        except (OSError, ValueError) as e:  # a folder, no permission, not JSON, not UTF-8
            raise ValueError(f"cost profile {str(path)!r} cannot be read as a profile ({e}); {hint}") from None
        if not isinstance(profile, dict):
            raise ValueError(f"cost profile {str(path)!r} is not a profile (a JSON {type(profile).__name__}); {hint}")
        try:
            return cls.from_profile(profile)
        except (KeyError, TypeError) as e:
            raise ValueError(f"cost profile {str(path)!r} is not a complete profile (missing {e}); {hint}") from None
        except ValueError as e:
            raise ValueError(f"cost profile {str(path)!r}: {e}; {hint}") from None

    @classmethod
    def from_profile(cls, profile: dict) -> "CostTables":
        """Validate a profile dict (see ``dynabatch.cost.profile``) and build the tables."""
        if profile.get("format") != FORMAT:
            raise ValueError(f"not a dynabatch profile (format={profile.get('format')!r})")
        if profile.get("version") != FORMAT_VERSION:
            raise ValueError(f"profile version {profile.get('version')} is not supported (expected {FORMAT_VERSION})")
        axes = {k: np.asarray(v, dtype=np.float64) for k, v in profile["axes"].items()}
        for name, axis in axes.items():
            if axis.ndim != 1 or axis.size < 2 or not np.all(np.diff(axis) > 0) or axis[0] <= 0:
                raise ValueError(f"axis {name} must hold >= 2 increasing positive values, got {axis.tolist()}")
        kinds = {}
        for name, rec in profile["layers"].items():
            dims = tuple(rec["dims"])
            if dims not in (("b", "E"), ("b", "D"), ("b", "E", "D")) or any(d not in axes for d in dims):
                raise ValueError(f"layer kind {name!r} has unsupported dims {dims}")
            shape = tuple(axes[d].size for d in dims)
            values = np.stack([_array(rec[m], shape) for m in METRICS])
            ok = np.array(rec["status"], dtype=object) == "ok"
            if ok.shape != shape:
                raise ValueError(f"layer kind {name!r}: status shape {ok.shape} does not match axes {shape}")
            if np.isnan(values[:, ok]).any():
                raise ValueError(f"layer kind {name!r}: a point marked 'ok' has a null value")
            values[:, ~ok] = np.nan
            kinds[name] = KindTable(dims, values, int(rec["num_params"]), int(rec.get("tied_params", 0)))
        model = profile["model"]
        cfg = model.get("config", {})
        kind = sequence_kind(model.get("sequence_kind", model["family"]))  # older profiles: the family name
        if is_seq2seq(kind):
            num_layers = (int(cfg.get("num_layers", 0)), int(cfg.get("num_decoder_layers") or cfg.get("num_layers", 0)))
        else:
            num_layers = (int(cfg.get("n_layer") or cfg.get("num_hidden_layers", 0)), 0)
        p2p = profile.get("p2p")
        sizes = times = None
        if p2p:
            sizes = np.asarray(p2p["sizes_bytes"], dtype=np.float64)
            times = np.asarray(p2p["send_s"], dtype=np.float64)
            if sizes.size < 2 or sizes.shape != times.shape or not np.all(np.diff(sizes) > 0):
                raise ValueError("p2p needs >= 2 increasing sizes with one time each")
        meta = {k: profile.get(k) for k in ("device", "versions", "num_threads", "settings", "created")}
        meta["model"] = {k: v for k, v in model.items() if k != "config"}
        meta["config"] = cfg
        return cls(kind, axes["b"], axes["E"], axes.get("D", np.array([1.0, 2.0])), kinds, num_layers,
                   sizes, times, meta)

    # ----- stage composition --------------------------------------------------------------------
    def stage_spec(self, start: int, stop: int) -> StageSpec:
        """The stage holding blocks ``[start, stop)`` (T5: encoder blocks first, then decoder blocks)."""
        n_enc, n_dec = self.num_layers
        total = n_enc + n_dec
        if not 0 <= start < stop <= total:
            raise ValueError(f"need 0 <= start < stop <= {total} blocks, got [{start}, {stop})")
        if not is_seq2seq(self.family):
            model = self.meta.get("model") or {}
            kinds = model.get("analytic_kinds") or GPT2_ANALYTIC_KINDS
            context = (model.get("context_kinds") or {"gpt": "gpt2_context"})["gpt"]
            c = {kinds["embedding"][0]: int(start == 0), context: 1, kinds["gpt"][0]: stop - start,
                 kinds["lm_head"][0]: int(stop == total)}
        else:
            enc = max(0, min(stop, n_enc) - start)
            dec = max(0, stop - max(start, n_enc))
            c = {"t5_encoder_embedding": int(start == 0), "t5_encoder_context": int(enc > 0),
                 "t5_encoder_block": enc, "t5_encoder_final": int(start < n_enc <= stop),
                 "t5_decoder_embedding": int(start <= n_enc < stop), "t5_decoder_context": int(dec > 0),
                 "t5_decoder_block": dec, "t5_head": int(stop == total)}
        return StageSpec.of(**{k: v for k, v in c.items() if v})

    def _check_stage(self, stage: StageSpec) -> dict[str, int]:
        counts = stage.counts()
        unknown = sorted(set(counts) - set(self.kinds))
        if unknown:
            raise ValueError(f"unknown layer kinds {unknown}; this profile has {sorted(self.kinds)}")
        return counts

    def stage_counts(self, stage: StageSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Count vectors (float64) matching ``kernel_arrays()`` kinds order."""
        counts = self._check_stage(stage)
        arrays = self.kernel_arrays()
        return tuple(np.array([counts.get(k, 0) for k in names], dtype=np.float64)
                     for names in (arrays.kinds_be, arrays.kinds_bd, arrays.kinds_bed))

    def kernel_arrays(self) -> KernelArrays:
        """Stacked tables for ``_kernels._stage_cost`` (cached)."""
        cached = self.__dict__.get("_kernel_arrays")
        if cached is not None:
            return cached
        groups = {dims: [k for k, t in self.kinds.items() if t.dims == dims]
                  for dims in (("b", "E"), ("b", "D"), ("b", "E", "D"))}
        nb, ne, nd = self.axis_b.size, self.axis_e.size, self.axis_d.size
        shapes = {("b", "E"): (8, nb, ne), ("b", "D"): (8, nb, nd), ("b", "E", "D"): (8, nb, ne, nd)}

        def stack(dims):
            names = groups[dims]
            if not names:
                return np.zeros((0, *shapes[dims]))
            return _kernels.pack_tables(np.stack([self.kinds[k].values for k in names]))

        arrays = KernelArrays(self.axis_b, self.axis_e, self.axis_d, stack(("b", "E")), stack(("b", "D")),
                              stack(("b", "E", "D")), tuple(groups[("b", "E")]), tuple(groups[("b", "D")]),
                              tuple(groups[("b", "E", "D")]))
        object.__setattr__(self, "_kernel_arrays", arrays)
        return arrays

    def _check_shape(self, b: float, e: float, d: float, needs_d: bool) -> None:
        checks = [("b", b, self.axis_b), ("E", e, self.axis_e)] + ([("D", d, self.axis_d)] if needs_d else [])
        for name, value, axis in checks:
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number, got {value}")
            if value > axis[-1]:
                raise ValueError(f"{name}={value} is beyond the profiled grid (max {axis[-1]:g}); "
                                 f"profile with a larger grid (dynabatch profile --help)")

    def stage_cost(self, stage: StageSpec, b: float, E: float, D: float = 0.0) -> StageCost:  # noqa: N803
        """Interpolated cost of one micro-batch of ``b`` samples (lengths E, D) on ``stage``."""
        counts = self._check_stage(stage)
        needs_d = any(self.kinds[k].dims[-1] == "D" for k, c in counts.items() if c)
        self._check_shape(b, E, D, needs_d)
        a = self.kernel_arrays()
        cnt_be, cnt_bd, cnt_bed = self.stage_counts(stage)
        out = _kernels._stage_cost(a.axis_b, a.axis_e, a.axis_d, a.tab_be, cnt_be, a.tab_bd, cnt_bd, a.tab_bed,
                                   cnt_bed, float(b), float(E), float(D if needs_d else 1.0))
        return StageCost(*(float(v) for v in out))

    def layer_cost(self, kind: str, b: float, E: float, D: float = 0.0) -> StageCost:  # noqa: N803
        """Cost of one layer of ``kind``."""
        return self.stage_cost(StageSpec.of(**{kind: 1}), b, E, D)

    def stage_params(self, stage: StageSpec) -> int:
        """Parameters held by a stage; the tied token embedding is counted once per stage."""
        counts = self._check_stage(stage)
        total = sum(c * self.kinds[k].num_params for k, c in counts.items())
        tied = [self.kinds[k].tied_params for k, c in counts.items() if c and self.kinds[k].tied_params]
        return total - (sum(tied) - max(tied) if tied else 0)

    def stage_model_state_bytes(self, stage: StageSpec, optimizer: str = "adam") -> int:
        """Parameter + gradient + optimizer-state bytes of a stage."""
        return model_state_bytes(self.stage_params(stage), optimizer)

    def p2p_time(self, nbytes: float) -> float:
        """One-way send seconds for a message of ``nbytes`` (see ``_kernels._p2p_time``)."""
        if self.p2p_sizes is None:
            raise ValueError("this profile has no p2p measurement (profiled with --p2p none?)")
        if not (nbytes >= 0 and math.isfinite(nbytes)):
            raise ValueError(f"nbytes must be a finite number >= 0, got {nbytes}")
        return float(_kernels._p2p_time(self.p2p_sizes, self.p2p_times, float(nbytes)))
