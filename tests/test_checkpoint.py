"""Reading transformers' Whisper checkpoints without transformers: every file layout gives the same model."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import Tensor

from app.model.weights import WhisperDims
from app.model.whisper import WhisperModel
from app.store.catalog import ModelNotFoundError, ModelStore
from app.store.checkpoint import CheckpointError, HubUnreachableError
from app.store.loader import is_settings_error, load_model
from tests.conftest import copy_side_files, save_checkpoint
from tests.drafts import random_tiny_checkpoint


def parameters(model: WhisperModel) -> dict[str, Tensor]:
    """Every tensor the engine holds for `model` (packed forms included)."""
    state = {f"decoder.{k}": v for k, v in model.decoder.state_dict().items()}
    if model.encoder is not None:
        state |= {f"encoder.{k}": v for k, v in model.encoder.state_dict().items()}
    return state


def assert_same(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [name for name in a if a[name].dtype != b[name].dtype or not torch.equal(a[name], b[name])]
    assert not differ, differ[:5]


@pytest.fixture(scope="module")
def reference(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny-shaped model saved by transformers as one safetensors file."""
    return random_tiny_checkpoint(base_dir, tmp_path_factory.mktemp("ckpt") / "reference")


@pytest.fixture(scope="module")
def expected(reference: Path, store: ModelStore) -> dict[str, Tensor]:
    return parameters(load_model(str(reference), store, progress=False))


def test_defaults_are_transformers_defaults() -> None:
    """A key left out of config.json means transformers' default, as it does for transformers."""
    from transformers import WhisperConfig

    theirs = WhisperConfig()
    mine = WhisperDims()
    for field in dataclasses.fields(WhisperDims):
        if field.name != "decoder_only":
            assert getattr(mine, field.name) == getattr(theirs, field.name), field.name
    assert WhisperDims.from_config({"d_model": 512, "architectures": ["WhisperForCausalLM"]}) == dataclasses.replace(
        mine, d_model=512, decoder_only=True
    )
    with pytest.raises(ValueError, match="not a Whisper checkpoint"):
        WhisperDims.from_config({"model_type": "llama"})


