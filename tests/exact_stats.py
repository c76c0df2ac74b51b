"""Goodness of fit against an exact distribution (the oracle of the sampling and loop tests)."""

from __future__ import annotations

import numpy as np


def chi2_pvalue(counts, expected_p) -> float:
    """Pearson chi-square p-value of counts against a distribution (cells with tiny mass pooled)."""
    from scipy.stats import chi2

    counts, expected = np.asarray(counts, float), np.asarray(expected_p, float) * np.sum(counts)
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    stat = np.sum((counts - expected) ** 2 / np.maximum(expected, 1e-12))
    return chi2.sf(stat, len(counts) - 1)
