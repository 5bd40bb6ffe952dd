"""Synthetic kineto Chrome traces of any size, laid out like torch.profiler's own.

What ``export_chrome_trace`` writes for a CUDA training job with ``record_shapes``,
``with_stack`` and ``profile_memory``: kineto's indentation (4-space keys, ``"dur": x`` then a
line with a lone ``,``), top-level metadata before ``traceEvents`` and ``traceName`` after it,
``ProfilerStep#N`` annotations, nested CPU ops on the main thread (a parent and its first
child may start on the same nanosecond) and backward ops on the autograd thread, CUDA runtime
calls with their flow events, kernels and memcpys on GPU streams, ``[memory]`` events for every
allocation and free, and the main thread's Python functions written after all of its ops, as
kineto does (so each thread's CPU events are two sorted runs, not one). Some names are not
ASCII. The same ``seed`` and size give the same bytes.

Used by ``bench/bench_pipeline.py`` (up to 1 GB) and the pipeline tests (a few MB).
"""

from __future__ import annotations

import io
import json
import random
import shutil
import tempfile
from dataclasses import dataclass
from typing import BinaryIO

PID = 4242
MAIN_TID = 4242
BWD_TID = 4299
STREAM = 7
T0_NS = 4_511_131_474_961_378  # kineto timestamps: µs with ns decimals, far from zero
LAYERS = 48
CLAMP_KERNEL = (
    "void at::native::vectorized_elementwise_kernel<4,"
    " at::native::(anonymous namespace)::launch_clamp_scalar>"
)


@dataclass
class SynthInfo:
    bytes: int = 0
    events: int = 0
    steps: int = 0
    cpu_events: int = 0
    python_events: int = 0
    gpu_events: int = 0
    memory_events: int = 0


def _ts(ns: int) -> str:
    return f"{ns // 1000}.{ns % 1000:03d}"


