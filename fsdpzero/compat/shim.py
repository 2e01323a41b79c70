"""Import hooks that run a DeepSpeed script unchanged on fsdpzero (installed by fsdpzero/compat/bootstrap.py only).

Why import hooks on module names and not patches of today's transformers internals: the hooks touch two public
names (`transformers.trainer.Trainer`, `TrainingArguments.__post_init__`) at the moment their modules finish
loading, whatever order the script imports them in (`from transformers import Trainer`, `transformers.Trainer`,
HfArgumentParser first, ...), and `deepspeed` is resolved before sys.path, so an installed DeepSpeed is not used.

- `deepspeed`, `deepspeed.zero`, `deepspeed.comm` (and the submodules accelerate imports: runtime.lr_schedules,
  runtime.utils, checkpoint.utils, ops.adam, utils, and for its ALST door runtime.sequence_parallel.ulysses_sp and
  utils.groups, fsdpzero.compat.sequence_parallel): new modules named so, whose attributes forward to fsdpzero.compat.deepspeed,
  fsdpzero.zero, fsdpzero.compat.comm and fsdpzero.compat.submodules (resolved on first use). Other `deepspeed.*`
  imports fail with a message naming the module. importlib.metadata finds a `deepspeed` distribution of version
  0.19.8+fsdpzero, so accelerate's and transformers' "is DeepSpeed installed" checks pass.
- accelerate.state: on a machine without GPUs, a DeepSpeed rank of accelerate joins a gloo process group (accelerate
  would run it alone), so `Accelerator(deepspeed_plugin=...)` runs on CPU ranks as on GPUs.
- transformers.training_args: `TrainingArguments(deepspeed=...)` (any subclass: Seq2SeqTrainingArguments, TRL's
  configs) keeps the config in `fsdpzero_config` and leaves `deepspeed` None, so transformers and accelerate never
  configure DeepSpeed; on a machine without GPUs it also sets `use_cpu=True` (accelerate joins a CPU process
  group only then). Without `deepspeed=`, an accelerate launch config's DeepSpeed settings (ACCELERATE_USE_DEEPSPEED
  and the rest, from `fsdpzero launch --config_file`) become the config, as transformers reads them.
- transformers.trainer: `Trainer` becomes a subclass of fsdpzero.hf.Trainer that takes the diverted config; a
  script that passes none runs ZeRO stage 0 (replicated data parallel, what transformers would do with DDP).
  fsdpzero.hf, which subclasses the original, loads transformers.trainer first whoever imports it first.
- transformers.integrations.deepspeed: `HfDeepSpeedConfig` becomes fsdpzero.hf's (the guide's Trainer-less script).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import os
import pathlib
import sys
import types

# module name -> the module whose attributes it forwards to
FORWARDS = {
    "deepspeed": "fsdpzero.compat.deepspeed",
    "deepspeed.zero": "fsdpzero.zero",
    "deepspeed.comm": "fsdpzero.compat.comm",
    # what accelerate's DeepSpeed integration imports (fsdpzero/compat/submodules.py)
    "deepspeed.runtime": "fsdpzero.compat.submodules",
    "deepspeed.runtime.lr_schedules": "fsdpzero.compat.submodules",
    "deepspeed.checkpoint": "fsdpzero.compat.submodules",
    "deepspeed.checkpoint.utils": "fsdpzero.compat.submodules",
    "deepspeed.ops": "fsdpzero.compat.submodules",
    "deepspeed.ops.adam": "fsdpzero.compat.submodules",
    "deepspeed.utils": "fsdpzero.compat.submodules",
    "deepspeed.runtime.utils": "fsdpzero.compat.submodules",
    # accelerate's ALST door: ParallelismConfig(sp_backend="deepspeed") (fsdpzero/compat/sequence_parallel.py)
    "deepspeed.runtime.sequence_parallel": "fsdpzero.compat.sequence_parallel",
    "deepspeed.runtime.sequence_parallel.ulysses_sp": "fsdpzero.compat.sequence_parallel",
    "deepspeed.utils.groups": "fsdpzero.compat.sequence_parallel",
}


# The stand-in's version, also its importlib.metadata version (accelerate and transformers check DeepSpeed is
# installed by its distribution metadata): the DeepSpeed release whose config fsdpzero follows (config.schema's
# COMPAT_VERSION, not imported here: metadata scans, pydantic's plugin lookup among them, run while it imports) and
# a local part saying what it really is.
STAND_IN_VERSION = "0.19.8+fsdpzero"


# a DeepSpeed config for a Trainer given none: replicated data parallel, batch and clipping from TrainingArguments
NO_CONFIG = {"zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": "auto",
             "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
NOTICE = ("[fsdpzero] launch: unchanged-script mode: `import deepspeed` is fsdpzero's stand-in and transformers' "
          "Trainer runs `deepspeed=` configs on fsdpzero (--no_shim turns this off; docs/launch.md)")


class ForwardingLoader(importlib.abc.Loader):
    """A fresh module whose missing attributes come from `target` (imported at first attribute use)."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        target = self.target

        def __getattr__(name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            if f"{module.__name__}.{name}" in FORWARDS:          # deepspeed.zero, deepspeed.comm
                return importlib.import_module(f"{module.__name__}.{name}")
            try:
                real = importlib.import_module(target)
            except ModuleNotFoundError as e:
                raise AttributeError(f"{module.__name__}.{name}: {target} is not available ({e})") from None
            return getattr(real, name)

        module.__getattr__ = __getattr__
        module.__fsdpzero_target__ = target
        if module.__name__ == "deepspeed":
            module.__version__ = STAND_IN_VERSION


class StandInDistribution(importlib.metadata.Distribution):
    """importlib.metadata's view of the stand-in: a `deepspeed` distribution of STAND_IN_VERSION, no files."""

    def read_text(self, filename):
        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {STAND_IN_VERSION}\n"
                    "Summary: fsdpzero's stand-in for DeepSpeed under `fsdpzero launch`\n")
        return None

    def locate_file(self, path):
        return pathlib.Path(path)


