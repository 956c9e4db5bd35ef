"""An ONNX speaker embedder the operator names: windows of 16-kHz audio in, one vector per window out.

The file's first input takes [batch, samples] float32 audio at 16 kHz; its first output gives [batch, dim].
Its metadata may say how long a window it wants to hear (`window_s`, default 1.5 s). The vectors are brought
to unit length here, whatever the model gives.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime

from app.speakers.windows import same_lengths

DEFAULT_WINDOW_S = 1.5


class OnnxEmbedder:
    def __init__(self, session: onnxruntime.InferenceSession, name: str, window_s: float) -> None:
        self.session = session
        self.name = name
        self.window_s = window_s
        inputs, outputs = session.get_inputs(), session.get_outputs()
        if len(inputs[0].shape) != 2:
            raise ValueError(f"{name}: its input must be [batch, samples] audio, not {inputs[0].shape}")
        self.input = inputs[0].name
        dim = outputs[0].shape[-1]
        if not isinstance(dim, int):
            raise ValueError(f"{name}: its output's last axis must have a fixed size, not {dim!r}")
        self.dim = dim

    @classmethod
    def load(cls, path: Path, threads: int = 1) -> OnnxEmbedder:
        if not path.is_file():
            raise FileNotFoundError(f"speaker embedder file not found: {path}")
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = threads
        session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        meta = session.get_modelmeta().custom_metadata_map
        return cls(session, path.name, float(meta.get("window_s", DEFAULT_WINDOW_S)))

    def embed(self, windows: list[np.ndarray]) -> np.ndarray:
        out = np.zeros((len(windows), self.dim), np.float32)
        for indices in same_lengths(windows):
            batch = np.stack([windows[i] for i in indices]).astype(np.float32, copy=False)
            vectors = np.asarray(self.session.run(None, {self.input: batch})[0], np.float32)
            out[indices] = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return out