def test_the_tables_held_here_are_transformers_tables() -> None:
    """The language names and the byte-level alphabet, held here so that no process imports transformers for
    them, are transformers' own."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.models.whisper.tokenization_whisper import LANGUAGES as THEIR_LANGUAGES

    from app.api.languages import LANGUAGES
    from app.model.tokenizer import byte_alphabet

    assert list(LANGUAGES.items()) == list(THEIR_LANGUAGES.items())
    assert byte_alphabet() == [bytes_to_unicode()[byte] for byte in range(256)]


def test_sharded_and_legacy_files_load_the_same(
    reference: Path, expected: dict[str, Tensor], store: ModelStore, tmp_path: Path
) -> None:
    from transformers import WhisperForConditionalGeneration

    hf = WhisperForConditionalGeneration.from_pretrained(reference, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="20MB")
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    shutil.copyfile(reference / "config.json", legacy / "config.json")
    torch.save(hf.state_dict(), legacy / "pytorch_model.bin")
    # A WhisperModel without the LM head: names without the "model." prefix.
    bare = save_checkpoint(hf.model, reference, tmp_path / "bare")
    for path in (sharded, legacy, bare):
        assert_same(parameters(load_model(str(copy_side_files(reference, path)), store, progress=False)), expected)


def test_untied_projection_and_decoder_only_checkpoints(reference: Path, store: ModelStore, tmp_path: Path) -> None:
    from transformers import WhisperConfig, WhisperForCausalLM, WhisperForConditionalGeneration

    hf = WhisperForConditionalGeneration.from_pretrained(reference, dtype=torch.float32)
    config = WhisperConfig.from_pretrained(reference, tie_word_embeddings=False)
    untied = WhisperForConditionalGeneration(config)
    untied.load_state_dict(hf.state_dict(), strict=False)
    with torch.no_grad():
        untied.proj_out.weight.copy_(hf.proj_out.weight * 0.5)
    model = load_model(str(save_checkpoint(untied, reference, tmp_path / "untied")), store, progress=False)
    with torch.no_grad():
        embed = untied.model.decoder.embed_tokens.weight
        assert torch.equal(model.decoder.embed.weight, embed)
        # The engine's (packed) vocabulary projection computes with proj_out, not with the embeddings.
        x = torch.randn(1, 3, config.d_model)
        torch.testing.assert_close(model.decoder.proj(x), x @ untied.proj_out.weight.T)
        assert not torch.allclose(model.decoder.proj(x), x @ embed.T)

    causal = WhisperForCausalLM(WhisperConfig.from_pretrained(reference))
    causal.model.decoder.load_state_dict(hf.model.decoder.state_dict())
    assistant = load_model(str(save_checkpoint(causal, reference, tmp_path / "causal")), store, progress=False)
    assert assistant.encoder is None
    full = load_model(str(reference), store, progress=False)
    assert_same(parameters(assistant), {k: v for k, v in parameters(full).items() if k.startswith("decoder.")})


def test_half_precision_is_a_cast_of_the_file(reference: Path, expected: dict[str, Tensor], store: ModelStore) -> None:
    half = parameters(load_model(str(reference), store, dtype=torch.float16, progress=False))
    assert half.keys() == expected.keys()
    for name, tensor in half.items():
        assert tensor.dtype == torch.float16, name
        # Equal but for the query scale applied after the cast: one more rounding of fp16 subnormals.
        torch.testing.assert_close(tensor, expected[name].half(), rtol=0, atol=1e-7)


def test_missing_weights_and_foreign_configs_are_refused(reference: Path, store: ModelStore, tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    shutil.copytree(reference, foreign)
    config = json.loads((reference / "config.json").read_text())
    (foreign / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ValueError, match="not a Whisper checkpoint"):
        load_model(str(foreign), store, progress=False)
    for layers, error in ((1, "does not account for"), (3, "no tensor")):
        wrong = tmp_path / f"layers-{layers}"
        shutil.copytree(reference, wrong)
        (wrong / "config.json").write_text(json.dumps({**config, "decoder_layers": layers}))
        with pytest.raises(CheckpointError, match=error):
            load_model(str(wrong), store, progress=False)
    for name, damage in (("config.json", b"{not json"), ("model.safetensors", b"\x10\x00")):
        broken = tmp_path / f"broken-{name}"
        shutil.copytree(reference, broken)
        (broken / name).write_bytes(damage)
        with pytest.raises(CheckpointError, match=f"{name}: cannot read") as caught:
            load_model(str(broken), store, progress=False)
        assert is_settings_error(caught.value)
    lost = tmp_path / "lost"
    shutil.copytree(reference, lost)
    (lost / "model.safetensors").unlink()
    (lost / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"gone\.safetensors, which is missing"):
        load_model(str(lost), store, progress=False)


def hub_cache(root: Path, repo: str, files: dict[str, Path | None]) -> None:
    """`repo` laid out as huggingface_hub caches it: `files` in a snapshot of `main`, or, where the
    source is None, marked as absent on the hub (what the cache records after a 404)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    for name, source in files.items():
        target = folder / ("snapshots" if source is not None else ".no_exist") / commit / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source is not None:
            shutil.copyfile(source, target)
        else:
            target.touch()


