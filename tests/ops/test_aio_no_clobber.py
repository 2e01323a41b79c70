"""Issue 32 item 7: `fsdpzero nvme-bench` and the NVMe swap space never write through a name someone else planted.
The names they use are predictable (pid, instance counter); a symlink planted there by another user of a shared
scratch disk pointed the write at a file of the victim's choosing, which was overwritten. Files are now created
exclusively and without following links (O_CREAT | O_EXCL | O_NOFOLLOW), inside a private (0700) directory made for
the purpose; the planted link's target is left as it was."""
import itertools
import os
import socket
import stat
from pathlib import Path

import pytest

from fsdpzero.cli import main
from fsdpzero.offload import swapdir
from fsdpzero.offload.swapdir import SWAP_ROOT, SwapDir
from fsdpzero_ops import aio

VICTIM_TEXT = b"the victim's data\n"


def _victim(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(VICTIM_TEXT)
    return victim


def test_nvme_bench_does_not_write_through_a_planted_symlink(tmp_path, capsys):
    scratch_dir = tmp_path / "shared"
    scratch_dir.mkdir()
    victim = _victim(tmp_path)
    # the scratch name nvme-bench used: .fsdpzero_nvme_bench.<pid>.bin in the directory under test
    (scratch_dir / f".fsdpzero_nvme_bench.{os.getpid()}.bin").symlink_to(victim)
    assert main(["nvme-bench", str(scratch_dir), "--size", "64K", "--block-sizes", "64K", "--queue-depths", "1",
                 "--parallelism", "1", "--repeat", "1", "--backend", "python", "--json"]) == 0
    capsys.readouterr()
    assert victim.read_bytes() == VICTIM_TEXT
    # its own scratch space is gone again; the planted link is not ours to remove
    assert [p.name for p in scratch_dir.iterdir()] == [f".fsdpzero_nvme_bench.{os.getpid()}.bin"]


def test_exclusive_open_refuses_an_existing_name_and_a_symlink(tmp_path):
    victim = _victim(tmp_path)
    link = tmp_path / "swap.bin"
    link.symlink_to(victim)
    for direct in (True, False):
        with pytest.raises(FileExistsError, match="swap.bin"):
            aio.open_file(link, write=True, direct=direct, exclusive=True)
        with pytest.raises(OSError, match="symbolic link"):   # reopening for I/O never follows a link either
            aio.open_file(link, write=True, direct=direct)
    assert victim.read_bytes() == VICTIM_TEXT
    with aio.open_file(tmp_path / "fresh.bin", write=True, exclusive=True) as f:
        assert f.fd >= 0
    assert stat.S_IMODE((tmp_path / "fresh.bin").stat().st_mode) == 0o600


def test_swap_dir_is_private_and_never_a_planted_one(tmp_path, monkeypatch):
    """The swap directory's name is <host>.<pid>.<n>.rank<r>: plant a symlink to the victim's directory there."""
    victim_dir = tmp_path / "victim_dir"
    victim_dir.mkdir()
    (tmp_path / SWAP_ROOT).mkdir()
    monkeypatch.setattr(swapdir, "_instances", itertools.count(1000))
    planted = tmp_path / SWAP_ROOT / f"{socket.gethostname()}.{os.getpid()}.1000.rank0"
    planted.symlink_to(victim_dir, target_is_directory=True)
    live = SwapDir(tmp_path, rank=0)
    try:
        assert list(victim_dir.iterdir()) == []
        assert not live.path.is_symlink() and live.path.resolve().parent == (tmp_path / SWAP_ROOT).resolve()
        assert stat.S_IMODE(live.path.stat().st_mode) == 0o700
        live.check_space(4096)
        with aio.open_file(live.path / "optimizer_states.swp", write=True, exclusive=True):
            pass
        assert list(victim_dir.iterdir()) == []
    finally:
        live.close()
    assert planted.is_symlink() and list(victim_dir.iterdir()) == []


def test_swap_root_that_is_a_symlink_is_refused(tmp_path):
    victim_dir = tmp_path / "victim_dir"
    victim_dir.mkdir()
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    (nvme / SWAP_ROOT).symlink_to(victim_dir, target_is_directory=True)
    with pytest.raises(OSError, match=f"{SWAP_ROOT}.*symbolic link"):
        SwapDir(nvme, rank=0, key="zero_optimization.offload_optimizer.nvme_path")
    assert list(victim_dir.iterdir()) == []


# ---- round 2: the directory above the swap directory, stale markers, the bench's private directory --------------

def test_a_swap_root_another_user_made_is_refused(tmp_path, monkeypatch):
    """On a shared (1777) disk another user can make the swap root first, 0777, and then replace the victim's fresh
    0700 directory in it by a link. The root is this user's own (`fsdpzero_swap-<uid>`, made 0700); one that anybody
    else can write, or that belongs to someone else, is refused naming it and the config key."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    os.chmod(nvme, 0o1777)
    (nvme / SWAP_ROOT).mkdir()
    os.chmod(nvme / SWAP_ROOT, 0o777)
    with pytest.raises(OSError, match=f"config key 'offload_optimizer.nvme_path'.*{SWAP_ROOT} belongs to uid "
                                      f"{os.geteuid()} with mode 777") as info:
        SwapDir(nvme, rank=0)
    assert "\n" not in str(info.value)
    assert list((nvme / SWAP_ROOT).iterdir()) == []
    os.chmod(nvme / SWAP_ROOT, 0o700)          # this user's, open to nobody else: used
    real_euid = os.geteuid()
    monkeypatch.setattr(swapdir.os, "geteuid", lambda: real_euid + 1)   # as if another user had made it
    with pytest.raises(OSError, match=f"belongs to uid {real_euid} with mode 700: not this user's"):
        SwapDir(nvme, rank=0)
    monkeypatch.undo()
    live = SwapDir(nvme, rank=0)
    try:
        assert live.path.parent == nvme / SWAP_ROOT and stat.S_IMODE(live.path.stat().st_mode) == 0o700
    finally:
        live.close()
    assert not (nvme / SWAP_ROOT).exists()
    fresh = SwapDir(nvme, rank=0)               # made by fsdpzero itself: 0700 whatever the umask
    try:
        assert stat.S_IMODE((nvme / SWAP_ROOT).stat().st_mode) == 0o700
    finally:
        fresh.close()


def test_a_swap_dir_replaced_by_a_link_after_mkdir_is_not_written_through(tmp_path, monkeypatch):
    """The attacker's move, made deterministic: right after the exclusive mkdir of the private directory, it is
    renamed away and a link to the attacker's directory put at its name, where a link named like the marker points
    at the victim's file. The marker write followed both links and overwrote the victim's file. The directory is
    opened with O_NOFOLLOW and everything is created relative to it: refused, the victim's file intact."""
    victim = _victim(tmp_path)
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / swapdir.MARKER).symlink_to(victim)
    real_mkdir = os.mkdir

    def mkdir_then_swap(p, mode=0o777, *, dir_fd=None):
        real_mkdir(p, mode, dir_fd=dir_fd)
        if str(p).endswith(".rank0"):
            os.rename(p, f"{p}.moved", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.symlink(evil, p, dir_fd=dir_fd)
    monkeypatch.setattr(swapdir.os, "mkdir", mkdir_then_swap)
    try:
        with pytest.raises(OSError, match="symbolic link"):
            SwapDir(tmp_path, rank=0).close()
    finally:
        monkeypatch.undo()
    assert victim.read_bytes() == VICTIM_TEXT
    assert [p.name for p in evil.iterdir()] == [swapdir.MARKER]


def test_swap_files_are_created_in_the_directory_held_open(tmp_path):
    """Swap files go into the directory SwapDir made and holds open, even if its path is renamed meanwhile: the path
    is only a name in messages."""
    live = SwapDir(tmp_path, rank=0)
    try:
        moved = live.path.with_name(live.path.name + ".moved")
        os.rename(live.path, moved)
        live.path.mkdir(mode=0o700)             # someone else's directory at the old name
        with live.create_file("optimizer_states.swp", direct=False) as f:
            os.write(f.fd, b"state")
        assert (moved / "optimizer_states.swp").read_bytes() == b"state"
        assert list(live.path.iterdir()) == []
        live.path.rmdir()
        os.rename(moved, live.path)
    finally:
        live.close()


def test_a_stale_swap_dir_marker_is_read_bounded(tmp_path):
    """Stale directories (a dead pid) whose marker is a link to /dev/zero, a FIFO, or a sparse 1 GiB file: read
    whole, the first grew without bound, the second blocked forever, the third asked for 1 GiB. A marker is read
    only when it is a regular file of at most MARKER_MAX bytes (O_NOFOLLOW, O_NONBLOCK); these are removed as stale
    and the run starts. Run in a child capped at +512 MiB of address space, with a timeout."""
    import subprocess
    import sys
    base = tmp_path / SWAP_ROOT
    base.mkdir(mode=0o700)
    host = socket.gethostname()
    for i, plant in enumerate(("zero", "fifo", "sparse")):
        stale = base / f"{host}.999999{i}.0.rank0"    # a pid above pid_max: dead
        stale.mkdir()
        marker = stale / swapdir.MARKER
        if plant == "zero":
            marker.symlink_to("/dev/zero")
        elif plant == "fifo":
            os.mkfifo(marker)
        else:
            with open(marker, "wb") as f:
                f.truncate(1 << 30)
    code = ("import resource, sys\n"
            "from fsdpzero.offload.swapdir import SwapDir\n"
            "vm = int([l for l in open('/proc/self/status') if l.startswith('VmSize:')][0].split()[1]) << 10\n"
            "resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), vm + (512 << 20)))\n"
            f"d = SwapDir({str(tmp_path)!r})\n"
            "print('made', sorted(p.name for p in d.path.parent.iterdir()) == [d.path.name])\n"
            "d.close()\n")
    try:
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                               cwd=str(Path(__file__).resolve().parents[2]), env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        raise AssertionError("SwapDir blocked reading a stale marker") from None
    assert child.returncode == 0 and child.stdout.strip() == "made True", child.stderr[-2000:]
    assert not base.exists()


def test_nvme_bench_refuses_a_private_dir_replaced_after_mkdtemp(tmp_path, monkeypatch, capsys):
    """In a shared directory that is not sticky another user can rename the 0700 directory nvme-bench just made and
    put a link to a directory of theirs at its name: the scratch file was written there. The directory is opened
    with O_NOFOLLOW and checked; the bench stops with one line and writes nothing in the other directory."""
    import tempfile
    from fsdpzero_ops import aio_bench
    shared = tmp_path / "shared"
    shared.mkdir()
    evil = tmp_path / "evil"
    evil.mkdir()
    os.utime(evil, ns=(1, 1))
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp_then_swap(*args, **kwargs):
        made = real_mkdtemp(*args, **kwargs)
        os.rename(made, made + ".moved")
        os.symlink(evil, made)
        return made
    monkeypatch.setattr(aio_bench.tempfile, "mkdtemp", mkdtemp_then_swap)
    assert main(["nvme-bench", str(shared), "--size", "64K", "--block-sizes", "64K", "--queue-depths", "1",
                 "--parallelism", "1", "--repeat", "1", "--backend", "python", "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nvme-bench: error:" in err[0] and "symbolic link" in err[0], err
    assert list(evil.iterdir()) == [] and evil.stat().st_mtime_ns == 1   # nothing created (nor removed) there
