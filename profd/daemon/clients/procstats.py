"""Per-process CPU%, RSS and (where NVML finds a GPU) GPU utilisation and memory.

Runs on its own thread so a slow /proc or NVML never stalls the event loop; results go
back through the reactor. Without a GPU (or without the NVIDIA driver) the GPU columns stay
empty and nothing is logged as an error.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

log = logging.getLogger("profd.procstats")


@dataclass(frozen=True)
class ProcReading:
    """One process's figures as the process-statistics thread read them (psutil, NVML):
    "readings", so that "sample" keeps its one meaning, the watch's step-aligned captures."""

    pid: int
    alive: bool
    cpu: float | None = None
    rss: int | None = None
    gpu_util: float | None = None
    gpu_mem: int | None = None


class _Nvml:
    def __init__(self) -> None:
        self.ok = False
        self.handles: list[Any] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            n = pynvml.nvmlDeviceGetCount()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
            self.ok = n > 0
            self.nv = pynvml
        except Exception as exc:  # no driver, no GPU: an expected state, not an error
            log.debug("NVML unavailable: %s", exc)

    def per_pid(self) -> tuple[dict[int, int], dict[int, float]]:
        mem: dict[int, int] = {}
        util: dict[int, float] = {}
        if not self.ok:
            return mem, util
        nv = self.nv
        for h in self.handles:
            try:
                for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                    if p.usedGpuMemory is not None:
                        mem[p.pid] = mem.get(p.pid, 0) + int(p.usedGpuMemory)
            except Exception:
                pass
            try:
                for u in nv.nvmlDeviceGetProcessUtilization(h, 0):
                    util[u.pid] = max(util.get(u.pid, 0.0), float(u.smUtil))
            except Exception:
                pass
        return mem, util


class ProcStats(threading.Thread):
    def __init__(
        self,
        interval: float,
        pids: Callable[[], list[int]],
        report: Callable[[list[ProcReading]], None],
    ) -> None:
        super().__init__(name="profd-procstats", daemon=True)
        self.interval = interval
        self.pids = pids
        self.report = report
        self.stopping = threading.Event()
        self._procs: dict[int, psutil.Process] = {}

    def run(self) -> None:
        nvml = _Nvml()
        while not self.stopping.wait(self.interval):
            try:
                self.report(self.read(nvml))
            except Exception as exc:
                log.warning("sampling failed: %r", exc)

    def read(self, nvml: _Nvml) -> list[ProcReading]:
        wanted = set(self.pids())
        for pid in list(self._procs):
            if pid not in wanted:
                del self._procs[pid]
        gmem, gutil = nvml.per_pid()
        out = []
        for pid in wanted:
            try:
                p = self._procs.get(pid)
                if p is None:
                    p = self._procs[pid] = psutil.Process(pid)
                    p.cpu_percent(None)  # first call primes the counter
                with p.oneshot():
                    if p.status() == psutil.STATUS_ZOMBIE:
                        raise psutil.NoSuchProcess(pid)
                    out.append(
                        ProcReading(
                            pid,
                            True,
                            cpu=p.cpu_percent(None),
                            rss=p.memory_info().rss,
                            gpu_util=gutil.get(pid) if nvml.ok else None,
                            gpu_mem=gmem.get(pid) if nvml.ok else None,
                        )
                    )
            except psutil.NoSuchProcess:
                self._procs.pop(pid, None)
                out.append(ProcReading(pid, False))
            except psutil.AccessDenied:
                out.append(ProcReading(pid, True))
        return out

    def stop(self) -> None:
        self.stopping.set()
