"""The nsys backend on the training thread: a CUDA profiler range at exact step boundaries.

Nsight Systems cannot attach to a running process, so the job runs under ``nsys launch``
(``profctl run --nsys``) and the daemon starts a collection with
``--capture-range=cudaProfilerApi``. nsys then records only between ``cudaProfilerStart`` and
``cudaProfilerStop``, which this class calls at the step boundaries the daemon resolved, so an
nsys report holds exactly the requested steps. Each step is an NVTX range named
``ProfilerStep#N`` (the name torch.profiler uses), so both backends mark steps alike.

nsys writes the report itself; the client reports only the steps and wall times, and the
daemon collects the report from where it told nsys to write it.
"""

from __future__ import annotations

import time
from typing import Any

from .capture import CaptureResult

STEP_RANGE = "ProfilerStep#"


class NsysRange:
    """cudaProfilerStart/Stop around steps ``[start, stop)``; warm-up steps are not marked."""

    def __init__(self, start: int) -> None:
        self.start_step = start
        self.current = start
        self.started_at = 0.0
        self.notes: list[str] = []
        self._open = False
        self._torch: Any = None

    def start(self) -> None:
        import torch
        import torch.cuda.profiler

        self._torch = torch
        # Raises where CUDA is absent: the caller reports the rank failed with the reason.
        torch.cuda.profiler.start()  # type: ignore[no-untyped-call]
        self.started_at = time.time()
        self._push(self.current)

    def step(self) -> None:
        self._pop()
        self.current += 1
        self._push(self.current)

    def finish(self, last_step: int) -> CaptureResult:
        """End the range: sync so the last step's kernels land inside it, then stop."""
        t0 = time.perf_counter()
        error = None
        try:
            self._pop()
            self._sync()
            self._torch.cuda.profiler.stop()
        except Exception as exc:  # a failed stop must not reach training code
            error = f"cudaProfilerStop failed: {type(exc).__name__}: {exc}"
        steps = range(self.start_step, last_step + 1)
        return CaptureResult.ending_now([], steps, self.started_at, t0, error, self.notes)

    def abandon(self) -> None:
        # Stop anyway: an open range would keep nsys collecting until the process exits.
        try:
            self._pop()
            self._torch.cuda.profiler.stop()
        except Exception:
            pass

    def _push(self, step: int) -> None:
        try:
            self._torch.cuda.nvtx.range_push(f"{STEP_RANGE}{step}")
            self._open = True
        except Exception as exc:
            if not self.notes:
                self.notes.append(f"NVTX step ranges unavailable: {exc}")

    def _pop(self) -> None:
        if self._open:
            self._open = False
            self._torch.cuda.nvtx.range_pop()

    def _sync(self) -> None:
        cuda = self._torch.cuda
        if cuda.is_available() and cuda.is_initialized():
            cuda.synchronize()
