"""Issue 22 finding 9: every expected CLI failure is exit 2 with one error line naming the flag or path, never a
traceback, a hang, exit 1 ("unsupported") or a nonsense value accepted."""
from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest

from fsdpzero.cli.main import main

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "deepspeed_ckpts"


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:               # argparse's own errors
            code = e.code
    return code, out.getvalue(), err.getvalue()


def one_error(argv: list[str], *words: str) -> str:
    """exit 2, no traceback, one `fsdpzero CMD: error: ...` line (after argparse's usage, if any) holding words."""
    code, out, err = run_cli(argv)
    assert code == 2, (code, out, err)
    assert "Traceback" not in out + err
    lines = [line for line in err.splitlines() if line.startswith(f"fsdpzero {argv[0]}: error: ")]
    assert len(lines) == 1, err
    others = [line for line in err.splitlines() if line not in lines and "Warning" not in line
              and not line.startswith(("usage:", " "))]
    assert not others, err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> Path:
    """One of our checkpoints (DCP), made from a DeepSpeed one by the converter itself."""
    out = tmp_path_factory.mktemp("ours")
    argv = ["convert", str(ASSETS / "z1_fp32"), "--from", "deepspeed", "--to", "dcp", "--out", str(out)]
    assert run_cli(argv)[0] == 0
    return out


# ---------------------------------------------------------------- convert
def test_convert_on_a_missing_dir():
    one_error(["convert", "/no/such/dir", "--to", "fp32"], "/no/such/dir")


def test_convert_our_checkpoint_as_deepspeed(ours, tmp_path):
    one_error(["convert", str(ours), "--from", "deepspeed", "--to", "dcp", "--out", str(tmp_path / "o")], str(ours))


def test_convert_our_checkpoint_to_dcp_is_exit_2_not_1(ours):
    one_error(["convert", str(ours), "--to", "dcp"], "--to dcp")


@pytest.mark.parametrize("size", ["abc", "-5", "0", "0B", "5XB", ""])
def test_convert_bad_max_shard_size(ours, tmp_path, size):
    one_error(["convert", str(ours), "--to", "fp32", "--max-shard-size", size, "--out", str(tmp_path / "o")],
              "--max-shard-size")