def test_hub_ids_load_offline_from_the_cache_or_say_what_it_lacks(
    reference: Path, expected: dict[str, Tensor], store: ModelStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants
    from safetensors.torch import load_file

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 would at import
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    side: dict[str, Path | None] = {
        name: reference / name for name in ("config.json", "generation_config.json", "tokenizer.json")
    }
    torch.save(load_file(reference / "model.safetensors"), tmp_path / "pytorch_model.bin")
    hub_cache(tmp_path / "hub", "org/cached", side | {"model.safetensors": reference / "model.safetensors"})
    # An old repository: the hub said it has no safetensors; the cache holds the legacy file.
    hub_cache(
        tmp_path / "hub",
        "org/legacy",
        side | {"model.safetensors": None, "pytorch_model.bin": tmp_path / "pytorch_model.bin"},
    )
    hub_cache(tmp_path / "hub", "org/partial", side)  # the download was cut short
    weights = {"model.safetensors": reference / "model.safetensors"}
    hub_cache(tmp_path / "hub", "org/no-generation-config", side | weights | {"generation_config.json": None})
    # A cache filled by snapshot_download: no record of what the hub lacks, and this one lacks the optional file.
    hub_cache(
        tmp_path / "hub", "org/snapshot", {k: v for k, v in side.items() if k != "generation_config.json"} | weights
    )

    cached = load_model("org/cached", store, progress=False)
    assert cached.name == "org/cached"
    assert_same(parameters(cached), expected)
    assert_same(parameters(load_model("org/legacy", store, progress=False)), expected)
    # The generation config is optional, as in transformers: config.json's token lists stand in.
    for repo in ("org/no-generation-config", "org/snapshot"):
        assert_same(parameters(load_model(repo, store, progress=False)), expected)
    # Not "no weights": the cache lacks them and the hub cannot be asked whether they exist.
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not in the local Hugging Face cache") as partial:
        load_model("org/partial", store, progress=False)
    with pytest.raises(
        ModelNotFoundError, match=r"embedded model .*config\.json is not in the local Hugging Face"
    ) as absent:
        load_model("org/elsewhere", store, progress=False)
    # Offline by setting, these are final; with the hub merely out of reach, a later try may succeed.
    assert is_settings_error(partial.value) and is_settings_error(absent.value)
    assert not is_settings_error(HubUnreachableError("the network is down", offline=False))


def test_hub_models_come_from_the_cache_at_once_when_the_hub_is_out_of_reach(reference: Path, tmp_path: Path) -> None:
    """Not switched offline, but the hub does not answer: one request finds that out, and the cached
    files serve without huggingface_hub's retries (five per file, ~24 s each file)."""
    side = {name: reference / name for name in ("config.json", "generation_config.json", "tokenizer.json")}
    hub_cache(tmp_path / "hub", "org/cached", side | {"model.safetensors": reference / "model.safetensors"})
    hub_cache(tmp_path / "hub", "org/partial", side)
    requests: list[bytes] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:  # a hub that hangs up on every request

        def hang_up() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                with conn:
                    requests.append(conn.recv(4096).split(b"\r\n")[0])

        threading.Thread(target=hang_up, daemon=True).start()
        code = (
            "import sys\n"
            "from pathlib import Path\n"
            "from app.store.catalog import ModelStore\n"
            "from app.store.checkpoint import HubUnreachableError\n"
            "from app.store.loader import is_settings_error, load_model\n"
            "store = ModelStore(Path(sys.argv[1]))\n"
            "print(load_model('org/cached', store, progress=False).name)\n"
            "try:\n"
            "    load_model('org/partial', store, progress=False)\n"
            "except HubUnreachableError as exc:\n"
            "    print('settings error' if is_settings_error(exc) else 'may pass later', exc)\n"
        )
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        env |= {"HF_ENDPOINT": f"http://127.0.0.1:{listener.getsockname()[1]}", "HF_HUB_CACHE": str(tmp_path / "hub")}
        out = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / "store")], env=env, capture_output=True, text=True, timeout=600
        )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "org/cached"
    assert (
        lines[1].startswith("may pass later") and "model.safetensors is not in the local Hugging Face cache" in lines[1]
    )
    # One request found the hub out of reach; no file was asked for (huggingface_hub may fetch its own things).
    assert requests.count(b"HEAD / HTTP/1.1") == 1, requests
    assert not [line for line in requests if b"/org/" in line], requests


def test_loading_a_model_and_transcribing_does_not_import_transformers(base_dir: Path) -> None:
    """A worker's start no longer pays for transformers: its modeling modules cost ~6 s for Whisper base,
    and the package alone (for its mel filterbank) ~1.5 s."""
    code = (
        "import sys; import numpy as np; from pathlib import Path; from app.store.catalog import ModelStore; "
        "from app.store.loader import load_model; from app.engine.drafting.assistants import self_draft; "
        "from app.api.types import DecodingOptions; from app.engine.engine import Engine; "
        f"model = load_model({str(base_dir)!r}, ModelStore(Path({str(base_dir.parent)!r})), progress=False); "
        "Engine(model, self_draft(model)).transcribe([np.zeros(16000, np.float32)], [DecodingOptions(language='en')]); "
        "print(sorted(m for m in sys.modules if m.startswith(('transformers', 'torch._dynamo'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
