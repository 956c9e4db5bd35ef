"""Engine II: batched speculative decoding, timestamps, long-form, prompts, translation - all exact."""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pytest

from app.api.types import DecodingOptions, Transcription
from app.engine.drafting.assistants import self_draft
from app.engine.drafting.base import Drafter
from app.engine.engine import Engine
from app.model.whisper import WhisperModel
from tests.drafts import noisy_self_draft

pytestmark = pytest.mark.slow  # not in the quick tier: decodes real clips in every batch shape

# (clip, options) requests of different lengths, languages, tasks, prompts and timestamp modes.
REQUESTS = [
    ("whisper/jfk", DecodingOptions(language="en", timestamps="segment")),
    ("fleurs/fleurs-de-001", DecodingOptions(language="de")),
    ("pocketsphinx/goforward", DecodingOptions(language="en", prompt="Robot commands: go forward, turn left.")),
    ("fleurs/fleurs-fr-002", DecodingOptions(language="fr", task="translate")),
]


def _plain(opts: DecodingOptions) -> DecodingOptions:
    return DecodingOptions(**{**opts.__dict__, "use_assistant": False})


@pytest.fixture(scope="module")
def singles(base: WhisperModel, clip: Callable[[str], np.ndarray]) -> list[Transcription]:
    engine = Engine(base)
    return [engine.transcribe([clip(c)], [_plain(o)])[0] for c, o in REQUESTS]


@pytest.fixture(scope="module")
def drafters(base: WhisperModel) -> dict[str, Drafter]:
    return {"self-draft": self_draft(base), "weak": noisy_self_draft(base, 0.3)}


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("draft", ["self-draft", "weak"])
def test_batches_equal_single_greedy(
    size: int, draft: str, drafters: dict, base: WhisperModel, singles: list[Transcription], clip: Callable
) -> None:
    engine = Engine(base, drafters[draft])
    picked = list(range(size)) if size < 4 else [3, 0, 2, 1]
    results = engine.transcribe([clip(REQUESTS[i][0]) for i in picked], [REQUESTS[i][1] for i in picked])
    for i, result in zip(picked, results, strict=True):
        assert result.tokens == singles[i].tokens, REQUESTS[i][0]
        assert result.metrics.batch_size == size and result.metrics.speculative
    if draft == "weak":
        acceptance = sum(r.metrics.draft_accepted for r in results) / sum(r.metrics.draft_proposed for r in results)
        assert 0.1 <= acceptance <= 0.9


def test_rows_keep_their_own_acceptance(base: WhisperModel, clip: Callable, drafters: dict) -> None:
    """A row that accepts everything is not held back by a row that rejects (per-row advance)."""
    engine = Engine(base, drafters["self-draft"])
    alone = engine.transcribe([clip("ljspeech/LJ001-0001")], [DecodingOptions(language="en")])[0]
    mixed = engine.transcribe(
        [clip("ljspeech/LJ001-0001"), clip("fleurs/fleurs-de-001")],
        [DecodingOptions(language="en"), DecodingOptions(language="de")],
    )[0]
    assert mixed.tokens == alone.tokens
    assert mixed.metrics.main_passes == alone.metrics.main_passes


def test_timestamps(singles: list[Transcription]) -> None:
    jfk = singles[0]
    assert len(jfk.segments) >= 2
    prev_end = 0.0
    for seg in jfk.segments:
        assert prev_end <= seg.start < seg.end <= jfk.duration + 0.5
        prev_end = seg.end
    assert "ask not what your country" in jfk.text.lower()
    # Translation of French speech comes out in English.
    translated = singles[3].text.lower()
    assert sum(w in translated.split() for w in ("the", "a", "of", "and", "is", "to", "in")) >= 2


def test_word_timestamps(base: WhisperModel, clip: Callable, drafters: dict) -> None:
    engine = Engine(base, drafters["self-draft"])
    result = engine.transcribe([clip("whisper/jfk")], [DecodingOptions(language="en", timestamps="word")])[0]
    words = result.words
    assert [w.word.strip(" ,.").lower() for w in words][:5] == ["and", "so", "my", "fellow", "americans"]
    assert "".join(w.word for w in words).strip() == result.text
    starts = [w.start for w in words]
    assert starts == sorted(starts) and all(w.start <= w.end <= result.duration for w in words)
    americans = next(w for w in words if "Americans" in w.word)
    assert 1.0 <= americans.start <= 2.5  # "Americans" is spoken at about 1.5-2.1 s
    assert words[-1].end > 9.0


