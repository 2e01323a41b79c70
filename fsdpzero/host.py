"""The host's CPUs and where each local rank's CPU work runs: how many threads the offload path's CPU Adam gets and
on which cores (knobs offload_threads and offload_bind, fsdpzero/tuning.py; `fsdpzero launch --bind_cores_to_rank`).

Why: with N ranks on one host, every rank's CPU Adam used to take usable cores / N threads anywhere on the host.
The OpenMP team of one rank then shares cores with the next forward's launching thread, the CUDA and NCCL threads and
the other ranks' teams; one preempted thread holds its whole chunk back (a statically split parallel loop), and
pages first touched by a thread on the other socket stay remote. DeepSpeed's launcher (`--bind_cores_to_rank`,
deepspeed/utils/numa.py) and torchrun's `--numa-binding=exclusive` give each rank its own cores; so does this
module, by default wherever there is an accelerator:

- each local rank gets a disjoint slice of the cores the local ranks share (whole physical cores: SMT siblings stay
  together), on the NUMA node of its GPU where every node then has ranks, else contiguous in NUMA-node order;
- CPU Adam gets as many threads as the slice has CPUs, fewer where a cgroup CPU quota leaves the ranks less; a
  thread count the user set (knob offload_threads, or OMP_NUM_THREADS other than torchrun's default 1) stands, and
  the slice is not imposed on a count larger than it;
- ranks a launcher (SLURM, numactl, DeepSpeed's or ours) already gave disjoint CPUs keep them.

plan_placement() is the pure decision (tests feed it fake hosts); read_topology() reads /sys and the cgroup;
place_this_rank() gathers the local ranks' CPUs and GPU nodes (one all-gather over the world), plans and applies:
every thread of the process is pinned (new threads, OpenMP's included, inherit it), and pages touched later land
on the slice's node. `python -m fsdpzero.host --bind_cores_to_rank -- CMD...` is the launcher's per-rank binder.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import socket
import sys
from dataclasses import dataclass, field

SYS = "/sys"
CGROUP = "/sys/fs/cgroup"
PROC = "/proc"


# -- cpulists ---------------------------------------------------------------------------------------------------------
def parse_cpulist(text: str) -> list[int]:
    """"0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format; DeepSpeed's --bind_core_list)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"bad CPU list {text.strip()!r}: expected ranges like 0-3,8,10-11")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cpus)


def format_cpulist(cpus) -> str:
    """[0, 1, 2, 3, 8, 10, 11] -> "0-3,8,10-11"."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


# -- the host ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Topology:
    """node_of: CPU -> NUMA node; core_of: CPU -> its physical core (CPUs with one key are SMT siblings); quota: the
    cgroup's CPU quota in CPUs (None: no limit)."""
    node_of: dict[int, int] = field(default_factory=dict)
    core_of: dict[int, tuple] = field(default_factory=dict)
    quota: float | None = None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def read_topology(sys_root: str = SYS, cgroup_root: str = CGROUP, proc: str = PROC) -> Topology:
    """NUMA nodes and physical cores from sysfs, the CPU quota from this process's cgroup (v2, else v1). What sysfs
    does not say is left out: one node, every CPU its own core."""
    node_of: dict[int, int] = {}
    node_dir = os.path.join(sys_root, "devices/system/node")
    for name in sorted(os.listdir(node_dir)) if os.path.isdir(node_dir) else []:
        if name.startswith("node") and name[4:].isdigit():
            text = _read(os.path.join(node_dir, name, "cpulist"))
            for cpu in parse_cpulist(text) if text else []:
                node_of[cpu] = int(name[4:])
    core_of: dict[int, tuple] = {}
    cpu_dir = os.path.join(sys_root, "devices/system/cpu")
    for name in os.listdir(cpu_dir) if os.path.isdir(cpu_dir) else []:
        if name.startswith("cpu") and name[3:].isdigit():
            pkg = _read(os.path.join(cpu_dir, name, "topology/physical_package_id"))
            core = _read(os.path.join(cpu_dir, name, "topology/core_id"))
            if pkg is not None and core is not None:
                core_of[int(name[3:])] = (int(pkg), int(core))
    return Topology(node_of, core_of, cpu_quota(cgroup_root, proc))


