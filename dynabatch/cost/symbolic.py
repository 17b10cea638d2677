"""Max-plus forms: the analytic cost model traced once, then evaluated as a flat program.

The analytic model (:mod:`dynabatch.cost.analytic`) prices an array of micro-batches by building every layer's
kernels in Python and combining numpy arrays: several hundred array operations a call whatever its number of
entries, so pricing a few thousand micro-batches spends most of its milliseconds in Python and numpy dispatch,
not in arithmetic. Yet every quantity it computes is built from its inputs (``b``, ``E``, ``D`` and the attention
work: pairs, calls, longest segments) by ``+``, ``-``, ``x``, division by constants and ``np.maximum``: a kernel
takes ``max(compute, memory) + launch``, a stage's peak is its largest layer's transient, recomputation frees
``max(freed - bias, 0)``.

So the model's own methods run once on symbolic inputs (:class:`Sym`), and each output is recorded as a *max-plus
form*: a weighted sum of atoms, each atom a monomial of the inputs (``b E d`` bytes, ``h pairs`` scores) or the
maximum of other forms. Sums of forms add their weights (the kernels of one stage whose memory time is a
polynomial merge into one polynomial), a monomial times a form distributes into the maxima (the inputs are
non-negative, so ``m max(x, y) = max(m x, m y)``), and anything else (a comparison, a product of two maxima) raises
:class:`NotTraceable`, so a model that is not max-plus is priced as before. :func:`compile_forms` lays a set of
forms out as one program: the monomial columns, then sum and max nodes over earlier columns, each distinct
sub-form once (a T5 encoder block's GEMMs are shared by every stage that holds one); :func:`Program.run` evaluates
it over every entry in one numba pass (``dynabatch.cost._kernels._run_program``). The values are the model's up to
floating-point rounding (sums are re-associated), checked against it in ``tests/unit/cost/test_symbolic.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Real

import numpy as np

from dynabatch.cost._kernels import _run_program

VARIABLES = ("b", "E", "D", "pairs_encoder", "pairs_decoder", "pairs_cross", "calls_encoder", "calls_decoder",
             "calls_cross", "longest_input", "longest_target")
"""The inputs a form is a function of, in the order of :meth:`Program.run`'s rows."""

_CONSTANT = (0,) * len(VARIABLES)


class NotTraceable(TypeError):
    """An operation a max-plus form cannot express (a comparison, a conversion to a number, a product of maxima)."""


def _as_sym(x) -> "Sym":
    if isinstance(x, Sym):
        return x
    if isinstance(x, (Real, np.ndarray, np.generic)) and np.ndim(x) == 0:
        return Sym.constant(float(x))
    raise NotTraceable(f"cannot trace an operation with {type(x).__name__} {np.shape(x)}")