def test_convert_out_on_a_file(ours, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    one_error(["convert", str(ours), "--to", "fp32", "--out", str(f)], "--out", str(f))
    one_error(["convert", str(ASSETS / "z2_fp32"), "--from", "deepspeed", "--to", "dcp", "--out", str(f)], "--out")


@pytest.mark.parametrize("content", [b"\xff\xfe{\x00}\x00", b"\x89PNG\r\n\x1a\n\x00\x00", b"not json", b"[1, 2]"])
def test_convert_garbage_config_is_refused_before_converting(ours, tmp_path, content):
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(content)
    out = tmp_path / "o"
    one_error(["convert", str(ours), "--to", "fp32", "--config", str(garbage), "--out", str(out)], "--config")
    assert not out.exists()                   # nothing converted, no config.json copied


def test_convert_config_that_is_a_directory_or_fifo(ours, tmp_path):
    os.mkfifo(tmp_path / "fifo")
    for bad in (tmp_path, tmp_path / "fifo", "/dev/zero"):
        one_error(["convert", str(ours), "--to", "fp32", "--config", str(bad), "--out", str(tmp_path / "o")],
                  "--config")


def test_convert_with_a_good_config_copies_it(ours, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "gpt2"}')
    code, out, err = run_cli(["convert", str(ours), "--to", "fp32", "--config", str(cfg), "--out", str(tmp_path / "o")])
    assert code == 0, err
    assert (tmp_path / "o" / "config.json").read_text() == '{"model_type": "gpt2"}'


# ---------------------------------------------------------------- nvme-bench
SMALL = ["--size", "64K", "--block-sizes", "64K", "--queue-depths", "1", "--parallelism", "1", "--repeat", "1"]


def test_nvme_bench_on_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    one_error(["nvme-bench", str(f), *SMALL], "not a directory")


def test_nvme_bench_on_an_unwritable_place(tmp_path):
    one_error(["nvme-bench", "/proc/fsdpzero_bench", *SMALL], "/proc/fsdpzero_bench", "writable")
    if os.geteuid() != 0:                     # root writes through mode bits
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        one_error(["nvme-bench", str(ro), *SMALL], "writable")


@pytest.mark.parametrize("flag, value", [("--size", "0"), ("--size", "1000"), ("--size", "64G"), ("--size", "x"),
                                         ("--block-sizes", "256K,0"), ("--block-sizes", "2G"),
                                         ("--queue-depths", "0"), ("--queue-depths", "4,x"),
                                         ("--parallelism", "100000"), ("--repeat", "0"), ("--backend", "nope")])
def test_nvme_bench_bad_numbers(tmp_path, flag, value):
    one_error(["nvme-bench", str(tmp_path), flag, value], flag)


def test_nvme_bench_bounds_are_the_configs():
    """ops/ never imports the library: aio_bench repeats the config layer's aio bounds, which must agree."""
    from fsdpzero.config.bounds import BOUNDS
    from fsdpzero_ops import aio_bench
    hi = {b.key: b.hi for b in BOUNDS}
    assert (hi["aio.block_size"], hi["aio.queue_depth"], hi["aio.intra_op_parallelism"]) == (
        aio_bench.MAX_BLOCK_SIZE, aio_bench.MAX_QUEUE_DEPTH, aio_bench.MAX_INTRA_OP_PARALLELISM)


# ---------------------------------------------------------------- migrate / validate / estimate
@pytest.mark.parametrize("cmd", ["migrate", "validate"])
def test_migrate_on_a_directory_fifo_or_device(tmp_path, cmd):
    os.mkfifo(tmp_path / "fifo")
    for bad, words in ((tmp_path, "is a directory"), (tmp_path / "fifo", "not a regular file"),
                       ("/dev/zero", "not a regular file")):
        code, out, err = run_cli([cmd, str(bad)])
        assert code == 2 and words in out and "Traceback" not in out + err, (code, out, err)


@pytest.mark.parametrize("argv, flag", [
    (["validate", "CFG", "--nodes", "0"], "--nodes"),
    (["validate", "CFG", "--world-size", "-1"], "--world-size"),
    (["validate", "CFG", "--world-size", "3", "--nodes", "2"], "--nodes"),
    (["migrate", "CFG", "--hidden-size", "-5"], "--hidden-size"),
    (["migrate", "CFG", "--hidden-size", "x"], "--hidden-size"),
    (["estimate", "gpt2", "--gpu-memory", "-80"], "--gpu-memory"),
    (["estimate", "gpt2", "--cpu-memory", "nan"], "--cpu-memory"),
    (["estimate", "gpt2", "--gpus", "0"], "--gpus"),
    (["estimate", "gpt2", "--nodes", "-2"], "--nodes"),
    (["estimate", "gpt2", "--buffer-factor", "inf"], "--buffer-factor"),
])
def test_numeric_flags_are_validated(tmp_path, argv, flag):
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"train_micro_batch_size_per_gpu": 1}')
    one_error([str(cfg) if a == "CFG" else a for a in argv], flag)


def test_estimate_on_a_huge_file_does_not_parse_it(tmp_path):
    big = tmp_path / "config.json"
    with open(big, "wb") as f:
        f.truncate(64 * 2**20)
    one_error(["estimate", str(big)], "not a transformers config.json")


# ---------------------------------------------------------------- NVMe paths at engine build
@pytest.mark.parametrize("where", ["/proc", "/proc/self"])
def test_nvme_path_under_proc_names_the_key(where):
    from fsdpzero.offload.swapdir import SwapDir
    with pytest.raises(OSError, match="zero_optimization.offload_optimizer.nvme_path"):
        SwapDir(where, 0, key="zero_optimization.offload_optimizer.nvme_path")
