"""Helpers for tests/checkpoint/test_hostile_ds_ckpt.py, imported there and by its child processes: re-save a
DeepSpeed file as DeepSpeed writes it, run `fsdpzero convert` in-process, cap a process's address space."""
import io
import os
import pickle
import resource
import types

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


__all__ = ["cap_memory", "convert", "save", "as_deepspeed_wrote_it"]
