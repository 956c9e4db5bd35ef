"""The page at `/` in a real headless Chromium against the real server: upload, live microphone, live panel."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from playwright.sync_api import Browser, Page, expect, sync_playwright

from app.api.audio import decode_audio
from tests.conftest import ROOT
from tests.server import ServerProcess

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SHOTS = ROOT / "artifacts" / "screenshots"
CLIP = "audio/ljspeech/LJ001-0001.wav"
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
    "--autoplay-policy=no-user-gesture-required",
]

if not Path(CHROMIUM).exists():
    if os.environ.get("CI"):
        raise RuntimeError("Chromium is required in CI: scripts/system-deps.sh installs it")
    pytest.skip("Chromium is not installed (scripts/system-deps.sh installs it)", allow_module_level=True)


@pytest.fixture(scope="module")
def microphone(benchdata: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the fake microphone plays once: a second of silence, the clip twice (one 19-s utterance: time for
    several partials on a busy machine), three seconds of silence."""
    audio = decode_audio((benchdata / CLIP).read_bytes(), 600)
    silence = np.zeros(16000, dtype=np.float32)
    path = tmp_path_factory.mktemp("mic") / "mic.wav"
    sf.write(path, np.concatenate([silence, audio, audio, silence, silence, silence]), 16000, subtype="PCM_16")
    return path


@pytest.fixture(scope="module")
def browser(microphone: Path) -> Iterator[Browser]:
    # Playwright starts Chromium with a fresh, temporary profile of its own.
    with sync_playwright() as p:
        args = [*FLAGS, f"--use-file-for-fake-audio-capture={microphone}%noloop"]
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser, live_server: ServerProcess) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 1100})
    page = context.new_page()
    page.goto(live_server.url + "/")
    expect(page.locator("#server-status")).to_contain_text("Ready", timeout=30_000)
    yield page
    context.close()


def shot(page: Page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def test_upload_shows_transcript_metrics_and_comparison(page: Page, benchdata: Path) -> None:
    page.set_input_files("#file-input", str(benchdata / CLIP))
    expect(page.locator("#drop-text")).to_contain_text("LJ001-0001.wav")
    page.get_by_role("button", name="Transcribe").click()
    expect(page.locator("#speedup")).to_contain_text("identical text", timeout=180_000)
    transcript = page.locator("#transcript").inner_text()
    assert transcript.startswith("Printing, in the only sense")
    rows = page.locator("#timing tbody tr")
    expect(rows).to_have_count(8)
    acceptance = rows.nth(4).locator("td")
    assert acceptance.nth(0).inner_text() == "acceptance rate"
    assert acceptance.nth(1).inner_text().endswith("%") and acceptance.nth(2).inner_text() == "–"
    assert page.locator("#segments tbody tr").count() >= 1
    expect(page.locator("#tile-acceptance")).to_contain_text("%", timeout=10_000)
    shot(page, "upload")


def test_translation_upload(page: Page, benchdata: Path) -> None:
    """The page's translation task sends only what /v1/audio/translations knows (it refuses other fields)."""
    page.set_input_files("#file-input", str(benchdata / CLIP))
    page.select_option("#upload-task", "translations")
    page.locator("#compare").uncheck()
    page.get_by_role("button", name="Transcribe").click()
    expect(page.locator("#transcript")).to_contain_text("Printing", timeout=180_000)
    expect(page.get_by_role("alert")).to_have_count(0)


def test_api_errors_are_shown(page: Page, tmp_path: Path) -> None:
    bogus = tmp_path / "notes.wav"
    bogus.write_bytes(b"this is not audio at all")
    page.set_input_files("#file-input", str(bogus))
    page.locator("#compare").uncheck()
    page.keyboard.press("Tab")
    page.get_by_role("button", name="Transcribe").press("Enter")
    alert = page.get_by_role("alert")
    expect(alert).to_contain_text("400", timeout=60_000)
    expect(alert).to_contain_text("invalid_audio")
    shot(page, "error")


def test_live_microphone_streams_partials_and_final_utterance(page: Page) -> None:
    page.get_by_label("Language", exact=True).nth(1).select_option("en")
    page.get_by_role("button", name="Start recording").click()
    expect(page.get_by_role("button", name="Stop recording")).to_have_attribute("aria-pressed", "true")
    utterance = page.locator("#utterances li").first
    partial_seen = ""
    for _ in range(1200):  # up to two minutes on a busy machine
        if utterance.count() and utterance.inner_text().strip():
            break
        partial_seen = max(partial_seen, page.locator("#partial").inner_text(), key=len)
        page.wait_for_timeout(100)
    text = utterance.inner_text().lower()
    assert text.count("printing") == 2 and "exhibition" in text, text
    assert "ms after the last word" in text
    assert partial_seen, "text appeared while the utterance was still open"
    shot(page, "live")
    page.get_by_role("button", name="Stop recording").click()
    expect(page.locator("#vad")).to_have_text("idle")