class _Writer:
    def __init__(self, out: BinaryIO, side: BinaryIO, rng: random.Random) -> None:
        self.out = out
        self.side = side  # the main thread's python_function events, appended at the end
        self.rng = rng
        self.info = SynthInfo()
        self.first = True
        self.step_main: list[str] = []
        self.step_side: list[str] = []
        self.ext_id = 0
        self.ev_idx = 0
        self.corr = 0
        self.py_id = 0
        self.alloc = 1 << 30
        self.gpu_ns = T0_NS

    def emit(self, text: str, side: bool = False) -> None:
        # Held until the step ends: its ProfilerStep annotation (whose length is known only
        # then) goes before them, as kineto writes it.
        (self.step_side if side else self.step_main).append(text)
        self.info.events += 1

    def flush(self) -> None:
        for texts, fh in ((self.step_main, self.out), (self.step_side, self.side)):
            if texts:
                lead = "  " if fh is self.out and self.first else ",\n  "
                fh.write((lead + ",\n  ".join(texts)).encode("utf-8"))
                if fh is self.out:
                    self.first = False
            texts.clear()

    def complete(
        self, cat: str, name: str, tid: int | str, ts: int, dur: int, args: str, pid: int = PID
    ) -> str:
        return (
            f'{{\n    "ph": "X", "cat": "{cat}", "name": {json.dumps(name, ensure_ascii=False)},'
            f' "pid": {pid}, "tid": {json.dumps(tid)},\n    "ts": {_ts(ts)}, "dur": {_ts(dur)}\n'
            f'    ,\n    "args": {{\n      {args}\n    }}\n  }}'
        )

    def op(
        self, name: str, tid: int, ts: int, dur: int, dims: str = "[[32, 1024], [1024]]"
    ) -> None:
        self.ext_id += 1
        self.ev_idx += 1
        args = (
            f'"External id": {self.ext_id},"Record function id": 0, "Concrete Inputs": ["", ""],'
            f' "Input type": ["float", "float"], "Input Strides": [[1024, 1], [1]],'
            f' "Input Dims": {dims}, "Sequence number": {self.ext_id // 3},'
            f' "Fwd thread id": 0, "Ev Idx": {self.ev_idx}'
        )
        self.emit(self.complete("cpu_op", name, tid, ts, dur, args))
        self.info.cpu_events += 1

    def annotation(self, name: str, tid: int, ts: int, dur: int) -> None:
        self.ext_id += 1
        self.ev_idx += 1
        args = f'"External id": {self.ext_id},"Record function id": 0, "Ev Idx": {self.ev_idx}'
        self.emit(self.complete("user_annotation", name, tid, ts, dur, args))
        self.info.cpu_events += 1

    def python(self, name: str, ts: int, dur: int) -> None:
        self.py_id += 1
        self.ev_idx += 1
        args = (
            f'"Python parent id": {self.py_id - 1}, "Python id": {self.py_id},'
            f' "Ev Idx": {self.ev_idx}'
        )
        self.emit(self.complete("python_function", name, MAIN_TID, ts, dur, args), side=True)
        self.info.python_events += 1

    def memory(self, tid: int, ts: int, nbytes: int) -> None:
        self.alloc += nbytes
        self.ev_idx += 1
        self.emit(
            f'{{\n    "ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]",\n'
            f'    "pid": {PID}, "tid": {tid},\n    "ts": {_ts(ts)}\n    ,\n    "args": {{\n'
            f'      "Total Reserved": {(self.alloc | ((1 << 26) - 1)) + 1}, "Total Allocated":'
            f' {self.alloc}, "Bytes": {nbytes}, "Device Id": 0, "Device Type": 1, "Addr":'
            f' {139_000_000_000_000 + self.alloc}, "finished": false, "Ev Idx": {self.ev_idx}\n'
            f"    }}\n  }}"
        )
        self.info.memory_events += 1

    def launch(self, tid: int, ts: int, kernel: str, kdur: int) -> int:
        """cudaLaunchKernel at ``ts`` with its flow and kernel; returns the call's length."""
        self.corr += 1
        dur = 4_000 + self.rng.randrange(3_000)
        args = f'"cbid": 211, "correlation": {self.corr}'
        self.emit(self.complete("cuda_runtime", "cudaLaunchKernel", tid, ts, dur, args))
        self.emit(
            f'{{\n    "ph": "s", "id": {self.corr}, "pid": {PID}, "tid": {tid},'
            f' "ts": {_ts(ts)},\n    "cat": "ac2g", "name": "ac2g"\n  }}'
        )
        self.gpu_ns = max(self.gpu_ns, ts + dur) + 1_000
        cat = "gpu_memcpy" if kernel.startswith("Memcpy") else "kernel"
        kargs = (
            f'"queued": 0, "device": 0, "context": 1, "stream": {STREAM}, "correlation":'
            f' {self.corr}, "registers per thread": 128, "shared memory": 16384, "blocks per SM":'
            f' 1.2, "warps per SM": 4.8, "grid": [132, 1, 1], "block": [256, 1, 1],'
            f' "est. achieved occupancy %": 12'
        )
        self.emit(self.complete(cat, kernel, STREAM, self.gpu_ns, kdur, kargs, pid=0))
        self.emit(
            f'{{\n    "ph": "f", "id": {self.corr}, "pid": 0, "tid": {STREAM},'
            f' "ts": {_ts(self.gpu_ns)},\n    "cat": "ac2g", "name": "ac2g", "bp": "e"\n  }}'
        )
        self.gpu_ns += kdur
        self.info.gpu_events += 1
        return dur

    def linear(self, layer: int, t: int) -> int:
        """One nn.Linear forward on the main thread from ``t``; returns its end."""
        rng = self.rng
        start = t
        # aten::linear and aten::t start on the same nanosecond: the longer one is the parent.
        t_dur = 9_000 + rng.randrange(2_000)
        transpose = t_dur - 3_000
        mm_start = t + t_dur + 500
        k_dur = 40_000 + rng.randrange(20_000)
        inner = self.rng.randrange(1_000)
        mm_end = mm_start + 2_000 + 8_000 + inner
        end = mm_end + 700
        self.python(f"nn.Module: Linear_{layer}", start - 1_200, end - start + 2_400)
        self.python("torch/nn/modules/linear.py(125): forward", start - 600, end - start + 1_200)
        self.op("aten::linear", MAIN_TID, start, end - start)
        self.op("aten::t", MAIN_TID, start, t_dur, "[[1024, 1024]]")
        self.op("aten::transpose", MAIN_TID, start + 1_000, transpose, "[[1024, 1024], [], []]")
        self.op("aten::as_strided", MAIN_TID, start + 2_000, transpose - 2_500, "[[1024, 1024]]")
        self.op("aten::addmm", MAIN_TID, mm_start, mm_end - mm_start)
        self.memory(MAIN_TID, mm_start + 1_000, 131_072)
        self.launch(MAIN_TID, mm_start + 2_000, "sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n", k_dur)
        if layer % 2:
            relu = end + 300
            self.op("aten::relu", MAIN_TID, relu, 12_000, "[[32, 1024]]")
            self.op("aten::clamp_min", MAIN_TID, relu + 800, 10_000, "[[32, 1024], []]")
            self.launch(
                MAIN_TID,
                relu + 2_000,
                CLAMP_KERNEL,
                3_000,
            )
            end = relu + 12_000
        return end

    def backward(self, layer: int, t: int) -> int:
        name = "AddmmBackward0"
        dur = 30_000 + self.rng.randrange(10_000)
        self.annotation(f"autograd::engine::evaluate_function: {name}", BWD_TID, t, dur)
        self.op(name, BWD_TID, t + 500, dur - 1_000)
        half = (dur - 3_000) // 2
        self.op("aten::mm", BWD_TID, t + 1_000, half)
        self.launch(BWD_TID, t + 1_500, "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n", 45_000)
        self.op("aten::mm", BWD_TID, t + 1_000 + half + 500, half)
        self.launch(
            BWD_TID, t + 1_500 + half + 500, "sm90_xmma_gemm_f32f32_tf32f32_f32_nt_n", 45_000
        )
        self.memory(BWD_TID, t + dur - 200, -131_072)
        return t + dur + 400 + layer % 3

    def step(self, n: int, t: int) -> int:
        start = t
        t += 5_000
        for layer in range(LAYERS):
            t = self.linear(layer, t + 1_500)
        self.op("aten::sum", MAIN_TID, t + 1_000, 8_000, "[[32, 8]]")
        t += 10_000
        bt = t
        for layer in reversed(range(LAYERS)):
            bt = self.backward(layer, bt + 800)
        t = bt + 2_000
        self.annotation("Optimizer.step#SGD.step", MAIN_TID, t, 60_000)
        self.op("aten::_foreach_add_", MAIN_TID, t + 5_000, 50_000, "[[], []]")
        self.launch(MAIN_TID, t + 6_000, "Memcpy HtoD (Pageable -> Device)", 2_000)
        end = t + 64_000
        # The step's annotation and its Python frame go first, in time order with the rest.
        main, side = self.step_main[:], self.step_side[:]
        self.step_main.clear()
        self.step_side.clear()
        self.annotation(f"ProfilerStep#{n}", MAIN_TID, start, end - start)
        self.python("train_ü.py(42): step ✓", start + 1_000, end - start - 2_000)
        self.step_main.extend(main)
        self.step_side.extend(side)
        self.flush()
        self.info.steps += 1
        return end + 20_000


