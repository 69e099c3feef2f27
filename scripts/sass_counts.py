"""Static machine-code counts of the CUDA kernels, without a GPU: compiles csrc/opm_launch.cu to an
sm_90a cubin with nvcc, disassembles it with nvdisasm, and prints for each kernel whose name
contains one of the given patterns its instruction count, its most frequent opcodes and the
registers and spills ptxas reports.  With --against REV it also builds the sources of that git
revision and says, per kernel, whether its machine code is byte for byte the same: what a change
that should leave a kernel alone can be checked with before any GPU run (--rename FROM=TO maps a
kernel's name now to its name then, e.g. where a template parameter was added).

nvdisasm is not in every toolkit; the `nvidia-cuda-nvdisasm` wheel carries it
(pip download --no-deps nvidia-cuda-nvdisasm, unzip, nvidia/cu*/bin/nvdisasm); give its path in
$NVDISASM or put it on PATH.  Torch's headers come from the torch that runs this script.

With --loops it also lists each kernel's loops that hold MMAs (a backward branch and the
instructions from its target to it): their size and the opcodes that say what an iteration does
besides its MMAs (barriers, shuffles, conversions, shared, global and local loads, copies), to
compare a loop's work per iteration across changes.

    python scripts/sass_counts.py [--against REV] [--top 12] [--loops] PATTERN ...
    e.g. python scripts/sass_counts.py --against HEAD~1 bwd_side_kernelILi3ELi32 bwd_w_kernel
         python scripts/sass_counts.py --against 8edc17f --rename ELb0EEEvNS=EEEvNS bwd_side_kernel
"""
import argparse
import collections
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import torch.utils.cpp_extension as cpp

ROOT = Path(__file__).resolve().parent.parent
CSRC = "src/flashopm/csrc"


def build_cubin(csrc: Path, out: Path) -> str:
    """nvcc -cubin of opm_launch.cu; returns ptxas's resource report."""
    include = Path(cpp.include_paths()[0])
    nvcc = Path(cpp.CUDA_HOME or "/usr/local/cuda") / "bin" / "nvcc"
    cmd = [str(nvcc), "-std=c++17", "-O3", "-arch=sm_90a", "-cubin", "--resource-usage", "--expt-relaxed-constexpr",
           "-I", str(csrc), "-I", str(include), "-I", str(include / "torch/csrc/api/include"),
           "-o", str(out), str(csrc / "opm_launch.cu")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(done.stderr[-4000:])
    return done.stderr


def text_sections(cubin: Path) -> dict[str, bytes]:
    """Each kernel's machine code: the ELF sections .text.<mangled name>."""
    data = cubin.read_bytes()
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    entsize, count, strndx = struct.unpack_from("<HHH", data, 0x3A)
    header = lambda i: struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * entsize)  # noqa: E731
    names_at = header(strndx)[4]
    out = {}
    for i in range(count):
        name_off, _, _, _, off, size, *_ = header(i)
        name = data[names_at + name_off:data.index(b"\0", names_at + name_off)].decode()
        if name.startswith(".text."):
            out[name[len(".text."):]] = data[off:off + size]
    return out


def opcode_counts(nvdisasm: str, cubin: Path) -> dict[str, collections.Counter]:
    listing = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    counts, current = {}, None
    for line in listing.splitlines():
        if line.startswith(".text."):
            current = counts.setdefault(line[len(".text."):].rstrip(":"), collections.Counter())
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)", line)
        if m and current is not None:
            current[m.group(1)] += 1
    return counts


LOOP_OPCODES = ("HGMMA", "HMMA", "BAR", "SHFL", "F2FP", "FMNMX", "FFMA", "LDS", "LDG", "LDL", "STL", "LDGSTS")


def mma_loops(nvdisasm: str, cubin: Path) -> dict[str, list[collections.Counter]]:
    """Kernel -> its loops that hold MMAs, innermost first as they appear: opcode counts of the
    instructions from a backward branch's target label to the branch ("instructions": all)."""
    listing = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    out, kernel, ops, labels = {}, None, [], {}

    def close():
        if kernel is None:
            return
        loops = []
        for i, (op, target) in enumerate(ops):
            if op == "BRA" and labels.get(target, i + 1) <= i:
                body = collections.Counter(o for o, _ in ops[labels[target]:i + 1])
                if body["HGMMA"] or body["HMMA"]:
                    body["instructions"] = i + 1 - labels[target]
                    loops.append(body)
        out[kernel] = loops

    for line in listing.splitlines():
        if line.startswith(".text."):
            close()
            kernel, ops, labels = line[len(".text."):].rstrip(":"), [], {}
            continue
        m = re.match(r"^\.(L_x_\d+):", line.strip())
        if m:
            labels[m.group(1)] = len(ops)
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)(\.\S+)?(.*)", line)
        if m:
            target = re.search(r"\(\.(L_x_\d+)\)", m.group(3))
            ops.append((m.group(1), target.group(1) if target else None))
    close()
    return out


def resources(report: str) -> dict[str, str]:
    """Kernel -> 'R registers, S bytes spilled' from ptxas's -v lines."""
    out, name = {}, None
    for line in report.splitlines():
        m = re.search(r"Function properties for (\S+)", line) or re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and name:
            out[name] = f"{m.group(1)} B spilled"
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            out[name] = f"{m.group(1)} registers, " + out.get(name, "")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("patterns", nargs="+")
    parser.add_argument("--against", help="a git revision whose kernels to compare byte for byte")
    parser.add_argument("--rename", action="append", default=[], metavar="FROM=TO",
                        help="replace FROM by TO in a kernel's name to find it in --against's build")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--loops", action="store_true", help="each kernel's loops that hold MMAs (needs nvdisasm)")
    args = parser.parse_args()
    nvdisasm = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        report = build_cubin(ROOT / CSRC, tmp / "now.cubin")
        now = text_sections(tmp / "now.cubin")
        old, old_res = {}, {}
        if args.against:
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.against, CSRC], capture_output=True,
                                     check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
            old_res = resources(build_cubin(tmp / CSRC, tmp / "then.cubin"))
            old = text_sections(tmp / "then.cubin")
        counts = opcode_counts(nvdisasm, tmp / "now.cubin") if nvdisasm else {}
        loops = mma_loops(nvdisasm, tmp / "now.cubin") if nvdisasm and args.loops else {}
        res = resources(report)
        for name in sorted(now):
            if not any(p in name for p in args.patterns):
                continue
            line = f"{name}: {len(now[name]) // 16} instructions; {res.get(name, '')}"
            if args.against:
                then = name
                for rule in args.rename:
                    then = then.replace(*rule.split("=", 1))
                if old.get(then) == now[name]:
                    line += "; same as " + args.against
                elif then in old:
                    line += (f"; CHANGED from {args.against} ({len(old[then]) // 16} instructions; "
                             f"{old_res.get(then, '')})")
                else:
                    line += "; new since " + args.against
            print(line)
            if name in counts:
                print("   ", "  ".join(f"{op} {n}" for op, n in counts[name].most_common(args.top)))
            for body in loops.get(name, []):
                print("    loop:", body["instructions"], "instructions,",
                      "  ".join(f"{op} {body[op]}" for op in LOOP_OPCODES if body[op]))
        if not nvdisasm:
            print("(no nvdisasm: opcode counts left out; see the docstring)")


if __name__ == "__main__":
    main()
