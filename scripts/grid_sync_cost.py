"""What a grid-wide barrier costs on this GPU: a kernel of `blocks` blocks of 512 threads (one per
SM) that does `iters` cooperative-groups grid syncs, launched cooperatively or not (0 syncs), timed
per launch from CUDA-graph replay.

    python scripts/grid_sync_cost.py [blocks]
"""
import sys

import torch
from torch.utils.cpp_extension import load_inline

CUDA_SRC = r"""
#include <cooperative_groups.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

__global__ void __launch_bounds__(512, 1) syncs(int iters, int* out) {
  auto grid = cooperative_groups::this_grid();
  for (int i = 0; i < iters; ++i) grid.sync();
  if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = iters;
}

void run(int64_t blocks, int64_t iters, bool cooperative, torch::Tensor out) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(blocks));
  cfg.blockDim = dim3(512);
  cfg.stream = c10::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = cooperative ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  TORCH_CHECK(cudaLaunchKernelEx(&cfg, syncs, int(iters), out.data_ptr<int>()) == cudaSuccess, "launch failed");
}
"""


def main(args):
    blocks = int(args[0]) if args else 128
    ext = load_inline("grid_sync_cost", cpp_sources="void run(int64_t, int64_t, bool, torch::Tensor);",
                      cuda_sources=CUDA_SRC, functions=["run"], extra_cuda_cflags=["-O3"])
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  blocks {blocks}")
    for cooperative, iters in [(False, 0), (True, 0), (True, 1), (True, 10)]:
        call = lambda: ext.run(blocks, iters, cooperative, out)  # noqa: E731
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(100):
                call()
        g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            g.replay()
        end.record()
        end.synchronize()
        print(f"cooperative {cooperative!s:5s} syncs {iters:2d}: {start.elapsed_time(end) * 1e3 / 500:7.2f} us per launch")


if __name__ == "__main__":
    main(sys.argv[1:])
