"""One torch.profiler capture, driven from the training thread at step boundaries.

The training thread only starts the profiler, calls ``step()`` at boundaries, stops it and
writes the raw (uncompressed) Chrome trace; kineto writes that file from C++, which is far
cheaper than torch's Python gzip export. Compression, fixing and summarising happen in the
daemon. A memory snapshot is taken on the training thread (it is the allocator's state at the
capture's last step, and ending the allocator's history discards it) but pickled and written
on a thread of its own (:class:`SnapshotWrite`); the report that names the file waits for it.
"""

from __future__ import annotations

import errno
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


@dataclass
class CaptureResult:
    files: list[dict[str, str]]
    steps: list[int]
    started_at: float
    ended_at: float
    stall_ms: float
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    #: A file of ``files`` still being written off the training thread: the report waits.
    pending: SnapshotWrite | None = None

    @classmethod
    def ending_now(
        cls,
        files: list[dict[str, str]],
        steps: range,
        started_at: float,
        stop_began: float,
        error: str | None,
        notes: list[str],
        pending: SnapshotWrite | None = None,
    ) -> CaptureResult:
        """The result of a capture whose stop began at ``stop_began`` (perf_counter)."""
        return cls(
            files=files,
            steps=list(steps),
            started_at=started_at,
            ended_at=time.time(),
            stall_ms=(time.perf_counter() - stop_began) * 1000.0,
            error=error,
            notes=notes,
            pending=pending,
        )


class MemoryHistory(Protocol):
    """Where a capture's memory snapshot comes from: torch's CUDA caching allocator
    (:data:`CUDA_MEMORY`), or a test double where there is no GPU."""

    def available(self) -> bool: ...

    def start(self) -> None: ...

    def snapshot(self) -> object: ...

    def stop(self) -> None: ...


class CudaMemoryHistory:
    """torch.cuda.memory's allocator history: what ``--memory-snapshot`` records."""

    def available(self) -> bool:
        import torch

        return bool(torch.cuda.is_available())

    def start(self) -> None:
        import torch

        # Python frames only by default: symbolising the C++ frames of every allocation is
        # what _snapshot() spends its time on, on the training thread (1.7 s of stall at
        # capture end on an H100 with torch's default "all"). PROFD_MEMORY_STACKS=all
        # keeps them for whoever needs the C++ side and accepts the stall.
        stacks = "all" if os.environ.get("PROFD_MEMORY_STACKS") == "all" else "python"
        torch.cuda.memory._record_memory_history(max_entries=100_000, stacks=stacks)

    def snapshot(self) -> object:
        """The allocator's state and history now; the object ``_dump_snapshot`` pickles."""
        import torch

        return torch.cuda.memory._snapshot()

    def stop(self) -> None:
        import torch

        torch.cuda.memory._record_memory_history(enabled=None)


CUDA_MEMORY: MemoryHistory = CudaMemoryHistory()


class SnapshotWrite:
    """A memory snapshot pickled into ``path`` on a thread of its own.

    ``torch.cuda.memory._dump_snapshot`` pickles and writes on its caller's thread, which at a
    capture's end is the training thread. Here that thread only hands the snapshot over; the
    report naming ``path`` is held until :attr:`done` (see ``steps.ready``), so the daemon
    never reads half a file. pickle holds the GIL while it encodes and lets it go at each
    write, so training runs on between chunks instead of waiting for the whole file. The
    thread is not a daemon thread: an exiting process finishes the file first.
    """

    def __init__(self, snapshot: object, path: Path) -> None:
        self.path = path
        self.error: str | None = None  # set before ``done``: why no file was written
        self.took_ms = 0.0  # set before ``done``: how long pickling and writing took
        self.done = threading.Event()
        self._snapshot: object = snapshot
        self._notify: Callable[[], None] = lambda: None

    def start(self, notify: Callable[[], None]) -> None:
        """Begin writing; ``notify`` is called (on the writing thread) once it is done."""
        self._notify = notify
        threading.Thread(target=self._run, name="profd-snapshot-write").start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            with open(self.path, "wb") as fh:
                pickle.dump(self._snapshot, fh)
        except Exception as exc:
            self.error = "memory snapshot not written: " + _why(exc, self.path.parent)
            _remove(self.path)  # nothing half written stays behind
        finally:
            self._snapshot = None
            self.took_ms = (time.perf_counter() - t0) * 1000.0
            self.done.set()
            try:
                self._notify()
            except Exception:
                pass


