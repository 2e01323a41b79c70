"""Issue 32 item 7: `fsdpzero nvme-bench` and the NVMe swap space never write through a name someone else planted.
The names they use are predictable (pid, instance counter); a symlink planted there by another user of a shared
scratch disk pointed the write at a file of the victim's choosing, which was overwritten. Files are now created
exclusively and without following links (O_CREAT | O_EXCL | O_NOFOLLOW), inside a private (0700) directory made for
the purpose; the planted link's target is left as it was."""
import itertools
import os
import socket
import stat

import pytest

from fsdpzero.cli import main
from fsdpzero.offload import swapdir
from fsdpzero.offload.swapdir import SWAP_ROOT, SwapDir
from fsdpzero.ops import aio

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
