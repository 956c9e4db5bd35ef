"""The speakers package on real speech: the GE2E encoder against the `resemblyzer` package it takes its weights
from, windows over speech, clustering into speakers, known speakers, and words given their speakers."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from app.api.types import Segment, Word
from app.server.serving.speakers import SPEECH_VAD
from app.server.serving.uploads import UPLOAD_VAD
from app.server.vad import SileroVad
from app.speakers import clustering, embedders
from app.speakers import windows as plan
from app.speakers.ge2e import PARTIAL_FRAMES, Ge2eEmbedder, Ge2eEncoder, mel_power
from app.speakers.turns import SpeakerTimeline, SpeechRegions, Turn, diarize, turns
from app.speakers.voiced import EDGE_DB, MAX_GROW_S, MAX_TRIM_S, voiced
from app.tools import conversations
from app.tools.manifest import read_manifest

SR = 16000


@pytest.fixture(scope="module")
def embedder() -> Ge2eEmbedder:
    return Ge2eEmbedder.load()


@pytest.fixture(scope="module")
def pool(benchdata: Path) -> dict[str, conversations.Voice]:
    return conversations.voices(read_manifest(benchdata / "manifest.jsonl"))


def test_front_end_and_encoder_equal_the_resemblyzer_package(benchdata: Path) -> None:
    """Our mel front end against the package's (librosa's), and our encoder against its `VoiceEncoder` on the same
    frames: the weights were trained on exactly this input."""
    from resemblyzer import VoiceEncoder, audio  # the package, with librosa and webrtcvad (dev extras)

    wav, _ = sf.read(benchdata / "audio" / "whisper" / "jfk.wav", dtype="float32")
    theirs = audio.wav_to_mel_spectrogram(wav)
    ours = mel_power(torch.from_numpy(wav)[None])[0].numpy()
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * float(theirs.max()))

    reference = VoiceEncoder("cpu", verbose=False)
    frames = torch.from_numpy(np.stack([theirs[k : k + PARTIAL_FRAMES] for k in (0, 300, 600)]))
    with torch.inference_mode():
        np.testing.assert_allclose(Ge2eEncoder.load()(frames).numpy(), reference(frames).numpy(), atol=1e-5)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 60_000), st.integers(1, 120_000)), max_size=6),
    st.integers(1_000, 30_000),
    st.integers(100, 20_000),
)
def test_windows_cover_each_piece_and_never_cross_a_pause(raw: list[tuple[int, int]], size: int, hop: int) -> None:
    pieces, at = [], 0
    for gap, length in raw:
        pieces.append((at + gap, at + gap + length))
        at += gap + length
    windows = plan.plan(pieces, size, hop)
    spans = plan.spans(windows, pieces)
    for k, (start, end) in enumerate(pieces):
        mine = [w for w in windows if w.piece == k]
        assert mine and mine[0].start == start and mine[-1].end == end  # covered from its start to its end
        assert all(start <= w.start < w.end <= end and w.end - w.start <= size for w in mine)
        covered = [s for w, s in zip(windows, spans, strict=True) if w.piece == k]
        assert covered[0][0] == start and covered[-1][1] == end  # the spans tile the piece
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(covered))


def test_two_readers_are_two_speakers_and_references_name_them(
    embedder: Ge2eEmbedder, pool: dict[str, conversations.Voice]
) -> None:
    conversation = conversations.build("test", ("lj", "jfk"), pool, 40.0, overlap=False, seed=3)
    pieces = SileroVad().load().regions(conversation.audio, UPLOAD_VAD)
    voices = embedders.prints(embedder, conversation.audio, pieces)
    vectors = np.stack([v.vector for v in voices])
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    labels = clustering.cluster(vectors)
    assert labels.max() == 1 and labels[0] == 0  # two voices, numbered as they first speak

    def truth(t: float) -> str:  # the speaker of the turn nearest this time
        return min(conversation.turns, key=lambda u: max(u.start - t, t - u.end, 0.0)).speaker

    said = [truth((v.start + v.end) / 2) for v in voices]
    first = said[0]
    right = sum((label == 0) == (speaker == first) for label, speaker in zip(labels, said, strict=True))
    assert right / len(voices) >= 0.95

    # Known speakers: the references (audio kept out of the turns) name the clusters; a stranger names none.
    refs = np.stack([embedders.reference_print(embedder, conversation.references[v]) for v in ("jfk", "lj")])
    known = clustering.match_known(clustering.centroids(vectors, labels), refs)
    assert known == {0: 1 if first == "lj" else 0, 1: 0 if first == "lj" else 1}
    assert clustering.names(2, known, ["John", "Linda"]) == (["Linda", "John"] if first == "lj" else ["John", "Linda"])
    stranger = embedders.reference_print(embedder, pool["cards"].reference)[None]
    assert clustering.match_known(clustering.centroids(vectors, labels), stranger) == {}

    # The operator's bounds on the number of speakers win over the distance cut.
    assert clustering.cluster(vectors, max_speakers=1).max() == 0
    assert clustering.cluster(vectors, min_speakers=3).max() == 2


def test_names_are_letters_for_the_unknown_in_order_and_skip_given_names() -> None:
    assert clustering.names(3, {}, []) == ["A", "B", "C"]
    assert clustering.names(3, {1: 0}, ["A"]) == ["B", "A", "C"]
    assert clustering.names(28, {}, [])[25:] == ["Z", "AA", "AB"]


def _word(text: str, start: float, end: float) -> Word:
    return Word(text, start, end, 0.9, ())


def _segment(words: list[Word]) -> Segment:
    text = "".join(w.word for w in words)
    return Segment(0, 0, words[0].start, words[-1].end, text, [], 0.0, -0.1, 1.0, 0.0, words=words)


def test_words_take_the_speaker_they_overlap_most_and_segments_split_between_words() -> None:
    timeline = SpeakerTimeline(turns([(0.0, 1.0), (1.0, 2.0), (2.0, 2.4), (2.4, 4.0), (5.0, 6.0)], [0, 0, 1, 0, 1]))
    assert [(t.start, t.end, t.speaker) for t in timeline.turns] == [(0.0, 4.0, 0), (5.0, 6.0, 1)]  # a lone print
    words = [_word(" Hello", 0.2, 0.6), _word(" there.", 0.7, 3.9), _word(" Hi!", 4.2, 5.8)]
    assert timeline.speaker_of(3.5, 5.4) == 0  # 0.5 s in speaker 0's turn, 0.4 s in speaker 1's
    pieces = diarize([_segment(words)], timeline, ["Ann", "B"])
    assert [(p.text, p.speaker) for p in pieces] == [("Hello there.", "Ann"), ("Hi!", "B")]
    assert pieces[0].start == 0.2 and pieces[1].end == 5.8 and pieces[1].start == 4.2
    assert "".join(w.word for p in pieces for w in p.words) == _segment(words).text  # no word split or lost
    assert SpeakerTimeline([Turn(0.0, 1.0, 0), Turn(3.0, 4.0, 1)]).speaker_of(2.6, 2.8) == 1  # the nearest turn


def test_a_regions_pieces_cover_its_speech_and_speakers_meet_halfway() -> None:
    """Whisper started " So" late and wrote nothing of the region's last half second: the region's first piece starts
    with its speech and its last ends with it; where the speaker changes within the region (no pause the VAD heard),
    the two pieces meet halfway between their words. A word outside every region keeps its own times."""
    timeline = SpeakerTimeline([Turn(0.0, 2.0, 0), Turn(2.0, 5.0, 1), Turn(8.0, 9.0, 1)])
    words = [_word(" So", 0.6, 1.0), _word(" yes.", 1.0, 1.8), _word(" No,", 2.2, 2.6), _word(" no.", 2.6, 3.5)]
    speech = SpeechRegions([(0.3, 4.0)])
    pieces = diarize([_segment(words), _segment([_word(" Hm", 8.2, 8.6)])], timeline, ["A", "B"], speech)
    assert [(p.text, p.speaker, p.start, p.end) for p in pieces] == [
        ("So yes.", "A", 0.3, 2.0),
        ("No, no.", "B", 2.0, 4.0),
        ("Hm", "B", 8.2, 8.6),
    ]
    assert [w.start for p in pieces for w in p.words] == [0.6, 1.0, 2.2, 2.6, 8.2]  # the words keep their times


def test_a_region_whisper_wrote_nothing_of_goes_to_the_piece_of_its_voice_beside_it() -> None:
    """Regions without a word: B's right after B's piece is B's (the piece ends with it), A's right before A's
    piece is A's (the piece starts with it); one of A's after B's piece, or of B's past `CLAIM_GAP_S`, is nobody's."""
    timeline = SpeakerTimeline([Turn(0.0, 3.0, 1), Turn(3.0, 5.0, 0), Turn(5.0, 9.0, 1), Turn(11.0, 13.0, 1)])
    words = [_word(" Yes", 0.2, 0.8), _word(" No", 5.2, 5.8), _word(" so", 11.2, 11.8)]
    speech = SpeechRegions([(0.1, 0.9), (1.2, 2.0), (3.2, 4.6), (5.1, 5.9), (6.6, 7.0), (8.3, 8.8), (11.1, 11.9)])
    segments = [_segment([w]) for w in words]
    pieces = diarize(segments, timeline, ["A", "B"], speech)
    assert [(p.text, p.speaker, p.start, p.end) for p in pieces] == [
        ("Yes", "B", 0.1, 2.0),  # (1.2, 2.0): B's, 0.3 s after
        ("No", "B", 5.1, 7.0),  # (3.2, 4.6): A's, beside B's piece; (6.6, 7.0): B's, 0.7 s after
        ("so", "B", 11.1, 11.9),  # (8.3, 8.8): B's, 1.3 s after "No" and 2.3 s before "so"
    ]
    assert [w.start for p in pieces for w in p.words] == [0.2, 5.2, 11.2]
    alone = diarize([_segment([_word(" Hm", 4.0, 4.4)])], timeline, ["A", "B"], speech)
    assert [(p.text, p.speaker, p.start, p.end) for p in alone] == [("Hm", "A", 3.2, 4.6)]


