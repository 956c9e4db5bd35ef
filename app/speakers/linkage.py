"""Average-linkage agglomerative clustering over cosine distances, and the flat clusters of a cut.

What `scipy.cluster.hierarchy.linkage(method="average", metric="cosine")` and `fcluster` give, for the few hundred
voice prints of a conversation, without scipy in the web process: importing `scipy.cluster.hierarchy` cost it
43 MB of resident memory, more than the whole diarization may add (issue #46). The tree is built by the
nearest-neighbour chain, as scipy builds it: average linkage is reducible, so the chain finds the same merges at
the same heights as merging the closest pair each time would, in O(n²) time. `tests/test_speakers.py` holds the
cuts to scipy's on random and clustered prints.
"""

from __future__ import annotations

import numpy as np


def average_linkage(vectors: np.ndarray) -> list[tuple[int, int, float]]:
    """[n, dim] vectors -> the n - 1 merges (a, b, height) of average linkage under cosine distance, lowest first.

    a and b are the indices of one vector of each of the two groups merged; height is their average distance."""
    n = len(vectors)
    x = np.asarray(vectors, np.float64)
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-300)
    distance = np.clip(1.0 - x @ x.T, 0.0, 2.0)
    np.fill_diagonal(distance, np.inf)
    size = np.ones(n)
    merges: list[tuple[int, int, float]] = []
    chain: list[int] = []
    alive = list(range(n))
    while len(merges) < n - 1:
        if not chain:
            chain.append(alive[0])
        a = chain[-1]
        b = int(np.argmin(distance[a]))
        if len(chain) > 1 and distance[a, chain[-2]] <= distance[a, b]:
            b = chain[-2]  # ties go back down the chain, or it could cycle
        if len(chain) > 1 and b == chain[-2]:
            chain.pop()
            chain.pop()
            merges.append((a, b, float(distance[a, b])))
            merged = (size[a] * distance[a] + size[b] * distance[b]) / (size[a] + size[b])  # Lance-Williams
            distance[b, :] = merged
            distance[:, b] = merged
            distance[b, b] = np.inf
            distance[a, :] = np.inf
            distance[:, a] = np.inf
            size[b] += size[a]
            alive.remove(a)
        else:
            chain.append(b)
    merges.sort(key=lambda merge: merge[2])
    return merges


def cut(n: int, merges: list[tuple[int, int, float]], height: float) -> np.ndarray:
    """[n] flat cluster numbers: the groups that the merges up to `height` make (fcluster's "distance")."""
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b, h in merges:
        if h <= height:
            parent[root(a)] = root(b)
    return np.array([root(i) for i in range(n)], np.int64)


def cut_to(n: int, merges: list[tuple[int, int, float]], clusters: int) -> np.ndarray:
    """[n] flat cluster numbers: no more than `clusters` groups, at the lowest height that gives so few
    (fcluster's "maxclust")."""
    if clusters >= n:
        return np.arange(n, dtype=np.int64)
    return cut(n, merges, merges[n - 1 - max(clusters, 1)][2])