class ShimFinder(importlib.abc.MetaPathFinder):
    """Serves the `deepspeed` stand-ins, and wraps the loaders of the transformers modules that get a post-hook."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in FORWARDS:
            package = any(name.startswith(fullname + ".") for name in FORWARDS)
            return importlib.util.spec_from_loader(fullname, ForwardingLoader(FORWARDS[fullname]), is_package=package)
        if fullname.startswith("deepspeed."):
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: under `fsdpzero launch`, `deepspeed` is fsdpzero's stand-in, which "
                f"provides {', '.join(sorted(FORWARDS))}, deepspeed.initialize / init_distributed / "
                f"add_config_arguments (docs/launch.md); `fsdpzero launch --no_shim` runs the real DeepSpeed",
                name=fullname)
        if fullname in POST_HOOKS or fullname in PRE_HOOKS:
            for finder in sys.meta_path:       # whichever finder would have found it (site-packages, editable)
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = HookLoader(spec.loader, PRE_HOOKS.get(fullname), POST_HOOKS.get(fullname))
                    return spec
        return None

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        """The stand-in's metadata, found before an installed DeepSpeed's (this finder is first)."""
        if context.name is None or context.name.replace("-", "_").lower() == "deepspeed":
            return iter([StandInDistribution()])
        return iter(())


class HookLoader(importlib.abc.Loader):
    """The module's own loader, between `before()` and `after(module)`."""

    def __init__(self, loader, before, after):
        self.loader, self.before, self.after = loader, before, after

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        if self.before is not None:
            self.before()
        self.loader.exec_module(module)
        if self.after is not None:
            self.after(module)


def divert_training_arguments(module: types.ModuleType) -> None:
    """TrainingArguments (and every subclass) keeps `deepspeed=` for fsdpzero."""
    cls = module.TrainingArguments
    if getattr(cls, "__fsdpzero_diverted__", False):
        return
    original = cls.__post_init__

    def __post_init__(self):
        if self.deepspeed and getattr(self, "fsdpzero_config", None) is None:
            self.fsdpzero_config, self.deepspeed = self.deepspeed, None
        elif not self.deepspeed and getattr(self, "fsdpzero_config", None) is None \
                and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
            self.fsdpzero_config = accelerate_env_config(self)
        if getattr(self, "fsdpzero_config", None) is not None:
            from fsdpzero.dist import join_before_accelerate
            join_before_accelerate(float(self.ddp_timeout))
        import torch
        if not torch.cuda.is_available() and not self.use_cpu:
            self.use_cpu = True
        original(self)

    cls.__post_init__ = __post_init__
    n_gpu = cls.n_gpu

    def one_device_per_process(self) -> int:   # as fsdpzero.hf.TrainingArguments.n_gpu: no DataParallel
        n = n_gpu.fget(self)
        return min(n, 1) if getattr(self, "fsdpzero_config", None) is not None else n

    cls.n_gpu = property(one_device_per_process, doc=n_gpu.__doc__)
    cls.__fsdpzero_diverted__ = True


def accelerate_env_config(args) -> dict:
    """The DeepSpeed config an accelerate launch config gave a Trainer script (ACCELERATE_* variables, set by
    `fsdpzero launch --config_file` as by `accelerate launch`): what transformers builds then, accelerate's
    `DeepSpeedPlugin()` from the environment with the mixed precision applied. The variable is then cleared for this
    process, so the Trainer's own Accelerator stays out of DeepSpeed's way and fsdpzero's Trainer runs the config."""
    from accelerate.utils import DeepSpeedPlugin
    plugin = DeepSpeedPlugin()
    precision = "fp16" if args.fp16 else "bf16" if args.bf16 else os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    plugin.set_mixed_precision(precision)
    del os.environ["ACCELERATE_USE_DEEPSPEED"]
    return plugin.deepspeed_config


