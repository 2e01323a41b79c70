"""fsdpzero_ops.aio: every backend round-trips odd-sized tensors bit-exactly with many requests in flight; the bytes on
disk are checked with plain Python file reads (the oracle), and each error path names the file and the cause."""
import errno
import os
import resource
import warnings

import pytest
import torch

from fsdpzero.offload.swapdir import aio_config
from fsdpzero_ops import aio

BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(not aio.backend_available(b), reason=f"{b} not usable here"))
            for b in aio.BACKENDS]
DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float64]


def _bytes(t):
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _random(numel, dtype, gen):
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen).to(dtype)
    return torch.randint(-128, 127, (numel,), generator=gen, dtype=dtype)


def _roundtrip(tmp_path, backend, cfg, n=40):
    """Write n odd-sized tensors (some at unaligned buffer addresses) with all requests in flight at once, check
    the file bytes, then read them all back at once."""
    gen = torch.Generator().manual_seed(0)
    tensors = []
    for i in range(n):
        numel = int(torch.randint(1, 30_000, (1,), generator=gen)) + (i % 3)
        t = _random(numel, DTYPES[i % len(DTYPES)], gen)
        if i % 5 == 0:   # a view one byte into its storage: not aligned for O_DIRECT, must take the bounce path
            raw = torch.empty(t.numel() * t.element_size() + 1, dtype=torch.uint8)
            raw[1:].copy_(t.view(torch.uint8))
            t = raw[1:]
        tensors.append(t)
    offsets, at = [], 0
    for t in tensors:
        offsets.append(at)
        at += aio.padded_nbytes(t.numel() * t.element_size())
    path = tmp_path / f"swap_{backend}.bin"
    with aio.AioHandle(cfg, backend=backend) as h, h.open(path, write=True) as f:
        assert f.direct
        reqs = [h.pwrite(t, f, o) for t, o in zip(tensors, offsets)]
        for r in reqs:
            r.wait()
        data = path.read_bytes()                             # oracle: the kernel's view of the file
        for t, o in zip(tensors, offsets):
            nb = t.numel() * t.element_size()
            assert data[o:o + nb] == _bytes(t)
            assert data[o + nb:o + aio.padded_nbytes(nb)] == bytes(aio.padded_nbytes(nb) - nb)
        outs = [torch.full_like(t, 7) for t in tensors]
        outs = [aio.aligned_empty(t.numel(), t.dtype) if i % 2 else o for i, (t, o) in enumerate(zip(tensors, outs))]
        reqs = [h.pread(o, f, off) for o, off in zip(outs, offsets)]
        for r in reqs:
            r.wait()
            assert r.done()
    for t, o in zip(tensors, outs):
        assert _bytes(t) == _bytes(o)
    return path, tensors, offsets


@pytest.mark.parametrize("backend", BACKENDS)
def test_roundtrip_many_in_flight(tmp_path, backend):
    _roundtrip(tmp_path, backend, aio_config(block_size=8192, queue_depth=4, intra_op_parallelism=2))


@pytest.mark.parametrize("backend", ["io_uring", "libaio"])
@pytest.mark.parametrize("single_submit,overlap_events", [(True, False), (False, False), (True, True)])
def test_submit_modes(tmp_path, backend, single_submit, overlap_events):
    if not aio.backend_available(backend):
        pytest.skip(f"{backend} not usable here")
    cfg = aio_config(block_size=4096, queue_depth=3, intra_op_parallelism=1, single_submit=single_submit,
                        overlap_events=overlap_events)
    _roundtrip(tmp_path, backend, cfg, n=12)


def test_backends_share_the_file_layout(tmp_path):
    """What one backend writes, every other reads back (the reference defines the layout)."""
    path, tensors, offsets = _roundtrip(tmp_path, aio.available_backends()[0], aio_config(block_size=65536), n=8)
    for backend in aio.available_backends()[1:]:
        with aio.AioHandle(aio_config(block_size=4096, queue_depth=2), backend=backend) as h, h.open(path) as f:
            outs = [torch.empty_like(t) for t in tensors]
            for r in [h.pread(o, f, off) for o, off in zip(outs, offsets)]:
                r.wait()
        assert all(_bytes(a) == _bytes(b) for a, b in zip(tensors, outs)), backend


