"""Convert a CTranslate2 (faster-whisper) Whisper bundle into a Hugging Face directory."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from app.model.tokenizer import WhisperTokenizer
from app.store.ct2 import CT2Model, hf_config_kwargs, hf_state_dict, model_file, read_ct2

HF_WEIGHTS = "model.safetensors"
SOURCE_STAMP = "SOURCE.stat"  # size and mtime (ns) of each source file when it was read


def source_stamp(parts: Sequence[Path]) -> str:
    """One line per file of `parts`: its size and modification time, to tell a replaced file by."""
    stats = [part.stat() for part in parts]
    return "".join(f"{st.st_size} {st.st_mtime_ns}\n" for st in stats)


def _generation_config(tok: WhisperTokenizer, bundle: dict[str, Any], max_length: int) -> dict[str, Any]:
    lang_to_id = {f"<|{code}|>": token for code, token in tok.language_ids.items()}
    return {
        "decoder_start_token_id": tok.sot,
        "bos_token_id": tok.eot,
        "eos_token_id": tok.eot,
        "pad_token_id": tok.eot,
        "max_length": max_length,
        "suppress_tokens": list(bundle.get("suppress_ids", [])),
        "begin_suppress_tokens": list(bundle.get("suppress_ids_begin", [])),
        "alignment_heads": [list(pair) for pair in bundle.get("alignment_heads", [])],
        "is_multilingual": tok.multilingual,
        "lang_to_id": lang_to_id,
        "task_to_id": tok.task_ids if tok.multilingual else {"transcribe": tok.task_ids["transcribe"]},
        "no_timestamps_token_id": tok.no_timestamps,
        "prev_sot_token_id": tok.sot_prev,
        "max_initial_timestamp_index": 50,
        "return_timestamps": False,
    }


def _preprocessor_config(n_mels: int) -> dict[str, Any]:
    return {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "processor_class": "WhisperProcessor",
        "feature_size": n_mels,
        "sampling_rate": 16000,
        "hop_length": 160,
        "chunk_length": 30,
        "n_fft": 400,
        "n_samples": 480000,
        "nb_max_frames": 3000,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": False,
    }


def _to_torch(sd: dict[str, np.ndarray], progress: bool) -> dict[str, torch.Tensor]:
    items: Iterable[tuple[str, np.ndarray]] = sd.items()
    if progress:
        items = tqdm(items, total=len(sd), desc="converting", unit="tensor")
    # np.array(..., copy) detaches from the read buffer; contiguous for safetensors.
    return {name: torch.from_numpy(np.ascontiguousarray(array).copy()) for name, array in items}


def convert_ct2(
    source: Path | Sequence[Path],
    destination: Path,
    *,
    bundle_dir: Path | None = None,
    progress: bool = True,
) -> Path:
    """Convert CT2 `model.bin` (or its split parts, concatenated in order) to an HF directory.

    `bundle_dir` holds `config.json` and `tokenizer.json` (defaults to the folder of
    the first model file). The result is written to a temporary sibling folder and
    renamed into place, so a crash never leaves a half-converted model behind.
    """
    parts = [Path(source)] if isinstance(source, (str, Path)) else [Path(p) for p in source]
    bundle_dir = Path(bundle_dir or parts[0].parent)
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    stamp = source_stamp(parts)  # before reading: a file replaced meanwhile is converted again next time
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=destination.parent))
    staging.chmod(0o755)
    try:
        joined = model_file(parts, staging / "model.bin")
        ct2: CT2Model = read_ct2(joined)
        shapes = hf_config_kwargs(ct2)
        tok = WhisperTokenizer.from_file(bundle_dir / "tokenizer.json", vocab_size=shapes["vocab_size"])
        bundle = json.loads((bundle_dir / "config.json").read_text())
        state = _to_torch(hf_state_dict(ct2), progress)
        del ct2
        if joined not in parts:
            joined.unlink()
        save_file(state, str(staging / HF_WEIGHTS), metadata={"format": "pt"})
        generation = _generation_config(tok, bundle, shapes["max_target_positions"])
        config = {
            "model_type": "whisper",
            "architectures": ["WhisperForConditionalGeneration"],
            **shapes,
            "activation_function": "gelu",
            "scale_embedding": False,
            "tie_word_embeddings": "proj_out.weight" not in state,
            "torch_dtype": str(next(iter(state.values())).dtype).removeprefix("torch."),
            **{k: generation[k] for k in ("decoder_start_token_id", "bos_token_id", "eos_token_id", "pad_token_id")},
            "suppress_tokens": generation["suppress_tokens"],
            "begin_suppress_tokens": generation["begin_suppress_tokens"],
        }
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2))
        (staging / "preprocessor_config.json").write_text(
            json.dumps(_preprocessor_config(shapes["num_mel_bins"]), indent=2)
        )
        shutil.copyfile(bundle_dir / "tokenizer.json", staging / "tokenizer.json")
        (staging / "SOURCE").write_text("\n".join(str(p) for p in parts) + "\n")
        (staging / SOURCE_STAMP).write_text(stamp)
        for written in staging.iterdir():  # safetensors writes its file owner-only: a store others serve from
            written.chmod(0o644)  # (a server running as another user, an image's models) must read it
        if destination.exists():
            shutil.rmtree(destination)
        os.replace(staging, destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return destination
