"""The on-disk side of an fsdpzero checkpoint: atomic writes, the completion manifest, `latest`, rotation.

Every rank of a save writes into the save's own temp dir, <save_dir>/.tmp-<tag>.<token> (SaveSlot). Rank 0 then
fsyncs the files and, under the save directory's lock (.fsdpzero.lock, flock), checks that <tag> still holds what it
held when the save began (else another job committed it meanwhile: this save loses, cleanly), writes the manifest
(file names, sizes and CRC-32 checksums) last, renames the directory to <tag> (or moves its files into a <tag>/
directory that holds files of the user's, leaving those alone), and only then replaces `latest` (a temp file, fsync,
rename). A crash at any point leaves `latest` naming the previous complete checkpoint. What goes into the files (DCP
tensors, JSON state) is fsdpzero.checkpoint.dcp's business.

Tags are plain names inside the save dir (check_tag): on save, on an explicit load tag, and in `latest` when it is
read, so neither a tag nor a planted `latest` reaches outside the directory or a temp/cache name.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import time
import unicodedata
from pathlib import Path

from fsdpzero.checkpoint.trust import collect_side_checksums, file_crc

MANIFEST = "fsdpzero_complete.json"
FORMAT = "fsdpzero-dcp-1"   # "checksums" was added later, as an optional key: older checkpoints have sizes only
LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"   # DeepSpeed's pointer to a universal checkpoint (checkpoint.load_universal)
RESERVED_TAGS = (LATEST, LATEST_UNIVERSAL, MANIFEST)
HIDDEN_PREFIX = "."   # .tmp-<tag>.<token> (a save in progress), .old-<tag> (a re-save), .del-<tag> (a removal),
#                       .fsdpzero-<tag> (a converted DeepSpeed copy), .fsdpzero.lock (the save directory's lock)
TMP_PREFIX, OLD_PREFIX, DEL_PREFIX = ".tmp-", ".old-", ".del-"   # .del-<tag>: a checkpoint keep_last is removing
LOCK_FILE = ".fsdpzero.lock"
INCOMING = ".fsdpzero-incoming.json"   # in a <tag>/ of the user's while a commit moves files in: their names


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


def crash_point(name: str, crash_at: str | None) -> None:
    """Fault injection for the crash-safety tests: a save whose settings say ckpt_crash_at=<name>
    (FSDPZERO_CKPT_CRASH_AT, read into the save's settings when the save starts) kills the process here.
    Tests replace this function to pause a save at its points (tests/checkpoint/test_checkpoint_concurrency.py)."""
    if crash_at == name:
        os._exit(17)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """path <- text: a temp file beside it, fsync, rename; the temp file is removed if any step fails (a full disk)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
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


def checkpoint_identity(path: Path) -> tuple | None:
    """Which checkpoint <path> is now: its directory's (st_dev, st_ino) and its manifest's sha256 (each save's
    manifest is unique). A re-save of the tag either renames a new directory into place or replaces the files
    in it, manifest last: either changes this. None where there is no directory or manifest to identify."""
    try:
        st = os.stat(path)
        digest = hashlib.sha256((Path(path) / MANIFEST).read_bytes()).hexdigest()
    except OSError:
        return None
    return st.st_dev, st.st_ino, digest


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


# ---- a save's place in the directory: its own temp dir, the lock, the commit ----------------------------------------

class SaveRefused(Exception):
    """A save that must not go on: <save_dir>/<tag> is something fsdpzero did not write, or another save changed it
    while this one was writing. The message is one line, and nothing of the user's was touched."""


class LatestNotUpdated(Exception):
    """The checkpoint was committed (complete, loadable by its tag), but `latest` could not be replaced."""


# the files a save puts into <tag>/ (DCP names its data __<rank>_<n>.distcp); any of them in a <tag>/ directory that
# no manifest lists belongs to someone else, and a save of that tag would replace it
_SAVE_NAMES = re.compile(r"\.metadata|state\.json|client_state\.json|fsdpzero_complete\.json|__\d+_\d+\.distcp"
                         r"|rng_\d+\.safetensors")


def _tag_dir_state(final: Path) -> tuple[str | None, dict | None]:
    """What <save_dir>/<tag> is as a save finds it: (identity, its manifest). The identity is None (absent), "dir"
    (a directory without a manifest) or the manifest's digest (each save's manifest is unique), compared at the
    commit. SaveRefused where a save would have to move or replace something fsdpzero did not write."""
    if final.is_symlink():
        raise SaveRefused(f"{final} is a symbolic link: a checkpoint is saved only into a directory inside the save "
                          f"directory; remove the link or pick another tag")
    if not final.exists():
        return None, None
    if not final.is_dir():
        raise SaveRefused(f"{final} is a file, not a checkpoint directory, and fsdpzero does not move what it did not "
                          f"write: pick another tag or move the file")
    identity, manifest = "dir", None
    if (final / MANIFEST).is_file():
        identity = "manifest:" + hashlib.sha256((final / MANIFEST).read_bytes()).hexdigest()
        try:
            manifest = read_manifest(final)
        except ValueError:
            manifest = None   # its files are not known to be ours: the manifest itself clashes below
    ours = set(manifest["files"]) | {MANIFEST} if manifest is not None else _incoming(final)
    interrupted = manifest is None and _interrupted(final)   # then the checkpoint's names there are ours
    clash = sorted(n for n in os.listdir(final) if n not in ours and _SAVE_NAMES.fullmatch(n) and not interrupted)
    if clash:
        raise SaveRefused(f"{final / clash[0]} was not written by fsdpzero (no manifest lists it), and a save of tag "
                          f"{final.name!r} would replace it: move it, or save under another tag")
    return identity, manifest


def _interrupted(final: Path) -> bool:
    """A commit into <tag>/ was cut short: <tag>/ has no manifest and .old-<tag> holds the previous checkpoint whole
    (_commit_into). The save that was cut short checked that no file of the user's has a checkpoint's name there."""
    old = final.parent / f"{OLD_PREFIX}{final.name}"
    return old.is_dir() and not old.is_symlink() and not checkpoint_problems(old)


def _incoming(final: Path) -> set[str]:
    """The names a commit into <tag>/ was moving in when it was cut short (its INCOMING record): fsdpzero's, not the
    user's. Only checkpoint names count, whatever the record says."""
    try:
        names = json.loads((final / INCOMING).read_text())["names"]
    except (OSError, ValueError, KeyError, TypeError):
        return set()
    return {n for n in names if isinstance(n, str) and _SAVE_NAMES.fullmatch(n)} if isinstance(names, list) else set()


def _foreign(final: Path, manifest: dict) -> list[str]:
    """Entries of a checkpoint directory that its manifest does not list (the user's files beside ours)."""
    ours = set(manifest["files"]) | {MANIFEST, INCOMING}
    return sorted(n for n in os.listdir(final) if n not in ours)


@contextlib.contextmanager
def locked(save_dir: Path, lock_file: str = LOCK_FILE):
    """The save directory's lock (flock on <save_dir>/.fsdpzero.lock; released by the kernel if the process dies):
    commits, `latest` and rotation of concurrent jobs happen one at a time. (Conversions of DeepSpeed checkpoints
    take another lock file: fsdpzero.checkpoint.convert.)"""
    fd = os.open(save_dir / lock_file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        try:
            _wait_for_lock(fd, save_dir / lock_file)
        except OSError as e:   # a filesystem without locks: saves still work, unguarded against a second job
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            logging.getLogger("fsdpzero").warning("cannot lock %s (%s): saves into it are not guarded against a "
                                                  "second job saving there", save_dir, e)
        yield
    finally:
        os.close(fd)


LOCK_REPORT_S = 10.0   # a wait on another job's lock is said after this long, then every minute


def _wait_for_lock(fd: int, path: Path) -> None:
    """flock(LOCK_EX) that says what it waits for: commits are short, so a lock held for long is a stuck or stopped
    job (its pid and host are in the lock file); the wait goes on, as a second job's commit must not interleave."""
    start, next_report = time.monotonic(), LOCK_REPORT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            waited = time.monotonic() - start
            if waited >= next_report:
                try:
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                except OSError:
                    holder = "unknown"
                logging.getLogger("fsdpzero").warning(
                    "waiting %.0f s for %s, held by another job (%s): it commits a checkpoint into the same "
                    "directory; if that job is stopped or hung, end it (the lock is released when it exits)",
                    waited, path, holder)
                next_report = waited + 60.0
            time.sleep(0.05)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)


def hold(path: Path) -> int | None:
    """An exclusive, non-blocking flock on directory `path` (the fd that holds it), or None if another process
    holds it or the filesystem cannot lock directories."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError:
        os.close(fd)
        return None


def _remove_abandoned_temps(save_dir: Path, tag: str) -> None:
    """Under the save directory's lock: the temp dirs of earlier saves of any tag whose owner is gone (a killed job:
    nobody holds the temp dir's lock; a save in progress holds its own from the moment it makes it, under this same
    lock), the fixed-name temp dir of `tag` from before tokens, and what a cut-short keep_last removal left
    (.del-<tag>: removals happen under this lock too)."""
    abandoned = re.compile(re.escape(TMP_PREFIX) + r".+\.[0-9a-f]{16}|" + re.escape(f"{TMP_PREFIX}{tag}")
                           + "|" + re.escape(DEL_PREFIX) + r".+")
    for p in save_dir.iterdir():
        if abandoned.fullmatch(p.name) and p.is_dir() and not p.is_symlink():
            fd = hold(p)
            if fd is not None:
                try:
                    shutil.rmtree(p, ignore_errors=True)
                finally:
                    os.close(fd)


def _manifests(save_dir: Path) -> list[tuple[Path, dict]]:
    """The complete-looking checkpoints of save_dir (a readable manifest), with their manifests."""
    out = []
    for p in save_dir.iterdir():
        if p.name.startswith(HIDDEN_PREFIX) or p.is_symlink() or not (p / MANIFEST).is_file():
            continue
        try:
            out.append((p, read_manifest(p)))
        except ValueError:
            continue
    return out


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _age(manifest: dict) -> tuple:
    """Oldest first: the step recorded at save time, then the save directory's own sequence number (a clock step
    back changes neither); checkpoints from before both by their save time."""
    step, seq = _int(manifest.get("step")), _int(manifest.get("sequence"))
    return (-1 if step is None else step, -1 if seq is None else seq, _int(manifest.get("saved_at_ns")) or 0)


class SaveSlot:
    """One save's place in <save_dir>. Every rank writes into the save's own temp dir
    <save_dir>/.tmp-<tag>.<token> (the token is rank 0's, shared), so two jobs saving one tag never write into each
    other's files. Rank 0 opens it (checks <tag>, notes what it holds, holds a lock on the temp dir so that a later
    save can tell an abandoned one from one in progress) and commits it: under the save directory's lock, only if
    <tag> still holds what it held at the start (else SaveRefused: another save committed it meanwhile)."""

    def __init__(self, save_dir: Path, tag: str, token: str, crash_at: str | None = None):
        self.save_dir, self.tag = Path(save_dir), tag
        self.token = token
        self.crash_at = crash_at   # the save's ckpt_crash_at knob (test hook): crash_point
        self.tmp = self.save_dir / f"{TMP_PREFIX}{tag}.{token}"
        self.final = self.save_dir / tag
        self._expected: str | None = None
        self._fd: int | None = None

    def open(self) -> None:
        """Rank 0, before anything is written. SaveRefused (nothing created) if <tag> is not fsdpzero's to write."""
        _tag_dir_state(self.final)   # before the directory or the lock file is made: a refusal leaves no trace
        self.save_dir.mkdir(parents=True, exist_ok=True)
        with locked(self.save_dir):
            self._expected, _ = _tag_dir_state(self.final)
            _remove_abandoned_temps(self.save_dir, self.tag)
            self.tmp.mkdir()
            self._fd = hold(self.tmp)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def abandon(self) -> None:
        """Any rank, on failure: this save's temp dir removed (nothing else)."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.release()

    def commit(self, save_latest: bool, keep_last: int | None, world: int, step: int | None) -> None:
        """Rank 0, after every rank's files are written: manifest, fsync, rename (or move into a directory of the
        user's), `latest`, rotation. SaveRefused / LatestNotUpdated / OSError."""
        tmp, final, save_dir = self.tmp, self.final, self.save_dir
        sums = collect_side_checksums(tmp)   # DCP's data files, hashed as they were written
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        for name in files:
            fsync_path(tmp / name)
            if name not in sums:             # the small ones: JSON state, RNG states, DCP's index
                sums[name] = file_crc(tmp / name)
        try:
            with locked(save_dir):
                identity, old_manifest = _tag_dir_state(final)
                if identity != self._expected:
                    raise SaveRefused(f"another save wrote {final} while this one was writing (two jobs saving tag "
                                      f"{self.tag!r} into one directory?); {final} keeps that save's checkpoint")
                sequence = 1 + max((_int(m.get("sequence")) or 0 for _, m in _manifests(save_dir)), default=0)
                manifest = {"format": FORMAT, "tag": self.tag, "world_size": world, "step": step,
                            "sequence": sequence, "save_id": self.token, "saved_at_ns": time.time_ns(),
                            "files": files, "checksums": {name: sums[name] for name in files}}
                write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1))
                crash_point("before_rename", self.crash_at)
                old = save_dir / f"{OLD_PREFIX}{self.tag}"
                if identity is None:
                    os.rename(tmp, final)
                elif old_manifest is not None and not _foreign(final, old_manifest):
                    # re-saving a tag: move the old one aside first, so a crash leaves one of the two
                    shutil.rmtree(old, ignore_errors=True)
                    os.rename(final, old)
                    os.rename(tmp, final)
                else:
                    _commit_into(final, tmp, old_manifest, old)
                fsync_path(save_dir)
                shutil.rmtree(old, ignore_errors=True)
                crash_point("before_latest", self.crash_at)
                if save_latest:
                    _write_latest(save_dir, self.tag)
                if keep_last:   # best-effort: the save is committed whatever happens to older checkpoints
                    _rotate(save_dir, keep_last, protect={self.tag, _latest_or_none(save_dir)})
        finally:
            self.release()


