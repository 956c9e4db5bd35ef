// SpecWhisper page: upload (with a main-only comparison), live microphone over /v1/realtime, live server panel.
const $ = (id) => document.getElementById(id);
const SAMPLE_RATE = 24000; // pcm16 at 24 kHz: the Realtime API's default input format
const SEND_EVERY_MS = 100;

// -- errors and auth -------------------------------------------------------------------------------------
function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

function apiKey() {
  return $("api-key").value.trim();
}

function authHeaders() {
  const key = apiKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function apiError(response) {
  try {
    const body = await response.json();
    const e = body.error || {};
    return `${response.status}: ${e.message || response.statusText}${e.code ? ` (${e.code})` : ""}`;
  } catch {
    return `${response.status}: ${response.statusText}`;
  }
}

// -- upload ----------------------------------------------------------------------------------------------
const fmt = (ms) => (ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${Math.round(ms)} ms`);
const ROWS = [
  ["total", (m) => fmt(m.total_ms)],
  ["queue", (m) => fmt(m.queue_ms)],
  ["encode", (m) => fmt(m.encode_ms)],
  ["decode", (m) => fmt(m.decode_ms)],
  ["acceptance rate", (m) => (m.speculative ? `${(m.acceptance_rate * 100).toFixed(1)} %` : "–")],
  ["tokens per main pass", (m) => m.tokens_per_main_pass.toFixed(2)],
  ["real-time factor", (m) => m.real_time_factor.toFixed(3)],
  ["tokens", (m) => String(m.tokens)],
];

async function transcribe(file, speculative) {
  const form = new FormData();
  form.append("file", file);
  form.append("model", "whisper-1");
  form.append("response_format", "verbose_json");
  form.append("speculative", speculative ? "true" : "false");
  const task = $("upload-task").value;
  const language = $("upload-language").value;
  // Translations take neither (the server refuses fields an endpoint does not know); verbose_json has segments.
  if (task === "transcriptions") form.append("timestamp_granularities[]", "segment");
  if (language && task === "transcriptions") form.append("language", language);
  const response = await fetch(`/v1/audio/${task}`, { method: "POST", body: form, headers: authHeaders() });
  if (!response.ok) throw new Error(await apiError(response));
  return response.json();
}

function renderUpload(spec, plain) {
  $("transcript").textContent = spec.text;
  const timing = $("timing").tBodies[0];
  timing.replaceChildren();
  for (const [name, value] of ROWS) {
    const row = timing.insertRow();
    row.insertCell().textContent = name;
    const a = row.insertCell();
    a.className = "num";
    a.textContent = value(spec.metrics);
    const b = row.insertCell();
    b.className = "num";
    b.textContent = plain ? value(plain.metrics) : "–";
  }
  let note = "";
  if (plain) {
    const speedup = plain.metrics.decode_ms / Math.max(spec.metrics.decode_ms, 1e-3);
    const e2e = plain.metrics.total_ms / Math.max(spec.metrics.total_ms, 1e-3);
    const same = plain.text === spec.text ? "identical text" : "texts differ";
    note = `Decoding ${speedup.toFixed(2)}× faster with the assistant (end to end ${e2e.toFixed(2)}×), ${same}.`;
  }
  $("speedup").textContent = note;
  const segments = $("segments").tBodies[0];
  segments.replaceChildren();
  for (const s of spec.segments || []) {
    const row = segments.insertRow();
    for (const [value, cls] of [[s.start.toFixed(2), "num"], [s.end.toFixed(2), "num"], [s.text.trim(), ""]]) {
      const cell = row.insertCell();
      cell.textContent = value;
      if (cls) cell.className = cls;
    }
  }
  $("upload-result").hidden = false;
}

async function onUpload(event) {
  event.preventDefault();
  const file = $("file-input").files[0];
  if (!file) {
    showError("Choose an audio file first.");
    return;
  }
  showError("");
  const button = $("upload-button");
  button.disabled = true;
  button.textContent = "Transcribing…";
  try {
    const spec = await transcribe(file, true);
    renderUpload(spec, null);
    if ($("compare").checked) {
      button.textContent = "Running without the assistant…";
      renderUpload(spec, await transcribe(file, false));
    }
  } catch (err) {
    showError(`Transcription failed: ${err.message}`);
  } finally {
    button.disabled = false;
    button.textContent = "Transcribe";
  }
}

function setupDropZone() {
  const zone = $("drop-zone");
  const input = $("file-input");
  const label = () => {
    $("drop-text").textContent = input.files[0] ? `Selected: ${input.files[0].name}` : "Drop an audio file here";
  };
  input.addEventListener("change", label);
  zone.addEventListener("dragover", (e) => {
    e.preventDefault();
    zone.classList.add("over");
  });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (e) => {
    e.preventDefault();
    zone.classList.remove("over");
    if (e.dataTransfer.files.length) {
      input.files = e.dataTransfer.files;
      label();
    }
  });
}

// -- live microphone ---------------------------------------------------------------------------------------
let live = null;

function base64(int16) {
  const bytes = new Uint8Array(int16.buffer);
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(binary);
}

function toPcm16(chunks) {
  const length = chunks.reduce((n, c) => n + c.length, 0);
  const out = new Int16Array(length);
  let offset = 0;
  for (const chunk of chunks) {
    for (let i = 0; i < chunk.length; i++) out[offset + i] = Math.max(-32768, Math.min(32767, chunk[i] * 32768));
    offset += chunk.length;
  }
  return out;
}

function utteranceItem(id) {
  let item = $("utterances").querySelector(`li[data-item="${id}"]`);
  if (!item) {
    item = document.createElement("li");
    item.dataset.item = id;
    $("utterances").append(item);
  }
  return item;
}

function onServerEvent(event) {
  const partial = $("partial");
  switch (event.type) {
    case "input_audio_buffer.speech_started":
      $("vad").textContent = "speaking";
      $("vad").classList.add("speaking");
      break;
    case "input_audio_buffer.speech_stopped":
      $("vad").textContent = "listening";
      $("vad").classList.remove("speaking");
      break;
    case "conversation.item.input_audio_transcription.partial":
      // A hypothesis of the turn still spoken: each replaces the one before; `completed` replaces them all.
      partial.dataset.item = event.item_id;
      partial.textContent = event.transcript;
      partial.dataset.partials = String(Number(partial.dataset.partials) + 1);
      break;
    case "conversation.item.input_audio_transcription.completed": {
      const item = utteranceItem(event.item_id);
      const latency = event.metrics ? ` ${Math.round(event.metrics.latency_ms)} ms after the last word` : "";
      item.textContent = event.transcript || "(no speech)";
      const note = document.createElement("span");
      note.className = "latency";
      note.textContent = latency;
      item.append(note);
      if (partial.dataset.item === event.item_id) partial.textContent = "";
      break;
    }
    case "conversation.item.input_audio_transcription.failed":
      showError(`Live transcription failed: ${event.error?.message || "unknown error"}`);
      break;
    case "error":
      showError(`Live session error: ${event.error?.message || "unknown error"} (${event.error?.code || "error"})`);
      break;
    default:
      break;
  }
}

function configureLive(ws) {
  const language = $("live-language").value || null;
  ws.send(JSON.stringify({
    type: "session.update",
    session: {
      type: "transcription",
      audio: {
        input: {
          format: { type: "audio/pcm", rate: SAMPLE_RATE },
          transcription: { model: "whisper-1", language },
          turn_detection: { type: "server_vad", silence_duration_ms: 500 },
        },
      },
      include: ["item.input_audio_transcription.partials"],
    },
  }));
  $("vad").textContent = "listening";
}

async function startLive() {
  showError("");
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1, echoCancellation: true } });
  } catch (err) {
    showError(`No microphone: ${err.message}`);
    return;
  }
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const protocols = ["realtime"];
  if (apiKey()) protocols.push(`openai-insecure-api-key.${apiKey()}`);
  const ws = new WebSocket(`${scheme}://${location.host}/v1/realtime?intent=transcription`, protocols);
  // Handlers before anything awaits (the socket may open meanwhile); the session is configured once it exists.
  ws.onmessage = (e) => {
    const event = JSON.parse(e.data);
    if (event.type === "session.created") configureLive(ws);
    onServerEvent(event);
  };
  ws.onclose = (e) => {
    if (live && live.ws === ws) stopLive(e.code !== 1000 && e.code !== 1005 ? `connection closed (${e.code})` : "");
  };
  const context = new AudioContext({ sampleRate: SAMPLE_RATE });
  await context.audioWorklet.addModule("/static/pcm-worklet.js");
  const source = context.createMediaStreamSource(stream);
  const node = new AudioWorkletNode(context, "pcm-capture");
  const pending = [];
  node.port.onmessage = (e) => pending.push(e.data);
  source.connect(node);
  const timer = setInterval(() => {
    if (ws.readyState !== WebSocket.OPEN || !pending.length) return;
    const pcm = toPcm16(pending.splice(0));
    ws.send(JSON.stringify({ type: "input_audio_buffer.append", audio: base64(pcm) }));
  }, SEND_EVERY_MS);
  live = { ws, stream, context, timer };
  $("live-button").textContent = "Stop recording";
  $("live-button").setAttribute("aria-pressed", "true");
}

function stopLive(reason = "") {
  if (!live) return;
  const { ws, stream, context, timer } = live;
  live = null;
  clearInterval(timer);
  stream.getTracks().forEach((t) => t.stop());
  context.close();
  if (ws.readyState === WebSocket.OPEN) {
    ws.send(JSON.stringify({ type: "input_audio_buffer.commit" }));
    setTimeout(() => ws.close(1000), 15000); // let the last utterance complete
  }
  $("live-button").textContent = "Start recording";
  $("live-button").setAttribute("aria-pressed", "false");
  $("vad").textContent = "idle";
  $("vad").classList.remove("speaking");
  if (reason) showError(`Live session ended: ${reason}`);
}

// -- live panel --------------------------------------------------------------------------------------------
const HISTORY = 120;
const history = { queue: [], inflight: [], acceptance: [] };
let previous = null;

function push(series, value) {
  series.push(value);
  if (series.length > HISTORY) series.shift();
}

function drawLines(canvas, lines, max) {
  const g = canvas.getContext("2d");
  const { width: w, height: h } = canvas;
  g.clearRect(0, 0, w, h);
  g.strokeStyle = "#e6e9ee";
  for (let y = 0; y <= 4; y++) {
    g.beginPath();
    g.moveTo(0, (h * y) / 4);
    g.lineTo(w, (h * y) / 4);
    g.stroke();
  }
  for (const { values, color } of lines) {
    g.strokeStyle = color;
    g.lineWidth = 2;
    g.beginPath();
    let drawing = false; // a null (no data that second) breaks the line
    values.forEach((v, i) => {
      if (v === null) {
        drawing = false;
        return;
      }
      const x = (w * (i + HISTORY - values.length)) / (HISTORY - 1);
      const y = h - 4 - ((h - 8) * v) / max;
      if (drawing) g.lineTo(x, y);
      else g.moveTo(x, y);
      drawing = true;
    });
    g.stroke();
  }
  g.fillStyle = "#5b6570";
  g.font = "11px system-ui";
  g.fillText(String(max), 4, 12);
}

function drawBars(canvas, counts) {
  const g = canvas.getContext("2d");
  const { width: w, height: h } = canvas;
  g.clearRect(0, 0, w, h);
  const sizes = Object.keys(counts);
  const max = Math.max(1, ...Object.values(counts));
  const bw = w / sizes.length;
  sizes.forEach((size, i) => {
    const bh = ((h - 30) * counts[size]) / max;
    g.fillStyle = "#3451d1";
    g.fillRect(i * bw + 10, h - 18 - bh, bw - 20, bh);
    g.fillStyle = "#1b1f24";
    g.font = "11px system-ui";
    g.fillText(`${size}: ${counts[size]}`, i * bw + 10, h - 4);
  });
}

async function poll() {
  try {
    const response = await fetch("/stats", { headers: authHeaders() });
    if (!response.ok) throw new Error(await apiError(response));
    const s = await response.json();
    const status = $("server-status");
    status.textContent = s.ready ? `Ready: ${s.model} + ${s.assistant || "no assistant"}` : "Worker loading…";
    status.className = `status ${s.ready ? "ok" : "down"}`;
    push(history.queue, s.queue_depth);
    push(history.inflight, s.inflight);
    let acceptance = null;
    let rps = 0;
    if (previous) {
      const drafted = s.drafted - previous.drafted;
      acceptance = drafted > 0 ? (s.accepted - previous.accepted) / drafted : null;
      rps = s.requests - previous.requests;
    }
    push(history.acceptance, acceptance);
    const total = s.drafted > 0 ? s.accepted / s.drafted : null;
    $("tile-queue").textContent = String(s.queue_depth);
    $("tile-acceptance").textContent = total === null ? "–" : `${(total * 100).toFixed(1)} %`;
    $("tile-rps").textContent = previous ? rps.toFixed(0) : "–";
    $("tile-sessions").textContent = String(s.realtime_sessions);
    const top = Math.max(4, ...history.queue, ...history.inflight);
    drawLines($("chart-queue"), [
      { values: history.queue, color: "#3451d1" },
      { values: history.inflight, color: "#f0b400" },
    ], top);
    drawLines($("chart-acceptance"), [{ values: history.acceptance, color: "#167a3e" }], 1);
    drawBars($("chart-batches"), s.batches);
    previous = s;
  } catch (err) {
    $("server-status").textContent = `Server unreachable: ${err.message}`;
    $("server-status").className = "status down";
  }
}

// -- wiring ------------------------------------------------------------------------------------------------
$("upload-form").addEventListener("submit", onUpload);
$("live-button").addEventListener("click", () => (live ? stopLive() : startLive()));
setupDropZone();
poll();
setInterval(poll, 1000);
