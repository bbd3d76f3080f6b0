"""A naive single-process reference for expert-parallel dispatch and combine
(docs/spec.md section 11), for the multi-rank tests of moe_reroute.ep: every
rank's inputs in one process, one pair at a time, on bytes, then the naive
moe_re_routing of reference.py on what each rank received."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import reference


@dataclass
class RankInputs:
    """One rank's inputs as byte rows: x [T, row bytes], scales [T, row bytes]
    or None; expert_idx [T, k] ints; weights [T, k] float32 or None."""
    x: np.ndarray
    expert_idx: np.ndarray
    scales: np.ndarray | None = None
    weights: np.ndarray | None = None


@dataclass
class RankOutputs:
    """One rank's expected dispatch outputs, as reference.reroute gives them
    (data outputs as byte rows, pad rows zero, rows past `valid_rows` POISON:
    the call leaves them unwritten), and where each pair it sent landed."""
    tokens: np.ndarray
    scales: np.ndarray
    idx: np.ndarray
    expert_token_num: np.ndarray
    weight: np.ndarray  # byte rows [R, 4], or (0, 0) without weights
    counts: np.ndarray  # [N, E]: row r, what rank r sent here
    valid_rows: int
    landing: list  # [T * k] (rank, row) of pair p = t * k + j


def dispatch(ranks: list[RankInputs], num_experts: int, *, expert_alignment=1, capacity=None,
             idx_type=0, expert_token_num_type=1) -> list[RankOutputs]:
    """Every rank's dispatch outputs."""
    num_ranks = len(ranks)
    per_rank = num_experts // num_ranks
    # arrived[r][s][e]: (source rank s, pair p) in the order rank s sends them.
    arrived = [[[[] for _ in range(per_rank)] for _ in range(num_ranks)] for _ in range(num_ranks)]
    for s, inputs in enumerate(ranks):
        ids = [int(g) for g in inputs.expert_idx.reshape(-1)]
        for p in sorted(range(len(ids)), key=lambda p: (ids[p], p)):
            arrived[ids[p] // per_rank][s][ids[p] % per_rank].append(p)
    landings = [[None] * ranks[s].expert_idx.size for s in range(num_ranks)]
    outputs = []
    for r in range(num_ranks):
        counts = np.array([[len(arrived[r][s][e]) for e in range(per_rank)]
                           for s in range(num_ranks)], np.int64).reshape(num_ranks, per_rank)
        pairs = [(s, p) for s in range(num_ranks) for e in range(per_rank)
                 for p in arrived[r][s][e]]
        num_rows = len(pairs) if capacity is None else capacity
        x = np.full((num_rows, ranks[0].x.shape[1]), reference.POISON, np.uint8)
        scales = weights = None
        if ranks[0].scales is not None:
            scales = np.full((num_rows, ranks[0].scales.shape[1]), reference.POISON, np.uint8)
        if ranks[0].weights is not None:
            weights = np.full((num_rows, 4), reference.POISON, np.uint8)
        for a, (s, p) in enumerate(pairs):
            top_k = ranks[s].expert_idx.shape[1]
            x[a] = ranks[s].x[p // top_k]
            if scales is not None:
                scales[a] = ranks[s].scales[p // top_k]
            if weights is not None:
                weights[a] = np.float32(ranks[s].weights.reshape(-1)[p]).reshape(1).view(np.uint8)
        tokens, scales_out, idx, expert_token_num, weight = reference.reroute(
            x, counts, scales, weights, expert_token_num_type=expert_token_num_type,
            idx_type=idx_type, expert_alignment=expert_alignment,
            allow_spare_rows=capacity is not None)
        _, dst = reference.offsets(counts, expert_alignment)
        seen = np.zeros_like(counts)
        for s, inputs in enumerate(ranks):
            for e in range(per_rank):
                for p in arrived[r][s][e]:
                    landings[s][p] = (r, int(dst[s, e] + seen[s, e]))
                    seen[s, e] += 1
        outputs.append(RankOutputs(tokens, scales_out, idx, expert_token_num, weight,
                                   counts.astype(np.int32),
                                   reference.valid_rows(counts, expert_alignment), None))
    for s in range(num_ranks):
        outputs[s].landing = landings[s]
    return outputs


def combine(expert_outs: list[np.ndarray], ranks: list[RankInputs],
            dispatched: list[RankOutputs]) -> list[np.ndarray]:
    """Every rank's combine output from every rank's expert_out [R, H']
    (float16, ml_dtypes.bfloat16 or float32 arrays) after `dispatched`:
    out[t] = 0, then for j in order + w[t, j] * row(t, j) (weight 1 without
    weights) in np.float32, one rounded step at a time, cast to expert_out's
    dtype."""
    dtype, hidden = expert_outs[0].dtype, expert_outs[0].shape[1]
    results = []
    for inputs, outputs in zip(ranks, dispatched):
        num_tokens, top_k = inputs.expert_idx.shape
        out = np.empty((num_tokens, hidden), dtype)
        for t in range(num_tokens):
            y = np.zeros(hidden, np.float32)
            for j in range(top_k):
                r, row = outputs.landing[t * top_k + j]
                v = expert_outs[r][row].astype(np.float32)
                if inputs.weights is not None:
                    v = v * np.float32(inputs.weights[t, j])
                y = y + v
            out[t] = y.astype(dtype)
        results.append(out)
    return results
