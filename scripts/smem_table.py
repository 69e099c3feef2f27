"""Shared memory per block that the kernels' layouts take (opm_params.h), next to what GPUs allow,
without a GPU: compiles a small host program over the layout functions with the C++ compiler.

    python scripts/smem_table.py [--hidden 32 64 ...]

Prints, per hidden size and column tile (Tj halved from the full tile), the float32 tensor-core
kernel's mma.sync form (full stages and W chunks; half stages; half W chunks; both halved) and
wgmma forms, and the 16-bit kernel's mma.sync form (full and half stages); then, where the
tile's columns fit in it, both kernels with phase 1 half as wide (16-bit: full and half stages;
float32 as above); first the fixed sizes (the CUDA-core kernel, the backward's kernels).  Opt-in limits: sm_90 and sm_100 232448 bytes,
A100 166912, sm_86, sm_89 and sm_120 101376.
"""
import argparse
import os
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = r"""
#include "opm_params.h"
#include <cstdio>
#include <cstdlib>
using namespace flashopm;
int main(int argc, char** argv) {
  printf("CUDA-core kernel %d; backward side %d, W %d (mma.sync), %d, %d (float16 split)\n", kOuterSmemBytes,
         int(kBwSideSmemFloats * 4), int(kBwWSmemFloats * 4), kBsfSmemBytes, kBwfOverlapSmemBytes);
  for (int k = 1; k < argc; ++k) {
    const int H = std::atoi(argv[k]), Ti = kOuterMT / H;
    for (int tj = kOuterNT / H;; tj = (tj + 1) / 2) {
      printf("H %2d Ti %2d Tj %2d  float32 mma.sync %6d %6d %6d %6d  wgmma %6d  16-bit mma.sync %6d %6d", H, Ti, tj,
             tc_layout(H, Ti, tj, false).total * 4, tc_layout(H, Ti, tj, false, false, kTcBKSmall).total * 4,
             tc_layout(H, Ti, tj, false, false, kTcBK, kTcKCSmall).total * 4,
             tc_layout(H, Ti, tj, false, false, kTcBKSmall, kTcKCSmall).total * 4, tc_layout(H, Ti, tj, true).total * 4,
             tc16_layout(H, Ti, tj, kT16MmaSync).total, tc16_layout(H, Ti, tj, kT16MmaSyncHalfStages).total);
      if (tj * H <= kT16NTNarrow)
        printf(" narrow %6d %6d; float32 narrow %6d %6d %6d %6d", tc16_layout(H, Ti, tj, kT16MmaSyncNarrow).total,
               tc16_layout(H, Ti, tj, kT16MmaSyncNarrowHalfStages).total,
               tc_layout(H, Ti, tj, false, false, kTcBK, kTcKC, kTcNTNarrow).total * 4,
               tc_layout(H, Ti, tj, false, false, kTcBKSmall, kTcKC, kTcNTNarrow).total * 4,
               tc_layout(H, Ti, tj, false, false, kTcBK, kTcKCSmall, kTcNTNarrow).total * 4,
               tc_layout(H, Ti, tj, false, false, kTcBKSmall, kTcKCSmall, kTcNTNarrow).total * 4);
      printf("\n");
      if (tj == 1) break;
    }
  }
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="+", default=[8, 16, 32, 64])
    args = parser.parse_args()
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp, "smem.cpp"), Path(tmp, "smem")
        src.write_text(PROGRAM)
        subprocess.run(["g++", "-std=c++17", "-I", str(ROOT / "src/flashopm/csrc"), "-I", f"{cuda_home}/include",
                        str(src), "-o", str(exe)], check=True)
        subprocess.run([str(exe), *map(str, args.hidden)], check=True)


if __name__ == "__main__":
    main()
