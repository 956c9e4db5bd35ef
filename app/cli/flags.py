"""The command line's shared flags: the engine's settings given as flags, the model store."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, get_args

from app.settings import DtypeName, Settings


def settings_of(args: argparse.Namespace) -> Settings:
    return Settings(**overrides(args))


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags (the rest come from `SPECWHISPER_*` variables and defaults)."""
    flags = ("model", "assistant", "models_dir", "device", "dtype", "encoder_dtype", "threads", "draft_tokens")
    return {key: value for key in flags if (value := getattr(args, key, None)) is not None}


def add_store(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models-dir", type=Path, help="model store folder (default: ./models)")


def add_common(parser: argparse.ArgumentParser) -> None:
    """The flags of commands that load an engine."""
    parser.add_argument("--model", help="main model (store name, HF/CT2 directory or hub id)")
    parser.add_argument("--assistant", help="'self-draft' (default), 'none', or a model reference")
    add_store(parser)
    parser.add_argument("--device", help="auto, cpu, cuda, cuda:N")
    parser.add_argument(
        "--dtype",
        choices=get_args(DtypeName),
        help="the models' dtype (auto: float16 on a GPU, float32 on a CPU; int8: int8 linear layers on a CPU)",
    )
    parser.add_argument(
        "--encoder-dtype",
        choices=get_args(DtypeName),
        help="the main encoder's own dtype (auto: as --dtype; bfloat16 pays on CPUs with AMX)",
    )
    parser.add_argument("--threads", type=int, help="torch threads")