def test_segments_split_at_the_vads_pauses_and_keep_to_its_speech() -> None:
    """Whisper's word times stretch over a pause (here " there," ends at 2.4 s, the speech at 1.6 s): a piece
    ends where the VAD heard a pause between its words, and its times keep to the speech; a word outside every
    region keeps its own times."""
    timeline = SpeakerTimeline([Turn(0.0, 6.0, 0)])
    words = [_word(" Hello", 0.1, 0.9), _word(" there,", 0.9, 2.4), _word(" you.", 2.4, 3.6), _word(" Hm", 5.0, 5.5)]
    speech = SpeechRegions([(0.4, 1.6), (2.5, 3.2)])
    pieces = diarize([_segment(words)], timeline, ["A"], speech)
    expected = [("Hello there,", 0.4, 1.6), ("you.", 2.5, 3.2), ("Hm", 5.0, 5.5)]
    assert [(p.text, p.start, p.end) for p in pieces] == expected
    assert [(p.text, p.start, p.end) for p in diarize([_segment(words)], timeline, ["A"])] == [
        ("Hello there, you.", 0.1, 3.6),
        ("Hm", 5.0, 5.5),
    ]


def test_a_regions_ends_move_to_the_voice_and_long_pauses_cut_it() -> None:
    """A tone at -20 dBFS from 0.5 to 1.5 s with a hiss 40 dB below around it, and a pause of hiss inside it: the
    region (0.4, 1.9) s is cut to the tone, its trailing 0.4 s of hiss cut by `MAX_TRIM_S` only; a pause of 0.2 s
    inside stays, one of 0.4 s cuts the region in two; a region that starts or ends inside the tone takes in the
    rest of it, up to `MAX_GROW_S`, a neighbour or a seam; a hiss less than `EDGE_DB` below is voice; a region too
    short to judge is kept whole."""
    rng = np.random.default_rng(0)
    t = np.arange(2 * SR) / SR
    tone = 0.1 * np.sqrt(2) * np.sin(2 * np.pi * 220 * t)
    hiss = 0.001 * rng.standard_normal(t.size)

    def with_pause(a: float, b: float) -> np.ndarray:
        return np.where((t >= 0.5) & (t < 1.5) & ~((t >= a) & (t < b)), tone, hiss).astype(np.float32)

    audio = with_pause(0.9, 1.1)
    region = (int(0.4 * SR), int(1.9 * SR))
    start, end = voiced(audio, [region])[0]
    assert start == int(0.5 * SR)  # 0.1 s of hiss before the tone
    assert end == region[1] - int(MAX_TRIM_S * SR)  # 0.4 s after it: the most that goes
    assert voiced(with_pause(0.8, 1.2), [region]) == [(int(0.5 * SR), int(0.8 * SR)), (int(1.2 * SR), end)]
    inside = (int(0.7 * SR), int(1.4 * SR))
    assert voiced(audio, [inside]) == [(int(0.5 * SR), int(1.5 * SR))]  # grown to the tone's ends
    grown_back = int((1.3 - MAX_GROW_S) * SR)  # the tone goes on further back: the most that comes
    assert voiced(with_pause(0, 0), [(int(1.3 * SR), int(1.4 * SR))]) == [(grown_back, int(1.5 * SR))]
    assert voiced(audio, [inside], seams=[int(0.6 * SR), int(1.45 * SR)]) == [(int(0.6 * SR), int(1.45 * SR))]
    neighbours = [(int(0.5 * SR), int(0.6 * SR)), inside]
    assert voiced(audio, neighbours) == [(int(0.5 * SR), int(0.7 * SR)), (int(0.7 * SR), int(1.5 * SR))]  # they meet
    loud_hiss = np.where(audio == hiss.astype(np.float32), audio * 10 ** ((40 - EDGE_DB + 5) / 20), audio)
    assert voiced(loud_hiss, [region]) == [(0, 2 * SR)]  # 20 dB below: voice, not a pause, and taken in
    assert voiced(audio, [(int(1.55 * SR), int(1.6 * SR))]) == [(int(1.55 * SR), int(1.6 * SR))]


