"""The one moving average omlx keeps of measured speeds (prefill tokens/s, tier bytes/s)."""

from __future__ import annotations

NEW_WEIGHT = 0.3  # a new sample moves the average 30%: follows a change within a few samples


def moving_average(average: float | None, sample: float) -> float:
    """Returns `average` moved toward `sample` (the sample itself when there is none yet)."""
    return sample if average is None else (1 - NEW_WEIGHT) * average + NEW_WEIGHT * sample