def _commit_into(final: Path, tmp: Path, old_manifest: dict | None, old: Path) -> None:
    """<tag>/ holds files that are not ours (DeepSpeed writes into an existing directory too): move the new files in
    one by one, manifest last, and leave everything else as it is. A previous checkpoint there is first hard-linked
    into .old-<tag> (no data copied), where a load finds it (resolve_tag) until the new manifest is in; its files
    that the new save does not write are then removed (they were ours). The names moving in are recorded first
    (INCOMING), so that a commit cut short into a <tag>/ that held no checkpoint leaves files the next save knows
    as ours, not the user's."""
    new = [p.name for p in sorted(tmp.iterdir()) if p.name != MANIFEST]
    if old_manifest is not None:
        shutil.rmtree(old, ignore_errors=True)
        try:
            old.mkdir()
            for name in [*old_manifest["files"], MANIFEST]:
                os.link(final / name, old / name)
            fsync_path(old)
        except OSError:   # no hard links on this filesystem: the previous checkpoint is replaced unguarded
            shutil.rmtree(old, ignore_errors=True)
        os.unlink(final / MANIFEST)
        fsync_path(final)
        for name in old_manifest["files"]:
            if name not in new:
                (final / name).unlink(missing_ok=True)
    else:   # what a cut-short commit left (its INCOMING record, or .old-<tag>) and this one does not replace
        left = set(os.listdir(final)) if _interrupted(final) else _incoming(final)
        for name in sorted(left):
            if _SAVE_NAMES.fullmatch(name) and name not in new:
                (final / name).unlink(missing_ok=True)
    # the names about to move in, recorded first: if this is cut short, the next save knows they were ours
    write_atomic(final / INCOMING, json.dumps({"names": [*new, MANIFEST]}))
    for name in new:
        os.replace(tmp / name, final / name)
    os.replace(tmp / MANIFEST, final / MANIFEST)
    (final / INCOMING).unlink()
    fsync_path(final)
    shutil.rmtree(tmp)