def test_regions_moved_to_the_voice_keep_the_speech_and_lose_most_of_the_rest(benchdata: Path) -> None:
    """Silero's regions (as a diarized upload's pieces keep to) over two readers and JFK's crowd, against where
    their speech is (`conversations`' turns): moved to the voice (`voiced`), they run over far less time that is
    not speech (mostly the pauses between the readers' sentences: 10.3 -> 2.7% of the speech's time here) and
    miss no more of it (0.5 -> 0.1%)."""
    pool = conversations.voices(read_manifest(benchdata / "manifest.jsonl"))  # its own: a voice's turns go on
    talk = conversations.build("test", ("lj", "jfk", "austen"), pool, 40.0, overlap=False, seed=3)
    regions = SileroVad().load().regions(talk.audio, SPEECH_VAD)
    speech = np.zeros(talk.audio.size, bool)
    for turn in talk.turns:
        speech[round(turn.start * SR) : round(turn.end * SR)] = True

    def covered(spans: list[tuple[int, int]]) -> np.ndarray:
        out = np.zeros(talk.audio.size, bool)
        for a, b in spans:
            out[a:b] = True
        return out

    before, after = covered(regions), covered(voiced(talk.audio, regions))
    false_alarm = [(c & ~speech).sum() / speech.sum() for c in (before, after)]
    missed = [(speech & ~c).sum() / speech.sum() for c in (before, after)]
    print(f"false alarm {false_alarm[0]:.1%} -> {false_alarm[1]:.1%}, missed {missed[0]:.1%} -> {missed[1]:.1%}")
    assert false_alarm[1] < 0.4 * false_alarm[0]
    assert missed[1] <= missed[0]


