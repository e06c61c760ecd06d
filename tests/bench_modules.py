"""Importing a bench/ script as a module in a CPU test. The scripts import each other by bare name
(`import shapes`), so bench/ goes on sys.path while the module is in use."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


@contextmanager
def bench_module(name: str) -> Iterator[ModuleType]:
    """bench/<name>.py imported as ``name``; sys.path and sys.modules restored afterwards (the
    scripts add paths of their own and import each other, e.g. `shapes`, which must not shadow
    other modules for the rest of the session)."""
    path, modules = list(sys.path), set(sys.modules)
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path[:] = path
        for added in set(sys.modules) - modules:
            if str(getattr(sys.modules[added], "__file__", None) or "").startswith(str(BENCH)):
                del sys.modules[added]
