"""Every test file with a `gpu`-marked test is in a chunk of tests/gpu_chunks.py, so running every chunk runs the
whole `pytest -m gpu` suite (a GPU test outside every chunk would never run in the device calls)."""
from __future__ import annotations

import re
from pathlib import Path

from tests.gpu_chunks import CHUNKS

ROOT = Path(__file__).resolve().parents[2]
GPU_MARK = re.compile(r"pytest\.mark\.gpu\b")


def test_every_gpu_test_file_is_in_a_chunk():
    chunked = {p for c in CHUNKS for p in c.paths}
    marked = {str(f.relative_to(ROOT)) for f in (ROOT / "tests").rglob("test_*.py")
              if GPU_MARK.search(f.read_text(encoding="utf-8"))}
    missing = sorted(p for p in marked if not any(p == c or p.startswith(c.rstrip("/") + "/") for c in chunked))
    assert not missing, f"gpu-marked tests in no chunk of tests/gpu_chunks.py: {missing}"