def cpu_quota(cgroup_root: str = CGROUP, proc: str = PROC) -> float | None:
    """The smallest CPU quota (in CPUs) of this process's cgroup and its ancestors: cgroup v2 cpu.max "QUOTA
    PERIOD", v1 cpu.cfs_quota_us / cpu.cfs_period_us. None when unlimited or unreadable. Containers (docker --cpus,
    Kubernetes limits) show every host CPU in the affinity mask and enforce the quota by throttling."""
    v2 = os.path.exists(os.path.join(cgroup_root, "cgroup.controllers"))
    rel = "/"
    for line in (_read(os.path.join(proc, "self/cgroup")) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and ((v2 and parts[0] == "0") or (not v2 and "cpu" in parts[1].split(","))):
            rel = parts[2] or "/"
    if ".." in rel.split("/"):
        rel = "/"
    mounts = [cgroup_root] if v2 else [os.path.join(cgroup_root, m) for m in ("cpu,cpuacct", "cpu")]
    best = None
    for mount in mounts:
        path = rel.strip("/")
        while True:
            d = os.path.join(mount, path) if path else mount
            if v2:
                text = (_read(os.path.join(d, "cpu.max")) or "max").split()
                quota = int(text[0]) / int(text[1]) if len(text) == 2 and text[0].isdigit() else None
            else:
                q, p = _read(os.path.join(d, "cpu.cfs_quota_us")), _read(os.path.join(d, "cpu.cfs_period_us"))
                quota = int(q) / int(p) if q and p and q.isdigit() and p.isdigit() and int(p) else None
            if quota is not None and quota > 0:
                best = quota if best is None else min(best, quota)
            if not path:
                break
            path = os.path.dirname(path)
    return best


def pci_numa_node(domain: int, bus: int, device: int, sys_root: str = SYS) -> int | None:
    """The NUMA node of a PCI device (sysfs writes -1 where the platform does not say)."""
    text = _read(os.path.join(sys_root, f"bus/pci/devices/{domain:04x}:{bus:02x}:{device:02x}.0/numa_node"))
    try:
        node = int(text) if text is not None else -1
    except ValueError:
        return None
    return node if node >= 0 else None


def gpu_numa_node(index: int, sys_root: str = SYS) -> int | None:
    """The NUMA node of CUDA device `index` (None: not a CUDA device, or torch/sysfs does not say)."""
    import torch
    try:
        props = torch.cuda.get_device_properties(index)
        return pci_numa_node(props.pci_domain_id, props.pci_bus_id, props.pci_device_id, sys_root)
    except (AttributeError, RuntimeError, AssertionError):   # older torch, no CUDA
        return None


# -- the decision (pure) ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Peer:
    """What one local rank brings: its CPUs (affinity mask) and its GPU's NUMA node."""
    local_rank: int
    cpus: frozenset
    gpu_node: int | None = None


@dataclass(frozen=True)
class Placement:
    """One rank's CPU placement. threads: the CPU step's threads (None: leave torch's setting); cores: the CPUs it
    runs on (pinned when `bind`); slices: every local rank's CPUs, by local rank; why: how threads and cores were
    chosen, in words."""
    local_rank: int
    threads: int | None
    cores: tuple
    nodes: tuple
    bind: bool
    why: str
    slices: tuple = ()

    def describe(self) -> str:
        """The startup block's line: 'cpu: 16 threads/rank, cores 0-15, numa 0 (bound, ...); ranks 0-15 / 16-31'."""
        threads = "threads/rank unchanged" if self.threads is None else f"{self.threads} threads/rank"
        nodes = ",".join(map(str, self.nodes)) or "?"
        line = f"{threads}, cores {format_cpulist(self.cores)}, numa {nodes} ({self.why})"
        if len(self.slices) > 1:
            line += "; ranks " + " / ".join(format_cpulist(s) for s in self.slices)
        return line


def _units(cpus, topo: Topology) -> list[tuple[int, ...]]:
    """The physical cores among `cpus`, each as its CPUs (siblings together), in NUMA-node then CPU order."""
    groups: dict[tuple, list[int]] = {}
    for c in sorted(cpus):
        groups.setdefault(topo.core_of.get(c, ("cpu", c)), []).append(c)
    return sorted((tuple(g) for g in groups.values()), key=lambda g: (topo.node_of.get(g[0], 0), g[0]))


def _split(items: list, k: int) -> list[list]:
    """k consecutive, as even as possible parts (the first ones one longer), as torchrun's exclusive mode."""
    per, extra = divmod(len(items), k)
    out, start = [], 0
    for i in range(k):
        n = per + (1 if i < extra else 0)
        out.append(items[start:start + n])
        start += n
    return out


def _slices(sharers: list[Peer], units: list[tuple[int, ...]], topo: Topology) -> tuple[list[list], str] | None:
    """Each sharer's units: by its GPU's NUMA node when every node of the pool has ranks (a node left idle would
    leave its memory bandwidth unused), else contiguous in node order. None: fewer units than ranks."""
    k = len(sharers)
    nodes = sorted({topo.node_of.get(u[0], 0) for u in units})
    gpu = [s.gpu_node for s in sharers]
    if len(nodes) > 1 and all(g is not None for g in gpu) and set(nodes) <= set(gpu) and set(gpu) <= set(nodes):
        out: list[list] = [[] for _ in sharers]
        for n in nodes:
            mine = [i for i, g in enumerate(gpu) if g == n]
            parts = _split([u for u in units if topo.node_of.get(u[0], 0) == n], len(mine))
            if any(not p for p in parts):
                return None
            for i, part in zip(mine, parts):
                out[i] = part
        return out, "on its GPU's NUMA node"
    if len(units) < k:
        return None
    return _split(units, k), "split like --bind_cores_to_rank"


# The CPU step is bound by the host's memory bandwidth once several ranks step at once: on one 64-core 4x H200 host
# (BENCHMARKS.md S14, one call) four ranks ran their CPU Adam no slower with 8 threads (1.29-1.41 Gparam/s each) than
# with 16 (1.03-1.15), while the 16-thread runs preempted the GPU-launching threads ~25 times a step (2-4 with 8) and
# took 0.360 s a step against 0.295. The CPU-step threads of the ranks on one NUMA node together stay within
# HOST_STEP_THREADS, each keeping at least MIN_RANK_THREADS; the rest of a rank's slice stays free for its launch,
# autograd, copy and NCCL threads. A rank alone on its node keeps its whole slice (as measured on one GPU), and two
# ranks on a 32-core node keep 16 each (as measured on 2 GPUs).
HOST_STEP_THREADS = 32
MIN_RANK_THREADS = 8


def _user_threads(omp: str | None, local_world: int) -> int | None:
    """OMP_NUM_THREADS as the user's choice: torchrun sets 1 for several local ranks when it is unset, which would
    make the CPU step ~6x slower; any other value is the user's."""
    if omp is None or not omp.strip().isdigit() or int(omp) < 1:
        return None
    if int(omp) == 1 and local_world > 1:
        return None
    return int(omp)


def plan_placement(peers: list[Peer], local_rank: int, topo: Topology, *, threads: int | None = None,
                   bind: bool | None = None, accelerator: bool = True,
                   omp_num_threads: str | None = None, share_node: bool = True) -> Placement:
    """This rank's threads and cores. peers: the local ranks (this one included), as gathered; threads: the
    offload_threads knob; bind: the offload_bind knob (None: auto, i.e. with an accelerator); omp_num_threads: the
    environment's OMP_NUM_THREADS; share_node: the ranks on one NUMA node share HOST_STEP_THREADS (the CPU step's
    count; False: the launcher's binder, one thread per CPU of the slice as DeepSpeed's)."""
    me = next(p for p in peers if p.local_rank == local_rank)
    pool = sorted(me.cpus)
    local_world = len(peers)
    node_set = lambda cpus: tuple(sorted({topo.node_of.get(c, 0) for c in cpus}))   # noqa: E731
    user = _user_threads(omp_num_threads, local_world)
    chosen = (threads, "knob offload_threads") if threads is not None else \
        (user, f"OMP_NUM_THREADS={user} set by the user") if user is not None else (None, "")
    all_cpus = tuple(tuple(sorted(p.cpus)) for p in sorted(peers, key=lambda p: p.local_rank))
    quota_share = math.floor(topo.quota / local_world) if topo.quota and topo.quota < len(pool) else None

    def fit(n_cpus: int, label: str = "one per CPU of the slice") -> tuple[int, str]:
        """Threads for a slice of n_cpus: the user's, else the slice capped by the quota's share."""
        if chosen[0] is not None:
            return chosen[0], chosen[1]
        if quota_share is not None and quota_share < n_cpus:
            return max(1, quota_share), f"cgroup quota {topo.quota:g} CPUs / {local_world} ranks"
        return n_cpus, label

    def unbound(why: str, n_threads: int | None, reason: str) -> Placement:
        return Placement(local_rank, n_threads, tuple(pool), node_set(pool), False, f"{reason}; {why}" if why
                         else reason, all_cpus)

    off = "not bound: offload_bind=0" if bind is False else "not bound: a CPU-only run, offload_bind=1 binds it"
    if bind is None:
        bind = accelerator
    others = [p for p in peers if p is not me]
    if local_world > 1 and all(not (p.cpus & q.cpus) for i, p in enumerate(peers) for q in peers[i + 1:]):
        n, why = fit(len(pool), "one per CPU it has")   # a launcher gave each rank its own CPUs: keep them
        return unbound(why, n, "not re-bound: each local rank has CPUs of its own already")
    if not bind:                    # no pinning: the share of the usable cores, as before binding existed
        if chosen[0] is None and not accelerator:
            return unbound("", None, off)
        n, why = fit(max(1, len(pool) // local_world), f"{len(pool)} usable CPUs / {local_world} local ranks")
        return unbound(why, n, off)
    sharers = [me] + [p for p in others if p.cpus == me.cpus]
    sharers.sort(key=lambda p: p.local_rank)
    units = _units(pool, topo)
    planned = _slices(sharers, units, topo)
    if planned is None and len(pool) >= len(sharers):   # fewer physical cores than ranks: split the CPUs instead
        planned = _split([(c,) for c in pool], len(sharers)), "split by CPU (fewer cores than ranks)"
    if planned is None:
        n, why = fit(1, "one each")
        return unbound(why, n, f"not bound: {len(sharers)} local ranks share {len(pool)} CPUs")
    parts, where = planned
    slices = {s.local_rank: tuple(sorted(c for u in part for c in u)) for s, part in zip(sharers, parts)}
    cores = slices[local_rank]
    n, why = fit(len(cores))
    mine = set(node_set(cores))   # memory bandwidth is per NUMA node: count the ranks stepping on mine
    near = sum(1 for part in slices.values() if mine & set(node_set(part)))
    share = max(MIN_RANK_THREADS, HOST_STEP_THREADS // near)
    if share_node and chosen[0] is None and near > 1 and n > share:
        n, why = share, (f"{share} of the slice's {len(cores)} CPUs: {near} ranks share this NUMA node's memory "
                         f"bandwidth")
    if chosen[0] is not None and chosen[0] > len(cores):
        return unbound(why, n, f"not bound: {chosen[0]} threads would crowd a {len(cores)}-CPU slice")
    every = tuple(slices.get(p.local_rank, tuple(sorted(p.cpus))) for p in sorted(peers, key=lambda p: p.local_rank))
    return Placement(local_rank, n, cores, node_set(cores), True, f"bound, {where}; {why}", every)


# -- this process -----------------------------------------------------------------------------------------------------
def host_id() -> int:
    """This host, as a 63-bit number: ranks with equal ids share its CPUs. The kernel's boot id (containers on one
    machine share it, even with other host names), else the host name."""
    name = _read(os.path.join(PROC, "sys/kernel/random/boot_id")) or socket.gethostname()
    return int.from_bytes(hashlib.sha1(name.encode()).digest()[:8], "little") >> 1


def gather_local_peers(local_rank: int, gpu_node: int | None) -> list[Peer]:
    """Every rank of this host with its CPUs and GPU node: one all-reduce (the mask width) and one all-gather over
    the default group, integers only. Without a process group (or alone): this rank only."""
    import torch
    import torch.distributed as dist
    mine = sorted(os.sched_getaffinity(0))
    # without the others' answers: LOCAL_WORLD_SIZE ranks with this rank's CPUs, as a launcher starts them
    assumed = [Peer(r, frozenset(mine), gpu_node if r == local_rank else None)
               for r in range(max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1))))]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return assumed
    backend = str(dist.get_backend())
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend and "gloo" not in backend \
        else torch.device("cpu")
    width = torch.tensor([max(mine) + 1], dtype=torch.int64, device=device)
    dist.all_reduce(width, op=dist.ReduceOp.MAX)
    row = torch.zeros(3 + int(width.item()), dtype=torch.int64)
    row[0], row[1], row[2] = host_id(), local_rank, -1 if gpu_node is None else gpu_node
    row[3 + torch.tensor(mine)] = 1
    rows = [torch.empty_like(row, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row.to(device))
    peers = []
    for r in (t.cpu() for t in rows):
        if int(r[0]) == int(row[0]):
            cpus = frozenset(int(i) for i in torch.nonzero(r[3:]).flatten())
            peers.append(Peer(int(r[1]), cpus, None if int(r[2]) < 0 else int(r[2])))
    if len({p.local_rank for p in peers}) != len(peers):   # LOCAL_RANK not unique among them (separate jobs or
        return assumed                                      # containers on one machine)
    return peers


def bind_process(cpus) -> None:
    """Pin every thread of this process to `cpus` (taskset -a; threads created later inherit it)."""
    cpus = set(cpus)
    os.sched_setaffinity(0, cpus)
    for tid in os.listdir(os.path.join(PROC, "self/task")):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):   # a thread that just ended
            pass


_applied: Placement | None = None   # this process's placement (CPU affinity is the process's), for the startup block


def applied() -> Placement | None:
    """The placement place_this_rank last applied in this process (None: none yet)."""
    return _applied


def place_this_rank(*, threads: int | None = None, bind: bool | None = None, device=None) -> Placement:
    """Gather the local ranks, plan this rank's placement and apply it: bind, and set torch's (OpenMP) threads of
    this thread (worker threads set theirs from Placement.threads). Collective where a process group exists."""
    global _applied
    import torch
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    accelerator = device is not None and getattr(device, "type", str(device)) == "cuda"
    gpu_node = gpu_numa_node(device.index if device.index is not None else torch.cuda.current_device()) \
        if accelerator else None
    peers = gather_local_peers(local_rank, gpu_node)
    if not any(p.local_rank == local_rank for p in peers):
        peers.append(Peer(local_rank, frozenset(os.sched_getaffinity(0)), gpu_node))
    placement = plan_placement(peers, local_rank, read_topology(), threads=threads, bind=bind,
                               accelerator=accelerator, omp_num_threads=os.environ.get("OMP_NUM_THREADS"))
    if placement.bind:
        try:
            bind_process(placement.cores)
        except OSError as e:   # a sandbox that refuses sched_setaffinity: run unpinned, and say so
            placement = dataclasses.replace(placement, bind=False, cores=tuple(sorted(os.sched_getaffinity(0))),
                                            why=f"not bound: sched_setaffinity failed ({e.strerror}); "
                                                + placement.why.split("; ", 1)[-1])
    if placement.threads is not None:
        torch.set_num_threads(placement.threads)
    _applied = placement
    return placement


def place_cpu_step(knobs) -> Placement:
    """place_this_rank for an offload CPU step, from an engine's knobs (offload_threads, offload_bind), on this
    process's CUDA device if there is one."""
    import torch
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    return place_this_rank(threads=knobs.offload_threads, bind=knobs.offload_bind, device=device)


def build_cpu_adam_op(knobs) -> None:
    """JIT-build the CPU step's Adam op now (DeepSpeed builds its ops at initialize), not in the first step; nothing
    with the no_build knob (the op's reference kernel then). The offload and ZenFlow paths call it at build."""
    from fsdpzero_ops import cpu_adam
    if not knobs.no_build:
        cpu_adam.available_impls()


# -- the launcher's per-rank binder -----------------------------------------------------------------------------------
def launcher_binding(local_rank: int, local_world: int, core_list: str | None = None,
                     topo: Topology | None = None, affinity=None) -> Placement:
    """`fsdpzero launch --bind_cores_to_rank [--bind_core_list L]`: this rank's slice of L (default: the usable
    CPUs), before the program starts, as DeepSpeed's launcher runs each rank under numactl. Every local rank has the
    same pool here (the launcher started them all), so no gathering is needed."""
    pool = frozenset(affinity if affinity is not None else os.sched_getaffinity(0))
    if core_list:
        wanted = frozenset(parse_cpulist(core_list))
        if not wanted <= pool:
            raise ValueError(f"--bind_core_list {core_list}: CPUs {format_cpulist(wanted - pool)} are not usable "
                             f"here (usable: {format_cpulist(pool)})")
        pool = wanted
    peers = [Peer(r, pool) for r in range(local_world)]
    placement = plan_placement(peers, local_rank, topo or read_topology(), bind=True, share_node=False)
    if not placement.bind:
        raise ValueError(f"--bind_cores_to_rank: {local_world} ranks cannot each have their own CPU among "
                         f"{format_cpulist(pool)}")
    return placement


def main(argv: list[str]) -> None:
    """python -m fsdpzero.host --bind_cores_to_rank [--bind_core_list L] -- CMD ARGS: pin this rank (LOCAL_RANK of
    LOCAL_WORLD_SIZE) to its slice, set OMP_NUM_THREADS to its size, and exec CMD (affinity and environment carry
    over exec)."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m fsdpzero.host")
    ap.add_argument("--bind_cores_to_rank", action="store_true", required=True)
    ap.add_argument("--bind_core_list", default=None)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("give the command to run after --")
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    try:
        placement = launcher_binding(local_rank, local_world, args.bind_core_list)
    except ValueError as e:
        sys.exit(f"fsdpzero launch: {e}")
    os.sched_setaffinity(0, placement.cores)
    os.environ["OMP_NUM_THREADS"] = str(placement.threads)
    if local_rank == 0:
        print(f"fsdpzero launch: --bind_cores_to_rank: {placement.describe()}", file=sys.stderr, flush=True)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
