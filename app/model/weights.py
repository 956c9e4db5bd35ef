"""Whisper checkpoints' tensors, by transformers' names, into the lean modules' fused layout.

A checkpoint is read as a mapping from transformers' tensor names (`model.encoder.conv1.weight`,
`model.decoder.layers.0.self_attn.q_proj.weight`, `proj_out.weight`, ...) to tensors; `app.store`
reads one from files without importing transformers, and a transformers model's `state_dict()`
is such a mapping too. The modules are built on the meta device and take these tensors as their
parameters, so nothing is initialized only to be overwritten.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

Tensors = Mapping[str, Tensor]


@dataclass(frozen=True)
class WhisperDims:
    """A Whisper model's shapes, from a transformers `config.json`.

    A key missing from the file takes `transformers.WhisperConfig`'s default, as transformers
    itself does (`save_pretrained` may leave default values out).
    """

    vocab_size: int = 51865
    num_mel_bins: int = 80
    d_model: int = 384
    encoder_layers: int = 4
    encoder_attention_heads: int = 6
    encoder_ffn_dim: int = 1536
    decoder_layers: int = 4
    decoder_attention_heads: int = 6
    decoder_ffn_dim: int = 1536
    max_source_positions: int = 1500
    max_target_positions: int = 448
    tie_word_embeddings: bool = True
    decoder_only: bool = False  # a `WhisperForCausalLM` (a decoder-only assistant)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> WhisperDims:
        if config.get("model_type", "whisper") != "whisper":
            raise ValueError(f"not a Whisper checkpoint (model_type {config.get('model_type')!r})")
        known = {f.name for f in fields(cls)} - {"decoder_only"}
        values = {name: config[name] for name in known if config.get(name) is not None}
        return cls(**values, decoder_only="WhisperForCausalLM" in (config.get("architectures") or ()))


def renamed(tensors: Tensors, pairs: Sequence[tuple[str, str]], mine: str = "", theirs: str = "") -> dict[str, Tensor]:
    """The weight and bias of each Linear, LayerNorm or Conv1d `theirs.b` of the checkpoint as `mine.a`,
    for the (a, b) in `pairs`: {"mine.a.weight": tensors["theirs.b.weight"], "mine.a.bias": ...}."""
    out = {}
    for a, b in pairs:
        for part in ("weight", "bias"):
            out[f"{mine}{a}.{part}"] = tensors[f"{theirs}{b}.{part}"]
    return out


def fused(
    tensors: Tensors, into: str, parts: Sequence[str], scales: Sequence[float] | None = None
) -> dict[str, Tensor]:
    """Projections `parts` stacked along the output dimension (part i times scales[i]) as `into`'s weight and bias.

    A part without a bias (Whisper's key projections) contributes zeros to the fused bias.
    """
    scales = scales or [1.0] * len(parts)
    weights, biases = [], []
    for name, scale in zip(parts, scales, strict=True):
        weight = tensors[f"{name}.weight"]
        bias = tensors.get(f"{name}.bias")
        weights.append(weight * scale)
        if bias is None:
            bias = torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device)
        biases.append(bias * scale)
    return {f"{into}.weight": torch.cat(weights), f"{into}.bias": torch.cat(biases)}


def assign(module: nn.Module, state: Mapping[str, Tensor]) -> None:
    """Make `state` the parameters of `module` (built on the meta device); every one must be given."""
    module.load_state_dict(state, strict=True, assign=True)