def test_poll_and_large_request(tmp_path):
    """One 12 MiB + 3 byte request split across workers; done() turns True without wait()."""
    t = torch.randint(0, 255, (12 * 2**20 + 3,), dtype=torch.uint8)
    with aio.AioHandle(aio_config(block_size=2**20, queue_depth=8, intra_op_parallelism=2)) as h, \
            h.open(tmp_path / "big.bin", write=True) as f:
        r = h.pwrite(t, f)
        while not r.done():
            pass
        r.wait()
        out = aio.aligned_empty(t.numel())
        h.pread(out, f).wait()
    assert torch.equal(t, out)


def test_aligned_empty():
    t = aio.aligned_empty(1001, torch.float32)
    assert t.data_ptr() % aio.ALIGN == 0 and t.shape == (1001,) and t.dtype == torch.float32
    assert t.is_pinned() == torch.cuda.is_available()


@pytest.mark.parametrize("backend", BACKENDS)
def test_buffered_fallback_when_o_direct_refused(tmp_path, monkeypatch, backend):
    """A file system that rejects O_DIRECT (EINVAL at open, as older tmpfs does): buffered, one warning."""
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(aio.os, "open", no_direct)
    monkeypatch.setattr(aio, "_warned_buffered", set())
    t = torch.randn(333)
    with aio.AioHandle(aio_config(block_size=4096), backend=backend) as h:
        with pytest.warns(RuntimeWarning, match="refuses O_DIRECT"):
            f = h.open(tmp_path / "a.bin", write=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            g = h.open(tmp_path / "b.bin", write=True)      # same directory: no second warning
        assert not f.direct and not g.direct
        h.pwrite(t, f, offset=100).wait()                   # unaligned offsets are fine without O_DIRECT
        out = torch.empty_like(t)
        h.pread(out, f, offset=100).wait()
        f.close(), g.close()
    assert torch.equal(t, out)
    assert (tmp_path / "a.bin").stat().st_size == 100 + t.numel() * 4   # buffered: no padding


def test_config_errors():
    """The engine checks what it needs; the ds_config's own checks (use_gds, thread_count, unknown keys, ranges) are
    the schema's (tests/config)."""
    good = dict(block_size=4096, queue_depth=1, intra_op_parallelism=1, single_submit=False, overlap_events=True)
    with pytest.raises(ValueError, match="aio block_size=1000: must be a positive multiple of 4096"):
        aio.AioConfig(**good | {"block_size": 1000})
    with pytest.raises(ValueError, match="aio queue_depth=0"):
        aio.AioConfig(**good | {"queue_depth": 0})
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'overlap_events'"):
        aio.AioConfig(**{k: v for k, v in good.items() if k != "overlap_events"})   # no default of its own
    with pytest.raises(ValueError, match="backend 'spdk'"):
        aio.AioHandle(aio.AioConfig(**good), backend="spdk")


def test_offset_and_tensor_errors(tmp_path):
    with aio.AioHandle(aio_config()) as h, h.open(tmp_path / "x.bin", write=True) as f:
        with pytest.raises(ValueError, match="offset 100 .* not a multiple of 4096"):
            h.pwrite(torch.zeros(4), f, offset=100)
        with pytest.raises(ValueError, match="contiguous CPU tensor"):
            h.pwrite(torch.zeros(4, 4).t(), f)


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_past_end_of_file(tmp_path, backend):
    with aio.AioHandle(aio_config(block_size=4096), backend=backend) as h, \
            h.open(tmp_path / "short.bin", write=True) as f:
        h.pwrite(torch.zeros(100), f).wait()                # occupies 4096 bytes
        with pytest.raises(OSError, match=r"read of 40000 bytes at offset 0 of .*short.bin failed .*ends before"):
            h.pread(torch.empty(10_000), f).wait()


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_file_of_unaligned_size(tmp_path, backend):
    """A file written by someone else, 5000 bytes: O_DIRECT reads of exactly its size work (bounce path), a read
    past its end says so."""
    data = torch.randint(0, 255, (5000,), dtype=torch.uint8)
    (tmp_path / "other.bin").write_bytes(data.numpy().tobytes())
    with aio.AioHandle(aio_config(block_size=4096), backend=backend) as h, h.open(tmp_path / "other.bin") as f:
        out = torch.empty(5000, dtype=torch.uint8)
        h.pread(out, f).wait()
        assert torch.equal(out, data)
        with pytest.raises(OSError, match="ends before the requested range") as e:
            h.pread(aio.aligned_empty(8192), f).wait()
        assert e.value.errno == errno.ENODATA


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"cannot open .*nope/x.bin: directory .*nope does not exist"):
        aio.open_file(tmp_path / "nope" / "x.bin", write=True)


