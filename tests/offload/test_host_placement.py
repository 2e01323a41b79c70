"""fsdpzero/host.py: each local rank's CPU threads and cores, on fake hosts (sysfs trees, NUMA layouts, cgroup
quotas, affinity masks), and the launcher's per-rank binder."""
from __future__ import annotations

import os

import pytest

from fsdpzero.host import (Peer, Topology, cpu_quota, format_cpulist, launcher_binding, parse_cpulist, pci_numa_node,
                           plan_placement, read_topology)


def numa_host(nodes: int, cores_per_node: int, smt: int = 1) -> Topology:
    """Linux numbering: CPU c + k * (nodes * cores_per_node) is the k-th SMT sibling of core c."""
    physical = nodes * cores_per_node
    node_of, core_of = {}, {}
    for k in range(smt):
        for c in range(physical):
            node_of[c + k * physical] = c // cores_per_node
            core_of[c + k * physical] = (c // cores_per_node, c % cores_per_node)
    return Topology(node_of, core_of)


def plan_all(topo: Topology, pools, gpu_nodes=None, **kw):
    peers = [Peer(r, frozenset(pool), None if gpu_nodes is None else gpu_nodes[r]) for r, pool in enumerate(pools)]
    return [plan_placement(peers, r, topo, **kw) for r in range(len(peers))]


def assert_disjoint_within(plans, pool):
    seen = set()
    for p in plans:
        assert p.bind and p.cores, p
        assert not seen & set(p.cores), f"rank {p.local_rank} shares CPUs: {p.cores}"
        seen |= set(p.cores)
    assert seen <= set(pool)


def test_cpulists():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpulist([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    for bad in ("3-1", "a", "1-b"):
        with pytest.raises(ValueError, match="bad CPU list"):
            parse_cpulist(bad)


def test_two_numa_nodes_of_32_cores_four_ranks_on_their_gpus_nodes():
    topo = numa_host(2, 32)
    cpus = range(64)
    # GPUs 0,1 on node 1 and GPUs 2,3 on node 0 (as on hosts whose first GPUs hang off the second socket)
    plans = plan_all(topo, [cpus] * 4, gpu_nodes=[1, 1, 0, 0])
    assert_disjoint_within(plans, cpus)
    assert [p.cores for p in plans] == [tuple(range(32, 48)), tuple(range(48, 64)), tuple(range(0, 16)),
                                        tuple(range(16, 32))]
    assert [p.nodes for p in plans] == [(1,), (1,), (0,), (0,)]
    assert [p.threads for p in plans] == [16] * 4
    assert plans[0].describe().startswith("16 threads/rank, cores 32-47, numa 1 (bound, on its GPU's NUMA node")
    assert plans[0].describe().endswith("; ranks 32-47 / 48-63 / 0-15 / 16-31")
    # all four GPUs on node 0: node 1 would sit idle, so the split is contiguous (two ranks per node)
    plans = plan_all(topo, [cpus] * 4, gpu_nodes=[0, 0, 0, 0])
    assert [p.nodes for p in plans] == [(0,), (0,), (1,), (1,)]
    assert_disjoint_within(plans, cpus)


def test_smt_siblings_stay_with_their_core():
    topo = numa_host(2, 16, smt=2)     # CPUs 0-31 first threads, 32-63 their siblings
    plans = plan_all(topo, [range(64)] * 4, gpu_nodes=[0, 0, 1, 1])
    assert_disjoint_within(plans, range(64))
    assert plans[0].cores == (*range(0, 8), *range(32, 40))
    assert plans[3].cores == (*range(24, 32), *range(56, 64))
    assert plans[0].threads == 16


def test_sixteen_cores_eight_ranks_and_uneven_splits():
    topo = numa_host(1, 16)
    plans = plan_all(topo, [range(16)] * 8)
    assert_disjoint_within(plans, range(16))
    assert [p.cores for p in plans] == [(2 * r, 2 * r + 1) for r in range(8)]
    assert {p.threads for p in plans} == {2}
    plans = plan_all(topo, [range(16)] * 3)   # the first ranks get the extra core, none is left over
    assert [len(p.cores) for p in plans] == [6, 5, 5]
    assert_disjoint_within(plans, range(16))


def test_affinity_narrower_than_the_host():
    topo = numa_host(2, 32)
    pool = range(8, 24)                  # a container's cpuset (docker --cpuset-cpus 8-23)
    plans = plan_all(topo, [pool] * 2)
    assert_disjoint_within(plans, pool)
    assert [p.cores for p in plans] == [tuple(range(8, 16)), tuple(range(16, 24))]
    assert plans[0].threads == 8


def test_launcher_bound_ranks_keep_their_cpus():
    topo = numa_host(2, 32)
    plans = plan_all(topo, [range(0, 16), range(16, 32)], omp_num_threads="16")
    assert [(p.bind, p.cores, p.threads) for p in plans] == [(False, tuple(range(16)), 16),
                                                              (False, tuple(range(16, 32)), 16)]
    assert "each local rank has CPUs of its own already" in plans[0].why


def test_users_omp_num_threads_is_respected():
    topo = numa_host(2, 32)
    plans = plan_all(topo, [range(64)] * 4, omp_num_threads="4")
    assert [p.threads for p in plans] == [4] * 4
    assert_disjoint_within(plans, range(64))          # 4 threads fit each 16-CPU slice: still bound
    assert "OMP_NUM_THREADS=4 set by the user" in plans[0].why
    plans = plan_all(topo, [range(64)] * 4, omp_num_threads="32")
    assert [(p.threads, p.bind, len(p.cores)) for p in plans] == [(32, False, 64)] * 4   # never crowded into 16
    assert "would crowd a 16-CPU slice" in plans[0].why
    # torchrun's default for several local ranks is not the user's choice
    plans = plan_all(topo, [range(64)] * 4, omp_num_threads="1")
    assert [p.threads for p in plans] == [16] * 4
    # the knob wins over both
    assert plan_all(topo, [range(64)] * 4, omp_num_threads="4", threads=6)[0].threads == 6


def test_cgroup_quota_caps_the_threads():
    topo = Topology(numa_host(1, 64).node_of, {}, quota=8.0)   # docker --cpus 8 on a 64-CPU host
    plans = plan_all(topo, [range(64)] * 4)
    assert [p.threads for p in plans] == [2] * 4
    assert_disjoint_within(plans, range(64))
    assert "cgroup quota 8 CPUs / 4 ranks" in plans[0].why


def test_bind_off_is_the_old_share_and_cpu_only_is_left_alone():
    topo = numa_host(1, 16)
    old = plan_all(topo, [range(16)] * 4, bind=False)
    assert [(p.bind, p.threads, len(p.cores)) for p in old] == [(False, 4, 16)] * 4
    assert old[0].describe() == "4 threads/rank, cores 0-15, numa 0 (not bound: offload_bind=0; 16 usable CPUs / " \
                                "4 local ranks); ranks 0-15 / 0-15 / 0-15 / 0-15"
    cpu_only = plan_all(topo, [range(16)] * 2, accelerator=False)
    assert [(p.bind, p.threads) for p in cpu_only] == [(False, None)] * 2
    assert "threads/rank unchanged" in cpu_only[0].describe() and "CPU-only run" in cpu_only[0].why
    assert plan_all(topo, [range(16)] * 2, accelerator=False, threads=3)[0].threads == 3
    forced = plan_all(topo, [range(16)] * 2, accelerator=False, bind=True)
    assert_disjoint_within(forced, range(16))


def test_more_ranks_than_cpus_is_not_bound():
    plans = plan_all(numa_host(1, 2), [range(2)] * 4)
    assert [(p.bind, p.threads) for p in plans] == [(False, 1)] * 4


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_read_topology_and_quota_from_fake_sysfs(tmp_path):
    sys_root, cg, proc = tmp_path / "sys", tmp_path / "cgroup", tmp_path / "proc"
    for node, cpus in ((0, "0-1,4-5"), (1, "2-3,6-7")):
        _write(f"{sys_root}/devices/system/node/node{node}/cpulist", cpus + "\n")
    for cpu in range(8):
        _write(f"{sys_root}/devices/system/cpu/cpu{cpu}/topology/physical_package_id", str((cpu % 4) // 2))
        _write(f"{sys_root}/devices/system/cpu/cpu{cpu}/topology/core_id", str(cpu % 2))
    _write(f"{cg}/cgroup.controllers", "cpu memory")
    _write(f"{cg}/cpu.max", "max 100000")
    _write(f"{cg}/job/cpu.max", "300000 100000")     # the job's cgroup: 3 CPUs
    _write(f"{proc}/self/cgroup", "0::/job\n")
    topo = read_topology(str(sys_root), str(cg), str(proc))
    assert topo.node_of == {0: 0, 1: 0, 4: 0, 5: 0, 2: 1, 3: 1, 6: 1, 7: 1}
    assert topo.core_of[0] == topo.core_of[4] == (0, 0) and topo.core_of[2] == (1, 0)
    assert topo.quota == 3.0
    plans = plan_all(topo, [range(8)] * 2, gpu_nodes=[1, 0])
    assert [p.cores for p in plans] == [(2, 3, 6, 7), (0, 1, 4, 5)] and [p.threads for p in plans] == [1, 1]
    _write(f"{cg}/job/cpu.max", "max 100000")
    assert cpu_quota(str(cg), str(proc)) is None
    # cgroup v1
    v1 = tmp_path / "v1"
    _write(f"{v1}/cpu,cpuacct/cpu.cfs_quota_us", "-1")
    _write(f"{v1}/cpu,cpuacct/cpu.cfs_period_us", "100000")
    _write(f"{v1}/cpu,cpuacct/slurm/cpu.cfs_quota_us", "1600000")
    _write(f"{v1}/cpu,cpuacct/slurm/cpu.cfs_period_us", "100000")
    _write(f"{tmp_path}/p1/self/cgroup", "4:cpu,cpuacct:/slurm\n3:memory:/x\n")
    assert cpu_quota(str(v1), str(tmp_path / "p1")) == 16.0
    _write(f"{sys_root}/bus/pci/devices/0000:1b:00.0/numa_node", "1\n")
    _write(f"{sys_root}/bus/pci/devices/0000:9c:00.0/numa_node", "-1\n")
    assert pci_numa_node(0, 0x1b, 0, str(sys_root)) == 1
    assert pci_numa_node(0, 0x9c, 0, str(sys_root)) is None and pci_numa_node(0, 1, 0, str(sys_root)) is None


def test_launcher_binding_slices_the_core_list():
    topo = numa_host(2, 8)
    got = [launcher_binding(r, 2, "2-5,10-13", topo=topo, affinity=range(16)) for r in range(2)]
    assert [(p.cores, p.threads) for p in got] == [((2, 3, 4, 5), 4), ((10, 11, 12, 13), 4)]
    with pytest.raises(ValueError, match="--bind_core_list 14-17: CPUs 16-17 are not usable here"):
        launcher_binding(0, 2, "14-17", topo=topo, affinity=range(16))
    with pytest.raises(ValueError, match="3 ranks cannot each have their own CPU"):
        launcher_binding(0, 3, "0-1", topo=topo, affinity=range(16))



def test_launcher_binding_gives_the_whole_slice_as_deepspeed():
    """`fsdpzero launch --bind_cores_to_rank` sets OMP_NUM_THREADS to the slice's size, as DeepSpeed's launcher, also
    where 4 ranks share one NUMA node: the shared-node cap is the offload engine's (its CPU Adam), and the launched
    program may be any program (it was 8 of the 16 CPUs after the cap came)."""
    got = [launcher_binding(r, 4, topo=numa_host(1, 64), affinity=range(64)) for r in range(4)]
    assert [(len(p.cores), p.threads) for p in got] == [(16, 16)] * 4
    assert "memory bandwidth" not in got[0].describe()

# -- the engine on 2 gloo ranks: each rank's CPU Adam threads run on CPUs of its own ---------------------------------
def _thread_cpus() -> dict[str, list[int]]:
    """Every thread of this process: its name (comm) -> allowed CPUs."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            status = open(f"/proc/self/task/{tid}/status").read()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        out[f"{fields['Name'].strip()}/{tid}"] = parse_cpulist(fields["Cpus_allowed_list"])
    return out


def _placed_job(rank, world, stage):
    import dataclasses
    import logging
    import threading

    import torch

    from fsdpzero import host
    from fsdpzero.api import wrap
    from fsdpzero.plan import OffloadPlan
    from tests.engine_cases import batches, build_model, engine_losses, make_plan

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("fsdpzero").addHandler(handler)
    plan = dataclasses.replace(make_plan(stage=stage, world=world), offload=OffloadPlan(optimizer_device="cpu"))
    engine = wrap(build_model("llama"), plan, tuning={"offload_bind": 1, "offload_overlap": 1})
    seen = {}

    def where() -> tuple[list[int], int]:   # the calling thread's CPUs and torch threads
        return sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    if stage == 2:   # the offload path's fused CPU Adam runs on the overlapped step's worker thread
        adam, real = engine.grad_path.optimizer, engine.grad_path.optimizer.step_param
        adam.step_param = lambda *a, **k: (seen.__setitem__(threading.current_thread().name, where()), real(*a, **k))[1]
    engine_losses(engine, batches(2, 1, 2 * world), rank, world)
    engine.wait_for_params()
    if stage == 1:   # stage 1 steps its CPU masters with torch's optimizer on the engine's own thread
        seen[threading.current_thread().name] = where()
    placement = host.applied()
    return {"cores": list(placement.cores), "threads": placement.threads, "adam": seen, "tasks": _thread_cpus(),
            "startup": "\n".join(lines)}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two CPUs to be pinned apart")
@pytest.mark.parametrize("stage", [2, 1])
def test_two_ranks_cpu_adam_threads_run_on_disjoint_cores(stage):
    """Stage 2: the offload path; stage 1 + offload_optimizer cpu (its own CPU step: it ran on torchrun's one
    thread anywhere on the host before)."""
    from tests.multirank import run_distributed
    got = run_distributed(_placed_job, 2, stage, timeout=240)
    cores = [set(g["cores"]) for g in got]
    assert cores[0] and cores[1] and not cores[0] & cores[1], cores
    assert cores[0] | cores[1] <= os.sched_getaffinity(0)
    for g, mine in zip(got, cores):
        assert ("fsdpzero-offload-step" if stage == 2 else "MainThread") in g["adam"], g["adam"]
        for name, (cpus, threads) in g["adam"].items():            # the thread that ran the CPU step
            assert set(cpus) <= mine, (name, cpus, mine)
            assert threads == (g["threads"] - 1 if stage == 2 else g["threads"]) or threads == 1, (name, threads)
        for name, cpus in g["tasks"].items():                       # and every other thread of the rank
            assert set(cpus) <= mine, (name, cpus, mine)
        assert 1 <= g["threads"] <= len(mine)
    assert f"cpu: {got[0]['threads']} threads/rank, cores {format_cpulist(cores[0])}" in got[0]["startup"], \
        got[0]["startup"]
    assert "ranks " + " / ".join(format_cpulist(c) for c in cores) in got[0]["startup"]


def test_a_refused_binding_runs_unpinned_and_says_so(monkeypatch):
    import torch

    from fsdpzero import host

    def refuse(*_):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    monkeypatch.setattr(host, "_applied", None)   # restored after: this process's record stays as it was
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    before = torch.get_num_threads()
    try:
        placement = host.place_this_rank(bind=True)
    finally:
        torch.set_num_threads(before)
    assert not placement.bind and placement.cores == tuple(sorted(os.sched_getaffinity(0)))
    assert "not bound: sched_setaffinity failed (Operation not permitted)" in placement.describe()
    assert host.applied() is placement


def test_ranks_sharing_a_numa_node_share_its_memory_bandwidth():
    """The CPU step is memory-bound once several ranks step at once: four ranks on one 64-core node take 8 threads
    each (BENCHMARKS.md S14: the same Adam rate as 16, fewer preempted launch threads), in their 16-CPU slices;
    a rank alone keeps its slice, two ranks of a 32-core node keep 16 each, and the user's count always wins."""
    one_node = numa_host(1, 64)
    plans = plan_all(one_node, [range(64)] * 4)
    assert [len(p.cores) for p in plans] == [16] * 4 and [p.threads for p in plans] == [8] * 4
    assert "8 of the slice's 16 CPUs: 4 ranks share this NUMA node's memory bandwidth" in plans[0].describe()
    assert [p.threads for p in plan_all(one_node, [range(64)] * 8)] == [8] * 8
    assert [p.threads for p in plan_all(numa_host(1, 32), [range(32)] * 2)] == [16, 16]
    assert [p.threads for p in plan_all(numa_host(1, 16), [range(16)])] == [16]
    assert [p.threads for p in plan_all(one_node, [range(64)] * 4, threads=16)] == [16] * 4
    # two nodes of 32 cores, two ranks on each: 16 threads each, as before
    assert [p.threads for p in plan_all(numa_host(2, 32), [range(64)] * 4, gpu_nodes=[0, 0, 1, 1])] == [16] * 4
