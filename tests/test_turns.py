"""Turn detection's reading of a turn's words (semantic VAD), and the model names a client may send."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from app.api import errors
from app.api.audio import load_audio
from app.server.realtime.turns import SemanticVad, Turn, TurnFollower, reading
from app.server.serving.models import ModelNames
from app.server.vad import SileroVad, VadParams
from app.settings import Settings


@pytest.mark.parametrize(
    ("text", "verdict"),
    [
        ("Ask not what your country can do for you.", "finished"),
        ("Can you do that as well?", "finished"),  # a word that often goes on, but the question is asked
        ("I saw her.", "finished"),
        ("Stop!", "finished"),
        ('He said "no."', "finished"),
        ("And so my fellow Americans", "unsure"),  # no mark: the words alone do not tell
        ("Please call Dr.", "unsure"),  # an abbreviation's full stop ends no sentence
        ("I went to the", "continues"),
        ("I went to the.", "continues"),  # Whisper may close a sentence it has not heard the end of
        ("Well, I think that", "continues"),
        ("So I was going to...", "continues"),
        ("and then he said,", "continues"),
        ("", "unsure"),
    ],
)
def test_reading_a_turns_words(text: str, verdict: str) -> None:
    assert reading(text) == verdict


def test_eagerness_bounds_the_wait() -> None:
    """OpenAI's bounds: low 8 s, medium 4 s, high 2 s, auto as medium; an unsure turn waits half."""
    assert [SemanticVad(e).bound_ms for e in ("low", "medium", "high", "auto")] == [8000, 4000, 2000, 4000]
    assert SemanticVad("high").unsure_ms == 1000 and SemanticVad().vad.silence_duration_ms == 4000


def test_openai_model_names_resolve_unless_turned_off() -> None:
    names = ModelNames(Settings(model="models/whisper-base"))
    for name in ("whisper-base", "whisper-1", "gpt-4o-mini-transcribe", "gpt-4o-mini-transcribe-2025-12-15",
                 "gpt-transcribe", "gpt-realtime-whisper", "gpt-live-transcribe"):  # fmt: skip
        assert names.accepts(name), name
    for name in ("gpt-4o-transcribe-diarize", "gpt-4o-mini-transcribe-latest", "tts-1", ""):
        assert not names.accepts(name), name
    with pytest.raises(errors.ApiError) as refused:
        names.check("gpt-4o-transcribe-diarize")
    assert refused.value.status == 404 and refused.value.code == "model_not_found"
    off = ModelNames(Settings(model="models/whisper-base", openai_model_names=[]))
    assert off.accepts("whisper-1") and not off.accepts("gpt-4o-mini-transcribe")
    listed = ModelNames(Settings(model="models/whisper-base", openai_model_names=["gpt-transcribe"]))
    assert listed.accepts("gpt-transcribe") and not listed.accepts("gpt-4o-transcribe")


def test_semantic_turns_follow_the_words_even_when_they_come_late(benchdata: Path) -> None:
    """Real speech through Silero: at each pause the follower waits for the words. Words that read finished end
    the turn at once while the pause lasts (`stop`), or, if the speech went on before they came, end it at that
    pause (`split`, the next turn starting where the speech resumed); unfinished words keep the turn open."""
    clips = [load_audio(benchdata / "audio" / "ljspeech" / f"{c}.wav") for c in ("LJ001-0006", "LJ001-0008")]
    audio = np.concatenate([np.zeros(16000, np.float32), clips[0], np.zeros(19200, np.float32), clips[1]])
    follower = TurnFollower(SileroVad(), SemanticVad())
    turns = [t for i in range(0, audio.size, 1600) for t in follower.feed(audio[i : i + 1600])]
    pause = next(t for t in turns if t.kind == "pause")
    resume = next(t for t in turns if t.kind == "resume" and t.sample > pause.sample)
    assert follower.may_split(pause.sample)  # 1.2 s of silence: finished words would have ended the turn
    assert follower.read(pause.sample, "as an example of fine typography,") is None  # it goes on: no split
    follower = TurnFollower(SileroVad(), SemanticVad())
    turns = [t for i in range(0, audio.size, 1600) for t in follower.feed(audio[i : i + 1600])]
    assert follower.read(pause.sample, "And it is worth mention in passing.") == Turn(
        "split", pause.sample, resume.sample
    )
    assert follower.read(pause.sample, "And it is worth mention in passing.") is None  # once
    # The stream ends in a pause: finished words end the turn once the silence has lasted 500 ms (at once if it
    # has), its audio all that was heard; the silence goes on as no speech.
    last = [t for t in follower.feed(np.zeros(4800, np.float32)) if t.kind == "pause"]
    assert last and follower.paused_at == last[0].sample
    assert follower.read(last[0].sample, "has never been surpassed.") is None
    heard = audio.size + 4800
    stops = [t for _ in range(5) for t in follower.feed(np.zeros(1600, np.float32))]
    assert len(stops) == 1 and stops[0].kind == "stop" and stops[0].sample == last[0].sample
    assert last[0].sample + 512 + 8000 <= stops[0].end <= last[0].sample + 512 + 8000 + 1600 <= heard + 8000
    assert not follower.speaking and list(follower.feed(np.zeros(16000, np.float32))) == []


def test_a_follower_begun_later_counts_from_the_sessions_start(benchdata: Path) -> None:
    """Turn detection changed mid-session follows the stream from there on, in the session's sample positions."""
    speech = load_audio(benchdata / "audio" / "ljspeech" / "LJ001-0002.wav")
    audio = np.concatenate([np.zeros(8000, np.float32), speech, np.zeros(16000, np.float32)])
    first = [t for t in TurnFollower(SileroVad(), VadParams()).feed(audio)]
    later = [t for t in TurnFollower(SileroVad(), VadParams(), at=48000).feed(audio)]
    assert [t.kind for t in first] == [t.kind for t in later] and "stop" in [t.kind for t in first]
    assert [(t.sample + 48000, t.end + 48000 if t.end else 0) for t in first] == [(t.sample, t.end) for t in later]
