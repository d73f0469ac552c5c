"""Evaluation metrics a model's ``evaluate`` can use: jit-able, on a whole held-out set."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def auc(scores: jax.Array, labels: jax.Array) -> jax.Array:
    """The area under the ROC curve: the chance a positive outranks a negative (ties count
    half), from the ranks of the scores; NaN when one class is missing."""
    scores, labels = scores.reshape(-1), labels.reshape(-1).astype(jnp.float32)
    ordered = jnp.sort(scores)
    # 1-based ranks, a run of equal scores sharing its mean rank
    starts = jnp.searchsorted(ordered, scores, side="left")
    ends = jnp.searchsorted(ordered, scores, side="right")
    ranks = (starts + ends + 1) / 2.0
    positives = labels.sum()
    negatives = labels.size - positives
    above = (ranks * labels).sum() - positives * (positives + 1) / 2
    return jnp.where((positives > 0) & (negatives > 0), above / (positives * negatives), jnp.nan)