def swap_trainer(module: types.ModuleType) -> None:
    """`transformers.trainer.Trainer` (and the top-level name) becomes fsdpzero's."""
    if getattr(module.Trainer, "__fsdpzero_shim__", False):
        return
    from fsdpzero.hf.trainer import Trainer as FsdpTrainer   # subclasses the original: import it first

    class Trainer(FsdpTrainer):
        __doc__ = FsdpTrainer.__doc__
        __fsdpzero_shim__ = True

        def __init__(self, model=None, args=None, *pos, ds_config=None, **kwargs):
            if args is None:            # as transformers: default arguments in tmp_trainer
                args = module.TrainingArguments(output_dir="tmp_trainer")
            if ds_config is None and getattr(args, "fsdpzero_config", None) is None:
                import logging
                logging.getLogger("fsdpzero").warning(
                    "Trainer: no deepspeed= config given; running ZeRO stage 0 (replicated data parallel)")
                ds_config = dict(NO_CONFIG)
            super().__init__(model, args, *pos, ds_config=ds_config, **kwargs)

    Trainer.__module__ = module.__name__
    Trainer.__qualname__ = "Trainer"
    module.Trainer = Trainer
    top = sys.modules.get("transformers")
    if top is not None:
        setattr(top, "Trainer", Trainer)     # the lazy top-level module may have cached the original


def swap_hf_deepspeed_config(module: types.ModuleType) -> None:
    """`transformers.integrations.HfDeepSpeedConfig` (the guide's Trainer-less ZeRO-3 path) becomes
    fsdpzero.hf.HfDeepSpeedConfig, resolved when the script constructs one: importing fsdpzero.hf here could run
    while transformers.trainer is still importing this module."""

    class HfDeepSpeedConfig:
        __doc__ = "fsdpzero.hf.HfDeepSpeedConfig, under `fsdpzero launch`"

        def __new__(cls, *args, **kwargs):
            from fsdpzero.hf.zero3 import HfDeepSpeedConfig as real
            return real(*args, **kwargs)

    module.HfDeepSpeedConfig = HfDeepSpeedConfig
    parent = sys.modules.get("transformers.integrations")
    if parent is not None:
        setattr(parent, "HfDeepSpeedConfig", HfDeepSpeedConfig)   # the lazy module may have cached the original


def trainer_first() -> None:
    """Before fsdpzero.hf runs: load transformers.trainer (and so swap its Trainer), while fsdpzero.hf.trainer, which
    subclasses the original, can still be imported whole."""
    try:
        importlib.import_module("transformers.trainer")
    except ImportError:
        pass                     # no transformers (or no accelerate): fsdpzero.hf will say what is missing


def join_cpu_ranks(module: types.ModuleType) -> None:
    """accelerate's PartialState joins a CPU process group only when told `cpu=True`, and takes its DeepSpeed branch
    only when `cpu=False`: on a machine without GPUs an `Accelerator(deepspeed_plugin=...)` rank would run alone.
    There, a DeepSpeed rank (ACCELERATE_USE_DEEPSPEED and LOCAL_RANK set) picks its backend as a CPU rank does
    (gloo) and still takes the DeepSpeed branch, which joins through deepspeed.comm.init_distributed."""
    cls = module.PartialState
    if getattr(cls._prepare_backend, "__fsdpzero_shim__", False):
        return
    original = cls._prepare_backend

    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        import torch
        if not cpu and not torch.cuda.is_available() and int(os.environ.get("LOCAL_RANK", -1)) != -1 \
                and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
            cpu = True
        return original(self, cpu, sagemaker_dp, backend)

    _prepare_backend.__fsdpzero_shim__ = True
    cls._prepare_backend = _prepare_backend


POST_HOOKS = {"transformers.training_args": divert_training_arguments, "transformers.trainer": swap_trainer,
              "transformers.integrations.deepspeed": swap_hf_deepspeed_config, "accelerate.state": join_cpu_ranks}
PRE_HOOKS = {"fsdpzero.hf": trainer_first}


def install() -> None:
    """Put the finder first on sys.meta_path (idempotent); modules already loaded get their hooks now."""
    if any(isinstance(f, ShimFinder) for f in sys.meta_path):
        return
    for name in list(sys.modules):
        if name == "deepspeed" or name.startswith("deepspeed."):
            raise RuntimeError(f"{name} was imported before the fsdpzero shim was installed")
    sys.meta_path.insert(0, ShimFinder())
    for name, hook in POST_HOOKS.items():
        if name in sys.modules:
            hook(sys.modules[name])
