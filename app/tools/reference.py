"""openai-whisper's `transcribe()` on this project's own checkpoints: the reference long-form output.

`openai-whisper` (the `compare` extra; set-up installs it without its CUDA-only dependency, triton) cannot
download weights here, so `load_reference` builds its model from a converted checkpoint in the model store
(Hugging Face layout) by renaming the tensors, with the checkpoint's alignment heads. `compare_segments`
says where our segments differ from the reference's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from app.api.types import Segment

FALLBACK = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)

_LAYER = {
    "self_attn.q_proj": "attn.query",
    "self_attn.k_proj": "attn.key",
    "self_attn.v_proj": "attn.value",
    "self_attn.out_proj": "attn.out",
    "self_attn_layer_norm": "attn_ln",
    "encoder_attn.q_proj": "cross_attn.query",
    "encoder_attn.k_proj": "cross_attn.key",
    "encoder_attn.v_proj": "cross_attn.value",
    "encoder_attn.out_proj": "cross_attn.out",
    "encoder_attn_layer_norm": "cross_attn_ln",
    "fc1": "mlp.0",
    "fc2": "mlp.2",
    "final_layer_norm": "mlp_ln",
}
_TOP = {
    "model.encoder.conv1": "encoder.conv1",
    "model.encoder.conv2": "encoder.conv2",
    "model.encoder.embed_positions.weight": "encoder.positional_embedding",
    "model.encoder.layer_norm": "encoder.ln_post",
    "model.decoder.embed_tokens.weight": "decoder.token_embedding.weight",
    "model.decoder.embed_positions.weight": "decoder.positional_embedding",
    "model.decoder.layer_norm": "decoder.ln",
}


def _reference_name(name: str) -> str | None:
    """A Hugging Face Whisper tensor's name in openai-whisper's model (None: not one of its tensors)."""
    for hf, ours in _TOP.items():
        if name == hf or name.startswith(hf + "."):
            return ours + name[len(hf) :]
    parts = name.split(".")
    if len(parts) >= 5 and parts[0] == "model" and parts[2] == "layers":
        side, index, rest = parts[1], parts[3], ".".join(parts[4:])
        for hf, ours in _LAYER.items():
            if rest.startswith(hf + "."):
                return f"{side}.blocks.{index}.{ours}{rest[len(hf) :]}"
    return None


def load_reference(model_dir: Path) -> Any:
    """openai-whisper's `Whisper` model (fp32, CPU) with the weights and alignment heads of `model_dir`."""
    from whisper.model import ModelDimensions, Whisper

    config = json.loads((model_dir / "config.json").read_text())
    dims = ModelDimensions(
        n_mels=config["num_mel_bins"],
        n_audio_ctx=config["max_source_positions"],
        n_audio_state=config["d_model"],
        n_audio_head=config["encoder_attention_heads"],
        n_audio_layer=config["encoder_layers"],
        n_vocab=config["vocab_size"],
        n_text_ctx=config["max_target_positions"],
        n_text_state=config["d_model"],
        n_text_head=config["decoder_attention_heads"],
        n_text_layer=config["decoder_layers"],
    )
    model = Whisper(dims)
    tensors = {}
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        target = _reference_name(name)
        if target is not None:
            tensors[target] = tensor.float()
    model.load_state_dict(tensors)  # strict: every tensor of the reference is given
    generation = model_dir / "generation_config.json"
    heads = json.loads(generation.read_text()).get("alignment_heads") if generation.is_file() else None
    if heads:
        mask = torch.zeros(dims.n_text_layer, dims.n_text_head, dtype=torch.bool)
        for layer, head in heads:
            mask[layer, head] = True
        model.register_buffer("alignment_heads", mask.to_sparse(), persistent=False)
    return model.eval()


def reference_transcribe(model: Any, audio: np.ndarray, **options: Any) -> dict[str, Any]:
    """`whisper.transcribe(model, audio, fp16=False, **options)` (16-kHz mono float32 `audio`)."""
    import whisper

    return dict(whisper.transcribe(model, audio, fp16=False, verbose=None, **options))


def compare_segments(
    ours: Sequence[Segment], reference: Sequence[dict[str, Any]], duration: float, tolerance: float = 0.01
) -> list[str]:
    """Where our segments differ from the reference's: text, tokens, start and end (within `tolerance` s, the
    reference's times clamped to the audio's `duration`, as ours are), temperature, avg_logprob, compression
    ratio and no-speech probability (within 1e-3), and words when both have them. The reference's emptied
    segments (no text) are left out, as we leave them out. The comparison ends at the first window that either
    decoded by sampling (a fallback above temperature 0: its tokens depend on the random numbers drawn), which
    both must have sampled. An empty list: the same."""
    theirs = [s for s in reference if s["text"].strip()]
    problems: list[str] = []
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        where = f"segment {i} ({b['start']:.2f}-{b['end']:.2f} s)"
        if a.temperature > 0 or b["temperature"] > 0:  # sampled: the same only with the same random numbers
            if (a.temperature > 0) != (b["temperature"] > 0):
                problems.append(f"{where}: decoded at temperature {a.temperature}, the reference at {b['temperature']}")
            return problems
        if a.text != b["text"] or list(a.tokens) != list(b["tokens"]):
            return [*problems, f"{where}: text {a.text!r} != {b['text']!r}"]  # what follows is conditioned on it
        for field in ("start", "end"):
            if abs(getattr(a, field) - min(b[field], duration)) > tolerance:
                problems.append(f"{where}: {field} {getattr(a, field)} != {b[field]}")
        for field in ("temperature", "avg_logprob", "compression_ratio", "no_speech_prob"):
            if abs(getattr(a, field) - b[field]) > 1e-3:
                problems.append(f"{where}: {field} {getattr(a, field)} != {b[field]}")
        if a.words and "words" in b:
            if [w.word for w in a.words] != [w["word"] for w in b["words"]]:
                problems.append(f"{where}: words {[w.word for w in a.words]} != {[w['word'] for w in b['words']]}")
            for w, v in zip(a.words, b["words"], strict=False):
                if (
                    abs(w.start - min(v["start"], duration)) > tolerance
                    or abs(w.end - min(v["end"], duration)) > tolerance
                ):
                    problems.append(f"{where}: word {w.word!r} at {w.start}-{w.end} != {v['start']}-{v['end']}")
    if len(ours) != len(theirs):
        problems.append(f"{len(ours)} segments, the reference has {len(theirs)}")
    return problems
