"""CTranslate2 -> Hugging Face conversion: exact tensors, loadable checkpoints, correct transcripts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from app.api.types import DecodingOptions
from app.engine.engine import Engine
from app.store.catalog import EMBEDDED, ModelNotFoundError, ModelStore
from app.store.convert import convert_ct2
from app.store.ct2 import model_file, read_ct2
from app.store.loader import load_model
from tests.conftest import run_app

pytestmark = pytest.mark.slow  # not in the quick tier: converts the embedded models and loads them in transformers


def _ct2_source(name: str) -> tuple[list[Path], Path]:
    found = EMBEDDED[name].locate()
    assert found is not None, f"package for {name} is not installed"
    return found


@pytest.mark.parametrize("name", ["whisper-tiny.en", "whisper-base"])
def test_converted_tensors_equal_source(name: str, store: ModelStore, tmp_path: Path) -> None:
    parts, _ = _ct2_source(name)
    ct2 = read_ct2(model_file(parts, tmp_path / "model.bin"))
    converted = load_file(str(store.convert_embedded(name, progress=False) / "model.safetensors"))

    d = ct2["decoder/embeddings/weight"].shape[1]
    n_dec, n_enc = ct2.layer_count("decoder"), ct2.layer_count("encoder")
    assert n_dec >= 4 and n_enc >= 4
    # Independent spelling of the mapping for every layer: fused [q;k;v] and [k;v] split row-wise.
    for side, n in (("encoder", n_enc), ("decoder", n_dec)):
        for i in range(n):
            fused = ct2[f"{side}/layer_{i}/self_attention/linear_0/weight"]
            hf = f"model.{side}.layers.{i}.self_attn"
            np.testing.assert_array_equal(converted[f"{hf}.q_proj.weight"], fused[:d])
            np.testing.assert_array_equal(converted[f"{hf}.k_proj.weight"], fused[d : 2 * d])
            np.testing.assert_array_equal(converted[f"{hf}.v_proj.weight"], fused[2 * d :])
            bias = ct2[f"{side}/layer_{i}/self_attention/linear_0/bias"]
            np.testing.assert_array_equal(converted[f"{hf}.q_proj.bias"], bias[:d])
            np.testing.assert_array_equal(converted[f"{hf}.v_proj.bias"], bias[2 * d :])
            assert not np.any(bias[d : 2 * d]), "CT2 k bias should be zero (Whisper's k_proj has none)"
            assert f"{hf}.k_proj.bias" not in converted
            np.testing.assert_array_equal(
                converted[f"model.{side}.layers.{i}.fc2.weight"], ct2[f"{side}/layer_{i}/ffn/linear_1/weight"]
            )
    for i in range(n_dec):
        kv = ct2[f"decoder/layer_{i}/attention/linear_1/weight"]
        hf = f"model.decoder.layers.{i}.encoder_attn"
        np.testing.assert_array_equal(
            converted[f"{hf}.q_proj.weight"], ct2[f"decoder/layer_{i}/attention/linear_0/weight"]
        )
        np.testing.assert_array_equal(converted[f"{hf}.k_proj.weight"], kv[:d])
        np.testing.assert_array_equal(converted[f"{hf}.v_proj.weight"], kv[d:])
        np.testing.assert_array_equal(
            converted[f"{hf}.out_proj.bias"], ct2[f"decoder/layer_{i}/attention/linear_2/bias"]
        )
    np.testing.assert_array_equal(converted["model.decoder.embed_tokens.weight"], ct2["decoder/embeddings/weight"])
    np.testing.assert_array_equal(
        converted["model.encoder.embed_positions.weight"], ct2["encoder/position_encodings/encodings"]
    )
    np.testing.assert_array_equal(converted["model.encoder.conv1.weight"], ct2["encoder/conv1/weight"])
    np.testing.assert_array_equal(converted["model.decoder.layer_norm.weight"], ct2["decoder/layer_norm/gamma"])
    # Every CT2 weight tensor is accounted for: same number of values in and out (minus the zero k biases).
    ct2_values = sum(a.size for n, a in ct2.variables.items() if a.ndim > 0 and n != "decoder/projection/weight")
    zero_k_bias = (n_enc + n_dec) * d + n_dec * d
    assert sum(a.size for a in converted.values()) == ct2_values - zero_k_bias


def test_converted_checkpoint_loads_in_transformers_without_missing_keys(store: ModelStore) -> None:
    from transformers import WhisperForConditionalGeneration

    path = store.convert_embedded("whisper-tiny.en", progress=False)
    model, info = WhisperForConditionalGeneration.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.config.vocab_size == 51864 and model.config.decoder_layers == 4


def test_convert_ct2_directory_then_transcribe_jfk(tmp_path: Path, benchdata: Path) -> None:
    """A CT2 directory given on the command line is converted (with a progress bar) and used."""
    _, bundle = _ct2_source("whisper-tiny.en")
    store = tmp_path / "store"
    out = run_app("models", "convert", str(bundle), "--name", "tiny-en-test", "--models-dir", str(store))
    assert out.returncode == 0, out.stderr
    assert "converting" in out.stderr  # tqdm progress bar
    assert (store / "tiny-en-test" / "model.safetensors").is_file()
    # Readable by all, as the store's folders are: an image's server user is not the user that converted.
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in (store / "tiny-en-test").iterdir()} == {
        f.name: "0o644" for f in (store / "tiny-en-test").iterdir()
    }
    out = run_app(
        "transcribe",
        str(benchdata / "audio/whisper/jfk.wav"),
        *("--model", str(store / "tiny-en-test"), "--assistant", "none", "--models-dir", str(store)),
    )
    assert out.returncode == 0, out.stderr
    assert "ask not what your country can do for you" in out.stdout.lower()


@pytest.mark.parametrize("quantization", ["int8", "int16"])
def test_quantized_ct2_models_are_dequantized(
    quantization: str, store: ModelStore, tmp_path: Path, clip: Callable[[str], np.ndarray]
) -> None:
    """CTranslate2 stores quantized weights as round(w * scale) with their scales: converted back, they
    are the originals to within a quantization step, and the model still transcribes."""
    original = store.path("whisper-tiny.en")
    quantized = tmp_path / "ct2"
    subprocess.run(
        [sys.executable, "-m", "ctranslate2.converters.transformers", "--model", str(original),
         "--output_dir", str(quantized), "--quantization", quantization, "--copy_files", "tokenizer.json"],
        check=True, capture_output=True,
    )  # fmt: skip
    convert_ct2(quantized / "model.bin", tmp_path / "hf", bundle_dir=quantized, progress=False)
    expected, got = load_file(original / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        assert tensor.dtype.kind == "f", name
        scale = np.abs(expected[name]).max() + 1e-12
        assert np.abs(tensor.astype(np.float32) - expected[name]).max() / scale < 0.01, name
    model = load_model(str(tmp_path / "hf"), store, progress=False)
    text = Engine(model).transcribe([clip("whisper/jfk")], [DecodingOptions(language="en")])[0].text
    assert "ask not what your country can do for you" in text.lower()


def test_ct2_folders_get_store_entries_of_their_own(tmp_path: Path) -> None:
    """Two CTranslate2 folders of one name, and one named like an embedded model, convert into entries
    of their own; an entry an earlier version named after the folder still serves its own file; a
    changed model.bin (newer or older) is converted again; a name holding another file's model is refused."""
    _, bundle = _ct2_source("whisper-tiny.en")
    folders = [tmp_path / "a" / "model", tmp_path / "b" / "model", tmp_path / "c" / "whisper-base"]
    for folder in folders:
        folder.mkdir(parents=True)
        for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
            (folder / name).symlink_to(bundle / name)
    shutil.copyfile(bundle / "model.bin", folders[0] / "model.bin")  # a file of its own
    for folder in folders[1:]:
        (folder / "model.bin").symlink_to(bundle / "model.bin")  # one file, two folders
    store = ModelStore(tmp_path / "store")
    legacy = store.convert_dir(folders[0], name="model", progress=False)  # as earlier versions named it
    entries = [Path(store.resolve(str(folder), progress=False)) for folder in folders]
    assert entries[0] == legacy and len(set(entries)) == 3 and store.path("whisper-base") not in entries
    for folder, entry in zip(folders, entries, strict=True):
        assert (entry / "SOURCE").read_text().split() == [str((folder / "model.bin").resolve())]
    weights = legacy / "model.safetensors"
    converted_at = weights.stat().st_mtime_ns
    assert Path(store.resolve(str(folders[0]), progress=False)) == legacy
    assert weights.stat().st_mtime_ns == converted_at  # up to date: not converted again
    (folders[0] / "model.bin").unlink()
    shutil.copyfile(bundle / "model.bin", folders[0] / "model.bin")  # a new file, written after the conversion
    assert Path(store.resolve(str(folders[0]), progress=False)) == legacy
    assert weights.stat().st_mtime_ns != converted_at
    converted_at = weights.stat().st_mtime_ns
    os.utime(folders[0] / "model.bin", (1e9, 1e9))  # an older file put in its place, as `cp -p` does
    assert Path(store.resolve(str(folders[0]), progress=False)) == legacy
    assert weights.stat().st_mtime_ns != converted_at
    with pytest.raises(ModelNotFoundError, match="holds a model converted from"):
        store.convert_dir(folders[1], name="model", progress=False)
    assert store.convert_dir(folders[1], name="model", force=True, progress=False) == legacy


def test_convert_failure_leaves_nothing_behind(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.bin").write_bytes(b"\x06\x00\x00\x00garbage")
    (broken / "tokenizer.json").write_text("{}")
    (broken / "config.json").write_text("{}")
    with pytest.raises(ValueError):
        convert_ct2(broken / "model.bin", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["broken"]
