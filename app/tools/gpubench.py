"""Per-step costs of speculative decoding on an accelerator, with random weights, and the speedup they predict.

A main decoder of a given shape (default: Whisper large-v3's) and a decoder-only
assistant (default: distil-large-v3's 2 layers, reading the main encoder's output)
are built with random weights on `--device`; no checkpoint is needed. Timed, per step,
through the engine's own decoder and cache code:

* main-only step: feed 1 token, project, pick the argmax;
* verify(n): feed the pending token plus n drafts (n = 1..8) and score all n+1 positions;
* draft step: the assistant feeds 1 token and picks its argmax.

With per-token acceptance a and draft length k, one pass yields (1 - a^(k+1)) / (1 - a)
tokens for k draft steps plus verify(k), so the predicted decode speedup is
tokens_per_pass * main_step / (k * draft + verify(k)), maximised over k.

    python -m app gpubench                                  # CUDA, fp16, large-v3 / distil shapes
    python -m app gpubench --device cpu --dtype float32 --shape tiny --steps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from app.engine.decoding.batch import DecoderState
from app.model.decoder import TextDecoder

ACCEPTANCES = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
MAX_CANDIDATES = 8


@dataclass(frozen=True)
class Shape:
    """Decoder shapes of a main model and its assistant (Whisper's text decoder)."""

    vocab: int
    d_model: int
    heads: int
    ffn: int
    main_layers: int
    draft_layers: int
    positions: int = 448
    frames: int = 1500  # encoder states per 30-s window


SHAPES = {
    # openai/whisper-large-v3 and distil-whisper/distil-large-v3 (2 decoder layers, same width).
    "large-v3": Shape(vocab=51866, d_model=1280, heads=20, ffn=5120, main_layers=32, draft_layers=2),
    # A small stand-in with the same structure, for smoke tests on a CPU.
    "tiny": Shape(vocab=51865, d_model=384, heads=6, ffn=1536, main_layers=4, draft_layers=1),
}


def random_decoder(shape: Shape, layers: int, device: torch.device, dtype: torch.dtype) -> TextDecoder:
    """A TextDecoder of `shape` with `layers` layers and random weights (std 0.02), on `device` in `dtype`."""
    with torch.device(device):
        decoder = TextDecoder(shape.vocab, shape.d_model, shape.heads, shape.ffn, layers, shape.positions)
    with torch.no_grad():
        for p in decoder.parameters():
            p.normal_(0.0, 0.02)
    return decoder.to(dtype).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def step_ms(state: DecoderState, width: int, context: int, steps: int, warmup: int = 3) -> float:
    """Median wall time (ms) of one step: feed `width` tokens per row after `context` held tokens,
    project every fed position to the vocabulary and take the argmax (to the host, as the engine does)."""
    batch = len(state.fed)
    times = []
    for i in range(warmup + steps):
        state.rewind([context] * batch)
        _sync(state.cache.keys[0].device)
        started = time.perf_counter()
        hidden, _ = state.feed([[220] * width] * batch)
        state.decoder.logits(hidden).argmax(-1).tolist()
        if i >= warmup:
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def predict(main_step: float, draft_step: float, verify: dict[int, float]) -> dict[str, dict[str, float]]:
    """Best draft length k and its predicted decode speedup for each per-token acceptance."""
    out = {}
    for a in ACCEPTANCES:
        best = (0.0, 0)
        for k, cost in verify.items():
            tokens = (1 - a ** (k + 1)) / (1 - a)
            best = max(best, (tokens * main_step / (k * draft_step + cost), k))
        out[str(a)] = {"draft_length": best[1], "speedup": round(best[0], 3)}
    return out


@torch.inference_mode()
def run_gpubench(
    device: torch.device, dtype: torch.dtype, shape: Shape, *, batch: int = 1, steps: int = 20, context: int = 64
) -> dict[str, Any]:
    """Build the random pair on `device` and time its steps; returns the report (times in ms)."""
    torch.manual_seed(0)
    main = random_decoder(shape, shape.main_layers, device, dtype)
    draft = random_decoder(shape, shape.draft_layers, device, dtype)
    encoder_out = torch.randn(batch, shape.frames, shape.d_model, device=device, dtype=dtype)
    main_state = DecoderState.start(main, main.cross_kv(encoder_out), batch)
    draft_state = DecoderState.start(draft, draft.cross_kv(encoder_out), batch)
    for state in (main_state, draft_state):
        state.feed([[220] * context] * batch)
    main_step = step_ms(main_state, 1, context, steps)
    draft_step = step_ms(draft_state, 1, context, steps)
    verify = {n: step_ms(main_state, n + 1, context, steps) for n in range(1, MAX_CANDIDATES + 1)}
    return {
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "shape": asdict(shape),
        "batch": batch,
        "context_tokens": context,
        "steps": steps,
        "main_step_ms": round(main_step, 3),
        "draft_step_ms": round(draft_step, 3),
        "verify_ms": {str(n): round(t, 3) for n, t in verify.items()},
        "predicted_decode_speedup": predict(main_step, draft_step, verify),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--shape", default="large-v3", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=1, help="rows decoded together")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per measurement (median)")
    parser.add_argument("--json", help="also write the report to this file")


def run_cli(args: argparse.Namespace) -> int:
    report = run_gpubench(
        torch.device(args.device), getattr(torch, args.dtype), SHAPES[args.shape], batch=args.batch, steps=args.steps
    )
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as out:
            out.write(text)
    return 0
