"""The on-disk side of an fsdpzero checkpoint: atomic writes, the completion manifest, `latest`, rotation.

Rank 0 finishes a save that every rank has written into <save_dir>/.tmp-<tag>/: it fsyncs the files, writes the
manifest (file names and sizes) last, renames the directory to <tag>, and only then replaces `latest` (a temp file,
fsync, rename). A crash at any point leaves `latest` naming the previous complete checkpoint. What goes into the
files (DCP tensors, JSON state) is fsdpzero.checkpoint.dcp's business.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

MANIFEST = "fsdpzero_complete.json"
FORMAT = "fsdpzero-dcp-1"


def crash_point(name: str) -> None:
    """Fault injection for the crash-safety tests: FSDPZERO_CKPT_CRASH_AT=<name> kills the process here."""
    if os.environ.get("FSDPZERO_CKPT_CRASH_AT") == name:
        os._exit(17)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def checkpoint_problems(path: str | Path) -> list[str]:
    """What makes <path> not a complete fsdpzero checkpoint (empty list: complete)."""
    path = Path(path)
    if not path.is_dir():
        return [f"{path} does not exist"]
    if not (path / MANIFEST).is_file():
        return [f"{path / MANIFEST} is missing: the save did not finish"]
    manifest = json.loads((path / MANIFEST).read_text())
    problems = []
    for name, size in manifest["files"].items():
        f = path / name
        if not f.is_file():
            problems.append(f"{f} is missing")
        elif f.stat().st_size != size:
            problems.append(f"{f} has {f.stat().st_size} bytes, the manifest says {size}")
    return problems


def finalize_checkpoint(save_dir: Path, tag: str, tmp: Path, save_latest: bool, keep_last: int | None,
                        world: int) -> None:
    """Rank 0, after every rank's files are written: manifest, fsync, rename, `latest`, rotation."""
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    for name in files:
        fsync_path(tmp / name)
    manifest = {"format": FORMAT, "tag": tag, "world_size": world, "saved_at_ns": time.time_ns(), "files": files}
    write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1))
    crash_point("before_rename")
    final = save_dir / tag
    if final.exists():  # re-saving a tag: move the old one aside first, so a crash leaves one of the two
        old = save_dir / f".old-{tag}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    fsync_path(save_dir)
    crash_point("before_latest")
    if save_latest:
        write_atomic(save_dir / "latest", tag)
    if keep_last:
        _rotate(save_dir, keep_last, protect={tag, read_latest(save_dir)})


def read_latest(save_dir: Path) -> str | None:
    latest = save_dir / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def _rotate(save_dir: Path, keep_last: int, protect: set) -> None:
    done = [p for p in save_dir.iterdir() if p.is_dir() and (p / MANIFEST).is_file()]
    done.sort(key=lambda p: json.loads((p / MANIFEST).read_text())["saved_at_ns"])
    for p in done[:max(0, len(done) - keep_last)]:
        if p.name not in protect:
            shutil.rmtree(p)


def resolve_tag(load_dir: str | Path, tag: str | None = None) -> Path:
    load_dir = Path(load_dir)
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            raise FileNotFoundError(f"{load_dir / 'latest'} does not exist: nothing saved there yet, or pass tag=... "
                                    f"(complete checkpoints: "
                                    f"{sorted(p.parent.name for p in load_dir.glob('*/' + MANIFEST))})")
    path = load_dir / str(tag)
    aside = load_dir / f".old-{tag}"  # a crash while re-saving this tag left the previous copy here
    if not path.exists() and aside.is_dir() and not checkpoint_problems(aside):
        return aside
    return path
