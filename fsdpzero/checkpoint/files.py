"""The on-disk side of an fsdpzero checkpoint: atomic writes, the completion manifest, `latest`, rotation.

Rank 0 finishes a save that every rank has written into <save_dir>/.tmp-<tag>/: it fsyncs the files, writes the
manifest (file names, sizes and CRC-32 checksums) last, renames the directory to <tag>, and only then replaces
`latest` (a temp file, fsync, rename). A crash at any point leaves `latest` naming the previous complete checkpoint. What goes into the
files (DCP tensors, JSON state) is fsdpzero.checkpoint.dcp's business.

Tags are plain names inside the save dir (check_tag): on save, on an explicit load tag, and in `latest` when it is
read, so neither a tag nor a planted `latest` reaches outside the directory or a temp/cache name.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import unicodedata
from pathlib import Path

from fsdpzero.checkpoint.trust import collect_side_checksums, file_crc

MANIFEST = "fsdpzero_complete.json"
FORMAT = "fsdpzero-dcp-1"   # "checksums" was added later, as an optional key: older checkpoints have sizes only
LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"   # DeepSpeed's pointer to a universal checkpoint (checkpoint.load_universal)
RESERVED_TAGS = (LATEST, LATEST_UNIVERSAL, MANIFEST)
HIDDEN_PREFIX = "."   # .tmp-<tag> (a save in progress), .old-<tag> (a re-save), .fsdpzero-<tag> (a converted cache)


def check_tag(tag, what: str = "tag") -> str:
    """`tag` if it is a plain directory name for <save_dir>/<tag>, else ValueError (one line: value and fix).
    A pure function of the tag, so every rank given the same tag decides the same before anything is written."""
    if not isinstance(tag, str):
        raise ValueError(f"{what}={tag!r}: a checkpoint tag is a string such as 'global_step100'")
    problem = None
    if not tag:
        problem = "is empty"
    elif tag != tag.strip():
        problem = "has leading or trailing whitespace"
    elif any(unicodedata.category(c)[0] in "CZ" and c != " " for c in tag):
        problem = "contains a control, format or line-separator character"
    elif "/" in tag or "\\" in tag or os.sep in tag or (os.altsep and os.altsep in tag):
        problem = "contains a path separator"
    elif tag in (".", "..") or tag.startswith(HIDDEN_PREFIX):
        problem = f"starts with {HIDDEN_PREFIX!r} (reserved for temp, old and converted copies)"
    elif tag in RESERVED_TAGS:
        problem = "is a reserved name in the save directory"
    elif len(tag.encode()) > 200:
        problem = "is longer than 200 bytes"
    if problem:
        raise ValueError(f"{what}={tag!r} {problem}: a checkpoint tag must be a plain directory name inside the save "
                         f"directory, e.g. 'global_step100'")
    return tag


def crash_point(name: str) -> None:
    """Fault injection for the crash-safety tests: the ckpt_crash_at knob (FSDPZERO_CKPT_CRASH_AT=<name>, read now)
    kills the process here."""
    from fsdpzero.tuning import current
    if current().ckpt_crash_at == name:
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
    try:
        manifest = read_manifest(path)
    except ValueError as e:
        return [str(e)]
    problems = []
    for name, size in manifest["files"].items():
        f = path / name
        if not f.is_file():
            problems.append(f"{f} is missing")
        elif f.stat().st_size != size:
            problems.append(f"{f} has {f.stat().st_size} bytes, the manifest says {size}")
    return problems


def read_manifest(path: Path) -> dict:
    """The manifest of a complete checkpoint, its shape checked (ValueError naming the file)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files, sums = manifest["files"], manifest.get("checksums", {})
        ok = (isinstance(files, dict) and all(isinstance(v, int) for v in files.values()) and isinstance(sums, dict)
              and all(isinstance(v, str) and k in files for k, v in sums.items()))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path / MANIFEST} is not a valid manifest ({type(e).__name__}: {e})") from None
    if not ok:
        raise ValueError(f"{path / MANIFEST} is not a valid manifest (files must map names to sizes, checksums "
                         f"names to strings)")
    bad = [name for name in files if not name or "/" in name or "\\" in name or name in (".", "..")]
    if bad:
        raise ValueError(f"{path / MANIFEST} lists {bad[0]!r}, which is not a file of {path}")
    return manifest


def finalize_checkpoint(save_dir: Path, tag: str, tmp: Path, save_latest: bool, keep_last: int | None,
                        world: int) -> None:
    """Rank 0, after every rank's files are written: manifest, fsync, rename, `latest`, rotation."""
    sums = collect_side_checksums(tmp)   # DCP's data files, hashed as they were written
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    for name in files:
        fsync_path(tmp / name)
        if name not in sums:             # the small ones: JSON state, RNG states, DCP's index
            sums[name] = file_crc(tmp / name)
    manifest = {"format": FORMAT, "tag": tag, "world_size": world, "saved_at_ns": time.time_ns(), "files": files,
                "checksums": {name: sums[name] for name in files}}
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
        write_atomic(save_dir / LATEST, tag)
    if keep_last:
        _rotate(save_dir, keep_last, protect={tag, read_latest(save_dir)})


def read_latest(save_dir: Path, name: str = LATEST) -> str | None:
    """The tag `latest` (or DeepSpeed's `latest_universal`) names, checked like a tag; a trailing newline is
    tolerated, as hand-written files have."""
    latest = Path(save_dir) / name
    if not latest.is_file():
        return None
    try:
        text = latest.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as e:
        raise ValueError(f"{latest}: cannot be read as a tag ({e})") from None
    text = text[:-1] if text.endswith("\n") else text
    text = text[:-1] if text.endswith("\r") else text
    return check_tag(text, what=f"the tag in {latest}")


def _rotate(save_dir: Path, keep_last: int, protect: set) -> None:
    done = [p for p in save_dir.iterdir() if p.is_dir() and not p.name.startswith(HIDDEN_PREFIX)
            and (p / MANIFEST).is_file()]
    done.sort(key=lambda p: json.loads((p / MANIFEST).read_text()).get("saved_at_ns", 0))
    for p in done[:max(0, len(done) - keep_last)]:
        if p.name not in protect:
            shutil.rmtree(p)


def resolve_tag(load_dir: str | Path, tag: str | None = None) -> Path:
    load_dir = Path(load_dir)
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            raise FileNotFoundError(f"{load_dir / LATEST} does not exist: nothing saved there yet, or pass tag=... "
                                    f"(complete checkpoints: "
                                    f"{sorted(p.parent.name for p in load_dir.glob('*/' + MANIFEST))})")
    tag = check_tag(tag)
    path = load_dir / tag
    aside = load_dir / f".old-{tag}"  # a crash while re-saving this tag left the previous copy here
    if not path.exists() and not path.is_symlink() and aside.is_dir() and not aside.is_symlink() \
            and not checkpoint_problems(aside):
        return aside
    if path.is_symlink():   # a plain name may still be a link to anywhere: the checkpoint must be in the directory
        raise ValueError(f"{path} is a symbolic link (to {os.readlink(path)!r}): a checkpoint is loaded only from a "
                         f"directory inside {load_dir}; copy it there instead of linking")
    return path
