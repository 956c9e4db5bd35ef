"""CTranslate2 Whisper checkpoints: read `model.bin` and map it onto Hugging Face names.

File layout (little-endian): u32 binary version, string spec name, u32 revision,
u32 variable count, then per variable: string name, u8 rank, rank x u32 dims,
u8 dtype, u32 byte count, raw bytes; finally u32 alias count and (alias, target)
string pairs. A string is a u16 length (counting a trailing NUL), the bytes, the NUL.
"""

from __future__ import annotations

import shutil
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from app.store.checkpoint import CheckpointError

_DTYPES: dict[int, np.dtype] = {
    0: np.dtype("<f4"),
    1: np.dtype("i1"),
    2: np.dtype("<i2"),
    3: np.dtype("<i4"),
    4: np.dtype("<f2"),
    # bfloat16 has no numpy dtype: keep the raw 16-bit words and widen on use.
    5: np.dtype("<u2"),
}
_BF16 = 5


class CT2FormatError(CheckpointError):
    """The file is not a CTranslate2 Whisper model this reader understands."""


@dataclass(frozen=True)
class CT2Model:
    """Variables of a CTranslate2 model, aliases resolved."""

    spec: str
    version: int
    revision: int
    variables: dict[str, np.ndarray]

    def __getitem__(self, name: str) -> np.ndarray:
        return self.variables[name]

    def scalar(self, name: str) -> int:
        return int(self.variables[name].reshape(-1)[0])

    def layer_count(self, side: str) -> int:
        prefix = f"{side}/layer_"
        indices = {n[len(prefix) :].split("/")[0] for n in self.variables if n.startswith(prefix)}
        return sum(1 for index in indices if index.isdigit())


