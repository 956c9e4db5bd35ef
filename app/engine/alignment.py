"""Word-level timestamps: cross-attention alignment heads + dynamic time warping (OpenAI's method)."""

from __future__ import annotations

import string
from dataclasses import dataclass

import numpy as np
import torch

from app.engine.decoding.batch import DecoderState
from app.model.decoder import AttentionCapture, CrossKV
from app.model.features import TIME_PRECISION
from app.model.tokenizer import WhisperTokenizer
from app.model.whisper import WhisperModel

MEDIAN_FILTER_WIDTH = 7
SOFTMAX_ROWS = 16  # the word probabilities' logits and softmax: rows at a time
NO_SPACE_LANGUAGES = {"zh", "ja", "th", "lo", "my", "yue"}
PREPEND_PUNCTUATION = "\"'“¿([{-"
APPEND_PUNCTUATION = "\"'.。,，!！?？:：”)]}、"


def dtw(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The monotonic path (text indices, time indices) of least cost through x [N, M], as OpenAI's `dtw_cpu`
    finds it: costs kept in float32, ties broken the same way (diagonal only when strictly cheapest, then up,
    else left). Computed one anti-diagonal at a time (cells with i + j = d need only diagonals d-1, d-2), each
    stored as a row of its own (`[d, i]`), so that a step reads slices, not gathered cells."""
    n, m = x.shape
    rows, cols = np.indices((n, m))
    skewed = np.zeros((n + m + 1, n + 1))  # cell (i, j) of the cost table at [i + j, i]; x[i - 1, j - 1] likewise
    skewed[rows + cols + 2, rows + 1] = x
    cost = np.full((n + m + 1, n + 1), np.inf, dtype=np.float32)
    cost[0, 0] = 0.0
    trace = np.full((n + m + 1, n + 1), -1, dtype=np.int8)
    for d in range(2, n + m + 1):
        lo, hi = max(1, d - m), min(n, d - 1) + 1  # the diagonal's cells (i, d - i), lo <= i < hi
        c0, c1, c2 = cost[d - 2, lo - 1 : hi - 1], cost[d - 1, lo - 1 : hi - 1], cost[d - 1, lo:hi]
        step = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        cost[d, lo:hi] = skewed[d, lo:hi] + np.choose(step, [c0, c1, c2]).astype(np.float64)
        trace[d, lo:hi] = step
    i, j = n, m
    text, time = [], []
    while i > 0 or j > 0:
        text.append(i - 1)
        time.append(j - 1)
        move = 2 if i == 0 else 1 if j == 0 else int(trace[i + j, i])
        if move == 0:
            i, j = i - 1, j - 1
        elif move == 1:
            i -= 1
        else:
            j -= 1
    return np.array(text[::-1]), np.array(time[::-1])


def _median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """[H, S, T] -> the same, each row's median over `width` frames (reflected at its ends), the value
    `median(-1)` gives over the row's unfolded windows. The windows' values are sorted by an odd-even transposition
    network of elementwise min/max over `width` shifted views, one head at a time: 2.7x faster than `median(-1)`,
    which also materialised [H, S, T, width] floats (~40 MB for a 140-token window)."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    frames = x.shape[-1]
    out = torch.empty_like(x)
    for h in range(x.shape[0]):
        padded = torch.nn.functional.pad(x[h : h + 1], (pad, pad), mode="reflect")[0]
        values = [padded[:, k : k + frames] for k in range(width)]
        for rnd in range(width):
            for k in range(rnd % 2, width - 1, 2):
                low, high = values[k], values[k + 1]
                values[k], values[k + 1] = torch.minimum(low, high), torch.maximum(low, high)
        out[h] = values[(width - 1) // 2]
    return out


def split_words(tok: WhisperTokenizer, tokens: list[int], language: str | None) -> list[list[int]]:
    """Group text tokens into words: by spaces and punctuation, or per character run for CJK/Thai."""
    pieces: list[tuple[str, list[int]]] = []
    current: list[int] = []
    for token in tokens:
        current.append(token)
        text = tok.decode(current)
        if "\ufffd" not in text:
            pieces.append((text, current))
            current = []
    if language in NO_SPACE_LANGUAGES:
        return [p for _, p in pieces]
    words: list[list[int]] = []
    for text, piece in pieces:
        if not words or text.startswith(" ") or text.strip() in string.punctuation:
            words.append(list(piece))
        else:
            words[-1].extend(piece)
    return words


@dataclass
class WordTiming:
    """A word's tokens, times (s from its window's start) and probability; edited in place by `place_words`."""

    word: str
    tokens: list[int]
    start: float
    end: float
    probability: float


@torch.inference_mode()
def align_words(
    main: WhisperModel,
    cross: CrossKV,
    sot_sequence: list[int],
    text_tokens: list[int],
    num_frames: int,
    language: str | None,
) -> list[WordTiming]:
    """Word timings of `text_tokens` for one row (cross of batch 1), as OpenAI's `find_alignment`: the alignment
    heads' cross-attention over the window's `num_frames` mel frames, normalised per frame, median-filtered,
    and followed by DTW; a word starts at the frame where its first token's row is entered."""
    tok = main.tokenizer
    if not text_tokens:
        return []
    heads = main.constants.alignment_heads or tuple(
        (layer, h)
        for layer in range(len(main.decoder.layers) // 2, len(main.decoder.layers))
        for h in range(main.decoder.n_heads)
    )
    state = DecoderState.start(main.decoder, cross, 1)
    captured = AttentionCapture.of(heads)
    feed = [*sot_sequence, tok.no_timestamps, *text_tokens, tok.eot]
    hidden, _ = state.feed([feed], captured)
    # Probabilities among text tokens only (OpenAI's: logits up to end-of-text), a few rows' logits and softmax at a
    # time: all rows' at once held [tokens, vocabulary] floats twice over (~58 MB for 140 tokens).
    rows = hidden[0, len(sot_sequence) : len(sot_sequence) + len(text_tokens)]
    probs: list[float] = []
    for a in range(0, len(text_tokens), SOFTMAX_ROWS):
        p = main.decoder.logits(rows[a : a + SOFTMAX_ROWS])[:, : tok.eot].softmax(-1)
        probs += p[torch.arange(len(p)), torch.tensor(text_tokens[a : a + SOFTMAX_ROWS])].tolist()
    scores = torch.stack([captured.head(layer, head)[0] for layer, head in heads])  # [heads, S, T]
    del captured, hidden  # each [heads, S, T] step below is ~1 MB per 20 tokens: keep one or two alive at a time
    weights = scores[:, :, : max(1, num_frames // 2)].float().softmax(-1)  # a window may hold one mel frame
    del scores
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    weights = _median_filter(weights.sub_(mean).div_(std.clamp_min(1e-10)), MEDIAN_FILTER_WIDTH)
    # Rows: the no-timestamps position and each text token (each predicting the next token).
    matrix = weights.mean(0)[len(sot_sequence) : -1]
    text_idx, time_idx = dtw(-matrix.double().numpy())

    words = split_words(tok, text_tokens, language)
    jumps = np.pad(np.diff(text_idx), (1, 0), constant_values=1).astype(bool)
    jump_times = time_idx[jumps] * TIME_PRECISION
    bounds = np.pad(np.cumsum([len(w) for w in words]), (1, 0))
    return [
        WordTiming(
            tok.decode(word_tokens),
            list(word_tokens),
            float(jump_times[bounds[i]]),
            float(jump_times[bounds[i + 1]]),
            float(np.mean(probs[bounds[i] : bounds[i + 1]])),
        )
        for i, word_tokens in enumerate(words)
    ]


def merge_punctuation(
    words: list[WordTiming], prepended: str = PREPEND_PUNCTUATION, appended: str = APPEND_PUNCTUATION
) -> None:
    """Join opening punctuation to the word after it and closing punctuation to the word before it, leaving the
    merged entries empty (word "", no tokens), as OpenAI's `merge_punctuations` does."""
    i, j = len(words) - 2, len(words) - 1
    while i >= 0:
        previous, following = words[i], words[j]
        if previous.word.startswith(" ") and previous.word.strip() in prepended:
            following.word, following.tokens = previous.word + following.word, previous.tokens + following.tokens
            previous.word, previous.tokens = "", []
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(words):
        previous, following = words[i], words[j]
        if not previous.word.endswith(" ") and following.word in appended:
            previous.word, previous.tokens = previous.word + following.word, previous.tokens + following.tokens
            following.word, following.tokens = "", []
        else:
            i = j
        j += 1
