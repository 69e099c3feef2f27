"""Shared parts of the measurement scripts that time instrumented builds: edits to the extension's
sources at anchor lines, a build of the edited copy (its own csrc directory, so that the
package's stays as it is; the cache directory is the caller's, set before flashopm is imported),
and the problem they time."""
import pathlib
import sys
import tempfile

import torch

import flashopm
from flashopm import _build


def patch(text, anchor, add, before=False):
    """`text` with `add` inserted after (or before) the first `anchor`, which must be there."""
    assert anchor in text, anchor
    return text.replace(anchor, add + anchor if before else anchor + add, 1)


def load_patched(sources):
    """Builds and loads the extension from `sources` (name -> text, as _build.read_sources gives)."""
    patched_dir = pathlib.Path(tempfile.mkdtemp(prefix="flashopm-csrc-"))
    for name, text in sources.items():
        (patched_dir / name).write_text(text)
    _build.CSRC_DIR = patched_dir
    return _build.load()


def problem_from_argv():
    """(shape, ModelNew, x, mask) on the GPU for the shape B,S,N,C,H,D in sys.argv[1] (default: the
    specification's), seeded; the mask has zeros."""
    shape = tuple(int(v) for v in sys.argv[1].split(",")) if len(sys.argv) > 1 else (2, 8, 32, 64, 32, 64)
    B, S, N, C, H, D = shape
    torch.manual_seed(0)
    model = flashopm.ModelNew(C, D, H).cuda()
    x = torch.randn(B, S, N, C, device="cuda")
    m = (torch.rand(B, S, N, device="cuda") > 0.2).float()
    return shape, model, x, m
