"""Multi-task mixtures: spec files, mixing rates and a deterministic, resumable sampler.

Rates follow either fixed per-source weights or FLAN's examples-proportional rule: the rate of a
task is proportional to ``min(num_examples, cap)``, so large tasks do not drown small ones.

The sampler draws an endless stream of ``(source_index, row_index)``: the source by a seeded
PCG64 generator according to the rates, the row by walking a per-(seed, source, epoch) permutation
of that source. Its whole position (generator state, per-source cursors and epochs) is a small
JSON-able ``state_dict``, so a run resumes at exactly the next sample.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dynabatch.data.source_spec import BAD_ROW_POLICIES, SourceSpec, check_finite, check_spec_types
from dynabatch.data.user_files import USER_FILE_KINDS, file_syntax, is_user_file, parse_user_file

RATE_RULES = ("examples_proportional", "fixed")
MIXTURE_KINDS = {"rule": "a string", "cap": "a number", "seed": "an integer", "name": "a string", "bad_rows": "a string"}
"""The kind of every top-level mixture key except ``sources`` (a list)."""
DEFAULT_NAME = "mixture"
"""The name of a mixture whose spec gives none."""


@dataclass(frozen=True)
class MixtureSpec:
    """A list of sources and how to mix them."""

    sources: tuple[SourceSpec, ...]
    rule: str = "examples_proportional"
    """``examples_proportional`` (rate ~ min(n, cap)) or ``fixed`` (each source's ``rate``)."""
    cap: int | None = None
    """Cap on examples per task for the proportional rule (``None``: no cap)."""
    seed: int = 0
    """Seed of the interleaving."""
    name: str = DEFAULT_NAME
    bad_rows: str = "error"
    """Malformed rows: ``error`` (name the row) or ``skip`` (drop and count); a source's own ``bad_rows`` wins."""

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("a mixture needs at least one source")
        if self.rule not in RATE_RULES:
            raise ValueError(f"mixture rule must be one of {RATE_RULES}, got {self.rule!r}")
        check_finite("mixture cap", self.cap, 0, inclusive=False)
        if self.seed < 0:
            raise ValueError(f"mixture seed must be >= 0, got {self.seed}")
        if self.bad_rows not in BAD_ROW_POLICIES:
            raise ValueError(f"mixture bad_rows must be one of {BAD_ROW_POLICIES}, got {self.bad_rows!r}")
        with_rate = [s.task for s in self.sources if s.rate is not None]
        if self.rule == "fixed" and len(with_rate) != len(self.sources):
            missing = [s.task for s in self.sources if s.rate is None]
            raise ValueError(f"rule 'fixed' needs a rate on every source; missing on {missing}")
        if self.rule == "examples_proportional" and with_rate:
            raise ValueError(f"sources {with_rate} set 'rate' but the rule is examples_proportional; set rule: fixed")
        if self.rule == "fixed" and sum(s.rate for s in self.sources) <= 0:  # type: ignore[misc]
            raise ValueError("the fixed rates of the mixture sum to zero; give at least one source a positive rate")

    @staticmethod
    def from_file(path: str) -> "MixtureSpec":
        """Read a ``.yaml``/``.yml``, ``.json`` or ``.toml`` spec; relative data paths resolve against its folder.

        Every problem with the file (syntax, types, values) is a one-line ``ValueError`` naming it.
        """
        if not os.path.exists(path):
            raise FileNotFoundError(f"mixture spec {path!r} not found")
        if os.path.isdir(path):
            specs = sorted(f for f in os.listdir(path) if is_user_file(f))
            hint = f" (it holds {', '.join(specs[:5])})" if specs else ""
            raise ValueError(f"mixture spec {path!r} is a directory{hint}; pass a {USER_FILE_KINDS} spec file")
        raw = _read_spec_file(path)
        try:
            return MixtureSpec.from_dict(raw, base_dir=os.path.dirname(os.path.abspath(path)))
        except ValueError as e:
            raise ValueError(f"mixture spec {path}: {e}") from e

    @staticmethod
    def from_dict(raw: dict[str, Any], base_dir: str = ".") -> "MixtureSpec":
        if not isinstance(raw, dict) or "sources" not in raw:
            got = "an empty file" if raw is None else f"{type(raw).__name__} {raw!r:.60}"
            raise ValueError(f"a mixture spec is a mapping with a 'sources' list, got {got}")
        known = {"sources", *MIXTURE_KINDS}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown mixture keys {sorted(unknown)}; valid: {sorted(known)}")
        if not isinstance(raw["sources"], list):
            raise ValueError(f"'sources' must be a list of sources, got {type(raw['sources']).__name__} {raw['sources']!r:.60}")
        check_spec_types(raw, MIXTURE_KINDS, nullable={"cap"})
        sources = tuple(SourceSpec.from_dict(s, base_dir) for s in raw["sources"])
        return MixtureSpec(sources=sources, **{k: v for k, v in raw.items() if k != "sources"})


def _read_spec_file(path: str) -> Any:
    """The parsed content of a spec file, read by its ending (YAML, JSON or TOML; another ending is one line);
    syntax errors name the file, line and column (1-based)."""
    what = f"mixture spec {path}"
    syntax = file_syntax(path, what, hint=" (a mixture spec lists data files under 'sources'; one data file alone "
                                          "is --data FILE)")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{what}: not UTF-8 text ({e}); a spec is a {USER_FILE_KINDS} text file") from e
    return parse_user_file(text, what, syntax)


def require_keys(what: str, state: Any, keys: tuple[str, ...], owner: str) -> None:
    """``ValueError`` unless ``state`` is a dict holding ``keys``; says where such a state comes from."""
    missing = [k for k in keys if k not in state] if isinstance(state, dict) else list(keys)
    if missing:
        got = f"keys {sorted(state)}" if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"{what} is missing {missing} (got {got}); pass the dict returned by state_dict() of {owner} "
            "over the same mixture (e.g. the 'data' entry of a checkpoint manifest)"
        )