class Sym:
    """A max-plus form: ``sum weight x atom`` (:mod:`dynabatch.cost.symbolic`). An atom is ``("m", exponents)``, a
    monomial of :data:`VARIABLES`, or ``("x", children)``, the maximum of the forms whose keys are ``children``.
    It stands in for a numpy array of micro-batches while the analytic model runs on it: arithmetic, ``np.maximum``,
    ``np.zeros_like`` and ``np.broadcast_to`` work; anything that needs a value raises :class:`NotTraceable`."""

    __slots__ = ("terms", "_key")
    __array_priority__ = 1000
    shape = ()  # broadcasts to the traced inputs' shape (itself)
    ndim = 1  # not a scalar: the model keeps it as an array instead of converting it to a float

    def __init__(self, terms: dict) -> None:
        self.terms = {atom: w for atom, w in terms.items() if w != 0.0}
        self._key = None

    @classmethod
    def variable(cls, name: str) -> "Sym":
        exponents = [0] * len(VARIABLES)
        exponents[VARIABLES.index(name)] = 1
        return cls({("m", tuple(exponents)): 1.0})

    @classmethod
    def constant(cls, value: float) -> "Sym":
        return cls({("m", _CONSTANT): float(value)})

    @property
    def key(self) -> tuple:
        """Canonical and hashable: equal forms have equal keys."""
        if self._key is None:
            self._key = tuple(sorted(self.terms.items()))
        return self._key

    @classmethod
    def from_key(cls, key: tuple) -> "Sym":
        return cls(dict(key))

    @property
    def is_polynomial(self) -> bool:
        return all(atom[0] == "m" for atom in self.terms)

    # ---------------------------------------------------------------- arithmetic

    def __add__(self, other) -> "Sym":
        other = _as_sym(other)
        terms = dict(self.terms)
        for atom, w in other.terms.items():
            terms[atom] = terms.get(atom, 0.0) + w
        return Sym(terms)

    __radd__ = __add__

    def __neg__(self) -> "Sym":
        return self._scaled(-1.0)

    def __sub__(self, other) -> "Sym":
        return self + (-_as_sym(other))

    def __rsub__(self, other) -> "Sym":
        return _as_sym(other) + (-self)

    def __mul__(self, other) -> "Sym":
        if not isinstance(other, Sym):
            return self._scaled(_as_sym(other).value_if_constant())
        if self.is_polynomial and other.is_polynomial:
            out: dict = {}
            for (_, e1), w1 in self.terms.items():
                for (_, e2), w2 in other.terms.items():
                    atom = ("m", tuple(a + b for a, b in zip(e1, e2)))
                    out[atom] = out.get(atom, 0.0) + w1 * w2
            return Sym(out)
        for mono, form in ((self, other), (other, self)):
            if mono.is_polynomial and len(mono.terms) == 1:
                return form._times_monomial(*next(iter(mono.terms.items())))
        raise NotTraceable("a product of two forms holding maxima")

    __rmul__ = __mul__

    def __truediv__(self, other) -> "Sym":
        if isinstance(other, Sym):
            raise NotTraceable("division by a form")
        return self._scaled(1.0 / float(other))

    def __rtruediv__(self, other):
        raise NotTraceable("division by a form")

    def __pow__(self, power) -> "Sym":
        if not (isinstance(power, int) and power >= 0):
            raise NotTraceable(f"power {power!r}")
        out = Sym.constant(1.0)
        for _ in range(power):
            out = out * self
        return out

    def _scaled(self, factor: float) -> "Sym":
        return Sym({atom: w * factor for atom, w in self.terms.items()})

    def _times_monomial(self, atom: tuple, weight: float) -> "Sym":
        """``weight x atom x self`` for a monomial ``atom``: monomials multiply, maxima take the monomial inside
        (``m max(x, y) = max(m x, m y)``, the inputs being >= 0), the weight's sign staying outside."""
        inside = Sym({atom: abs(weight)})
        sign = 1.0 if weight >= 0 else -1.0
        out: dict = {}
        for a, w in self.terms.items():
            if a[0] == "m":
                a = ("m", tuple(x + y for x, y in zip(a[1], atom[1])))
                w = w * weight
            else:
                a = _max_atom([Sym.from_key(k) * inside for k in a[1]])
                w = w * sign
            out[a] = out.get(a, 0.0) + w
        return Sym(out)

    def value_if_constant(self) -> float:
        if set(self.terms) - {("m", _CONSTANT)}:
            raise NotTraceable("a form is not a constant")
        return self.terms.get(("m", _CONSTANT), 0.0)

    # ---------------------------------------------------------------- what needs a value

    def _no_value(self, *_):
        raise NotTraceable("a form has no value while it is traced")

    __float__ = __bool__ = __lt__ = __le__ = __gt__ = __ge__ = __index__ = _no_value

    def __eq__(self, other):  # identity: the model compares inputs with ``is``, never forms by value
        return self is other

    def __hash__(self) -> int:
        return id(self)

    # ---------------------------------------------------------------- numpy

    def astype(self, *_, **__) -> "Sym":
        return self

    def copy(self) -> "Sym":
        return self

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method != "__call__" or kwargs:
            raise NotTraceable(f"numpy {ufunc.__name__}.{method}")
        if ufunc is np.maximum:
            return maximum(*inputs)
        binary = {np.add: lambda a, b: a + b, np.subtract: lambda a, b: a - b, np.multiply: lambda a, b: a * b,
                  np.true_divide: lambda a, b: a / b, np.power: lambda a, b: a ** int(b)}
        if ufunc in binary:
            a, b = inputs
            return binary[ufunc](_as_sym(a), b if isinstance(b, Sym) or ufunc is np.power else _as_sym(b))
        if ufunc is np.negative:
            return -inputs[0]
        raise NotTraceable(f"numpy {ufunc.__name__}")

    def __array_function__(self, func, types, args, kwargs):
        if func is np.zeros_like:
            return Sym.constant(0.0)
        if func is np.ones_like:
            return Sym.constant(1.0)
        if func is np.broadcast_to and isinstance(args[0], Sym):
            return args[0]
        if func is np.ndim:
            return self.ndim
        raise NotTraceable(f"numpy {func.__name__}")


