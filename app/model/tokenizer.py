"""Whisper's byte-level BPE tokenizer with the special tokens the decoder needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from app.api.types import TASKS


def byte_alphabet() -> list[str]:
    """The character that stands for each byte (0..255) in a byte-level BPE vocabulary (GPT-2's): a printable
    Latin-1 character stands for itself, every other byte for chr(256 + n), n counting those bytes in order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = iter(range(256, 512))
    return [chr(byte) if byte in printable else chr(next(others)) for byte in range(256)]


class VocabularyMismatchError(ValueError):
    """Main and assistant models do not share a vocabulary."""


@dataclass(frozen=True)
class WhisperTokenizer:
    """Special token ids and text <-> id conversion for one Whisper vocabulary.

    `vocab_size` is the model's output dimension, which includes the timestamp
    tokens that follow `<|notimestamps|>` (they are not in `tokenizer.json`).
    """

    backend: _HFTokenizer = field(repr=False, compare=False)
    vocab_size: int

    @classmethod
    def from_file(cls, path: str | Path, vocab_size: int) -> WhisperTokenizer:
        return cls(backend=_HFTokenizer.from_file(str(path)), vocab_size=vocab_size)

    def _id(self, token: str) -> int:
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer has no special token {token}")
        return int(token_id)

    @cached_property
    def eot(self) -> int:
        return self._id("<|endoftext|>")

    @cached_property
    def sot(self) -> int:
        return self._id("<|startoftranscript|>")

    @cached_property
    def sot_prev(self) -> int:
        return self._id("<|startofprev|>")

    @cached_property
    def no_timestamps(self) -> int:
        return self._id("<|notimestamps|>")

    @cached_property
    def no_speech(self) -> int:
        token = self.backend.token_to_id("<|nospeech|>")
        return int(token) if token is not None else self._id("<|nocaptions|>")

    @cached_property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    @cached_property
    def task_ids(self) -> dict[str, int]:
        return {task: self._id(f"<|{task}|>") for task in TASKS}

    @property
    def multilingual(self) -> bool:
        # Multilingual vocabularies have 51865 entries (large-v3: 51866); English-only ones 51864.
        return self.vocab_size >= 51865

    @cached_property
    def language_ids(self) -> dict[str, int]:
        """Language code -> token id, in the model's order (empty for English-only models)."""
        if not self.multilingual:
            return {}
        first, last = self.sot + 1, self.task_ids["translate"]
        codes: dict[str, int] = {}
        for token_id in range(first, last):
            token = self.backend.id_to_token(token_id)
            if token and token.startswith("<|") and token.endswith("|>"):
                codes[token[2:-2]] = token_id
        return codes

    def signature(self) -> tuple[int, int, int, int]:
        """What two models must agree on to share drafts: size and special-token layout."""
        return (self.vocab_size, self.eot, self.sot, self.no_timestamps)

    def describe(self) -> str:
        kind = "multilingual" if self.multilingual else "English-only"
        return f"{self.vocab_size} tokens, {kind}, <|endoftext|>={self.eot}"

    def prompt(self, language: str | None, task: str, timestamps: bool = False) -> list[int]:
        """The forced decoder prompt: SOT, language, task, and no-timestamps unless timestamps are wanted."""
        tokens = [self.sot]
        if self.multilingual:
            if language is None:
                raise ValueError("a language is required for the prompt of a multilingual model")
            tokens += [self.language_ids[language], self.task_ids[task]]
        if not timestamps:
            tokens.append(self.no_timestamps)
        return tokens

    def encode(self, text: str) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    @cached_property
    def _byte_of(self) -> dict[str, int]:
        """Byte-level BPE's alphabet, reversed: the byte each character of the vocabulary stands for."""
        return {char: byte for byte, char in enumerate(byte_alphabet())}

    def token_bytes(self, token: int) -> bytes:
        """The bytes an ordinary token stands for (UTF-8 text, or part of a character)."""
        return bytes(self._byte_of[c] for c in self.backend.id_to_token(token) or "")

    def decode(self, tokens: list[int]) -> str:
        """Text of the ordinary tokens (special and timestamp tokens dropped)."""
        return str(self.backend.decode([t for t in tokens if t < self.eot], skip_special_tokens=False))


def check_same_vocabulary(main: WhisperTokenizer, main_name: str, other: WhisperTokenizer, other_name: str) -> None:
    """Raise a clear error when the assistant cannot draft for the main model."""
    if main.signature() != other.signature():
        raise VocabularyMismatchError(
            f"assistant {other_name!r} ({other.describe()}) does not share the vocabulary of main model "
            f"{main_name!r} ({main.describe()}); speculative decoding needs identical vocabularies"
        )
