"""The drafting contract: assistants that propose tokens for the main model to verify.

It follows transformers' candidate generators, batched: a `Drafter` is resident for the life of the
engine; `start()` opens a `DraftSession` for one batch, whose `get_candidates()` proposes up to a
budget of tokens per row and whose `update_candidate_strategy()` learns how many were accepted (and
which rows finished). New assistant kinds plug in by implementing these two methods; a session may
also take the main model's cache of a long prompt (`PromptAdopting`).

The kinds this project ships are in `app.engine.drafting.decoder` (a Whisper text decoder as the draft:
int8 self-draft, decoder-only, encoder-decoder) and are chosen in `app.engine.drafting.assistants`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import Tensor

from app.engine.decoding.batch import DecoderState, Row
from app.model.decoder import CrossKV


@dataclass(frozen=True)
class DraftInputs:
    """What a batch offers a drafter.

    features [B, n_mels, 3000], main encoder states [B, T, D], main cross-attention K/V.
    audio_frames: how many of the T encoder frames hold audio in the batch's longest row (the rest
    encode the padding of a window shorter than 30 s); None when unknown.
    capacity: the most tokens a row may hold (sizes the draft's cache); None: the model's limit.
    """

    features: Tensor
    encoder_out: Tensor
    main_cross: CrossKV
    audio_frames: int | None = None
    capacity: int | None = None


@dataclass(frozen=True)
class Drafts:
    """Proposed continuations per row, as the root-to-leaf paths of a tree (a row decoded greedily gets one)."""

    paths: list[list[list[int]]]

    @classmethod
    def empty(cls, batch: int) -> Drafts:
        return cls([[] for _ in range(batch)])

    @property
    def tokens(self) -> list[list[int]]:
        """Each row's first path (a greedy row's chain), [] where none."""
        return [paths[0] if paths else [] for paths in self.paths]


class DraftSession(Protocol):
    """Drafts for one batch of rows, from its first window pass to its last."""

    passes: int  # draft forward passes so far

    def get_candidates(self, rows: Sequence[Row], budgets: Sequence[int]) -> Drafts:
        """Propose continuations of at most budgets[b] tokens after rows[b].tokens. Any tokens are correct (the
        main model verifies them). A row decoded greedily gets one path; for a row that samples, the best guesses
        are the draft's argmax of its logits perturbed as the main model's will be
        (`app.engine.decoding.selection.perturbed`, the row's seed). Consecutive rows of one `group` with
        `beam` above 1 are the hypotheses of a beam search: the paths of each form the tree its search may take
        (for example the draft's own beam search a few steps ahead). Rows may come in any number and order
        from call to call (hypotheses fork and die); a session finds what it holds of each by its tokens."""

    def update_candidate_strategy(self, rows: Sequence[Row], accepted: Sequence[int], proposed: Sequence[int]) -> None:
        """Learn that rows[b] (those of the last call) kept accepted[b] of the proposed[b] drafted steps."""


@runtime_checkable
class PromptAdopting(Protocol):
    """A session that can take the main model's keys/values of a long prompt instead of feeding it."""

    def adopts_prompt(self, rows: Sequence[Row]) -> bool:
        """Whether the first main pass should run without drafts so that `adopt()` can take its cache."""

    def adopt(self, main: DecoderState, rows: Sequence[Row]) -> None:
        """Take the main model's cache of `rows` (row b: main row b, its first main.fed[b] tokens) instead of
        feeding them."""


class Drafter(Protocol):
    name: str

    def start(self, inputs: DraftInputs) -> DraftSession: ...


@dataclass(frozen=True)
class DraftLength:
    """Adaptive draft length per row (transformers' heuristic): +2 after a fully accepted draft, -1 otherwise.

    A fixed length is `DraftLength(initial=k, adaptive=False)`. Drafting of a row also stops at a
    token the draft itself gives less than `confidence` probability.
    """

    initial: int = 5
    maximum: int = 12
    adaptive: bool = True
    confidence: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.initial <= self.maximum:
            raise ValueError(f"draft length must be within 1..{self.maximum}, got {self.initial}")
        if not 0.0 <= self.confidence < 1.0:
            raise ValueError("draft confidence threshold must be in [0, 1)")

    def next(self, current: int, accepted: int, proposed: int) -> int:
        if not self.adaptive or proposed == 0:
            return current
        if accepted == proposed:
            return min(self.maximum, current + 2)
        return max(1, current - 1)
