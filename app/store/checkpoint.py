"""Read a Hugging Face Whisper checkpoint's files: a local directory, or a hub id through its cache.

The tensors come straight from the weight files (safetensors, or a legacy `pytorch_model.bin`,
either one file or shards with an index), one at a time as the engine's modules take them.
Importing transformers' model code and building its modules cost a worker ~6 s at every start
for Whisper base, before a single weight was read.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

# In transformers' order of preference.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class CheckpointError(ValueError):
    """A checkpoint's files are missing or are not a Whisper model's."""


class HubUnreachableError(CheckpointError):
    """A hub file is not in the local cache, and the hub cannot be asked whether it exists.

    `offline`: the hub is switched off (HF_HUB_OFFLINE), so asking again cannot help; otherwise the
    network or the hub may come back.
    """

    def __init__(self, message: str, *, offline: bool) -> None:
        super().__init__(message)
        self.offline = offline


REACH_TTL_S = 60.0
_reach: dict[str, tuple[float, bool]] = {}  # hub endpoint -> (when asked, whether it answered)


def hub_reachable(endpoint: str) -> bool:
    """Whether the hub at `endpoint` answered a request lately (asked again after REACH_TTL_S).

    huggingface_hub retries a request that cannot connect five times (~24 s) before it settles for
    its cache, and it does so for each file. A model of five files, all cached, then took two
    minutes to load with the network down. One quick request tells, and the files come from the
    cache at once.
    """
    now = time.monotonic()
    asked = _reach.get(endpoint)
    if asked is None or now - asked[0] > REACH_TTL_S:
        from huggingface_hub.utils import get_session

        try:
            get_session().head(endpoint, timeout=5)  # any answer, even an error status, will do
            answered = True
        except Exception as exc:  # what a transport raises varies: no connection, no name, a timeout
            answered = False
            log.warning("the hub %s cannot be reached (%s); hub models come from the local cache", endpoint, exc)
        _reach[endpoint] = asked = (now, answered)
    return asked[1]


def checkpoint_file(ref: str, name: str) -> Path | None:
    """`name` in the local directory `ref`, or in the hub repository `ref` (downloaded once); None if absent.

    Raises CheckpointError when the hub cannot say: no such repository (or one the token may not
    read), or the file is not in the local cache and the hub cannot be reached (offline).
    """
    local = Path(ref) / name
    if Path(ref).is_dir():
        return local if local.is_file() else None
    from huggingface_hub import _CACHED_NO_EXIST, constants, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.utils import (
        EntryNotFoundError,
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        local_only = constants.HF_HUB_OFFLINE or not hub_reachable(constants.ENDPOINT)
        return Path(hf_hub_download(ref, name, local_files_only=local_only))
    except LocalEntryNotFoundError as exc:  # before EntryNotFoundError, of which it is a subclass
        if try_to_load_from_cache(ref, name) is _CACHED_NO_EXIST:  # the hub said so before
            return None
        raise HubUnreachableError(
            f"{ref}: {name} is not in the local Hugging Face cache and the hub cannot be reached"
            " (offline?); fetch the model once with network access, or give a local directory",
            offline=constants.HF_HUB_OFFLINE,
        ) from exc
    except EntryNotFoundError:
        return None
    except GatedRepoError as exc:
        raise CheckpointError(f"{ref}: a gated repository; accept its terms on the hub and set HF_TOKEN") from exc
    except RepositoryNotFoundError as exc:
        raise CheckpointError(f"{ref}: no such model repository on the hub (a private one needs HF_TOKEN)") from exc
    except HFValidationError as exc:
        raise CheckpointError(f"{ref}: not a valid hub id ({exc})") from exc


def _weights_file(ref: str) -> Path:
    """The first of WEIGHT_FILES that `ref` has; offline, the first the cache has."""
    unknown: HubUnreachableError | None = None
    for name in WEIGHT_FILES:
        try:
            path = checkpoint_file(ref, name)
        except HubUnreachableError as exc:  # a cached legacy .bin still serves, as in transformers
            unknown = unknown or exc
            continue
        if path is not None:
            return path
    if unknown is not None:
        raise unknown
    raise CheckpointError(f"{ref}: no weights (looked for {', '.join(WEIGHT_FILES)})")


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read it: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return data


def read_config(ref: str) -> dict[str, Any]:
    path = checkpoint_file(ref, "config.json")
    if path is None:
        raise CheckpointError(f"{ref}: no config.json")
    return read_json(path)


class CheckpointTensors(Mapping[str, Tensor]):
    """A checkpoint's tensors by transformers' full names, read when asked for, cast to `dtype` on `device`.

    Names are those of `WhisperForConditionalGeneration` / `WhisperForCausalLM` (`model.encoder.*`,
    `model.decoder.*`, `proj_out.weight`); a bare `WhisperModel`'s (`encoder.*`, `decoder.*`) are
    read under the same names. `dtype_under` casts the floating tensors under a name prefix to
    another dtype (`{"model.encoder.": torch.bfloat16}`). Use as a context manager: it holds the files open.
    """

    def __init__(
        self,
        ref: str,
        *,
        device: torch.device,
        dtype: torch.dtype,
        dtype_under: Mapping[str, torch.dtype] | None = None,
    ) -> None:
        self.ref, self.device, self.dtype = ref, device, dtype
        self.dtype_under = dict(dtype_under or {})
        self._files = ExitStack()
        self._where: dict[str, tuple[Any, str]] = {}  # name -> (open file, name in that file)
        self._read: set[str] = set()
        try:
            self._open(_weights_file(ref), ref)
        except BaseException:
            self._files.close()
            raise
        if not any(name.startswith("model.") for name in self._where):
            self._where = {f"model.{name}": where for name, where in self._where.items()}

    def _open(self, path: Path, ref: str) -> None:
        if path.name.endswith(".index.json"):
            index = read_json(path).get("weight_map")
            if not isinstance(index, dict):
                raise CheckpointError(f"{path}: no weight_map")
            for shard in sorted(set(index.values())):
                shard_path = checkpoint_file(ref, shard)
                if shard_path is None:
                    raise CheckpointError(f"{ref}: {path.name} names {shard}, which is missing")
                self._open(shard_path, ref)
            return
        try:
            if path.suffix == ".safetensors":
                from safetensors import safe_open

                handle = self._files.enter_context(safe_open(str(path), framework="pt", device="cpu"))
                self._where |= {name: (handle, name) for name in handle.keys()}  # noqa: SIM118 - not a dict
            else:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                self._where |= {name: (state, name) for name in state}
        except Exception as exc:  # truncated, corrupt, or a pickle that is more than tensors
            raise CheckpointError(f"{path}: cannot read its weights: {exc}") from exc

    def __getitem__(self, name: str) -> Tensor:
        source, key = self._where[name]
        self._read.add(name)
        # Both formats hand out views of a private memory map of the file: always copy, so that no
        # parameter stays backed by a file that may be rewritten while the model runs.
        tensor = source[key] if isinstance(source, dict) else source.get_tensor(key)
        return tensor.to(device=self.device, dtype=self._dtype_of(name, tensor), copy=True)

    def _dtype_of(self, name: str, tensor: Tensor) -> torch.dtype:
        """The dtype `name` is read as: its own unless floating point, else the one set for its prefix."""
        if not tensor.is_floating_point():
            return tensor.dtype
        return next((d for prefix, d in self.dtype_under.items() if name.startswith(prefix)), self.dtype)

    def __contains__(self, name: object) -> bool:  # without reading the tensor, as Mapping's would
        return name in self._where

    def unread(self, prefix: str) -> list[str]:
        """Names under `prefix` that no one asked for (for example layers the config does not count)."""
        return sorted(name for name in self._where if name.startswith(prefix) and name not in self._read)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __enter__(self) -> CheckpointTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self._files.close()
        self._where = {}
