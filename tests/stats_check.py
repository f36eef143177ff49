"""Goodness-of-fit helpers for the losslessness tests."""

import numpy as np
from scipy.stats import chisquare


def fit(samples, probs) -> tuple[float, float]:
    """(chi-square p-value, total-variation distance) of integer samples against probabilities.

    Bins whose expected count is under 5 are pooled, as the chi-square approximation needs.
    """
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum()
    counts = np.bincount(np.asarray(samples), minlength=len(probs)).astype(np.float64)
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    f_obs = np.append(counts[big], counts[~big].sum())
    f_exp = np.append(expected[big], expected[~big].sum())
    if f_exp[-1] == 0:
        f_obs, f_exp = f_obs[:-1], f_exp[:-1]
    if f_obs.sum() != f_exp.sum():
        f_exp = f_exp * f_obs.sum() / f_exp.sum()
    pvalue = chisquare(f_obs, f_exp).pvalue
    tvd = 0.5 * np.abs(counts / n - probs).sum()
    return float(pvalue), float(tvd)