def _write_latest(save_dir: Path, tag: str) -> None:
    try:
        previous = read_latest(save_dir)
    except ValueError:
        previous = None
    try:
        write_atomic(save_dir / LATEST, tag)
    except OSError as e:
        named = f"still names {previous!r}" if previous is not None else "does not exist"
        raise LatestNotUpdated(f"checkpoint {save_dir / tag} was saved and is complete, but {save_dir / LATEST} was "
                               f"not updated ({type(e).__name__}: {e.strerror or e}) and {named}; load the new "
                               f"checkpoint with tag={tag!r}, or free space and save again") from e


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


def _latest_or_none(save_dir: Path) -> str | None:
    """The tag `latest` names, or None where it is missing or unreadable (rotation protects what it can read)."""
    try:
        return read_latest(save_dir)
    except (ValueError, OSError):
        return None


def _rotate(save_dir: Path, keep_last: int, protect: set) -> None:
    """keep_last, after a commit: the oldest complete checkpoints beyond keep_last are removed; one that cannot be
    (a file held open on NFS: EBUSY) is left, with a warning naming it. Never an error: the save went through."""
    done = sorted(_manifests(save_dir), key=lambda pm: _age(pm[1]))
    for p, manifest in done[:max(0, len(done) - keep_last)]:
        if p.name not in protect:
            try:
                remove_checkpoint(p, manifest)
            except OSError as e:
                logging.getLogger("fsdpzero").warning(
                    "keep_last: checkpoint %s was not removed (%s: %s); the new save is complete and `latest` was "
                    "updated; remove it by hand", p, type(e).__name__, e)