def mixture_rates(spec: MixtureSpec, num_examples: list[int]) -> np.ndarray:
    """Normalised sampling rate of each source (float64, sums to 1)."""
    if len(num_examples) != len(spec.sources):
        raise ValueError(f"{len(num_examples)} example counts for {len(spec.sources)} sources")
    if spec.rule == "fixed":
        weights = np.array([s.rate for s in spec.sources], dtype=np.float64)
    else:
        counts = np.asarray(num_examples, dtype=np.float64)
        weights = np.minimum(counts, spec.cap) if spec.cap is not None else counts
    with np.errstate(over="ignore"):
        total = weights.sum()
    if not np.isfinite(total):
        raise ValueError(f"mixture weights {weights.tolist()} sum to {total}; use finite rates of a sane size")
    if total <= 0:
        raise ValueError(f"mixture rates sum to zero (weights {weights.tolist()})")
    return weights / total


@dataclass
class MixtureSampler:
    """Endless deterministic stream of ``(source_index, row_index)`` drawn by the mixture rates."""

    rates: np.ndarray
    num_examples: list[int]
    seed: int = 0
    _cumulative: np.ndarray = field(init=False, repr=False)
    _rng: np.random.Generator = field(init=False, repr=False)
    _cursors: list[int] = field(init=False, repr=False)
    _epochs: list[int] = field(init=False, repr=False)
    _perms: dict[int, np.ndarray] = field(init=False, repr=False)
    num_drawn: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.rates = np.asarray(self.rates, dtype=np.float64)
        if len(self.rates) != len(self.num_examples):
            raise ValueError("rates and num_examples differ in length")
        if any(n <= 0 for n, r in zip(self.num_examples, self.rates) if r > 0):
            raise ValueError(f"a source with a positive rate has no examples: {self.num_examples}")
        self._cumulative = np.cumsum(self.rates / self.rates.sum())
        self._rng = np.random.Generator(np.random.PCG64(self.seed))
        self._cursors = [0] * len(self.rates)
        self._epochs = [0] * len(self.rates)
        self._perms = {}

    def _perm(self, source: int) -> np.ndarray:
        if source not in self._perms:
            rng = np.random.default_rng([self.seed, source, self._epochs[source]])
            self._perms[source] = rng.permutation(self.num_examples[source])
        return self._perms[source]

    def draw(self) -> tuple[int, int]:
        """The next ``(source_index, row_index)``."""
        u = self._rng.random()
        source = min(int(np.searchsorted(self._cumulative, u, side="right")), len(self.rates) - 1)
        while self.rates[source] <= 0:  # guard against float edge cases at the top of the CDF
            source -= 1
        row = int(self._perm(source)[self._cursors[source]])
        self._cursors[source] += 1
        if self._cursors[source] == self.num_examples[source]:
            self._cursors[source] = 0
            self._epochs[source] += 1
            self._perms.pop(source, None)
        self.num_drawn += 1
        return source, row

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "rng": copy.deepcopy(self._rng.bit_generator.state),
            "cursors": list(self._cursors),
            "epochs": list(self._epochs),
            "num_drawn": self.num_drawn,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        require_keys("sampler state", state, ("seed", "rng", "cursors", "epochs", "num_drawn"), "a MixtureSampler")
        if state["seed"] != self.seed or len(state["cursors"]) != len(self.rates):
            raise ValueError(
                f"sampler state is for seed {state['seed']} with {len(state['cursors'])} sources; "
                f"this sampler has seed {self.seed} with {len(self.rates)} sources"
            )
        beyond = [i for i, (c, n) in enumerate(zip(state["cursors"], self.num_examples)) if not 0 <= c < max(n, 1)]
        if beyond:
            i = beyond[0]
            raise ValueError(
                f"sampler state has cursor {state['cursors'][i]} for source {i}, which has {self.num_examples[i]} rows: "
                "the state is from another mixture (or other data files)"
            )
        self._rng.bit_generator.state = copy.deepcopy(state["rng"])
        self._cursors = list(state["cursors"])
        self._epochs = list(state["epochs"])
        self._perms = {}
        self.num_drawn = int(state["num_drawn"])
