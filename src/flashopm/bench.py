"""Timing and memory measurement on the GPU, shared by the benchmark CLI and the tests."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    n: int

    def __str__(self) -> str:
        return f"{self.median_us:9.1f} us [{self.p10_us:.1f}, {self.p90_us:.1f}]"


def _quantiles(samples: list[float]) -> Timing:
    s = sorted(samples)
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]  # noqa: E731
    return Timing(statistics.median(s), q(0.1), q(0.9), len(s))


class L2Flusher:
    """Writes a buffer larger than the L2 cache, so that each timed call starts cold."""

    def __init__(self, device=None):
        props = torch.cuda.get_device_properties(device)
        size = max(2 * int(getattr(props, "L2_cache_size", 64 << 20)), 64 << 20)
        self.buf = torch.empty(size // 4, dtype=torch.float32, device=device)

    def __call__(self):
        self.buf.fill_(1.0)


def warm_gpu(seconds: float = 0.3) -> None:
    """Keeps the GPU busy for a while so that its clocks have ramped up before timing starts."""
    import time

    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


class _CallTimer:
    """One call's wall time in µs the way KernelBench measures it: CUDA events around the call, after
    an L2 flush (if asked) and a synchronize."""

    def __init__(self, flush_l2: bool):
        self.flusher = L2Flusher() if flush_l2 else None
        self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.flusher is not None:
            self.flusher()
        torch.cuda.synchronize()
        self.start.record()
        fn()
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) * 1e3


def time_wall(fn: Callable[[], object], n: int = 100, warmup: int = 10, flush_l2: bool = True) -> Timing:
    """Wall time per call the way KernelBench measures it: CUDA events around each call, with a
    synchronize (and an L2 flush) between calls.  Median and 10th/90th percentiles in µs."""
    timer = _CallTimer(flush_l2)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return _quantiles([timer(fn) for _ in range(n)])


def paired_speedup(base: Callable[[], object], fn: Callable[[], object], n: int = 100, warmup: int = 3,
                   flush_l2: bool = True) -> float:
    """Median over n rounds of base's wall time / fn's, the two timed as `time_wall` times a call,
    back to back in each round and in alternating order: a drift of the host's speed (which sets
    the wall time of short calls) lands on both sides of each ratio instead of on one block of
    calls."""
    timer = _CallTimer(flush_l2)
    for _ in range(warmup):
        base()
        fn()
    ratios = []
    for k in range(n):
        if k % 2 == 0:
            b = timer(base)
            t = timer(fn)
        else:
            t = timer(fn)
            b = timer(base)
        ratios.append(b / t)
    return statistics.median(ratios)


def time_graph(fn: Callable[[], object], n: int = 100, warmup: int = 3, repeats: int = 5) -> Timing | None:
    """GPU time per call from CUDA-graph replay (launch gaps and host time removed): a graph of
    `n` calls is replayed `repeats` times; per-call time of each replay.  None if not capturable."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                fn()
    except RuntimeError:
        torch.cuda.synchronize()
        return None
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / n)
    del g
    return _quantiles(samples)


def time_graph_amortised(fn: Callable[[], object], replay_us: float = 2000.0, max_calls: int = 400,
                         ) -> tuple[Timing | None, int]:
    """GPU time per call from graphs long enough that the graph's own launch stays out of it:
    a graph of 20 calls first, then, where one replay of it takes under `replay_us`, a graph of
    enough calls (at most `max_calls`) to take about that long.  A replay's launch costs a few
    microseconds once per graph, i.e. 0.1-0.4 us per call at 20 calls of 10 us each.  Returns the
    timing and the number of calls per graph."""
    first = time_graph(fn, n=20)
    if first is None or first.median_us * 20 >= replay_us:
        return first, 20
    n = min(max_calls, max(20, math.ceil(replay_us / max(first.median_us, 1e-3))))
    longer = time_graph(fn, n=n)
    return (longer, n) if longer is not None else (first, 20)


def peak_extra_bytes(fn: Callable[[], object]) -> tuple[int, object]:
    """Peak memory allocated during fn() above what was allocated before it (the result included)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, out


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc)


def gemm_tflops(dtype: torch.dtype, n: int = 8192, tf32: bool = False) -> float:
    """The GPU's GEMM rate for `dtype` through PyTorch (cuBLAS), measured now: the ceiling."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        t = time_wall(lambda: a @ b, n=10, warmup=3, flush_l2=False)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return 2 * n**3 / (t.median_us * 1e-6) / 1e12