def write_trace(
    out: BinaryIO,
    target_bytes: int,
    *,
    seed: int = 0,
    info: str = "head",
    rank: int = 3,
    world_size: int = 8,
    first_step: int = 100,
) -> SynthInfo:
    """Write a trace of about ``target_bytes`` (at least one step) to ``out``.

    ``info``: where ``distributedInfo`` goes: ``"head"`` (before traceEvents, as kineto writes
    it for a distributed job), ``"tail"`` (after), or ``"none"`` (a single-process job).
    """
    if info not in ("head", "tail", "none"):
        raise ValueError(f"info must be head, tail or none, not {info!r}")
    dist = json.dumps(
        {
            "backend": "nccl",
            "rank": rank,
            "world_size": world_size,
            "pg_count": 2,
            "pg_config": [
                {
                    "pg_name": "0",
                    "pg_desc": "default_pg",
                    "backend_config": "cuda:nccl",
                    "pg_size": world_size,
                    "ranks": list(range(world_size)),
                }
            ],
            "nccl_version": "2.27.3",
        }
    )
    head = (
        '{\n  "schemaVersion": 1,\n  "deviceProperties": [\n    {\n      "id": 0,'
        ' "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85045477376,\n'
        '      "computeMajor": 9, "computeMinor": 0,\n      "maxThreadsPerBlock": 1024,'
        ' "maxThreadsPerMultiprocessor": 2048,\n      "regsPerBlock": 65536,'
        ' "warpSize": 32,\n      "sharedMemPerBlock": 49152, "numSms": 132\n    }\n  ],\n'
        + (f'  "distributedInfo": {dist},\n' if info == "head" else "")
        + '  "record_shapes": 1,\n  "with_stack": 1,\n  "profile_memory": 1,\n'
        '  "trace_id": "F5CA9CA483284BA898E2018D10527100",\n  "displayTimeUnit": "ms",\n'
        '  "baseTimeNanoseconds": 1790857026000000000,\n  "traceEvents": [\n'
    )
    with tempfile.TemporaryFile() as side:
        w = _Writer(out, side, random.Random(seed))
        start = out.tell()
        out.write(head.encode())
        meta = [
            ("process_name", 0, '"name": "python"'),
            ("thread_name", MAIN_TID, '"name": "thread 4242 (python)"'),
            ("thread_name", BWD_TID, '"name": "thread 4299 (pt_autograd_0)"'),
        ]
        for name, tid, args in meta:
            w.emit(
                f'{{\n    "name": "{name}", "ph": "M", "ts": {_ts(T0_NS)}, "pid": {PID},'
                f' "tid": {tid},\n    "args": {{\n      {args}\n    }}\n  }}'
            )
        w.flush()
        t = T0_NS + 1_000_000
        step = first_step
        while True:
            t = w.step(step, t)
            step += 1
            if out.tell() - start + side.tell() >= target_bytes * 0.97:
                break
        side.seek(0)
        shutil.copyfileobj(side, out, 1 << 20)
    w.emit(
        '{\n    "ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "",'
        f' "ts": {_ts(t)}\n  }}'
    )
    w.flush()
    tail = '\n  ],\n  "traceName": "synthetic.pt.trace.json"'
    if info == "tail":
        tail += f',\n  "distributedInfo": {dist}'
    out.write((tail + "\n}\n").encode())
    w.info.bytes = out.tell() - start
    return w.info