def torch_info() -> tuple[str | None, str | None]:
    """(torch version, device description) without initialising CUDA needlessly."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return None, None
    device = "cpu"
    try:
        # Never initialise CUDA from here: the agent thread runs before the training code has
        # picked its device, and a context on GPU 0 for every rank wastes memory there.
        if torch.cuda.is_available():
            device = "cuda"
            if torch.cuda.is_initialized():
                device = f"cuda:{torch.cuda.current_device()} {torch.cuda.get_device_name()}"
    except Exception:
        device = "cpu"
    return str(torch.__version__), device


class TorchCapture:
    """torch.profiler for steps ``[start, stop)`` after ``warmup`` warm-up steps."""

    def __init__(
        self,
        options: dict[str, Any],
        out_dir: Path,
        stem: str,
        warmup_start: int,
        start: int,
        memory: MemoryHistory = CUDA_MEMORY,
    ) -> None:
        self.options = options
        self.out_dir = out_dir
        self.stem = stem
        self.warmup_start = warmup_start
        self.start_step = start
        self.started_at = 0.0
        self.prof: Any = None
        self.memory = memory
        self.snapshot = False
        self.notes: list[str] = []

    def start(self) -> None:
        import torch
        from torch.profiler import ProfilerAction, ProfilerActivity, profile

        acts = []
        for a in self.options.get("activities", ["cpu", "cuda"]):
            if a == "cpu":
                acts.append(ProfilerActivity.CPU)
            elif a == "cuda":
                if torch.cuda.is_available():
                    acts.append(ProfilerActivity.CUDA)
                else:
                    self.notes.append("cuda activity requested but CUDA is not available")
        if not acts:
            acts.append(ProfilerActivity.CPU)
        first, warm = self.start_step, self.warmup_start

        def schedule(step: int) -> ProfilerAction:
            # profile() asks for step 0 in its constructor, before step_num can be set to the
            # global step; steps are 1-indexed, so 0 stands for the first step we run.
            if step == 0:
                step = warm
            return ProfilerAction.WARMUP if step < first else ProfilerAction.RECORD

        self.prof = profile(
            activities=acts,
            schedule=schedule,
            record_shapes=bool(self.options.get("record_shapes")),
            profile_memory=bool(self.options.get("profile_memory")),
            with_stack=bool(self.options.get("with_stack")),
            with_flops=bool(self.options.get("with_flops")),
            with_modules=bool(self.options.get("with_modules")),
        )
        # ProfilerStep#N markers carry the global step number of the step about to run.
        self.prof.step_num = self.warmup_start
        if self.options.get("memory_snapshot"):
            if self.memory.available():
                self.memory.start()
                self.snapshot = True
            else:
                self.notes.append("memory snapshot needs CUDA; none on this process")
        self.started_at = time.time()
        _scopes.install()
        self.prof.start()

    def step(self) -> None:
        self.prof.step()

    def finish(self, last_step: int) -> CaptureResult:
        """Stop and write the raw trace; the returned stall is what training waited."""
        t0 = time.perf_counter()
        files: list[dict[str, str]] = []
        error = None
        pending: SnapshotWrite | None = None
        try:
            _scopes.end_enclosing()
            self.prof.stop()
            _scopes.uninstall()
            os.makedirs(self.out_dir, exist_ok=True)
            trace = self.out_dir / f"{self.stem}.pt.trace.json"
            self.prof.export_chrome_trace(str(trace))
            if not trace.exists():
                # kineto logs a failed write and returns; what it wrote is in ``.tmp``.
                raise _ExportFailed(self.out_dir, "torch wrote no trace file")
            files.append({"kind": "trace", "path": str(trace)})
            if self.snapshot:
                pending = self._take_snapshot()
                if pending is not None:
                    files.append({"kind": "memory", "path": str(pending.path)})
        except Exception as exc:  # a failed export must not reach training code
            error = "export failed: " + _why(exc, self.out_dir)
            # Nothing half written stays behind: the daemon would never clean it up.
            for name in (".pt.trace.json", ".pt.trace.json.tmp", ".memory.pickle"):
                _remove(self.out_dir / f"{self.stem}{name}")
            files, pending = [], None
        finally:
            _scopes.uninstall()
            if self.snapshot:  # the export failed before the snapshot: end the history
                self.snapshot = False
                try:
                    self.memory.stop()
                except Exception:
                    pass
        steps = range(self.start_step, last_step + 1)
        return CaptureResult.ending_now(
            files, steps, self.started_at, t0, error, self.notes, pending
        )

    def _take_snapshot(self) -> SnapshotWrite | None:
        """The allocator's snapshot, taken here and handed to a writer that is not started
        yet; a failure costs the snapshot only (a note says why), never the trace."""
        self.snapshot = False  # the history ends here, whatever happens next
        s0 = time.perf_counter()
        try:
            taken = self.memory.snapshot()
        except Exception as exc:
            self.notes.append(f"memory snapshot failed: {type(exc).__name__}: {exc}")
            return None
        finally:
            try:
                self.memory.stop()
            except Exception:
                pass
        took = (time.perf_counter() - s0) * 1000.0
        self.notes.append(
            f"memory snapshot taken in {took:.1f} ms on the training thread, pickled and"
            " written off it"
        )
        return SnapshotWrite(taken, self.out_dir / f"{self.stem}.memory.pickle")

    def abandon(self) -> None:
        try:
            _scopes.end_enclosing()
            self.prof.stop()
        except Exception:
            pass
        _scopes.uninstall()
        if self.snapshot:
            self.snapshot = False
            try:
                self.memory.stop()
            except Exception:
                pass


class _ExportFailed(Exception):
    def __init__(self, out_dir: Path, why: str) -> None:
        super().__init__(why)
        self.out_dir = out_dir


def _why(exc: Exception, out_dir: Path) -> str:
    """A failed export in one line; a full disk says so (kineto itself does not)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"disk full in {out_dir} ({exc.strerror})"
    if isinstance(exc, _ExportFailed) and _free_bytes(out_dir) < _FULL_BELOW:
        return f"disk full in {out_dir} ({exc})"
    return f"{type(exc).__name__}: {exc}"


