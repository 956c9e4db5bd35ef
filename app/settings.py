"""All configuration in one pydantic-settings class (environment prefix `SPECWHISPER_`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

# OpenAI's speech-to-text and realtime model names that resolve to the served model by default (not
# `gpt-4o-transcribe-diarize`: diarized_json answers on the served id; an operator may add the name).
OPENAI_MODEL_NAMES = (
    "gpt-4o-transcribe",
    "gpt-4o-mini-transcribe",
    "gpt-transcribe",
    "gpt-live-transcribe",
    "gpt-realtime",
    "gpt-realtime-mini",
    "gpt-realtime-whisper",
    "gpt-4o-realtime-preview",
    "gpt-4o-mini-realtime-preview",
)
# "auto": float16 on a GPU, float32 on a CPU; "int8": int8 linear layers on a CPU, float32 around them
DtypeName = Literal["auto", "float32", "float16", "bfloat16", "int8"]


def default_models_dir() -> Path:
    """`models/` beside the `app` package (the repository's model store)."""
    return Path(__file__).resolve().parent.parent / "models"


class Settings(BaseSettings):
    """Engine and server settings; every field can be set as `SPECWHISPER_<FIELD>`."""

    model_config = SettingsConfigDict(env_prefix="SPECWHISPER_", extra="ignore")

    model: str = Field("whisper-base", description="main model: store name, local dir, CT2 dir or hub id")
    assistant: str = Field("self-draft", description="'self-draft', 'none', or a model reference")
    models_dir: Path = Field(default_factory=default_models_dir, description="where converted models live")
    device: str = Field("auto", description="'auto' (cuda when present), 'cpu', 'cuda', 'cuda:1', ...")
    dtype: DtypeName = Field(
        "auto",
        description="the models' dtype: 'auto' is float16 on a GPU, float32 on a CPU; 'int8' (CPUs) gives the main"
        " model int8 linear layers (AVX-512 VNNI or AVX2) and float32 elsewhere",
    )
    encoder_dtype: DtypeName = Field(
        "auto",
        description="the main encoder's own dtype ('auto': as `dtype`); bfloat16 on a CPU with AMX runs it"
        " ~3x faster while the decoders keep `dtype` (on a CPU without bf16 arithmetic, many times slower)",
    )
    threads: int | None = Field(None, ge=1, description="torch intra-op threads (default: torch's choice)")
    draft_tokens: int = Field(5, ge=1, le=12, description="initial draft length per row")
    adaptive_draft: bool = Field(True, description="adapt the draft length to acceptance")
    int8_kernel: bool = Field(
        True, description="self-draft: this project's int8 kernel where the CPU has AVX2 + FMA (else torch's)"
    )
    encoder_attention: Literal["auto", "onednn", "flash"] = Field(
        "auto",
        description="the encoder's self-attention in fp32 on a CPU: oneDNN products per head, torch's flash kernel,"
        " or whichever runs faster on this CPU (timed once per machine and kept)",
    )
    encoder_rows: int = Field(
        0,
        ge=0,
        le=4,
        description="most windows the main encoder runs in one pass; 0 (auto): 2 on a CPU, where four at once ran"
        " 17% slower per window than one or two (their activations outgrow the caches), all of them on a GPU",
    )
    decoder_attention: Literal["invariant", "sdpa"] = Field(
        "invariant",
        description="the decoders' attention: 'invariant' gives every token the same bits whether a pass feeds it"
        " alone or with drafts and other rows (this project's kernel, fp32 on an x86-64 CPU with AVX2; elsewhere"
        " torch's), so speculative output is main-only's bit for bit; 'sdpa': torch's kernel everywhere",
    )
    log_level: str = Field("info", description="logging level of the server and worker")
    worker_heap_trim: bool = Field(True, description="return freed heap memory to the OS when the worker idles")

    # server
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    served_model_name: str | None = Field(None, description="model id in the API (default: the model's name)")
    model_aliases: list[str] = Field(default_factory=lambda: ["whisper-1"], description="other accepted model ids")
    openai_model_names: list[str] = Field(
        default_factory=lambda: list(OPENAI_MODEL_NAMES),
        description="OpenAI's transcription and realtime model names that also resolve to the served model, each"
        " with its dated snapshots (NAME-YYYY-MM-DD): what voice-agent frameworks send on their defaults; [] turns"
        " this off",
    )
    max_batch: int = Field(4, ge=1, le=4, description="most requests decoded together")
    long_upload_batch: int = Field(
        2,
        ge=1,
        le=4,
        description="most jobs of long uploads (their chunks, or windows) decoded together: a short upload or live"
        " final that comes while they run waits for a smaller batch, and the worker holds a smaller one",
    )
    max_batch_rows: int = Field(
        10,
        ge=1,
        le=64,
        description="most decoding rows of a batch: a greedy request takes 1, a beam-5 request 5 (a request wider"
        " than this runs alone)",
    )
    worker_memory_mb: float | None = Field(
        None,
        gt=0,
        description="the worker process's memory budget in MB: it measures its own size and a clip's cost in its"
        " warm-up, and batches hold no more clips than fit (it refuses to start where not even one fits); unset: no"
        " budget, batches of up to max_batch",
    )
    speculation: Literal["adaptive", "always", "never"] = Field(
        "adaptive", description="per batch: measured choice, always speculative, or always plain greedy"
    )
    batch_window_ms: float = Field(10.0, ge=0, le=1000, description="how long a batch waits to fill")
    queue_size: int = Field(64, ge=1, description="requests waiting beyond this get 429")
    max_upload_bytes: int = Field(25 * 1024 * 1024, ge=1, description="largest accepted upload")
    max_audio_seconds: float = Field(3600.0, gt=0, description="longest accepted audio")
    default_beam_size: int = Field(
        1,
        ge=1,
        le=16,
        description="uploads that send no `beam_size`: 1 decodes greedily (the fastest), 5 searches 5 hypotheses as"
        " openai-whisper's and faster-whisper's command lines do (fewer word errors, see docs/performance.md)",
    )
    default_chunking_strategy: Literal["none", "auto"] = Field(
        "none",
        description="uploads that send no `chunking_strategy`: 'none' decodes the audio as one block (OpenAI's"
        " default), 'auto' cuts it at pauses found by the VAD and decodes its speech only, in batches",
    )
    max_queued_audio_seconds: float = Field(
        4 * 3600.0, gt=0, description="decoded audio waiting in the queue (4 bytes/sample at 16 kHz); beyond it 429"
    )
    max_audio_in_flight_s: float = Field(
        3600.0,
        gt=0,
        description="seconds of audio uploads may hold at once (a single-block upload all of its audio, a chunked"
        " one a few chunks, ~5 min at most); an upload that does not fit waits, and past a line of as much audio"
        " gets 429; uploads of 60 s or less have 240 s more of their own",
    )
    windows_per_turn: int = Field(
        1,
        ge=0,
        description="30-s windows a single-block upload decodes per batch before others may join its batch (its"
        " transcription so far waits in the worker); 0: all of them, the others wait",
    )
    upload_threads: int = Field(
        1,
        ge=1,
        le=64,
        description="threads (at a lower OS priority than the worker's) that decode uploads past their first second"
        " and run their VAD, a bounded step at a time; one more thread reads every upload's first second, and one at"
        " the process's priority its first 20 ms of CPU",
    )
    request_timeout_s: float = Field(600.0, gt=0, description="a request waiting longer gets 504")
    shutdown_timeout_s: float = Field(30.0, ge=0, description="time to finish in-flight work on shutdown")
    worker_start_timeout_s: float = Field(
        900.0, gt=0, description="a worker not ready after this (models loading or downloading) is restarted"
    )
    worker_stall_timeout_s: float = Field(
        300.0,
        gt=0,
        description="a worker with no sign of progress (it sends one per main-model pass) this long in a batch is"
        " taken as hung and restarted",
    )
    api_keys: list[str] = Field(default_factory=list, description="accepted Bearer keys; empty = no auth")

    # live transcription (/v1/realtime)
    realtime_partial_interval_s: float = Field(
        1.0, gt=0, description="with `include` partials, re-transcribe an open turn this often"
    )
    realtime_max_utterance_s: float = Field(30.0, gt=1, le=30, description="an utterance is finalized at this length")
    realtime_max_backlog_s: float = Field(120.0, gt=0, description="untranscribed audio a session may hold")
    realtime_max_event_bytes: int = Field(1024 * 1024, ge=1024, description="largest client event accepted")
    realtime_max_sessions: int = Field(32, ge=1, description="concurrent WebSocket sessions")
    speaker_embedder: Path | None = Field(
        None,
        description="an ONNX speaker embedder ([batch, samples] 16-kHz audio in, [batch, dim] out) for"
        " diarization, instead of the GE2E encoder whose weights come with the resemblyzer wheel",
    )
    realtime_partial_max_wait_s: float = Field(1.0, ge=0, description="a partial waiting longer goes before uploads")