def test_an_onnx_embedder_file_the_operator_names(tmp_path: Path, benchdata: Path) -> None:
    """A tiny embedder exported here: [batch, samples] audio in, [batch, 8] out; its window from its metadata."""
    import onnx

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv1d(1, 16, 400, 160)
            self.out = torch.nn.Linear(16, 8)

        def forward(self, audio: torch.Tensor) -> torch.Tensor:
            return self.out(self.conv(audio[:, None]).abs().mean(2))

    path = tmp_path / "tiny.onnx"
    torch.onnx.export(
        Tiny(), (torch.randn(2, SR),), str(path), input_names=["audio"], output_names=["embedding"],
        dynamic_axes={"audio": {0: "batch", 1: "samples"}, "embedding": {0: "batch"}}, dynamo=False,
    )  # fmt: skip
    model = onnx.load(str(path))
    onnx.helper.set_model_props(model, {"window_s": "1.2"})
    onnx.save(model, str(path))

    embedder = embedders.load_embedder(path)
    assert embedder.dim == 8 and embedder.window_s == 1.2 and embedder.name == "tiny.onnx"
    wav, _ = sf.read(benchdata / "audio" / "whisper" / "jfk.wav", dtype="float32")
    voices = embedders.prints(embedder, wav, [(0, 5 * SR), (6 * SR, 6 * SR + 8000)])
    assert len(voices) == 9 + 1  # 5 s in 1.2-s windows every 0.5 s (flush with its end), and a 0.5-s piece whole
    assert voices[-1].start == 6.0 and voices[-1].end == 6.5
    np.testing.assert_allclose([np.linalg.norm(v.vector) for v in voices], 1.0, atol=1e-5)
    with pytest.raises(ValueError, match="ONNX"):
        embedders.load_embedder(tmp_path / "weights.bin")


