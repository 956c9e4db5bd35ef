"""Read a Hugging Face Whisper checkpoint's files: a local directory, or a hub id through its cache.

The tensors come straight from the weight files (safetensors, or a legacy `pytorch_model.bin`,
either one file or shards with an index), one at a time as the engine's modules take them.
Importing transformers' model code and building its modules cost a worker ~6 s at every start
for Whisper base, before a single weight was read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

# In transformers' order of preference.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class CheckpointError(ValueError):
    """A checkpoint's files are missing or are not a Whisper model's."""


def checkpoint_file(ref: str, name: str) -> Path | None:
    """`name` in the local directory `ref`, or in the hub repository `ref` (downloaded once); None if absent."""
    local = Path(ref) / name
    if Path(ref).is_dir():
        return local if local.is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(ref, name))
    except EntryNotFoundError:
        return None


def read_config(ref: str) -> dict[str, Any]:
    path = checkpoint_file(ref, "config.json")
    if path is None:
        raise CheckpointError(f"{ref}: no config.json")
    return dict(json.loads(path.read_text()))


class CheckpointTensors(Mapping[str, Tensor]):
    """A checkpoint's tensors by transformers' full names, read when asked for, cast to `dtype` on `device`.

    Names are those of `WhisperForConditionalGeneration` / `WhisperForCausalLM` (`model.encoder.*`,
    `model.decoder.*`, `proj_out.weight`); a bare `WhisperModel`'s (`encoder.*`, `decoder.*`) are
    read under the same names. Use as a context manager: it holds the files open.
    """

    def __init__(self, ref: str, *, device: torch.device, dtype: torch.dtype) -> None:
        self.ref, self.device, self.dtype = ref, device, dtype
        self._files = ExitStack()
        self._where: dict[str, tuple[Any, str]] = {}  # name -> (open file, name in that file)
        for name in WEIGHT_FILES:
            path = checkpoint_file(ref, name)
            if path is not None:
                self._open(path, ref)
                break
        else:
            raise CheckpointError(f"{ref}: no weights (looked for {', '.join(WEIGHT_FILES)})")
        if not any(name.startswith("model.") for name in self._where):
            self._where = {f"model.{name}": where for name, where in self._where.items()}

    def _open(self, path: Path, ref: str) -> None:
        if path.name.endswith(".index.json"):
            shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
            for shard in shards:
                shard_path = checkpoint_file(ref, shard)
                if shard_path is None:
                    raise CheckpointError(f"{ref}: {path.name} names {shard}, which is missing")
                self._open(shard_path, ref)
        elif path.suffix == ".safetensors":
            from safetensors import safe_open

            handle = self._files.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            self._where |= {name: (handle, name) for name in handle.keys()}  # noqa: SIM118 - not a dict
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            self._where |= {name: (state, name) for name in state}

    def __getitem__(self, name: str) -> Tensor:
        source, key = self._where[name]
        if isinstance(source, dict):  # a memory-mapped legacy state dict: copy out of the file
            tensor, copy = source[key], True
        else:  # safetensors hands out a fresh tensor
            tensor, copy = source.get_tensor(key), False
        dtype = self.dtype if tensor.is_floating_point() else tensor.dtype
        return tensor.to(device=self.device, dtype=dtype, copy=copy)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __enter__(self) -> CheckpointTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self._files.close()
        self._where = {}
