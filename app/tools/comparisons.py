"""Reference decoders for the benchmark: transformers' `generate` and faster-whisper, on the same weights.

Each runner transcribes one clip with the same first-window log-mel input as the engine
(short clips, no timestamps, language given) and reports its text tokens and wall time,
so the benchmark can compare them with the engine's own modes clip by clip.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from app.model.features import N_FRAMES, N_SAMPLES, log_mel, window
from app.model.whisper import WhisperModel
from app.store.ct2 import model_file


@dataclass(frozen=True)
class RunResult:
    """One clip through one decoder: generated text tokens (no special tokens) and wall time."""

    tokens: list[int]
    text: str
    total_ms: float


class ClipRunner(Protocol):
    name: str

    def run(self, audio: np.ndarray, language: str) -> RunResult:
        """Transcribe one clip of at most 30 s (16-kHz mono samples)."""


def first_window(audio: np.ndarray, n_mels: int) -> torch.Tensor:
    """The engine's log-mel of a clip's first 30-s window: [1, n_mels, 3000]."""
    mel = log_mel(audio, n_mels, padding=N_SAMPLES)
    return window(mel, 0, min(N_FRAMES, mel.shape[-1] - N_FRAMES)).unsqueeze(0)


class HFGenerate:
    """transformers' `WhisperForConditionalGeneration.generate`, greedy, optionally with
    `assistant_model=`: the same pair as the engine's default, i.e. a decoder-only copy of the
    main decoder with int8 dynamic-quantized linears reading the main encoder's output."""

    def __init__(self, main: WhisperModel, assisted: bool) -> None:
        from transformers import WhisperForCausalLM, WhisperForConditionalGeneration

        self.name = "hf_assisted" if assisted else "hf_greedy"
        self.tokenizer = main.tokenizer
        self.n_mels = main.n_mels
        self.model = WhisperForConditionalGeneration.from_pretrained(main.source, dtype=torch.float32).eval()
        self.assistant: nn.Module | None = None
        if assisted:
            from torch.ao.quantization import quantize_dynamic

            # WhisperForCausalLM edits the config it is given (is_encoder_decoder=False): pass a copy.
            draft = WhisperForCausalLM(copy.deepcopy(self.model.config)).eval()
            draft.model.decoder.load_state_dict(self.model.model.decoder.state_dict())
            draft.generation_config = copy.deepcopy(self.model.generation_config)
            self.assistant = quantize_dynamic(draft, {nn.Linear}, dtype=torch.qint8)

    @torch.inference_mode()
    def run(self, audio: np.ndarray, language: str) -> RunResult:
        started = time.perf_counter()
        features = first_window(audio, self.n_mels)
        extra: dict[str, Any] = {"assistant_model": self.assistant} if self.assistant is not None else {}
        out = self.model.generate(features, language=language, task="transcribe", do_sample=False, num_beams=1, **extra)
        elapsed = (time.perf_counter() - started) * 1000
        tokens = [t for t in out[0].tolist() if t < self.tokenizer.eot]
        return RunResult(tokens, self.tokenizer.decode(tokens), elapsed)


def ct2_source(model_name: str) -> tuple[list[Path], Path]:
    """The CTranslate2 files a store model was converted from: model.bin parts and the bundle folder."""
    from app.store.catalog import EMBEDDED

    embedded = EMBEDDED.get(model_name)
    found = embedded.locate() if embedded is not None else None
    if found is None:
        raise LookupError(f"no CTranslate2 source for {model_name!r} (needs an embedded model's packages)")
    return found


def load_faster_whisper(model_name: str, threads: int) -> tuple[tempfile.TemporaryDirectory[str], Any]:
    """faster-whisper's model (fp32, CPU) on the CTranslate2 checkpoint store model `model_name` was converted
    from, assembled in a temporary folder (kept alive by the returned handle)."""
    os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")  # its VAD runs on onnxruntime (see app/server/vad.py)
    from faster_whisper import WhisperModel as FWModel

    parts, bundle = ct2_source(model_name)
    handle = tempfile.TemporaryDirectory(prefix="specwhisper-ct2-")
    folder = Path(handle.name)
    model_file(parts, folder / "model.bin", reuse_single=False)  # CTranslate2 reads one model.bin
    for name in ("config.json", "tokenizer.json", "vocabulary.txt", "vocabulary.json", "preprocessor_config.json"):
        if (bundle / name).is_file():
            shutil.copyfile(bundle / name, folder / name)
    return handle, FWModel(str(folder), device="cpu", compute_type="float32", cpu_threads=threads, num_workers=1)


class FasterWhisper:
    """faster-whisper (CTranslate2) on the CTranslate2 checkpoint the engine's weights were converted
    from, computing in fp32, greedy or with beam search (`beam_size`), without timestamps (optional dependency
    `faster-whisper`)."""

    def __init__(self, main: WhisperModel, threads: int, beam_size: int = 1) -> None:
        self._dir, self.model = load_faster_whisper(main.name, threads)
        self.tokenizer = main.tokenizer
        self.beam_size = beam_size
        self.name = "faster_whisper" if beam_size == 1 else f"faster_whisper_beam{beam_size}"

    def run(self, audio: np.ndarray, language: str) -> RunResult:
        started = time.perf_counter()
        segments, _ = self.model.transcribe(
            audio.astype(np.float32),
            language=language,
            task="transcribe",
            beam_size=self.beam_size,
            best_of=1,
            temperature=0.0,
            without_timestamps=True,
            condition_on_previous_text=False,
            vad_filter=False,
        )
        done = list(segments)
        elapsed = (time.perf_counter() - started) * 1000
        tokens = [t for s in done for t in s.tokens if t < self.tokenizer.eot]
        return RunResult(tokens, self.tokenizer.decode(tokens), elapsed)
