"""Scaling of the residue-sharded OPM (`flashopm.distributed`) over processes: one GPU per process
with NCCL, or CPU processes with gloo (a dry run of the same code).

Strong scaling keeps N and splits its residues over P processes; weak scaling keeps the work per
process constant (the output rows per process times N, i.e. N grows as sqrt(P)).  Per case: wall
time of one sharded forward (the slowest rank, synchronised), the time of its all-gathers alone
(communication), peak memory per process, and the parallel efficiency against P = 1.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .testing import free_port


@dataclass
class ShardedCase:
    mode: str  # "strong" or "weak"
    world: int
    N: int
    S: int
    C: int
    H: int
    D: int
    base_n: int  # N of this series at world size 1


def cases_for(worlds: list[int], sizes: list[int], S: int, C: int, H: int, D: int) -> list[ShardedCase]:
    """Strong scaling at every N, and weak scaling from every N (N_P = N sqrt(P), a multiple of P)."""
    cases = []
    for N in sizes:
        for P in worlds:
            cases.append(ShardedCase("strong", P, N, S, C, H, D, N))
        for P in worlds:
            n_p = max(P, int(round(N * math.sqrt(P) / P)) * P)
            cases.append(ShardedCase("weak", P, n_p, S, C, H, D, N))
    return cases


def _max_over_ranks(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timed(fn, device, calls: int) -> float:
    """Median over `calls` of the slowest rank's wall time of fn(), in ms (ranks start together)."""
    samples = []
    for _ in range(calls):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(_max_over_ranks((time.perf_counter() - t0) * 1e3, device))
    samples.sort()
    return samples[len(samples) // 2]


def _worker(rank: int, world: int, port: int, backend: str, cases: list[ShardedCase], calls: int, out) -> None:
    from . import reference
    from .distributed import _gather_along_residues, shard_bounds, sharded_outer_product_mean
    from .testing import Shape, make_params

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # CPU processes share the machine's cores
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        for case in cases:
            bounds = shard_bounds(case.N, world)
            n0, n1 = bounds[rank]
            g = torch.Generator().manual_seed(1000 + rank)
            p = make_params(Shape(1, case.S, case.N, case.C, case.H, case.D), torch.Generator().manual_seed(0))
            p = {k: v.to(device) for k, v in p.items()}
            x = torch.randn(1, case.S, n1 - n0, case.C, generator=g).to(device)
            m = (torch.rand(1, case.S, n1 - n0, generator=g) > 0.1).float().to(device)
            args = (x, m, p["ln_weight"], p["ln_bias"], p["w_a"], p["b_a"], p["w_b"], p["b_b"], p["w_out"], p["b_out"])
            sizes = [e - s for s, e in bounds]
            with torch.no_grad():
                sharded_outer_product_mean(*args)  # warm-up (and the build on the first CUDA call)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                total = _timed(lambda: sharded_outer_product_mean(*args), device, calls)
                peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
                _, b = reference.masked_projections(x, m, *args[2:8])

                def gathers():
                    _gather_along_residues(b, None, sizes)
                    _gather_along_residues(m, None, sizes)

                comm = _timed(gathers, device, calls)
            peak = _max_over_ranks(peak, device)
            if rank == 0:
                out.append({**asdict(case), "backend": backend, "time_ms": total, "comm_ms": comm,
                            "comm_share": comm / total if total > 0 else float("nan"), "peak_gib_per_rank": peak})
            del x, m, args, b, p
            if device.type == "cuda":
                torch.cuda.empty_cache()
        dist.barrier()  # every rank done before any tears its connections down
    finally:
        dist.destroy_process_group()
    # Everything is measured and sent: leave without the interpreter's teardown, where the
    # communication library's threads can abort the process at exit (seen with gloo, rarely).
    os._exit(0)


def run(cases: list[ShardedCase], backend: str = "nccl", calls: int = 3) -> list[dict]:
    """Runs every case (grouped by world size, one group of processes each); returns one row per
    case with the parallel efficiency against the world size 1 row of the same mode and N."""
    if backend == "nccl":
        from . import _build

        available = torch.cuda.device_count()
        if available:
            _build.load()  # once, before the processes start
    else:
        available = os.cpu_count() or 1
    rows: list[dict] = []
    for world in sorted({c.world for c in cases}):
        group = [c for c in cases if c.world == world]
        if world > available:
            rows += [{**asdict(c), "backend": backend, "status": f"needs {world} devices, {available} here"}
                     for c in group]
            continue
        with mp.Manager() as manager:
            out = manager.list()
            mp.spawn(_worker, args=(world, free_port(), backend, group, calls, out), nprocs=world, join=True)
            rows += [dict(r, status="ok") for r in out]
    base = {(r["mode"], r["base_n"]): r["time_ms"] for r in rows if r["world"] == 1 and r["status"] == "ok"}
    for r in rows:
        t1 = base.get((r["mode"], r["base_n"]))
        if r["status"] == "ok" and t1 is not None:
            # strong: the same work split P ways; weak: the same work per process
            r["efficiency"] = t1 / (r["world"] * r["time_ms"]) if r["mode"] == "strong" else t1 / r["time_ms"]
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'mode':6s} {'P':>2s} {'N':>6s} {'S':>5s} {'time ms':>10s} {'comm ms':>9s} {'comm':>5s} "
            f"{'GiB/rank':>8s} {'eff':>5s}")
    lines = [head]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['mode']:6s} {r['world']:2d} {r['N']:6d} {r['S']:5d} {r['status']}")
            continue
        eff = f"{r['efficiency']:5.2f}" if "efficiency" in r else f"{'-':>5s}"
        lines.append(f"{r['mode']:6s} {r['world']:2d} {r['N']:6d} {r['S']:5d} {r['time_ms']:10.1f} "
                     f"{r['comm_ms']:9.1f} {r['comm_share']:5.0%} {r['peak_gib_per_rank']:8.2f} {eff}")
    return "\n".join(lines)