@pytest.mark.slow
def test_long_form_is_exact(base: WhisperModel, clip: Callable, manifest: dict, drafters: dict) -> None:
    """95 s of read speech (4 windows): OpenAI's sequential algorithm, speculative == main-only, batched
    with a short clip. The long clip joins LJ001-0001..0032 with 0.25 s of silence between them; it is cut
    in the silence after the 14th sentence, so the first 14 sentences are its reference."""
    sentences = [manifest[f"ljspeech/LJ001-{n:04d}"] for n in range(1, 15)]
    cut = sum(s.duration_s for s in sentences) + 0.25 * (len(sentences) - 1) + 0.125
    audio = [clip("ljspeech_longform/LJ001-0001_to_LJ001-0032")[: int(cut * 16000)], clip("fleurs/fleurs-de-009")]
    opts = [DecodingOptions(language="en"), DecodingOptions(language="de")]
    plain = Engine(base).transcribe(audio, opts)
    spec = Engine(base, drafters["self-draft"]).transcribe(audio, opts)
    for p, s in zip(plain, spec, strict=True):
        assert s.tokens == p.tokens and s.text == p.text
        assert s.metrics.windows >= 2 and s.metrics.draft_proposed > 0
        ends = [seg.end for seg in s.segments]
        assert ends == sorted(ends) and ends[-1] <= s.duration + 1.0
    assert spec[0].metrics.windows >= 4
    long_text = _words(spec[0].text)
    reference = _words(" ".join(s.text for s in sentences))
    assert " ".join(reference[:8]) in " ".join(long_text)
    assert " ".join(reference[-6:]) in " ".join(long_text)  # the last window was reached
    assert len(long_text) > 0.8 * len(reference)


def _words(text: str) -> list[str]:
    return re.sub(r"[^\w\s]", "", text.lower()).split()


def test_warm_up_leaves_no_trace(base: WhisperModel, clip: Callable, drafters: dict) -> None:
    """Warm-up decodes in both modes at each batch size without touching what requests see: seeded
    sampling in both modes afterwards draws what it draws on an engine that never warmed up."""
    audio = [clip("ljspeech/LJ001-0001")] * 2
    options = [DecodingOptions(language="en", temperature=0.7, use_assistant=use) for use in (True, False)]
    cold = Engine(base, drafters["self-draft"], seed=3).transcribe(audio, options)
    warm = Engine(base, drafters["self-draft"], seed=3)
    assert warm.warm_up([4, 1, 4]) == {1, 4}
    assert [t.tokens for t in warm.transcribe(audio, options)] == [t.tokens for t in cold]


def test_a_request_the_engine_refuses_fails_alone(base: WhisperModel, clip: Callable, drafters: dict) -> None:
    """The worker's batch runner checks each request: an empty clip or an unknown language fails with
    its reason, and the batch's other request is transcribed as it would be alone."""
    from app.server.worker.policy import ModePolicy
    from app.server.worker.process import BatchRunner
    from app.server.worker.protocol import BatchRequest, Job

    engine = Engine(base, drafters["self-draft"])
    runner = BatchRunner(engine, ModePolicy(), send=lambda message: None)
    audio = clip("ljspeech/LJ001-0001")
    jobs = [
        Job("empty", np.zeros(0, np.float32), DecodingOptions(language="en")),
        Job("klingon", audio, DecodingOptions(language="tlh")),
        Job("good", audio, DecodingOptions(language="en")),
    ]
    empty, klingon, good = runner.run(BatchRequest(0, jobs)).results
    assert empty.error == "empty audio" and not empty.internal
    assert klingon.error is not None and "unsupported language" in klingon.error
    assert good.error is None and good.transcription is not None
    assert good.transcription.tokens == engine.transcribe([audio], [DecodingOptions(language="en")])[0].tokens


