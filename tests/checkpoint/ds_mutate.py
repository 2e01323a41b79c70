"""Helpers for the malformed-checkpoint tests (tests/checkpoint/test_hostile_ds_ckpt.py: ZeRO files;
test_universal.py: universal ones), imported there and by their child processes: re-save a DeepSpeed file as
DeepSpeed writes it, run `fsdpzero convert` in-process and judge its outcome, cap a process's address space, and the
seeded mutations both fuzz tests apply."""
import io
import os
import pickle
import random
import resource
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import torch

from fsdpzero.checkpoint.deepspeed_reader import FragmentAddress, LossScalerState, ZeroStage


def cap_memory(extra: int = 768 << 20) -> None:
    """Address space capped at what this process has mapped now plus `extra`."""
    vm = int([line for line in open("/proc/self/status") if line.startswith("VmSize:")][0].split()[1]) << 10
    resource.setrlimit(resource.RLIMIT_AS, (vm + extra, vm + extra))


def convert(argv: list[str]) -> tuple[int, str]:
    """`fsdpzero convert ...` in this process: (exit code, stderr text); an escaped exception is reported as a
    traceback line, which the tests count as a failure."""
    from contextlib import redirect_stderr

    from fsdpzero.cli.main import main
    err = io.StringIO()
    try:
        with redirect_stderr(err):
            rc = main(["convert", *argv])
    except BaseException as e:      # what a user would see as a traceback
        return 99, f"Traceback: {type(e).__name__}: {e}"
    return rc, err.getvalue()


def one_line_error(rc: int, stderr: str) -> bool:
    """`fsdpzero convert`'s clear failure: exit 2 and one line "fsdpzero convert: error: ...", no traceback and no
    allocation failure."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    return rc == 2 and len(lines) == 1 and lines[0].startswith("fsdpzero convert: error:") and \
        "Traceback" not in stderr and "can't allocate" not in stderr and "MemoryError" not in stderr


def run_child(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`code` (dedented) in a fresh Python at the repository root, with this module's names imported."""
    repo = Path(__file__).resolve().parents[2]
    code = ("from tests.checkpoint.ds_mutate import *\nimport os\nimport torch\nfrom pathlib import Path\n"
            + textwrap.dedent(code))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo)), cwd=str(repo))


class Mutator:
    """Seeded mutations of a checkpoint file, in place: structural (load it, drop a key of one of its dicts or lists
    or give it a value of the wrong type; tensors truncated, reshaped, re-typed, stride-0 expanded, emptied; saved
    back as DeepSpeed writes it) three times in four, else at the byte level (bytes flipped, the file truncated).
    `rng` is the fuzz's one random stream: the tests draw their own choices (variant, file) from it too."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def mutate(self, f: Path) -> None:
        (self.structural if self.rng.random() < 0.75 else self.byte_level)(f)

    def value(self, v):
        rng = self.rng
        if torch.is_tensor(v) and v.numel() > 1 and rng.random() < 0.8:
            return rng.choice([
                lambda t: t.reshape(-1)[: t.numel() // 2].clone(),
                lambda t: t.reshape(1, -1).clone(),
                lambda t: t.to(torch.float16),
                lambda t: t.reshape(-1)[:1].expand(2_000_000_000),
                lambda t: torch.zeros(0),
            ])(v)
        return rng.choice([None, "x", 7, -1, 10**12, [], {}, torch.zeros(3), 1.5, (1, 2)])

    def structural(self, f: Path) -> None:
        from fsdpzero.checkpoint.deepspeed_reader import load_ds_file
        obj = load_ds_file(f)
        spots = [c for c in _containers(obj) if len(c)]
        if not spots:   # a bare value (a universal checkpoint's step.pt)
            save(self.value(obj), f)
            return
        c = self.rng.choice(spots)
        key = self.rng.choice(list(c) if isinstance(c, dict) else range(len(c)))
        if self.rng.random() < 0.3:
            del c[key]
        else:
            c[key] = self.value(c[key])
        save(obj, f)

    def byte_level(self, f: Path) -> None:
        rng = self.rng
        data = bytearray(f.read_bytes())
        if rng.random() < 0.5:
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(len(data))
                data[i] = rng.randrange(256)
        else:
            data = data[: rng.randrange(len(data))]
        f.write_bytes(bytes(data))


def _containers(obj):
    """Every dict and list in obj, depth first, obj first."""
    if isinstance(obj, dict):
        yield obj
        for v in list(obj.values()):
            yield from _containers(v)
    elif isinstance(obj, list):
        yield obj
        for v in obj:
            yield from _containers(v)


# The reader's stand-ins are pickled back under DeepSpeed's names, as DeepSpeed writes them (DeepSpeed is not
# imported): a pickler that writes those GLOBALs itself.
DS_NAMES = {LossScalerState: b"deepspeed.runtime.fp16.loss_scaler\nDynamicLossScaler",
            FragmentAddress: b"deepspeed.utils.tensor_fragment\nfragment_address"}
AS_DS = {cls: type(cls.__name__ + "AsDeepSpeed", (), {}) for cls in DS_NAMES}
GLOBALS = {AS_DS[cls]: name for cls, name in DS_NAMES.items()}


class _DeepSpeedNames(pickle._Pickler):
    def save_global(self, obj, name=None):
        if obj in GLOBALS:
            self.write(pickle.GLOBAL + GLOBALS[obj] + b"\n")
            self.memoize(obj)
            return
        super().save_global(obj, name)

    dispatch = dict(pickle._Pickler.dispatch)
    dispatch[type] = save_global


pickle_module = types.SimpleNamespace(Pickler=_DeepSpeedNames, __name__="pickle")


def as_deepspeed_wrote_it(obj):
    """The reader's stand-ins back to what DeepSpeed pickles (its classes, ints for the stage enum)."""
    if isinstance(obj, dict):
        return type(obj)((k, as_deepspeed_wrote_it(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [as_deepspeed_wrote_it(v) for v in obj]
    if isinstance(obj, ZeroStage):
        return int(obj)
    if type(obj) in AS_DS:
        out = AS_DS[type(obj)].__new__(AS_DS[type(obj)])
        out.__dict__.update(vars(obj))
        return out
    return obj


def save(obj, path) -> None:
    """torch.save beside, then rename: `obj` may still hold the old file's tensors."""
    torch.save(as_deepspeed_wrote_it(obj), f"{path}.new", pickle_module=pickle_module)
    os.replace(f"{path}.new", path)


__all__ = ["Mutator", "as_deepspeed_wrote_it", "cap_memory", "convert", "one_line_error", "run_child", "save"]