def trace_bytes(target_bytes: int, **kw: object) -> bytes:
    buf = io.BytesIO()
    write_trace(buf, target_bytes, **kw)  # type: ignore[arg-type]
    return buf.getvalue()


def sync_job_events(
    compute_us: list[list[float]],
    *,
    comm_us: float = 500.0,
    idle_us: float = 100.0,
    first_step: int = 1,
    gpu: bool = False,
    t0_us: float = 1_000_000.0,
) -> list[list[dict[str, object]]]:
    """Chrome-trace events of a synchronous data-parallel job, one list per rank.

    ``compute_us[r][k]``: rank ``r``'s compute before the collective in its ``k``-th step.
    Every step starts on every rank at once, each rank computes (``aten::mm`` in a
    ``cpu_op``), then all-reduces: on CPU (gloo) a short ``c10d::allreduce_`` on the training
    thread and a ``gloo:all_reduce`` range on gloo's own thread, which lasts until the last
    rank has arrived plus ``comm_us``; with ``gpu`` an NCCL kernel of that length instead, after
    a ``aten::mm`` kernel. ``idle_us`` of nothing follows each step's collective.
    """
    ranks = len(compute_us)
    out: list[list[dict[str, object]]] = [[] for _ in range(ranks)]
    t = t0_us
    for k in range(len(compute_us[0])):
        arrive = [t + 50 + compute_us[r][k] for r in range(ranks)]
        done = max(arrive) + comm_us
        end = done + idle_us
        for r in range(ranks):
            ev = out[r]
            main = {"pid": 100 + r, "tid": 100 + r}
            ev.append(
                {
                    "ph": "X",
                    "cat": "user_annotation",
                    "name": f"ProfilerStep#{first_step + k}",
                    "ts": t,
                    "dur": end - t,
                    **main,
                }
            )
            ev.append(
                {
                    "ph": "X",
                    "cat": "cpu_op",
                    "name": "aten::mm",
                    "ts": t + 50,
                    "dur": compute_us[r][k],
                    **main,
                }
            )
            ev.append(
                {
                    "ph": "X",
                    "cat": "cpu_op",
                    "name": "c10d::allreduce_",
                    "ts": arrive[r],
                    "dur": 20.0,
                    **main,
                }
            )
            if gpu:
                ev.append(
                    {
                        "ph": "X",
                        "cat": "kernel",
                        "name": "ampere_sgemm_128x64_nn",
                        "pid": 0,
                        "tid": 7,
                        "ts": t + 60,
                        "dur": compute_us[r][k] - 20,
                    }
                )
                ev.append(
                    {
                        "ph": "X",
                        "cat": "kernel",
                        "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
                        "pid": 0,
                        "tid": 20,
                        "ts": arrive[r] + 10,
                        "dur": done - arrive[r] - 10,
                    }
                )
            else:
                ev.append(
                    {
                        "ph": "X",
                        "cat": "user_annotation",
                        "name": "gloo:all_reduce",
                        "pid": 100 + r,
                        "tid": 900 + r,
                        "ts": arrive[r] + 5,
                        "dur": done - arrive[r] - 5,
                    }
                )
        t = end
    return out


