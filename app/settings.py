"""All configuration in one pydantic-settings class (environment prefix `SPECWHISPER_`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_models_dir() -> Path:
    """`models/` beside the `app` package (the repository's model store)."""
    return Path(__file__).resolve().parent.parent / "models"


class Settings(BaseSettings):
    """Engine and server settings; every field can be set as `SPECWHISPER_<FIELD>`."""

    model_config = SettingsConfigDict(env_prefix="SPECWHISPER_", extra="ignore")

    model: str = Field("whisper-base", description="main model: store name, local dir, CT2 dir or hub id")
    assistant: str = Field("self-draft", description="'self-draft', 'none', or a model reference")
    models_dir: Path = Field(default_factory=default_models_dir, description="where converted models live")
    device: str = Field("auto", description="'auto' (cuda when present), 'cpu', 'cuda', 'cuda:1', ...")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    threads: int | None = Field(None, ge=1, description="torch intra-op threads (default: torch's choice)")
    draft_tokens: int = Field(5, ge=1, le=12, description="initial draft length per row")
    adaptive_draft: bool = Field(True, description="adapt the draft length to acceptance")
