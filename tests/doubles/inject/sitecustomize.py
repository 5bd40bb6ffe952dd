"""CUDA profiler API emulation for the fake ``nsys`` TEST DOUBLE (stands in for NVIDIA nsys).

The fake ``nsys launch`` puts this directory first on PYTHONPATH, so every Python process it
launches (and their Python children) imports this module at start-up. When
``FAKE_NSYS_SESSION_DIR`` is set, it replaces ``torch.cuda.profiler.start/stop`` and
``torch.cuda.nvtx.range_push/range_pop`` with fakes that record events into the session's running
collection instead of calling CUDA (which the CPU build of torch lacks).

torch is patched lazily, when ``torch.cuda.profiler`` / ``torch.cuda.nvtx`` are first imported,
so processes that never import torch (the fake ``nsys`` itself included) pay nothing. Nothing
here may break the host process: every failure is swallowed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_SESSION_DIR = os.environ.get("FAKE_NSYS_SESSION_DIR")
_depth = threading.local()


def _event(ev: str, **extra: Any) -> dict[str, Any]:
    return {"pid": os.getpid(), "ev": ev, **extra, "t": time.time()}


def _fake_start() -> None:
    """cudaProfilerStart: opens a capture range if a collection is waiting for one."""
    try:
        import fake_nsys_state as state

        assert _SESSION_DIR is not None
        with state.locked(_SESSION_DIR):
            coll = state.read_collection(_SESSION_DIR)
            if coll is None:  # no `nsys start`: real nsys ignores cudaProfilerStart
                return
            if coll["open"] is None and coll["ranges"] < coll["max_ranges"]:
                coll["ranges"] += 1
                coll["open"] = {"index": coll["ranges"], "events": []}
            if coll["open"] is None:
                return
            coll["open"]["events"].append(_event("start"))
            state.save_collection(_SESSION_DIR, coll)
    except Exception:
        pass


def _fake_stop() -> None:
    """cudaProfilerStop: ends the open range (writes its report) unless FAKE_NSYS_HOLD=1."""
    try:
        import fake_nsys_state as state

        assert _SESSION_DIR is not None
        with state.locked(_SESSION_DIR):
            coll = state.read_collection(_SESSION_DIR)
            if coll is None or coll["open"] is None:
                return
            coll["open"]["events"].append(_event("stop"))
            if os.environ.get("FAKE_NSYS_HOLD") == "1":
                state.save_collection(_SESSION_DIR, coll)
            else:
                state.close_range(_SESSION_DIR, coll)
    except Exception:
        pass


def _append_if_open(event: dict[str, Any]) -> None:
    try:
        import fake_nsys_state as state

        assert _SESSION_DIR is not None
        if not os.path.exists(state.collection_path(_SESSION_DIR)):
            return
        with state.locked(_SESSION_DIR):
            coll = state.read_collection(_SESSION_DIR)
            if coll is None or coll["open"] is None:
                return
            coll["open"]["events"].append(event)
            state.save_collection(_SESSION_DIR, coll)
    except Exception:
        pass


def _fake_range_push(msg: str) -> int:
    """nvtxRangePushA: returns the zero-based depth of the range started (per thread)."""
    level: int = getattr(_depth, "n", 0)
    _depth.n = level + 1
    _append_if_open(_event("push", name=str(msg)))
    return level


def _fake_range_pop() -> int:
    """nvtxRangePop: returns the zero-based depth of the range ended, -1 if none was open."""
    level: int = getattr(_depth, "n", 0) - 1
    if level < 0:
        return -1
    _depth.n = level
    _append_if_open(_event("pop"))
    return level


_PATCHES: dict[str, dict[str, Any]] = {
    "torch.cuda.profiler": {"start": _fake_start, "stop": _fake_stop},
    "torch.cuda.nvtx": {"range_push": _fake_range_push, "range_pop": _fake_range_pop},
}


def _patch(module: ModuleType) -> None:
    try:
        for name, fake in _PATCHES[module.__name__].items():
            setattr(module, name, fake)
    except Exception:
        pass


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _patch(module)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    """Finds the torch modules to patch the ordinary way, and patches them once executed."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _PATCHES:
            return None
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
            return spec
        except Exception:
            return None


if _SESSION_DIR:
    try:
        for _name in _PATCHES:
            if _name in sys.modules:
                _patch(sys.modules[_name])
        sys.meta_path.insert(0, _PatchingFinder())
    except Exception:
        pass
