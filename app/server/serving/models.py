"""The names a client may give the served model."""

from __future__ import annotations

import re

from app.api import errors
from app.settings import Settings

SNAPSHOT = re.compile(r"-\d{4}-\d{2}-\d{2}$")  # a dated snapshot of a model name: gpt-4o-transcribe-2025-03-20


class ModelNames:
    """The served model's id (`served_model_name`, else the model's own name), its aliases (listed by
    `/v1/models`), and OpenAI's names that resolve to it (`openai_model_names`, each with its snapshots)."""

    def __init__(self, settings: Settings) -> None:
        self.served = settings.served_model_name or settings.model.rstrip("/").split("/")[-1]
        self.ids = [self.served, *[a for a in settings.model_aliases if a != self.served]]
        self._openai = frozenset(settings.openai_model_names)

    def accepts(self, model: str) -> bool:
        return model in self.ids or SNAPSHOT.sub("", model) in self._openai

    def check(self, model: str) -> None:
        """ApiError 404 (`model_not_found`) unless `model` names the served model."""
        if not self.accepts(model):
            raise errors.model_not_found(model)
