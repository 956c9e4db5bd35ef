"""Voice prints -> speakers: agglomerative clustering (`linkage`), the number of speakers found by a distance cut.

Prints are merged bottom-up by average cosine distance; merging stops at `threshold` (measured on the
benchmark's conversations, `docs/performance.md`), so the number of speakers is what the voices say, kept within
[min_speakers, max_speakers] when those are given. Speakers are numbered in order of first appearance. Known
speakers (references' prints) are then matched to clusters one to one, nearest first, where the cosine
similarity of a cluster's mean print to a reference's is at least `KNOWN_SIMILARITY`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from app.speakers.linkage import average_linkage, cut, cut_to

THRESHOLD = 0.45  # average cosine distance at which two groups of prints are different voices (see the module doc)
MAX_TREE = 1000  # prints in the tree at most (its distances: n² / 2 floats); of more, every k-th one
KNOWN_SIMILARITY = 0.75  # a cluster is a named speaker when its mean print is at least this close to the reference


def cluster(
    vectors: np.ndarray,
    threshold: float = THRESHOLD,
    min_speakers: int | None = None,
    max_speakers: int | None = None,
    weak: np.ndarray | None = None,
) -> np.ndarray:
    """[n, dim] unit prints (in time order) -> [n] speaker numbers, 0 the first heard.

    `weak` ([n] bool) marks prints of too little speech to found a speaker on (a short piece's): they are left
    out of the clustering, then given the speaker whose mean print is nearest (all are clustered if all are weak).
    """
    n = len(vectors)
    if n <= 1:
        return np.zeros(n, np.int64)
    strong = ~weak if weak is not None and not weak.all() else np.ones(n, bool)
    labels = np.zeros(n, np.int64)
    labels[strong] = _tree_labels(vectors[strong], threshold, min_speakers, max_speakers)
    if not strong.all():
        means = centroids(vectors[strong], labels[strong])
        labels[~strong] = np.argmax(vectors[~strong] @ means.T, axis=1)
    return _by_first_appearance(labels)


def _tree_labels(vectors: np.ndarray, threshold: float, low: int | None, high: int | None) -> np.ndarray:
    n = len(vectors)
    if n == 1:
        return np.zeros(1, np.int64)
    if n > MAX_TREE:  # the tree over every k-th print (prints as they are: the threshold holds), then each
        # print to its nearest speaker
        stride = -(-n // MAX_TREE)
        sample = vectors[::stride]
        means = centroids(sample, _tree_labels(sample, threshold, low, high))
        return _by_first_appearance(np.argmax(vectors @ means.T, axis=1))
    merges = average_linkage(vectors)
    labels = cut(n, merges, threshold)
    found = len(set(labels.tolist()))
    least, most = max(1, low or 1), min(n, high or n)
    if not least <= found <= most:
        labels = cut_to(n, merges, min(max(found, least), most))
    return _by_first_appearance(labels)


def _by_first_appearance(labels: np.ndarray) -> np.ndarray:
    order: dict[int, int] = {}
    for label in labels.tolist():
        order.setdefault(label, len(order))
    return np.array([order[label] for label in labels.tolist()], np.int64)


def unit_mean(vectors: np.ndarray) -> np.ndarray:
    """[n, dim] prints -> their mean, to unit length (a voice: a turn's, a reference's)."""
    mean = np.asarray(vectors, np.float32).mean(axis=0)
    return mean / max(float(np.linalg.norm(mean)), 1e-12)


def centroids(vectors: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """[speakers, dim] unit mean prints."""
    count = int(labels.max()) + 1 if len(labels) else 0
    means = np.stack([vectors[labels == k].mean(axis=0) for k in range(count)]) if count else np.zeros((0, 1))
    return means / np.maximum(np.linalg.norm(means, axis=1, keepdims=True), 1e-12)


def match_known(speakers: np.ndarray, references: np.ndarray, similarity: float = KNOWN_SIMILARITY) -> dict[int, int]:
    """Speaker -> reference, one to one, the most similar pairs first, each at least `similarity` alike."""
    if not len(speakers) or not len(references):
        return {}
    scores = speakers @ references.T
    pairs = sorted(np.ndindex(scores.shape), key=lambda ij: -scores[ij])
    matched: dict[int, int] = {}
    for i, j in pairs:
        if scores[i, j] < similarity:
            break
        if i not in matched and j not in matched.values():
            matched[int(i)] = int(j)
    return matched


def names(count: int, known: dict[int, int], reference_names: Sequence[str]) -> list[str]:
    """Each speaker's label: a known speaker's name, else "A", "B", ... in order of appearance among the rest."""
    taken = set(reference_names)
    letters = (_letters(k) for k in range(10_000))
    out = []
    for speaker in range(count):
        if speaker in known:
            out.append(reference_names[known[speaker]])
        else:
            out.append(next(letter for letter in letters if letter not in taken))
    return out


def _letters(k: int) -> str:
    """0 -> "A", 25 -> "Z", 26 -> "AA", ..."""
    out = ""
    k += 1
    while k:
        k, r = divmod(k - 1, 26)
        out = chr(ord("A") + r) + out
    return out