def test_words_of_a_window_one_frame_long(base: WhisperModel, clip: Callable) -> None:
    """Seeking moves two mel frames at a time, so a clip can end in a 1-frame window; if that window
    yields text, its words are aligned to its one audio position instead of failing the batch."""
    from app.engine.alignment import align_words
    from app.model.features import log_mel

    features = log_mel(clip("whisper/jfk"), base.n_mels, padding=480_000)[:, :3000].unsqueeze(0)
    cross = base.decoder.cross_kv(base.encode(features))
    tok = base.tokenizer
    text = tok.encode(" And so my fellow Americans")
    words = align_words(base, cross, tok.prompt("en", "transcribe", timestamps=True), text, 1, "en")
    assert "".join(w.word for w in words) == " And so my fellow Americans"
    assert all(w.start == w.end == 0.0 for w in words)


def test_a_window_without_speech_gives_no_text_in_any_mode(base: WhisperModel, drafters: dict) -> None:
    """Five seconds of faint noise: the model says no speech (and has no confident text), so the window
    is skipped with or without timestamps; before, without timestamps it made up a sentence."""
    noise = (np.random.default_rng(0).standard_normal(16000 * 5) * 0.01).astype(np.float32)
    engine = Engine(base, drafters["self-draft"])
    for timestamps in ("none", "segment"):
        for use in (True, False):
            result = engine.transcribe(
                [noise], [DecodingOptions(language="en", timestamps=timestamps, use_assistant=use)]
            )
            assert (result[0].text, result[0].segments) == ("", []), (timestamps, use)


def test_a_batch_everyone_left_stops_within_its_window(base: WhisperModel, clip: Callable, drafters: dict) -> None:
    """Once every clip of a batch is cancelled, the batch stops at the next heartbeat, here between two encoder
    layers, without waiting for the window (what lets a finished utterance preempt a batch of partials); while
    one clip is still wanted, the window runs to its end for it."""
    engine = Engine(base, drafters["self-draft"])
    audio = [clip("whisper/jfk"), clip("ljspeech/LJ001-0001")]
    options = [DecodingOptions(language="en")] * 2
    beats: list[int] = []
    wanted = {0: True, 1: True}

    def heartbeat() -> None:
        beats.append(len(beats))
        if len(beats) == 2:  # the encoder's first layer is done: both clients leave
            wanted.update({0: False, 1: False})

    stopped = engine.transcribe(audio, options, cancelled=lambda i: not wanted[i], heartbeat=heartbeat)
    assert [t.finish for t in stopped] == ["cancelled", "cancelled"] and not any(t.segments for t in stopped)
    assert len(beats) == 2  # it stopped at the heartbeat that saw the cancellations: inside the encoder

    beats.clear()
    wanted.update({0: True, 1: True})
    halfway = engine.transcribe(
        audio, options, cancelled=lambda i: i == 0 and len(beats) >= 2, heartbeat=lambda: beats.append(0)
    )
    alone = engine.transcribe(audio[1:], options[1:])[0]
    assert halfway[1].text == alone.text and halfway[1].finish != "cancelled"
    assert base.encoder is not None and len(beats) > len(base.encoder.layers) + 1  # the window went on


def test_a_long_clip_decoded_a_window_per_turn_with_others_joining_is_the_same(
    base: WhisperModel, clip: Callable, drafters: dict
) -> None:
    """What the worker does with an hour-long upload: a window per batch, its state kept between batches, other
    requests joining some of them, speculative in some, plain in others. Its segments and tokens are the ones it gets
    decoded alone in one go (timestamps, the seek and the previous text carry over from batch to batch)."""
    engine = Engine(base, drafters["self-draft"])
    gap = np.zeros(8000, np.float32)
    long = np.concatenate([clip("fleurs/fleurs-de-009"), gap, clip("whisper/jfk"), gap, clip("fleurs/fleurs-de-001")])
    options = DecodingOptions(language="en", timestamps="segment")
    alone = engine.transcribe([long], [_plain(options)])[0]
    assert alone.metrics.windows >= 3

    job, turn = engine.start(long, options), 0
    while not job.done:
        job.options = options if turn % 2 else _plain(options)
        others = [engine.start(clip(REQUESTS[turn % 4][0]), REQUESTS[turn % 4][1])] if turn % 3 != 2 else []
        engine.advance([job, *others], windows=1)
        engine.advance(others)
        assert all(o.done for o in others)
        turn += 1
    cut = engine.finish(job, 0.0, 1)
    assert turn >= 3
    assert cut.tokens == alone.tokens
    assert [(s.start, s.end, s.text) for s in cut.segments] == [(s.start, s.end, s.text) for s in alone.segments]