def single_rank_nccl_events(steps: int = 3, t0_us: float = 1_000_000.0) -> list[dict[str, object]]:
    """Chrome-trace events of a one-rank NCCL job, as torch 2.11 with NCCL 2.28 records it.

    Each 1 ms step: an ``aten::mm`` launching a 200 µs kernel, an ``aten::copy_`` launching a
    50 µs host-to-device memcpy, then ``c10d::allreduce_`` holding ``record_param_comms`` and
    ``nccl:all_reduce``, whose only GPU work is a 100 µs ``Memcpy DtoD (Device -> Device)``
    launched by ``cudaMemcpyAsync`` inside it (at world size 1 NCCL copies, no kernel). Each
    launch and its activity share a correlation id, as kineto writes them.
    """
    main = {"pid": 77, "tid": 77}
    out: list[dict[str, object]] = []
    corr = 0

    def x(cat: str, name: str, ts: float, dur: float, **kw: object) -> None:
        out.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, **kw})

    def launch(call: str, at: float, cat: str, name: str, gpu_at: float, dur: float) -> None:
        nonlocal corr
        corr += 1
        x("cuda_runtime", call, at, 5.0, args={"correlation": corr}, **main)
        x(cat, name, gpu_at, dur, pid=0, tid=7, args={"correlation": corr, "stream": 7})

    for k in range(steps):
        t = t0_us + k * 1000.0
        x("user_annotation", f"ProfilerStep#{k + 1}", t, 1000.0, **main)
        x("cpu_op", "aten::mm", t + 10, 20.0, **main)
        launch("cudaLaunchKernel", t + 15, "kernel", "ampere_sgemm_128x64_nn", t + 40, 200.0)
        x("cpu_op", "aten::copy_", t + 40, 20.0, **main)
        launch("cudaMemcpyAsync", t + 45, "gpu_memcpy", "Memcpy HtoD (Pageable -> Device)",
               t + 250, 50.0)  # fmt: skip
        x("cpu_op", "c10d::allreduce_", t + 100, 40.0, **main)
        x("cpu_op", "record_param_comms", t + 102, 36.0, **main)
        x("user_annotation", "nccl:all_reduce", t + 104, 30.0, **main)
        launch("cudaMemcpyAsync", t + 110, "gpu_memcpy", "Memcpy DtoD (Device -> Device)",
               t + 400, 100.0)  # fmt: skip
    return out


#: Python frames of profd's client as torch names them (``--with-stack``), and zmq's below them.
PROFD_FRAMES = (
    "profd_client/api.py(150): _post_step",
    "profd_client/steps.py(239): _advance",
    "profd_client/capture.py(249): enter",
    "profd_client/agent.py(112): run",
    "profd_client/agent.py(121): _loop_once",
)