def remove_checkpoint(path: Path, manifest: dict) -> None:
    """A checkpoint's own files, so that it stops being one before anything else goes: a directory that holds only
    ours is renamed to .del-<tag> (hidden: never taken as a checkpoint; removed, or by a later save if this one is
    cut short); in one that holds files of the user's, the manifest is unlinked first, then the files it listed."""
    if not _foreign(path, manifest):
        doomed = path.parent / f"{DEL_PREFIX}{path.name}"
        shutil.rmtree(doomed, ignore_errors=True)
        os.rename(path, doomed)
        shutil.rmtree(doomed)
        return
    (path / MANIFEST).unlink()
    for name in manifest["files"]:
        (path / name).unlink(missing_ok=True)


def resolve_tag(load_dir: str | Path, tag: str | None = None, latest: str = LATEST) -> Path:
    """<load_dir>/<tag>, or what `latest` names; on this rank alone (fsdpzero.checkpoint.agree.resolve_on_rank0 is
    the form every rank agrees on). A crash during a commit may have left the previous copy in .old-<tag>: it is
    used while <tag> has no manifest."""
    load_dir = Path(load_dir)
    if tag is None:
        tag = read_latest(load_dir, latest)
        if tag is None:
            if latest != LATEST:
                raise FileNotFoundError(f"{load_dir / latest} does not exist: pass tag=...")
            raise FileNotFoundError(f"{load_dir / LATEST} does not exist: nothing saved there yet, or pass tag=... "
                                    f"(complete checkpoints: "
                                    f"{sorted(p.parent.name for p in load_dir.glob('*/' + MANIFEST))})")
    tag = check_tag(tag)
    path = load_dir / tag
    aside = load_dir / f"{OLD_PREFIX}{tag}"  # a crash while re-saving this tag left the previous copy here
    if not path.is_symlink() and not (path / MANIFEST).is_file() and aside.is_dir() and not aside.is_symlink() \
            and not checkpoint_problems(aside):
        return aside
    if path.is_symlink():   # a plain name may still be a link to anywhere: the checkpoint must be in the directory
        raise ValueError(f"{path} is a symbolic link (to {os.readlink(path)!r}): a checkpoint is loaded only from a "
                         f"directory inside {load_dir}; copy it there instead of linking")
    return path
