"""A deliberately naive reference (a double loop over the count matrix, one
row at a time, on bytes) and random cases for the tests."""

from __future__ import annotations

import numpy as np

POISON = 0xA5


def rows_out(num_tokens: int, num_experts: int, expert_alignment: int) -> int:
    """R: the forward's output rows (docs/spec.md section 9)."""
    return num_tokens if expert_alignment == 1 else num_tokens + num_experts * (expert_alignment - 1)


def padded_totals(counts, expert_alignment: int):
    """(c_e, p_e) per expert: totals over ranks and totals rounded up to k."""
    totals = [int(sum(counts[r, e] for r in range(counts.shape[0])))
              for e in range(counts.shape[1])]
    padded = [-(-c // expert_alignment) * expert_alignment for c in totals]
    return totals, padded


def offsets(counts: np.ndarray, expert_alignment: int = 1):
    """src[r, e]: block (r, e)'s first row in rank order; dst[r, e]: in expert
    order, expert e's segment starting at p_0 + ... + p_(e-1)."""
    num_ranks, num_experts = counts.shape
    src = np.zeros((num_ranks, num_experts), np.int64)
    dst = np.zeros((num_ranks, num_experts), np.int64)
    row = 0
    for r in range(num_ranks):
        for e in range(num_experts):
            src[r, e] = row
            row += counts[r, e]
    _, padded = padded_totals(counts, expert_alignment)
    segment = 0
    for e in range(num_experts):
        row = segment
        for r in range(num_ranks):
            dst[r, e] = row
            row += counts[r, e]
        segment += padded[e]
    return src, dst


def move_rows(inputs, counts, src, dst, num_rows):
    """Poisoned [num_rows, ...] copies of the byte-row `inputs` (None stays
    None) with row src[r, e] + i of each moved to row dst[r, e] + i, one row
    at a time."""
    outputs = [None if x is None else np.full((num_rows, x.shape[1]), POISON, np.uint8)
               for x in inputs]
    for r in range(counts.shape[0]):
        for e in range(counts.shape[1]):
            for i in range(counts[r, e]):
                for x, y in zip(inputs, outputs):
                    if x is not None:
                        y[dst[r, e] + i] = x[src[r, e] + i]
    return outputs


def reroute(tokens, counts, scales=None, weight=None, expert_token_num_type=1, idx_type=0,
            expert_alignment=1, allow_spare_rows=False):
    """Expected outputs from inputs given as byte rows ([A, bytes per row] uint8):
    (tokens, scales, idx, expert_token_num, weight), data outputs as byte rows.
    Pad rows are zero; tail rows (past the last padded segment) stay POISON,
    as the op never writes them. allow_spare_rows only permits sum(c) < A."""
    counts = np.asarray(counts, np.int64)
    num_tokens = tokens.shape[0]
    num_experts = counts.shape[1]
    num_rows = rows_out(num_tokens, num_experts, expert_alignment)
    src, dst = offsets(counts, expert_alignment)
    no_scales = np.zeros((num_tokens, 4), np.uint8)
    outputs = move_rows([tokens, no_scales if scales is None else scales, weight], counts,
                        src, dst, num_rows)
    totals, padded = padded_totals(counts, expert_alignment)
    segment = 0
    for e in range(num_experts):
        for row in range(segment + totals[e], segment + padded[e]):
            for y in outputs:
                if y is not None:
                    y[row] = 0
        segment += padded[e]
    idx = np.full(num_rows if idx_type == 0 else num_tokens, -1, np.int32)
    for r in range(counts.shape[0]):
        for e in range(counts.shape[1]):
            for i in range(counts[r, e]):
                if idx_type == 0:
                    idx[dst[r, e] + i] = src[r, e] + i
                else:
                    idx[src[r, e] + i] = dst[r, e] + i
    expert_token_num = np.array(np.cumsum(padded) if expert_token_num_type == 0 else totals,
                                np.int64)
    weight_out = outputs[2] if weight is not None else np.zeros((0, 0), np.uint8)
    return outputs[0], outputs[1], idx, expert_token_num, weight_out


def valid_rows(counts, expert_alignment=1) -> int:
    """Rows of the forward's outputs the op writes: the sum of the padded totals."""
    return int(sum(padded_totals(np.asarray(counts, np.int64), expert_alignment)[1]))


def inverse(tokens, counts, scales=None, weight=None, expert_alignment=1, allow_spare_rows=False):
    """Expected restored byte rows from R expert-ordered byte rows (None for
    absent inputs): A = R - E*(k-1) rows, spare rows (past sum(c)) POISON."""
    counts = np.asarray(counts, np.int64)
    num_experts = counts.shape[1]
    num_rows = tokens.shape[0]
    num_tokens = num_rows if expert_alignment == 1 else num_rows - num_experts * (expert_alignment - 1)
    src, dst = offsets(counts, expert_alignment)
    return tuple(move_rows([tokens, scales, weight], counts, dst, src, num_tokens))


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