def _in_child(fn):
    """Run fn in a forked child (rlimits and uids must not leak into the test process); returns its message."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            msg = fn()
        except BaseException as e:  # noqa: BLE001  report anything to the parent
            msg = f"{type(e).__name__}: {e}"
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        out = pipe.read().decode()
    os.waitpid(pid, 0)
    return out


def test_unwritable_directory(tmp_path):
    d = tmp_path / "ro"
    d.mkdir(mode=0o555)

    def attempt():
        if os.geteuid() == 0:       # root ignores modes: drop to nobody
            os.setgid(65534), os.setuid(65534)
        aio.open_file(d / "x.bin", write=True)
        return "opened"
    assert "PermissionError: [Errno 13] fsdpzero aio: cannot open" in _in_child(attempt)
    assert "for writing: permission denied" in _in_child(attempt)


@pytest.mark.parametrize("backend", BACKENDS)
def test_disk_full(tmp_path, backend):
    """A 1 MiB file-size limit (what a full disk or a quota does to a write): the write fails with a clear error
    naming file and offset, and the engine stays usable."""
    def attempt():
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))   # Python ignores SIGXFSZ: write gets EFBIG
        with aio.AioHandle(aio_config(block_size=2**18, queue_depth=4), backend=backend) as h, \
                h.open(tmp_path / "full.bin", write=True) as f:
            try:
                h.pwrite(torch.zeros(2**20), f).wait()                # 4 MiB
            except OSError as e:
                h.pwrite(torch.ones(10), f).wait()                  # still works below the limit
                return f"{e.errno} {e}"
        return "no error"
    msg = _in_child(attempt)
    assert msg.startswith(f"{errno.EFBIG} ") and "write of 4194304 bytes at offset 0 of" in msg, msg
    assert "file size limit reached" in msg


@pytest.mark.gpu
def test_pinned_buffers_to_gpu_and_back(tmp_path):
    """GPU tensor -> pinned aligned buffer -> disk -> pinned buffer -> GPU, bit-exact (the param-offload route)."""
    x = torch.randn(3_000_001, device="cuda").bfloat16()
    buf = aio.aligned_empty(x.numel(), x.dtype)
    assert buf.is_pinned() and buf.data_ptr() % aio.ALIGN == 0
    with aio.AioHandle(aio_config()) as h, h.open(tmp_path / "g.bin", write=True) as f:
        buf.copy_(x, non_blocking=True)
        torch.cuda.synchronize()
        h.pwrite(buf, f).wait()
        back = aio.aligned_empty(x.numel(), x.dtype)
        h.pread(back, f).wait()
    assert torch.equal(back.to("cuda", non_blocking=True), x)


def test_nvme_bench_cli(tmp_path, capsys):
    import json
    from fsdpzero.cli import main
    assert main(["nvme-bench", str(tmp_path), "--size", "1M", "--block-sizes", "256K,512K", "--queue-depths", "2",
                 "--parallelism", "1,2", "--repeat", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["results"]) == 4 and all(r["write_GBps"] > 0 and r["read_GBps"] > 0 for r in out["results"])
    assert set(out["best"]["aio"]) == {"block_size", "queue_depth", "intra_op_parallelism", "single_submit",
                                       "overlap_events"}   # an aio section to paste (use_gds: false by default)
    assert list(tmp_path.iterdir()) == []                      # the scratch file is gone
    assert main(["nvme-bench", str(tmp_path), "--size", "1M", "--block-sizes", "1M", "--queue-depths", "2",
                 "--parallelism", "1", "--repeat", "1"]) == 0
    assert '"aio": {' in capsys.readouterr().out


def test_the_engine_takes_every_aio_value_from_the_schema():
    """ops/ never imports the library, so AioConfig declares no defaults: each parameter is a key of the schema's
    `aio` section (fsdpzero.config.sections.Aio), and the library passes every one from the plan."""
    import dataclasses

    from fsdpzero.config.sections import Aio
    from fsdpzero.plan import AioPlan
    params = dataclasses.fields(aio.AioConfig)
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING for f in params)
    assert {f.name for f in params} == set(Aio.model_fields) - {"use_gds"}   # use_gds=true: refused by the config
    plan = AioPlan(block_size=2 * 1_048_576, queue_depth=3, intra_op_parallelism=2, single_submit=True,
                   overlap_events=False)
    assert dataclasses.asdict(aio_config(plan)) == {k: v for k, v in dataclasses.asdict(plan).items() if k != "use_gds"}
    assert aio_config(queue_depth=5) == aio_config(AioPlan(queue_depth=5))   # the rest: the schema's defaults
