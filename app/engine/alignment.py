"""Word-level timestamps: cross-attention alignment heads + dynamic time warping (OpenAI's method)."""

from __future__ import annotations

import string

import numpy as np
import torch

from app.api.types import Word
from app.engine.decoding.batch import DecoderState
from app.model.decoder import CrossKV
from app.model.features import TIME_PRECISION
from app.model.tokenizer import WhisperTokenizer
from app.model.whisper import WhisperModel

MEDIAN_FILTER_WIDTH = 7
NO_SPACE_LANGUAGES = {"zh", "ja", "th", "lo", "my", "yue"}
PREPEND_PUNCTUATION = "\"'“¿([{-"
APPEND_PUNCTUATION = "\"'.。,，!！?？:：”)]}、"


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Monotonic alignment path (text indices, time indices) through cost [N, M]."""
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf)
    acc[0, 0] = 0.0
    trace = np.zeros((n + 1, m + 1), dtype=np.int8)
    for i in range(1, n + 1):
        row_prev, row = acc[i - 1], acc[i]
        c = cost[i - 1]
        for j in range(1, m + 1):
            c0, c1, c2 = float(row_prev[j - 1]), float(row_prev[j]), float(row[j - 1])
            best: float
            t: int
            if c0 <= c1 and c0 <= c2:
                best, t = c0, 0
            elif c1 <= c2:
                best, t = c1, 1
            else:
                best, t = c2, 2
            row[j] = c[j - 1] + best
            trace[i, j] = t
    i, j = n, m
    text, time = [], []
    while i > 0 and j > 0:
        text.append(i - 1)
        time.append(j - 1)
        step = trace[i, j]
        if step == 0:
            i, j = i - 1, j - 1
        elif step == 1:
            i -= 1
        else:
            j -= 1
    return np.array(text[::-1]), np.array(time[::-1])


def _median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    padded = torch.nn.functional.pad(x, (pad, pad), mode="reflect")
    return padded.unfold(-1, width, 1).median(-1).values


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


@torch.inference_mode()
def align_words(
    main: WhisperModel,
    cross: CrossKV,
    sot_sequence: list[int],
    text_tokens: list[int],
    num_frames: int,
    language: str | None,
) -> list[Word]:
    """Word timings (seconds from the window start) of `text_tokens` for one row (cross of batch 1)."""
    tok = main.tokenizer
    if not text_tokens:
        return []
    heads = main.constants.alignment_heads or tuple(
        (layer, h)
        for layer in range(len(main.decoder.layers) // 2, len(main.decoder.layers))
        for h in range(main.decoder.n_heads)
    )
    state = DecoderState.start(main.decoder, cross, 1)
    captured: list[torch.Tensor] = []
    feed = [*sot_sequence, tok.no_timestamps, *text_tokens, tok.eot]
    hidden, _ = state.feed([feed], captured)
    logits = main.decoder.logits(hidden[0, len(sot_sequence) : len(sot_sequence) + len(text_tokens)])
    probs = logits.softmax(-1)[torch.arange(len(text_tokens)), torch.tensor(text_tokens)].tolist()
    weights = torch.stack([captured[layer][0, head] for layer, head in heads])  # [heads, S, T]
    weights = weights[:, :, : max(1, num_frames // 2)].float()  # a window may hold a single mel frame
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    weights = _median_filter((weights - mean) / (std + 1e-10), MEDIAN_FILTER_WIDTH)
    # Rows: the no-timestamps position and each text token (each predicting the next token).
    matrix = weights.mean(0)[len(sot_sequence) : -1]
    text_idx, time_idx = dtw(-matrix.double().numpy())

    words = split_words(tok, text_tokens, language)
    jumps = np.pad(np.diff(text_idx), (1, 0), constant_values=1).astype(bool)
    jump_times = time_idx[jumps] * TIME_PRECISION
    bounds = np.pad(np.cumsum([len(w) for w in words]), (1, 0))
    out: list[Word] = []
    for i, word_tokens in enumerate(words):
        start = float(jump_times[min(bounds[i], len(jump_times) - 1)])
        end = float(jump_times[min(bounds[i + 1], len(jump_times) - 1)])
        p = probs[bounds[i] : bounds[i + 1]]
        out.append(
            Word(
                tok.decode(word_tokens),
                round(start, 2),
                round(max(end, start), 2),
                round(float(np.mean(p)), 4),
                tuple(word_tokens),
            )
        )
    return _merge_punctuation(out)


def _merge_punctuation(words: list[Word]) -> list[Word]:
    """Attach leading/trailing punctuation to the neighbouring word (as OpenAI does)."""
    merged: list[Word] = []
    for w in words:
        stripped = w.word.strip()
        if merged and stripped and all(c in APPEND_PUNCTUATION for c in stripped) and not w.word.startswith(" "):
            prev = merged[-1]
            merged[-1] = Word(
                prev.word + w.word, prev.start, max(prev.end, w.end), prev.probability, prev.tokens + w.tokens
            )
        else:
            merged.append(w)
    return merged
