"""Scorers: which expected strings a model's answer contains."""

from __future__ import annotations

import re
from collections.abc import Sequence


def contains(answer: str, value: str) -> bool:
    """Whether ``value`` occurs in ``answer`` as a whole token (case-insensitive): not as part
    of a longer run of letters/digits, so ``1234`` is not found in ``12345``."""
    pattern = r"(?<![A-Za-z0-9])" + re.escape(value) + r"(?![A-Za-z0-9])"
    return re.search(pattern, answer, flags=re.IGNORECASE) is not None


def score(answer: str, expected: Sequence[str], forbidden: Sequence[str] = ()) -> float:
    """Fraction in [0, 1] of ``expected`` values found in ``answer``; 0 if any ``forbidden``
    value (a distractor the question did not ask for) is found too."""
    if not expected:
        raise ValueError("score needs at least one expected value")
    if any(contains(answer, f) for f in forbidden):
        return 0.0
    return sum(contains(answer, e) for e in expected) / len(expected)