def test_many_prints_are_clustered_from_a_sample_to_the_same_speakers(
    embedder: Ge2eEmbedder, pool: dict[str, conversations.Voice]
) -> None:
    """More prints than the tree takes (`MAX_TREE`): every k-th one is clustered, the rest join the nearest."""
    conversation = conversations.build("test", ("lj", "jfk"), pool, 40.0, overlap=False, seed=3)
    pieces = SileroVad().load().regions(conversation.audio, UPLOAD_VAD)
    vectors = np.stack([v.vector for v in embedders.prints(embedder, conversation.audio, pieces)])
    whole = clustering.cluster(vectors)
    sampled = clustering.cluster(np.repeat(vectors, 20, axis=0))  # > MAX_TREE
    assert len(vectors) * 20 > clustering.MAX_TREE
    agree = np.mean(np.repeat(whole, 20) == sampled)
    assert sampled.max() == whole.max() == 1 and agree >= 0.97


def test_a_quiet_recording_prints_as_its_voice_not_as_silence(
    embedder: Ge2eEmbedder, pool: dict[str, conversations.Voice]
) -> None:
    """The encoder hears power: windows are levelled first, so a voice 40 dB down prints as itself."""
    lj, austen = pool["lj"].reference, pool["austen"].reference
    loud = embedders.reference_print(embedder, lj)
    quiet = embedders.reference_print(embedder, lj * 0.01)
    other = embedders.reference_print(embedder, austen * 0.01)
    assert float(loud @ quiet) > 0.99 and float(quiet @ other) < 0.75


def _partition(labels: np.ndarray) -> list[tuple[int, ...]]:
    groups: dict[int, list[int]] = {}
    for i, label in enumerate(labels.tolist()):
        groups.setdefault(label, []).append(i)
    return sorted(tuple(g) for g in groups.values())


def test_average_linkage_and_its_cuts_are_scipys() -> None:
    """`linkage` builds scipy's average-linkage tree over cosine distances (the same heights) and cuts it as `fcluster`
    does, by height and to a number of clusters, on prints in voice-like groups and on unstructured ones."""
    from scipy.cluster.hierarchy import fcluster
    from scipy.cluster.hierarchy import linkage as scipy_linkage

    from app.speakers.linkage import average_linkage, cut, cut_to

    rng = np.random.default_rng(7)
    for trial in range(12):
        n, dim, voices = int(rng.integers(2, 120)), 32, int(rng.integers(1, 6))
        centres = rng.standard_normal((voices, dim))
        spread = 0.3 if trial % 2 else 3.0  # tight groups, or hardly any
        prints = centres[rng.integers(0, voices, n)] + spread * rng.standard_normal((n, dim))
        tree = scipy_linkage(prints, method="average", metric="cosine")
        merges = average_linkage(prints)
        assert np.allclose([h for _, _, h in merges], tree[:, 2], atol=1e-9), trial
        for height in (0.1, 0.3, 0.45, 0.8):
            ours, theirs = cut(n, merges, height), fcluster(tree, t=height, criterion="distance")
            assert _partition(ours) == _partition(theirs), (trial, height)
        for k in (1, 2, 3, n):
            assert _partition(cut_to(n, merges, k)) == _partition(fcluster(tree, t=k, criterion="maxclust")), (trial, k)
