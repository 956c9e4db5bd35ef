"""`bench-audio --part diarization`: who spoke when, measured through a real server on conversations of real speech.

Conversations of 2, 3 and 4 voices, and 2 voices talking over each other (`conversations.py`), go to the server
as `diarized_json` uploads (the default `chunking_strategy`: auto). For each:
- DER by `pyannote.metrics` (the field's scorer), with no collar and with ±0.25 s (pyannote's `collar=0.5`),
  split into missed speech, false alarm and confusion;
- with every voice's reference sent as a known speaker: the share of speech time labelled with the right name
  (1 - `IdentificationErrorRate`'s missed and confused time over the total);
- whether `text` is the `json` answer's for the same upload (diarization must change no word).
Then a 10-minute 3-voice conversation, as `json` and as `diarized_json`, each on a server of its own started for
it (`LONG_RUNS` times, the two alternating): the time diarization adds to its transcription, and the memory it adds
to the worker (its highest batch peak) and the web process (resident after). One server for both would report the
higher of the two runs' peaks as the second's: a batch's peak varies by ~30 MB from run to run.
"""

from __future__ import annotations

import base64
import io
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import soundfile as sf
from tqdm import tqdm

from app.tools import conversations
from app.tools.manifest import read_manifest
from app.tools.process import ServerProcess
from app.tools.scrape import sample_value, scrape_metrics
from app.tools.usage import rss_mb

SR = 16000
COLLARS = {"none": 0.0, "0.25 s": 0.5}  # pyannote's collar is the whole width: 0.5 is ±0.25 s
LONG_RUNS = 2  # the 10-minute conversation: runs of each format, each on a fresh server


def _wav(audio: np.ndarray) -> bytes:
    out = io.BytesIO()
    sf.write(out, audio, SR, format="WAV", subtype="PCM_16")
    return out.getvalue()


def _worker_peak_mb(url: str) -> float:
    """The worker's highest peak over a batch since it started (its own VmHWM starts afresh at each batch)."""
    peak = sample_value(scrape_metrics(url), "specwhisper_worker_batch_peak_memory_bytes")
    return peak / 2**20 if peak else float("nan")


def _post(url: str, audio: bytes, **fields: Any) -> tuple[dict[str, Any], float]:
    started = time.perf_counter()
    response = httpx.post(
        f"{url}/v1/audio/transcriptions",
        data={"model": "whisper-1", **fields},
        files={"file": ("talk.wav", audio)},
        timeout=3600,
    )
    response.raise_for_status()
    return response.json(), time.perf_counter() - started


def _annotations(talk: conversations.Conversation, segments: list[dict[str, Any]]) -> tuple[Any, Any]:
    from pyannote.core import Annotation, Segment

    reference, hypothesis = Annotation(), Annotation()
    for k, turn in enumerate(talk.turns):
        reference[Segment(turn.start, turn.end), k] = turn.speaker
    for k, s in enumerate(segments):
        hypothesis[Segment(float(s["start"]), float(s["end"])), k] = s["speaker"]
    return reference, hypothesis


