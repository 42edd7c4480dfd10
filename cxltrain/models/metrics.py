"""Click-through-rate metrics: log loss and ROC AUC (no scikit-learn needed)."""

from __future__ import annotations

import numpy as np
import torch


def logloss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy of logits [N] against 0/1 labels [N]."""
    return float(torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), labels.float()))


def roc_auc(scores, labels) -> float:
    """Area under the ROC curve: the probability a random positive outscores a random negative.

    scores, labels: [N] (tensors or arrays). Ties count one half (average ranks). NaN when all
    labels are the same class.
    """
    scores = np.asarray(torch.as_tensor(scores).detach().cpu(), dtype=np.float64)
    labels = np.asarray(torch.as_tensor(labels).detach().cpu()) > 0.5
    positives = int(labels.sum())
    negatives = labels.size - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(scores.size, dtype=np.float64)
    # average rank (1-based) within each run of tied scores
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], scores.size]
    average = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(average, ends - starts)
    return float((ranks[labels].sum() - positives * (positives + 1) / 2.0) / (positives * negatives))
