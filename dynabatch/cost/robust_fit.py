"""Robust, non-negative, prior-anchored least squares for the online cost calibration.

:func:`fit_relative` solves, for one pipeline stage and direction, ``t ~= X theta`` over observed
micro-batches (rows of features ``X``, measured seconds ``t``) in *relative* error, because step times
span orders of magnitude and a 1 ms micro-batch matters as much as a 1 s one:

    minimise  sum_i w_i (1 - X_i theta / t_i)^2  +  lam_n * || (theta - theta0) * c ||^2,   theta >= 0

* ``theta0`` is the warm start (the prior): with no observations the answer is ``theta0`` exactly.
  ``c`` scales each coefficient to the relative size of its feature in the data (the median of
  ``X_f / t``), so the penalty is in the units of the residuals, and a feature the data never exercises
  (an all-zero column) keeps its prior coefficient. The prior's weight ``lam_n = lam^2 / (lam + n)``
  is ``lam`` observations' worth at first and fades as ``n`` observations arrive: a quadratic penalty
  holds on to a warm start 50x off with a force that grows with the miss, so a constant weight would
  never let the data overrule it.
* ``w_i`` are Huber weights (IRLS): residuals beyond ``k`` times a robust scale (1.4826 x the median
  absolute residual, at least ``min_scale``) are down-weighted by ``k scale / |r|``, so outliers from a
  noisy machine -- a step that lost its core to the planner thread, a page fault storm -- cannot swing
  the fit.
* ``theta >= 0`` (Lawson-Hanson active set): the features grow with the micro-batch, so non-negative
  coefficients keep predicted time non-decreasing in its shape, which the planner's DP relies on.
* A final scale makes the summed prediction equal the summed measurement over the inliers (the rows
  the last Huber pass kept at full weight). On a shared machine op times are skewed to the slow side,
  so the robust fit finds the *typical* time while a step lasts the *sum* of its ops; the inliers' ratio
  of sums removes that bias without letting the outliers back in.
"""

from __future__ import annotations

import numpy as np

HUBER_K = 1.345
"""Huber's tuning constant (95% efficiency under Gaussian noise)."""
RIDGE = 1e-3
"""Least weight of the warm start (in observations), however many observations there are."""


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 100) -> np.ndarray:
    """``argmin ||a x - b||`` subject to ``x >= 0`` (Lawson and Hanson's active-set method)."""
    return nnls_gram(a.T @ a, a.T @ b, max_iter)


def nnls_gram(g: np.ndarray, c: np.ndarray, max_iter: int = 100, x0: np.ndarray | None = None) -> np.ndarray:
    """:func:`nnls` from the normal equations: ``argmin x' g x - 2 c' x`` subject to ``x >= 0``, with
    ``g = a' a`` and ``c = a' b``. Every sub-problem is an F x F solve, so the cost does not grow with the
    number of observations (the online fit runs once per planned step). ``x0`` (a feasible point, e.g.
    the previous reweighting pass's answer) starts the active set where it is positive."""
    n = len(c)
    x = np.zeros(n) if x0 is None else np.maximum(np.asarray(x0, dtype=np.float64), 0.0)
    free = x > 0
    warm = bool(free.any())
    for _ in range(max_iter):
        if not warm:
            grad = c - g @ x
            candidates = ~free & (grad > 1e-12 * max(1.0, float(np.abs(grad).max(initial=0.0))))
            if not candidates.any():
                break
            free[int(np.argmax(np.where(candidates, grad, -np.inf)))] = True
        warm = False
        while True:
            z = np.zeros(n)
            idx = np.flatnonzero(free)
            z[idx] = np.linalg.lstsq(g[np.ix_(idx, idx)], c[idx], rcond=None)[0]
            if np.all(z[free] > 0):
                x = z
                break
            neg = free & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            free &= x > 1e-15
            x[~free] = 0.0
    return x


def fit_relative(x: np.ndarray, t: np.ndarray, theta0: np.ndarray, lam: float, *, iterations: int = 10,
                 min_scale: float = 0.02) -> np.ndarray:
    """Coefficients ``theta`` (see the module docstring) from features ``x`` (n, F), seconds ``t`` (n,),
    prior ``theta0`` (F,) of weight ``lam`` observations."""
    x, t, theta0 = (np.asarray(v, dtype=np.float64) for v in (x, t, theta0))
    keep = np.isfinite(t) & (t > 0) & np.all(np.isfinite(x), axis=1)
    x, t = x[keep], t[keep]
    if len(t) == 0:
        return theta0.copy()
    a = x / t[:, None]
    scale = np.array([float(np.median(col[col > 0])) if np.any(col > 0) else 1.0 for col in a.T])
    z = a / scale
    prior = theta0 * scale
    reg = np.sqrt(max(RIDGE, lam * lam / (lam + len(t)))) * np.eye(len(scale))
    w = np.ones(len(t))
    theta_s = prior
    for _ in range(iterations):
        zw = z * w[:, None]
        theta_s = nnls_gram(z.T @ zw + reg.T @ reg, zw.sum(axis=0) + reg.T @ (reg @ prior),
                            x0=theta_s if theta_s is not prior else None)
        r = 1.0 - z @ theta_s
        s = max(min_scale, 1.4826 * float(np.median(np.abs(r))))
        new_w = np.minimum(1.0, HUBER_K * s / np.maximum(np.abs(r), 1e-12))
        done = np.allclose(new_w, w, atol=1e-4)
        w = new_w
        if done:
            break
    theta = theta_s / scale
    pred = x @ theta
    inside = w >= 1.0
    if inside.sum() >= 10 and np.all(pred[inside] > 0):
        theta = theta * (t[inside].sum() / pred[inside].sum())
    return theta