def der(talk: conversations.Conversation, segments: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """DER and its parts (shares of the reference's speech time), at each collar."""
    from pyannote.metrics.diarization import DiarizationErrorRate

    reference, hypothesis = _annotations(talk, segments)
    out = {}
    for name, collar in COLLARS.items():
        d = DiarizationErrorRate(collar=collar)(reference, hypothesis, detailed=True)
        total = d["total"] or 1.0
        out[name] = {
            "der": round(d["diarization error rate"], 4),
            "missed": round(d["missed detection"] / total, 4),
            "false_alarm": round(d["false alarm"] / total, 4),
            "confusion": round(d["confusion"] / total, 4),
        }
    return out


def named_right(talk: conversations.Conversation, segments: list[dict[str, Any]]) -> float:
    """The share of the reference's speech time labelled with its speaker's own name (no mapping)."""
    from pyannote.metrics.identification import IdentificationErrorRate

    reference, hypothesis = _annotations(talk, segments)
    d = IdentificationErrorRate(collar=0.0)(reference, hypothesis, detailed=True)
    return round(1 - (d["missed detection"] + d["confusion"]) / (d["total"] or 1.0), 4)


def _known(talk: conversations.Conversation) -> dict[str, list[str]]:
    names = talk.speakers
    urls = ["data:audio/wav;base64," + base64.b64encode(_wav(talk.references[name])).decode() for name in names]
    return {"known_speaker_names[]": names, "known_speaker_references[]": urls}


def _long_run(audio: bytes, warm: bytes, response_format: str) -> tuple[dict[str, Any], dict[str, float]]:
    """One upload of the long conversation on a fresh server (warmed by a 5-s `json` upload first): its answer,
    its time, the worker's highest batch peak and the web process's resident memory after it."""
    server = ServerProcess({}).start()
    try:
        assert server.proc is not None
        _post(server.url, warm, response_format="json")  # one-off costs first
        fields = {"chunking_strategy": "auto"} if response_format == "json" else {}
        answer, seconds = _post(server.url, audio, response_format=response_format, **fields)
        return answer, {"s": seconds, "worker_peak_mb": _worker_peak_mb(server.url), "web_mb": rss_mb(server.proc.pid)}
    finally:
        server.stop()


def _long(long: conversations.Conversation, steps: tqdm) -> dict[str, Any]:
    audio, warm = _wav(long.audio), _wav(long.audio[: 5 * SR])
    runs: dict[str, list[dict[str, float]]] = {"json": [], "diarized_json": []}
    texts: set[str] = set()
    diarized: dict[str, Any] = {}
    for _ in range(LONG_RUNS):
        for fmt in runs:
            answer, figures = _long_run(audio, warm, fmt)
            runs[fmt].append(figures)
            texts.add(answer["text"])
            diarized = answer if fmt == "diarized_json" else diarized
            steps.update()
    plain, diar = runs["json"], runs["diarized_json"]
    pairs = list(zip(plain, diar, strict=True))
    added = [d["worker_peak_mb"] + d["web_mb"] - p["worker_peak_mb"] - p["web_mb"] for p, d in pairs]
    return {
        "minutes": round(long.seconds / 60, 2),
        "runs": runs,
        "json_s": round(float(np.mean([r["s"] for r in plain])), 2),
        "diarized_json_s": round(float(np.mean([r["s"] for r in diar])), 2),
        "time_added": round(float(np.mean([d["s"] / p["s"] - 1 for p, d in pairs])), 4),
        "memory_added_mb_by_run": [round(x, 1) for x in added],
        "memory_added_mb": round(float(np.mean(added)), 1),
        "der": der(long, diarized["segments"]),
        "text_unchanged": len(texts) == 1,
    }


def run_diarization_bench(manifest: Path, seconds: float = 120.0, long_minutes: float = 10.0) -> dict[str, Any]:
    clips = read_manifest(manifest)
    talks = conversations.standard(clips, seconds)
    pool = conversations.voices(clips)
    long = conversations.build("long", ("lj", "austen", "jfk"), pool, long_minutes * 60, overlap=False, seed=9)
    report: dict[str, Any] = {"conversations": {}}
    steps = tqdm(total=len(talks) * 3 + 2 * LONG_RUNS, desc="diarization", unit="upload")
    report["long"] = _long(long, steps)
    server = ServerProcess({}).start()
    try:
        _post(server.url, _wav(talks[0].audio[: 5 * SR]), response_format="json")  # one-off costs first
        for talk in talks:
            audio = _wav(talk.audio)
            plain, _ = _post(server.url, audio, response_format="json", chunking_strategy="auto")
            steps.update()
            diarized, _ = _post(server.url, audio, response_format="diarized_json")
            steps.update()
            named, _ = _post(server.url, audio, response_format="diarized_json", **_known(talk))
            steps.update()
            report["conversations"][talk.name] = {
                "seconds": round(talk.seconds, 1),
                "speakers": len(talk.speakers),
                "speakers_found": len({s["speaker"] for s in diarized["segments"]}),
                "der": der(talk, diarized["segments"]),
                "named_right": named_right(talk, named["segments"]),
                "text_unchanged": diarized["text"] == plain["text"],
            }
    finally:
        steps.close()
        server.stop()
    report["targets"] = _targets(report)
    return report


def _targets(report: dict[str, Any]) -> dict[str, Any]:
    talks, long = report["conversations"], report["long"]
    plain = [name for name, t in talks.items() if t["speakers"] in (2, 3) and "overlapping" not in name]
    worst = max(talks[name]["der"]["none"]["der"] for name in plain)
    named = min(t["named_right"] for name, t in talks.items() if "overlapping" not in name)
    return {
        "der_2_and_3_speakers_no_collar": {"worst": worst, "target": 0.10, "met": worst <= 0.10},
        "named_right_with_references": {"worst": named, "target": 0.95, "met": named >= 0.95},
        "time_added_10_min": {"added": long["time_added"], "target": 0.25, "met": long["time_added"] <= 0.25},
        "memory_added_mb": {"added": long["memory_added_mb"], "target": 30, "met": long["memory_added_mb"] <= 30},
        "text_unchanged": {
            "met": all(t["text_unchanged"] for t in talks.values()) and long["text_unchanged"],
        },
    }


def table(report: dict[str, Any]) -> str:
    rows = [
        "| conversation | s | speakers (found) | DER | missed | false alarm | confusion | DER ±0.25 s | named right |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, t in report["conversations"].items():
        d, c = t["der"]["none"], t["der"]["0.25 s"]
        rows.append(
            f"| {name} | {t['seconds']} | {t['speakers']} ({t['speakers_found']}) | {d['der']:.1%} | {d['missed']:.1%}"
            f" | {d['false_alarm']:.1%} | {d['confusion']:.1%} | {c['der']:.1%} | {t['named_right']:.1%} |"
        )
    long = report["long"]
    rows.append(
        f"\n{long['minutes']} min, 3 voices, {LONG_RUNS} runs of each on fresh servers: json {long['json_s']} s,"
        f" diarized_json {long['diarized_json_s']} s (+{long['time_added']:.0%}); memory added"
        f" {long['memory_added_mb']} MB (by run {long['memory_added_mb_by_run']}); DER {long['der']['none']['der']:.1%}"
    )
    return "\n".join(rows)
