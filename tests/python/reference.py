"""A deliberately naive reference (a double loop over the count matrix, one
row at a time, on bytes) and random cases for the tests."""

from __future__ import annotations

import numpy as np

POISON = 0xA5


def offsets(counts: np.ndarray):
    num_ranks, num_experts = counts.shape
    src = np.zeros((num_ranks, num_experts), np.int64)
    dst = np.zeros((num_ranks, num_experts), np.int64)
    row = 0
    for r in range(num_ranks):
        for e in range(num_experts):
            src[r, e] = row
            row += counts[r, e]
    row = 0
    for e in range(num_experts):
        for r in range(num_ranks):
            dst[r, e] = row
            row += counts[r, e]
    return src, dst


def move_rows(inputs, counts, src, dst):
    """Poisoned copies of the byte-row `inputs` (None stays None) with row
    src[r, e] + k of each moved to row dst[r, e] + k, one row at a time."""
    outputs = [None if x is None else np.full_like(x, POISON) for x in inputs]
    for r in range(counts.shape[0]):
        for e in range(counts.shape[1]):
            for k in range(counts[r, e]):
                for x, y in zip(inputs, outputs):
                    if x is not None:
                        y[dst[r, e] + k] = x[src[r, e] + k]
    return outputs


def reroute(tokens, counts, scales=None, weight=None, expert_token_num_type=1, idx_type=0):
    """Expected outputs from inputs given as byte rows ([A, bytes per row] uint8):
    (tokens, scales, idx, expert_token_num, weight), data outputs as byte rows."""
    counts = np.asarray(counts, np.int64)
    num_tokens = tokens.shape[0]
    src, dst = offsets(counts)
    no_scales = np.zeros((num_tokens, 4), np.uint8)
    outputs = move_rows([tokens, no_scales if scales is None else scales, weight], counts,
                        src, dst)
    idx = np.full(num_tokens, -1, np.int32)
    for r in range(counts.shape[0]):
        for e in range(counts.shape[1]):
            for k in range(counts[r, e]):
                if idx_type == 0:
                    idx[dst[r, e] + k] = src[r, e] + k
                else:
                    idx[src[r, e] + k] = dst[r, e] + k
    totals = counts.sum(axis=0)
    expert_token_num = np.cumsum(totals) if expert_token_num_type == 0 else totals
    weight_out = outputs[2] if weight is not None else np.zeros((0, 0), np.uint8)
    return outputs[0], outputs[1], idx, expert_token_num, weight_out


def inverse(tokens, counts, scales=None, weight=None):
    """Expected restored byte rows from byte rows (None for absent inputs)."""
    counts = np.asarray(counts, np.int64)
    src, dst = offsets(counts)
    return tuple(move_rows([tokens, scales, weight], counts, dst, src))


def random_counts(rng: np.random.Generator, num_tokens: int | None = None, dtype=np.int32):
    """[N, E] counts with zeros and skew; total `num_tokens` (random when None)."""
    num_ranks, num_experts = rng.integers(1, 6, size=2)
    if num_tokens is None:
        num_tokens = int(rng.integers(0, 120))
    weights = rng.random(num_ranks * num_experts) ** 3
    weights[rng.random(weights.size) < 0.3] = 0
    if weights.sum() == 0:
        weights[0] = 1
    cells = rng.choice(weights.size, size=num_tokens, p=weights / weights.sum())
    counts = np.bincount(cells, minlength=weights.size).reshape(num_ranks, num_experts)
    return counts.astype(dtype)


def random_bytes(rng: np.random.Generator, shape) -> np.ndarray:
    return rng.integers(0, 256, size=shape, dtype=np.uint8)
