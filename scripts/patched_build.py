"""Instrumented builds for the measurement scripts: edits to the extension's sources at anchor
lines, and a build of the edited copy (its own csrc directory, so that the package's stays as it
is; the cache directory is the caller's, set before flashopm is imported)."""
import pathlib
import tempfile

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