def with_stack_job_events(
    compute_us: list[list[float]], *, first_step: int = 1, t0_us: float = 2_000_000.0
) -> list[list[dict[str, object]]]:
    """Chrome-trace events of a synchronous gloo job captured with ``with_stack``, one list
    per rank, laid out as torch 2.x writes them for a job attached to profd (seen in real
    captures): Python frames around every operator (``<built-in method mm of type object at
    0x7f..>``, with an address that differs between ranks), annotations opened inside a frame
    and outliving it (``ProfilerStep#N`` opened by profd's step hook, the user's
    ``profd_client.region("forward")``, ``Optimizer.step#SGD.step``), an ``aten::empty`` that
    profd's hook runs, profd's agent thread (thread bootstrap, ``profd_client/agent.py``
    frames, ``zmq/sugar/poll.py`` blocking most of the time), and the collective as
    ``gloo:all_reduce`` on two gloo threads at once, each as long as the wait.

    ``compute_us[r][k]``: rank ``r``'s ``aten::mm`` time in its ``k``-th step; the others wait
    for the slowest in the all-reduce. ``ProfilerStep#N`` ends and ``N+1`` opens inside
    profd's ``_post_step`` frame, as ``prof.step()`` does.
    """
    ranks = len(compute_us)
    out: list[list[dict[str, object]]] = [[] for _ in range(ranks)]

    def x(r: int, cat: str, name: str, tid: int, ts: float, dur: float) -> None:
        out[r].append(
            {"ph": "X", "cat": cat, "name": name, "pid": 100 + r, "tid": tid, "ts": ts, "dur": dur}
        )

    def frame(r: int, name: str, ts: float, dur: float, tid: int | None = None) -> None:
        x(r, "python_function", name, 100 + r if tid is None else tid, ts, dur)

    def addr(r: int, k: int) -> str:
        return f"0x7f{r:02x}{k:02x}caecea40"

    steps = len(compute_us[0])
    t = t0_us
    starts = []
    for k in range(steps):
        starts.append(t)
        arrive = [t + 280 + compute_us[r][k] for r in range(ranks)]
        done = max(arrive) + 300
        end = done + 400  # the optimizer, then profd's step hook ends this step, opens the next
        for r in range(ranks):
            main, c = 100 + r, compute_us[r][k]
            x(r, "user_annotation", f"ProfilerStep#{first_step + k}", main, t, end - t)
            # profd_client.region("forward"): opened in profd's frame, closed after the mm.
            frame(r, "profd_client/capture.py(249): enter", t + 25, 10)
            enter = (
                f"<built-in method _record_function_enter_new of PyCapsule object at {addr(r, 1)}>"
            )
            frame(r, enter, t + 28, 4)
            x(r, "user_annotation", "forward", main, t + 29, c + 50)
            frame(r, "train.py(30): step", t + 40, c + 20)
            frame(r, f"<built-in method mm of type object at {addr(r, 2)}>", t + 45, c + 10)
            x(r, "cpu_op", "aten::mm", main, t + 50, c)
            b = t + 80 + c
            engine = (
                f"<built-in method run_backward of torch._C._EngineBase object at {addr(r, 3)}>"
            )
            frame(r, engine, b, 180)
            x(r, "cpu_op", "autograd::engine::evaluate_function: MmBackward0", main, b + 10, 150)
            x(r, "cpu_op", "aten::mm", main, b + 20, 120)
            a = arrive[r]
            frame(r, "torch/distributed/distributed_c10d.py(3155): all_reduce", a, done - a)
            x(r, "cpu_op", "c10d::allreduce_", main, a + 5, 20)
            frame(
                r, f"<built-in method wait of Work object at {addr(r, 4)}>", a + 30, done - a - 35
            )
            for tid in (900 + r, 950 + r):
                x(r, "user_annotation", "gloo:all_reduce", tid, a + 40, done - a - 45)
            o = done + 20
            frame(r, "torch/optim/optimizer.py(509): wrapper", o, end + 22 - o)
            x(r, "user_annotation", "Optimizer.step#SGD.step", main, o + 10, 100)
            frame(r, f"<built-in method add_ of Parameter object at {addr(r, 5)}>", o + 20, 60)
            x(r, "cpu_op", "aten::add_", main, o + 30, 40)
            # profd's step hook: an op of its own, zmq, and the step boundary inside it.
            frame(r, "profd_client/api.py(150): _post_step", end - 50, 70)
            frame(r, "profd_client/steps.py(239): _advance", end - 45, 60)
            x(r, "cpu_op", "aten::empty", main, end - 40, 20)
            frame(r, "zmq/sugar/socket.py(638): send", end - 15, 10)
        t = end
    for r in range(ranks):
        first, last = starts[0] - 500, t + 500
        frame(r, "train.py(1): <module>", first - 100, last - first + 200)
        agent = 800 + r
        frame(r, "threading.py(1002): _bootstrap", first, last - first, agent)
        frame(r, "threading.py(1045): _bootstrap_inner", first + 1, last - first - 2, agent)
        frame(r, "profd_client/agent.py(112): run", first + 2, last - first - 4, agent)
        at = first + 10
        while at + 400 < last:
            frame(r, "profd_client/agent.py(121): _loop_once", at, 380, agent)
            frame(r, "zmq/sugar/poll.py(80): poll", at + 5, 300, agent)
            frame(r, "msgpack/__init__.py(30): packb", at + 310, 20, agent)
            at += 400
    return out