#: Free space under which a failed write is taken for a full disk.
_FULL_BELOW = 1 << 20


def _free_bytes(d: Path) -> int:
    try:
        st = os.statvfs(d)
    except OSError:
        return _FULL_BELOW
    return st.f_bavail * st.f_frsize


def _remove(p: Path) -> None:
    try:
        p.unlink()
    except OSError:
        pass


class _OptimizerScopes:
    """Remembers the latest ``Optimizer.step#...`` record_function entered during a capture.

    Step boundaries come from the global optimizer post-hook, which torch calls inside the
    ``record_function("Optimizer.step#...")`` of that step. That range was opened while the
    profiler was recording; stopping the profiler before it closes, and closing it afterwards,
    corrupts the heap (seen as segfaults in later gc runs). So during a capture (only: the
    idle path is untouched) ``record_function.__enter__`` is wrapped to remember the range,
    and :meth:`end_enclosing` ends it while the profiler still runs and turns its own exit
    into a no-op. The trace shows that optimizer step ending where the capture stops.
    """

    def __init__(self) -> None:
        self.latest: Any = None
        self._orig: Any = None

    def install(self) -> None:
        from torch.autograd.profiler import record_function

        if self._orig is not None:
            return
        orig = record_function.__enter__
        scopes = self

        def enter(rf: Any) -> Any:
            out = orig(rf)  # type: ignore[no-untyped-call]
            if rf.name.startswith("Optimizer.step#"):
                scopes.latest = rf
            return out

        self._orig = orig
        record_function.__enter__ = enter  # type: ignore[method-assign]

    def uninstall(self) -> None:
        from torch.autograd.profiler import record_function

        if self._orig is not None:
            record_function.__enter__ = self._orig  # type: ignore[method-assign]
            self._orig = None
        self.latest = None

    def end_enclosing(self) -> None:
        rf = self.latest
        if rf is None or not rf.run_callbacks_on_exit or rf.record is None:
            return
        f: Any = sys._getframe(1)
        while f is not None:
            code = f.f_code
            if code.co_name == "wrapper" and code.co_filename.endswith(_OPTIMIZER_FILE):
                break
            f = f.f_back
        else:
            return  # not inside an optimizer step (manual stepping, region exit, detach)
        import torch

        rf.run_callbacks_on_exit = False
        with torch._C.DisableTorchFunctionSubclass():
            torch.ops.profiler._record_function_exit._RecordFunction(rf.record)


_scopes = _OptimizerScopes()


_OPTIMIZER_FILE = os.path.join("torch", "optim", "optimizer.py")
