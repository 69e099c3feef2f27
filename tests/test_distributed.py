"""The residue-sharded OPM on the CPU with the gloo backend, 2 and 3 processes, uneven shards:
outputs and gradients equal the unsharded op's on the gathered inputs, for every normalisation;
on 2-4 GPUs with NCCL (the fused kernel on each rank's rows) where a machine has them."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashopm
from flashopm.distributed import ShardedOuterProductMean, shard_bounds, sharded_outer_product_mean
from flashopm.testing import PARAM_ORDER, Shape, free_port, make_problem


def _check_against_unsharded(results, shape, normalization, world, **tol):
    """Each rank's rows and gradients (parameters summed over ranks) against the unsharded op on
    the gathered inputs, in float64; `tol` loosens the comparison for float32 ranks."""
    x, m, p = make_problem(shape, "masked_positions", seed=3)
    x = x.double().requires_grad_()
    p = {k: v.double().requires_grad_() for k, v in p.items()}
    expect = flashopm.outer_product_mean(x, m.double(), *(p[k] for k in PARAM_ORDER), normalization=normalization)
    g = torch.randn(shape.B, shape.N, shape.N, shape.D, generator=torch.Generator().manual_seed(5)).double()
    (expect * g).sum().backward()
    for rank, (n0, n1) in enumerate(shard_bounds(shape.N, world)):
        out, grad_x, grads = results[rank]
        torch.testing.assert_close(out.double(), expect[:, n0:n1].detach(), **tol.get("out", {}))
        torch.testing.assert_close(grad_x.double(), x.grad[:, :, n0:n1], **tol.get("out", {}))
        for k in PARAM_ORDER:
            torch.testing.assert_close(grads[k].double(), p[k].grad, msg=k, **tol.get("params", {}))


def _worker(rank, world, port, shape, normalization, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        x, m, p = make_problem(shape, "masked_positions", seed=3)
        x, p = x.double(), {k: v.double() for k, v in p.items()}
        m = m.double()
        n0, n1 = shard_bounds(shape.N, world)[rank]
        leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
        x_local = x[:, :, n0:n1].clone().requires_grad_()
        out = sharded_outer_product_mean(x_local, m[:, :, n0:n1], *(leaves[k] for k in PARAM_ORDER),
                                         normalization=normalization)
        g = torch.randn(shape.B, shape.N, shape.N, shape.D, generator=torch.Generator().manual_seed(5)).double()
        (out * g[:, n0:n1]).sum().backward()
        grads = {k: v.grad.clone() for k, v in leaves.items()}
        for t in grads.values():  # parameters are replicated: their gradient is the sum over ranks
            dist.all_reduce(t)
        results[rank] = (out.detach(), x_local.grad.detach(), grads)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("normalization", ["row", "openfold", "boltz"])
def test_sharded_matches_unsharded(world, normalization):
    shape = Shape(2, 3, 8, 6, 3, 4)
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(world, free_port(), shape, normalization, results), nprocs=world, join=True)
    _check_against_unsharded(results, shape, normalization, world)


def _module_worker(rank, world, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        mods = [flashopm.ModelNew(6, 4, 3), flashopm.OpenFoldOuterProductMean(6, 4, 3),
                flashopm.BoltzOuterProductMean(6, 3, 4)]
        for mod in mods:
            with torch.no_grad():
                for q in mod.parameters():
                    q.normal_(0.0, 0.4)
        x = torch.randn(1, 3, 7, 6, generator=torch.Generator().manual_seed(1))
        m = (torch.rand(1, 3, 7, generator=torch.Generator().manual_seed(2)) > 0.3).float()
        n0, n1 = shard_bounds(7, world)[rank]
        results[rank] = [ShardedOuterProductMean(mod)(x[:, :, n0:n1], m[:, :, n0:n1]).detach() for mod in mods]
    finally:
        dist.destroy_process_group()


def test_module_wrapper_matches_each_module():
    world = 2
    results = mp.Manager().dict()
    mp.spawn(_module_worker, args=(world, free_port(), results), nprocs=world, join=True)
    torch.manual_seed(0)
    mods = [flashopm.ModelNew(6, 4, 3), flashopm.OpenFoldOuterProductMean(6, 4, 3), flashopm.BoltzOuterProductMean(6, 3, 4)]
    for mod in mods:
        with torch.no_grad():
            for q in mod.parameters():
                q.normal_(0.0, 0.4)
    x = torch.randn(1, 3, 7, 6, generator=torch.Generator().manual_seed(1))
    m = (torch.rand(1, 3, 7, generator=torch.Generator().manual_seed(2)) > 0.3).float()
    for k, mod in enumerate(mods):
        full = mod(x, m)
        got = torch.cat([results[r][k] for r in range(world)], dim=1)
        torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)


def test_sharded_benchmark_runs_on_gloo():
    """The multi-process benchmark's code path, on CPU processes (the GPU runs use NCCL)."""
    from flashopm.bench_sharded import cases_for, run, table

    rows = run(cases_for([1, 2], [12], S=3, C=8, H=4, D=4), backend="gloo", calls=1)
    assert [(r["mode"], r["world"], r["N"]) for r in rows] == [
        ("strong", 1, 12), ("weak", 1, 12), ("strong", 2, 12), ("weak", 2, 16)]  # 12·sqrt(2), a multiple of 2
    for r in rows:
        assert r["status"] == "ok" and r["time_ms"] > 0 and r["comm_ms"] > 0 and r["efficiency"] > 0
    assert "strong" in table(rows)


def _nccl_worker(rank, world, port, shape, normalization, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        x, m, p = make_problem(shape, "masked_positions", seed=3)
        dev = torch.device("cuda", rank)
        leaves = {k: v.to(dev).requires_grad_() for k, v in p.items()}
        n0, n1 = shard_bounds(shape.N, world)[rank]
        x_local = x[:, :, n0:n1].to(dev).requires_grad_()
        out = sharded_outer_product_mean(x_local, m[:, :, n0:n1].to(dev), *(leaves[k] for k in PARAM_ORDER),
                                         normalization=normalization)
        g = torch.randn(shape.B, shape.N, shape.N, shape.D, generator=torch.Generator().manual_seed(5)).to(dev)
        (out * g[:, n0:n1]).sum().backward()
        grads = {k: v.grad.clone() for k, v in leaves.items()}
        for t in grads.values():
            dist.all_reduce(t)
        results[rank] = (out.detach().cpu(), x_local.grad.detach().cpu(), {k: v.cpu() for k, v in grads.items()})
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("normalization", ["row", "openfold"])
def test_sharded_matches_unsharded_on_gpus_with_nccl(normalization):
    """On several GPUs: the fused kernel on each rank's rows, NCCL gathers, float32."""
    world = min(torch.cuda.device_count(), 4)
    shape = Shape(1, 16, 37, 24, 8, 16)
    flashopm.load()
    results = mp.Manager().dict()
    mp.spawn(_nccl_worker, args=(world, free_port(), shape, normalization, results), nprocs=world, join=True)
    _check_against_unsharded(results, shape, normalization, world, out=dict(atol=1e-4, rtol=1e-4),
                             params=dict(atol=1e-3, rtol=1e-4))