def _read_exact(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise CT2FormatError("unexpected end of file")
    return data


def _u32(f: BinaryIO) -> int:
    return int(struct.unpack("<I", _read_exact(f, 4))[0])


def _string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<H", _read_exact(f, 2))
    return _read_exact(f, n)[:-1].decode("utf-8")


def _iter_variables(f: BinaryIO) -> Iterator[tuple[str, np.ndarray]]:
    for _ in range(_u32(f)):
        name = _string(f)
        rank = _read_exact(f, 1)[0]
        dims = [_u32(f) for _ in range(rank)]
        code = _read_exact(f, 1)[0]
        if code not in _DTYPES:
            raise CT2FormatError(f"variable {name!r} has unknown dtype code {code}")
        nbytes = _u32(f)
        array = np.frombuffer(_read_exact(f, nbytes), dtype=_DTYPES[code]).reshape(dims)
        if code == _BF16:
            array = (array.astype(np.uint32) << 16).view(np.float32)
        yield name, array


def model_file(parts: Sequence[Path], into: Path, *, reuse_single: bool = True) -> Path:
    """The one `model.bin` CTranslate2 reads, from `parts` (a model.bin split in parts, in order).

    The parts joined into `into`; with `reuse_single`, a model.bin in one part is that file itself (no copy).
    """
    if reuse_single and len(parts) == 1:
        return Path(parts[0])
    with open(into, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, length=16 << 20)
    return into


def read_ct2(path: str | Path) -> CT2Model:
    """Read a CTranslate2 `model.bin` (format version 6)."""
    with open(path, "rb") as f:
        version = _u32(f)
        if version != 6:
            raise CT2FormatError(f"{path}: unsupported CTranslate2 binary version {version} (expected 6)")
        spec = _string(f)
        if spec != "WhisperSpec":
            raise CT2FormatError(f"{path}: model spec is {spec!r}, not a Whisper model")
        revision = _u32(f)
        variables = _dequantized(dict(_iter_variables(f)))
        for _ in range(_u32(f)):
            alias, target = _string(f), _string(f)
            if target in variables:  # else a scale, gone with dequantizing
                variables[alias] = variables[target]
    return CT2Model(spec=spec, version=version, revision=revision, variables=variables)


def _dequantized(variables: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Quantized weights (`--quantization int8*` or `int16`) as float32, their scales dropped.

    CTranslate2 stores round(w * scale): int8 with one scale per output row, int16 with one scale
    for the whole tensor. Dividing back gives the weights the quantized model computes with.
    """
    out = dict(variables)
    for name in variables:
        weight = name.removesuffix("_scale")
        if weight == name or weight not in variables:
            continue
        q, scale = variables[weight], variables[name].astype(np.float32)
        if q.dtype not in (np.int8, np.int16):
            raise CT2FormatError(f"{weight}: a scale for {q.dtype} weights")
        per_row = scale.reshape(scale.shape + (1,) * (q.ndim - scale.ndim))
        out[weight] = q.astype(np.float32) / per_row
        del out[name]
    return out


def hf_config_kwargs(model: CT2Model) -> dict[str, int]:
    """WhisperConfig arguments implied by the tensor shapes."""
    vocab, d_model = model["decoder/embeddings/weight"].shape
    return {
        "vocab_size": int(vocab),
        "num_mel_bins": int(model["encoder/conv1/weight"].shape[1]),
        "d_model": int(d_model),
        "encoder_layers": model.layer_count("encoder"),
        "decoder_layers": model.layer_count("decoder"),
        "encoder_attention_heads": model.scalar("encoder/num_heads"),
        "decoder_attention_heads": model.scalar("decoder/num_heads"),
        "encoder_ffn_dim": int(model["encoder/layer_0/ffn/linear_0/weight"].shape[0]),
        "decoder_ffn_dim": int(model["decoder/layer_0/ffn/linear_0/weight"].shape[0]),
        "max_source_positions": int(model["encoder/position_encodings/encodings"].shape[0]),
        "max_target_positions": int(model["decoder/position_encodings/encodings"].shape[0]),
    }


def _linear(out: dict[str, np.ndarray], hf: str, model: CT2Model, ct2: str, bias: bool = True) -> None:
    out[f"{hf}.weight"] = model[f"{ct2}/weight"]
    if bias:
        out[f"{hf}.bias"] = model[f"{ct2}/bias"]


def _norm(out: dict[str, np.ndarray], hf: str, model: CT2Model, ct2: str) -> None:
    out[f"{hf}.weight"] = model[f"{ct2}/gamma"]
    out[f"{hf}.bias"] = model[f"{ct2}/beta"]


def _split_fused(out: dict[str, np.ndarray], hf: str, model: CT2Model, ct2: str, names: list[str]) -> None:
    """Split a fused projection ([q;k;v] or [k;v]) into HF's separate ones (k has no bias)."""
    weights = np.split(model[f"{ct2}/weight"], len(names), axis=0)
    biases = np.split(model[f"{ct2}/bias"], len(names), axis=0)
    for name, w, b in zip(names, weights, biases, strict=True):
        out[f"{hf}.{name}.weight"] = w
        if name != "k_proj":
            out[f"{hf}.{name}.bias"] = b


def hf_state_dict(model: CT2Model) -> dict[str, np.ndarray]:
    """HF `WhisperForConditionalGeneration` state dict (numpy, source dtype) from CT2 variables."""
    sd: dict[str, np.ndarray] = {}
    enc, dec = "model.encoder", "model.decoder"
    _linear(sd, f"{enc}.conv1", model, "encoder/conv1")
    _linear(sd, f"{enc}.conv2", model, "encoder/conv2")
    sd[f"{enc}.embed_positions.weight"] = model["encoder/position_encodings/encodings"]
    for i in range(model.layer_count("encoder")):
        src, dst = f"encoder/layer_{i}", f"{enc}.layers.{i}"
        _split_fused(sd, f"{dst}.self_attn", model, f"{src}/self_attention/linear_0", ["q_proj", "k_proj", "v_proj"])
        _linear(sd, f"{dst}.self_attn.out_proj", model, f"{src}/self_attention/linear_1")
        _norm(sd, f"{dst}.self_attn_layer_norm", model, f"{src}/self_attention/layer_norm")
        _linear(sd, f"{dst}.fc1", model, f"{src}/ffn/linear_0")
        _linear(sd, f"{dst}.fc2", model, f"{src}/ffn/linear_1")
        _norm(sd, f"{dst}.final_layer_norm", model, f"{src}/ffn/layer_norm")
    _norm(sd, f"{enc}.layer_norm", model, "encoder/layer_norm")

    sd[f"{dec}.embed_tokens.weight"] = model["decoder/embeddings/weight"]
    sd[f"{dec}.embed_positions.weight"] = model["decoder/position_encodings/encodings"]
    for i in range(model.layer_count("decoder")):
        src, dst = f"decoder/layer_{i}", f"{dec}.layers.{i}"
        _split_fused(sd, f"{dst}.self_attn", model, f"{src}/self_attention/linear_0", ["q_proj", "k_proj", "v_proj"])
        _linear(sd, f"{dst}.self_attn.out_proj", model, f"{src}/self_attention/linear_1")
        _norm(sd, f"{dst}.self_attn_layer_norm", model, f"{src}/self_attention/layer_norm")
        _linear(sd, f"{dst}.encoder_attn.q_proj", model, f"{src}/attention/linear_0")
        _split_fused(sd, f"{dst}.encoder_attn", model, f"{src}/attention/linear_1", ["k_proj", "v_proj"])
        _linear(sd, f"{dst}.encoder_attn.out_proj", model, f"{src}/attention/linear_2")
        _norm(sd, f"{dst}.encoder_attn_layer_norm", model, f"{src}/attention/layer_norm")
        _linear(sd, f"{dst}.fc1", model, f"{src}/ffn/linear_0")
        _linear(sd, f"{dst}.fc2", model, f"{src}/ffn/linear_1")
        _norm(sd, f"{dst}.final_layer_norm", model, f"{src}/ffn/layer_norm")
    _norm(sd, f"{dec}.layer_norm", model, "decoder/layer_norm")
    projection = model.variables.get("decoder/projection/weight")
    if projection is not None and projection is not model["decoder/embeddings/weight"]:
        sd["proj_out.weight"] = projection
    return sd