def _max_atom(children: list) -> tuple:
    keys = sorted({c.key for c in children})
    return ("x", tuple(keys))


def maximum(*forms) -> Sym:
    """The element-wise maximum of forms (and constants), nested maxima flattened."""
    children = []
    for f in map(_as_sym, forms):
        atom, weight = next(iter(f.terms.items())) if len(f.terms) == 1 else (None, None)
        if atom is not None and atom[0] == "x" and weight == 1.0:
            children.extend(Sym.from_key(k) for k in atom[1])
        else:
            children.append(f)
    atom = _max_atom(children)
    return Sym.from_key(atom[1][0]) if len(atom[1]) == 1 else Sym({atom: 1.0})


@dataclass(frozen=True)
class Program:
    """Forms laid out for evaluation: columns ``0 .. K - 1`` are monomials (``exponents``, ``(K, V)``), column
    ``K + i`` node ``i``: a weighted sum (``kinds[i] == 0``) or the maximum (1) of the columns
    ``cols[starts[i]:starts[i + 1]]`` (with ``weights``), each referring to earlier columns only; ``outputs`` are
    the columns of the forms compiled, in order."""

    exponents: np.ndarray
    kinds: np.ndarray
    starts: np.ndarray
    cols: np.ndarray
    weights: np.ndarray
    outputs: np.ndarray

    def run(self, variables: np.ndarray) -> np.ndarray:
        """``(len(outputs), n)`` values of the forms at ``variables`` (``(len(VARIABLES), n)`` float64; rows of
        variables no form uses may hold anything)."""
        x = np.ascontiguousarray(variables, dtype=np.float64)
        return _run_program(x, self.exponents, self.kinds, self.starts, self.cols, self.weights, self.outputs)


def compile_forms(forms) -> Program:
    """:class:`Program` of ``forms`` (:class:`Sym` or numbers), every distinct form and monomial one column."""
    monomials: dict = {}
    nodes: dict = {}
    node_list: list = []  # (kind, [(col, weight)])

    def monomial(exponents: tuple) -> int:
        return monomials.setdefault(exponents, len(monomials))

    def column(form: Sym):
        """("m", k) for a bare monomial, ("n", i) for node i."""
        key = form.key
        if key in nodes:
            return nodes[key]
        if len(key) == 1 and key[0][1] == 1.0:  # a bare monomial or maximum: its own column, not a copy
            return column_of_atom(key[0][0])
        entries = [(column_of_atom(atom), w) for atom, w in key]
        node_list.append((0, entries))
        nodes[key] = ("n", len(node_list) - 1)
        return nodes[key]

    def column_of_atom(atom: tuple):
        if atom[0] == "m":
            return ("m", monomial(atom[1]))
        if atom in nodes:
            return nodes[atom]
        children = [column(Sym.from_key(k)) for k in atom[1]]
        node_list.append((1, [(c, 1.0) for c in children]))
        nodes[atom] = ("n", len(node_list) - 1)
        return nodes[atom]

    outputs = [column(_as_sym(f)) for f in forms]
    k = len(monomials)

    def index(col) -> int:
        return col[1] if col[0] == "m" else k + col[1]

    exponents = np.zeros((max(k, 1), len(VARIABLES)), dtype=np.int64)
    for e, i in monomials.items():
        exponents[i] = e
    starts, cols, weights = [0], [], []
    for _, entries in node_list:
        cols.extend(index(c) for c, _ in entries)
        weights.extend(w for _, w in entries)
        starts.append(len(cols))
    return Program(exponents[:k] if k else exponents[:0], np.array([kind for kind, _ in node_list], dtype=np.int8),
                   np.array(starts, dtype=np.int64), np.array(cols, dtype=np.int64),
                   np.array(weights, dtype=np.float64), np.array([index(c) for c in outputs], dtype=np.int64))


__all__ = ["NotTraceable", "Program", "Sym", "VARIABLES", "compile_forms", "maximum"]