def test_a_suspended_job_a_new_worker_does_not_hold_starts_again(
    base: WhisperModel, clip: Callable, drafters: dict
) -> None:
    """A single-block upload decoded a window per batch, its state kept in the worker between batches: if the worker
    restarts meanwhile, the new one starts the job again from its audio, to the answer it gets in one go; a
    streamed one, whose first segments were sent, fails instead (from the start they would be sent twice)."""
    import dataclasses

    from app.server.worker.policy import ModePolicy
    from app.server.worker.process import BatchRunner
    from app.server.worker.protocol import BatchRequest, Job

    gap = np.zeros(8000, np.float32)
    long = np.concatenate([clip("fleurs/fleurs-de-009"), gap, clip("whisper/jfk"), gap, clip("whisper/jfk")])
    options = DecodingOptions(language="en", timestamps="segment")
    engine = Engine(base, drafters["self-draft"])
    alone = engine.transcribe([long], [options])[0]
    for stream in (False, True):
        job = Job("long", long, options, stream=stream)
        first = BatchRunner(engine, ModePolicy(), send=lambda message: None, windows=1)
        assert first.run(BatchRequest(0, [job])).results[0].suspended
        restarted = BatchRunner(engine, ModePolicy(), send=lambda message: None, windows=0)
        (result,) = restarted.run(BatchRequest(1, [dataclasses.replace(job, resume=True)])).results
        if stream:
            assert result.internal and result.error is not None and "lost" in result.error
        else:
            assert result.error is None and result.transcription is not None
            assert result.transcription.tokens == alone.tokens


def test_a_batch_that_comes_runs_inside_a_batch_of_long_uploads(
    base: WhisperModel, clip: Callable, drafters: dict
) -> None:
    """The worker's batch runner, running a batch of long uploads' jobs, takes a batch that came meanwhile at a
    heartbeat and runs it there, answering it before the long batch ends; both give the tokens they give alone. A
    batch of other jobs takes none."""
    from app.server.worker.policy import ModePolicy
    from app.server.worker.process import BatchRunner
    from app.server.worker.protocol import BatchRequest, BatchResult, Job

    engine = Engine(base, drafters["self-draft"])
    long_audio, short_audio = clip("fleurs/fleurs-de-009"), clip("ljspeech/LJ001-0002")
    alone = engine.transcribe(
        [long_audio, short_audio], [DecodingOptions(language="de"), DecodingOptions(language="en")]
    )
    inner = BatchRequest(2, [Job("short", short_audio, DecodingOptions(language="en"))])
    sent: list[object] = []
    asked: list[int] = []

    def waiting() -> BatchRequest | None:
        asked.append(len(sent))
        return inner if len(asked) == 3 else None

    runner = BatchRunner(engine, ModePolicy(), send=sent.append, waiting=waiting)
    outer = runner.run(BatchRequest(1, [Job("long", long_audio, DecodingOptions(language="de"), background=True)]))
    answers = [m for m in sent if isinstance(m, BatchResult)]
    assert [a.batch_id for a in answers] == [2]  # sent from inside the long batch, before its own answer
    (short,) = answers[0].results
    (long,) = outer.results
    assert short.transcription is not None and short.transcription.tokens == alone[1].tokens
    assert long.transcription is not None and long.transcription.tokens == alone[0].tokens
    assert outer.nested_clips == 1 and answers[0].nested_clips == 0 and len(asked) > 3

    asked.clear()
    runner.run(BatchRequest(3, [Job("short2", short_audio, DecodingOptions(language="en"))]))
    assert asked == []  # not a batch of long uploads' jobs: nothing runs inside it
