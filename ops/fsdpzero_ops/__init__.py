"""What FSDP2 lacks, as ops with pure-torch reference paths: the fused CPU Adam (cpu_adam), the O_DIRECT tensor I/O
engine under NVMe offload (aio; `fsdpzero nvme-bench` is aio_bench) and ZeRO stage 1 (stage1/).

The C++ sources sit in csrc/ and are JIT-built on first use (build.py). Each op's reference implementation is what
its tests compare against and the fallback when nothing can be compiled. This package never imports the rest of
fsdpzero (tests/project/test_layout.py checks): the library builds the ops' inputs from its plan.
"""
from .cpu_adam import CPUAdam, CPUAdamW  # noqa: F401
