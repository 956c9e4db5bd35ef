"""A realtime session's configuration in both API shapes (GA `session.update`, beta `transcription_session.update`),
and the raw audio formats a session takes (pcm16, G.711 mu-law and A-law)."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from app.api.audio import AudioError, decode_raw
from app.api.types import InvalidRequestError
from app.server.realtime.config import SessionConfig, apply_update
from app.server.vad import VadParams


def ga(inp: dict[str, Any], **session: Any) -> dict[str, Any]:
    return {"type": "transcription", "audio": {"input": inp}, **session}


@pytest.mark.parametrize(
    ("update", "audio_format", "rate"),
    [
        (ga({"format": {"type": "audio/pcm", "rate": 24000}}), "pcm16", 24000),
        (ga({"format": {"type": "audio/pcm", "rate": 16000}}), "pcm16", 16000),
        (ga({"format": {"type": "audio/pcmu"}}), "g711_ulaw", 8000),
        (ga({"format": {"type": "audio/pcma", "rate": 8000}}), "g711_alaw", 8000),
        ({"input_audio_format": "pcm16"}, "pcm16", 24000),
        ({"input_audio_format": "g711_ulaw"}, "g711_ulaw", 8000),
        ({"input_audio_format": "g711_alaw", "input_audio_sample_rate": 8000}, "g711_alaw", 8000),
    ],
)
def test_formats_in_both_shapes(update: dict[str, Any], audio_format: str, rate: int) -> None:
    config = apply_update(SessionConfig(), update)
    assert (config.audio_format, config.rate) == (audio_format, rate)
    # The session echoes what it runs, in either shape.
    assert (
        config.beta("s")["input_audio_format"] == audio_format and config.beta("s")["input_audio_sample_rate"] == rate
    )
    fmt = config.ga("s")["audio"]["input"]["format"]
    assert (
        fmt["rate"] == rate
        and {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}[audio_format] == fmt["type"]
    )


def test_noise_reduction_is_validated_and_echoed() -> None:
    config = apply_update(SessionConfig(), ga({"noise_reduction": {"type": "far_field"}}))
    assert config.noise_reduction == "far_field"
    assert config.ga("s")["audio"]["input"]["noise_reduction"] == {"type": "far_field"}
    config = apply_update(config, {"input_audio_noise_reduction": {"type": "near_field"}})
    assert config.beta("s")["input_audio_noise_reduction"] == {"type": "near_field"}
    assert apply_update(config, {"input_audio_noise_reduction": None}).noise_reduction is None


@pytest.mark.parametrize(
    ("update", "param"),
    [
        ({"input_audio_format": "opus"}, "session.input_audio_format"),
        ({"input_audio_format": "g711_ulaw", "input_audio_sample_rate": 16000}, "session.input_audio_sample_rate"),
        (ga({"format": {"type": "audio/opus"}}), "session.audio.input.format.type"),
        (ga({"format": {"type": "audio/pcmu", "rate": 16000}}), "session.audio.input.format.rate"),
        (ga({"format": {"type": "audio/pcm", "rate": 44100}}), "session.audio.input.format.rate"),
        (ga({"noise_reduction": {"type": "studio"}}), "session.audio.input.noise_reduction.type"),
        ({"input_audio_noise_reduction": "near_field"}, "session.input_audio_noise_reduction"),
        # Unknown fields are named, at any depth, as OpenAI names them.
        ({"input_audio_fromat": "pcm16"}, "session.input_audio_fromat"),
        (ga({"formats": {}}), "session.audio.input.formats"),
        (
            ga({"transcription": {"model": "whisper-1", "temperature": 0}}),
            "session.audio.input.transcription.temperature",
        ),
        (ga({}, voice="alloy"), "session.voice"),
        ({"type": "realtime", "audio": {}}, "session.type"),
        ({"modalities": ["audio", "text"]}, "session.modalities"),
        ({"include": "logprobs"}, "session.include"),
        # Turn detection: an unknown type or eagerness is named.
        ({"turn_detection": {"type": "push_to_talk"}}, "session.turn_detection.type"),
        ({"turn_detection": {"type": "semantic_vad", "eagerness": "eager"}}, "session.turn_detection.eagerness"),
        ({"turn_detection": {"type": "semantic_vad", "eagerness": 2}}, "session.turn_detection.eagerness"),
        (
            ga({"turn_detection": {"type": "semantic_vad", "silence_duration_ms": 500}}),
            "session.audio.input.turn_detection.silence_duration_ms",
        ),
        (
            ga({"turn_detection": {"type": "server_vad", "eagerness": "low"}}),
            "session.audio.input.turn_detection.eagerness",
        ),
        (ga({"transcription": {"languages": "en"}}), "session.audio.input.transcription.languages"),
        (ga({"transcription": {"delay": "instant"}}), "session.audio.input.transcription.delay"),
    ],
)
def test_bad_updates_name_the_field(update: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        apply_update(SessionConfig(), update)
    assert refused.value.param == param


def test_include_logprobs() -> None:
    wanted = ["item.input_audio_transcription.logprobs"]
    for update in ({"include": wanted}, ga({}, include=wanted)):
        config = apply_update(SessionConfig(), update)
        assert config.logprobs and config.ga("s")["include"] == wanted and config.beta("s")["include"] == wanted
        assert not apply_update(config, {"include": []}).logprobs
    with pytest.raises(InvalidRequestError) as refused:
        apply_update(SessionConfig(), {"include": ["item.input_audio_transcription.words"]})
    assert refused.value.param == "session.include"


@pytest.mark.parametrize("eagerness", ["low", "medium", "high", "auto"])
def test_semantic_vad_in_both_shapes(eagerness: str) -> None:
    """semantic_vad is accepted with OpenAI's eagerness values (auto by default) and echoed in either shape;
    switching back to server_vad starts from its defaults."""
    detection = {"type": "semantic_vad", "eagerness": eagerness}
    for update in (ga({"turn_detection": detection}), {"turn_detection": detection}):
        config = apply_update(SessionConfig(), update)
        assert config.ga("s")["audio"]["input"]["turn_detection"] == detection
        assert config.beta("s")["turn_detection"] == detection
    plain = apply_update(SessionConfig(), {"turn_detection": {"type": "semantic_vad", "create_response": True}})
    assert plain.beta("s")["turn_detection"] == {"type": "semantic_vad", "eagerness": "auto"}
    back = apply_update(plain, {"turn_detection": {"type": "server_vad"}})
    assert back.beta("s")["turn_detection"] == {"type": "server_vad", **VadParams().to_dict()}


def test_languages_keywords_and_delay_of_newer_models() -> None:
    """gpt-transcribe's `languages` and `keywords` and gpt-realtime-whisper's `delay` are applied and echoed:
    one language is the language, several are detected; keywords join the prompt."""
    config = apply_update(SessionConfig(), ga({"transcription": {
        "model": "gpt-transcribe", "languages": ["de"], "keywords": ["SpecWhisper", "Silero"], "prompt": "Tech talk.",
        "delay": "low"}}))  # fmt: skip
    assert (config.decoding_language, config.decoding_prompt) == ("de", "Tech talk. SpecWhisper, Silero")
    echoed = config.ga("s")["audio"]["input"]["transcription"]
    assert (
        echoed["languages"] == ["de"] and echoed["keywords"] == ["SpecWhisper", "Silero"] and echoed["delay"] == "low"
    )
    several = apply_update(config, {"input_audio_transcription": {"languages": ["de", "fr"], "keywords": []}})
    assert several.decoding_language is None and several.decoding_prompt == "Tech talk."
    assert apply_update(SessionConfig(), SessionConfig().ga("s"))._transcription() == SessionConfig()._transcription()


def test_fields_a_client_echoes_back_are_accepted() -> None:
    received = SessionConfig().beta("sess_1")
    assert apply_update(SessionConfig(), received) == SessionConfig()
    assert apply_update(SessionConfig(), SessionConfig().ga("sess_1")) == SessionConfig()


@pytest.mark.parametrize("encoding", ["g711_ulaw", "g711_alaw"])
def test_g711_decodes_as_the_standard_says(encoding: str) -> None:
    """Every byte value decodes to the G.711 table's level (libsndfile's codec, checked against Python's
    audioop, the reference until 3.13), and a tone survives the round trip within G.711's error."""
    audioop = pytest.importorskip("audioop")
    every = bytes(range(256))
    reference = np.frombuffer((audioop.ulaw2lin if encoding == "g711_ulaw" else audioop.alaw2lin)(every, 2), "<i2")
    assert np.array_equal(decode_raw(every, encoding), reference.astype(np.float32) / 32768.0)
    tone = (0.5 * np.sin(2 * np.pi * 440 * np.arange(8000) / 8000)).astype(np.float32)
    out = io.BytesIO()
    sf.write(out, tone, 8000, format="RAW", subtype="ULAW" if encoding == "g711_ulaw" else "ALAW")
    assert np.max(np.abs(decode_raw(out.getvalue(), encoding) - tone)) < 0.02
    assert decode_raw(b"", encoding).size == 0


def test_pcm16_needs_whole_samples() -> None:
    assert np.array_equal(decode_raw(b"\x00\x80\xff\x7f", "pcm16"), np.array([-1.0, 32767 / 32768], np.float32))
    with pytest.raises(AudioError):
        decode_raw(b"\x00", "pcm16")
