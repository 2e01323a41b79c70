"""`fsdpzero launch`: the `deepspeed` launcher's command line, run by torchrun (`torch.distributed.run`).

    fsdpzero launch --num_gpus 2 train.py --deepspeed ds_config.json          # one machine (gloo ranks on CPU)
    fsdpzero launch --hostfile hosts --master_addr node0 train.py ...         # the same command on every node
    fsdpzero launch --num_nodes 2 --node_rank K --num_gpus 8 --master_addr node0 train.py ...   # node K of 2

DeepSpeed's flags are translated into torchrun's and torchrun starts and watches the processes; nothing here
manages processes. Resource selection follows DeepSpeed 0.19.8's runner exactly (hostfile `host slots=N` lines,
`--include`/`--exclude` `NAME[:SLOT[,SLOT]]@...`, `--num_nodes`, `--num_gpus`): tests/cli/test_launch.py checks it
against DeepSpeed's own functions. What differs, because torchrun runs one agent per node instead of DeepSpeed
ssh-ing (pdsh) into the hosts: run the command on every node (by hand, as with DeepSpeed's `--no_ssh`, or one task
per node under `srun`, whose SLURM_NODEID / SLURM_NNODES / node list stand for --node_rank / --num_nodes /
--master_addr). A node that knows its index (--node_rank, SLURM, or its hostname in the hostfile) joins torchrun's
static rendezvous at `--master_addr:--master_port` as node k, so ranks are numbered node by node as DeepSpeed's
launcher does (GROUP_RANK = k); otherwise the nodes meet at a c10d rendezvous there. Each process gets LOCAL_RANK,
RANK, WORLD_SIZE, MASTER_ADDR/PORT in its environment and, as DeepSpeed passes it, `--local_rank=N` before the
script's own arguments (`--no_local_rank` drops it). On a machine without GPUs `--num_gpus N` starts N processes
(fsdpzero then uses gloo).

Python scripts run through `fsdpzero.compat.bootstrap`, which makes `import deepspeed` and transformers' Trainer
run on fsdpzero for that process only (`--no_shim` runs the script as it is); see docs/launch.md.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import socket
from dataclasses import dataclass, field

DEFAULT_HOSTFILE = "/job/hostfile"    # DeepSpeed's default (DLTS); absent means "this machine only"
DEFAULT_PORT = 29500                  # DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT
MAX_SLOTS = 1024   # processes per host: a bound, so that a typo does not plan millions of processes
_HOST_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")   # DeepSpeed's pattern: anything after the count is ignored


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-H", "--hostfile", default=None,
                        help=f"hostfile of `host slots=N` lines (default {DEFAULT_HOSTFILE} when it exists, else "
                             f"this machine only)")
    parser.add_argument("-i", "--include", default="",
                        help='resources to use: NAME[:SLOT[,SLOT...]][@NAME...], e.g. "worker-0:0,2@worker-1"')
    parser.add_argument("-e", "--exclude", default="", help="resources not to use (same syntax as --include)")
    parser.add_argument("--num_nodes", type=int, default=-1, help="use the first N hosts of the hostfile")
    parser.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1,
                        help="processes per node, on GPUs [0, N) (on a CPU-only machine: N processes, gloo)")
    parser.add_argument("--master_addr", default="",
                        help="node 0's address: torchrun's rendezvous endpoint (default 127.0.0.1 on one machine)")
    parser.add_argument("--master_port", type=int, default=None,
                        help=f"rendezvous port (default {DEFAULT_PORT} across nodes; a free port on one machine)")
    parser.add_argument("--node_rank", type=int, default=-1,
                        help="this machine's index among the nodes, 0..N-1 (default: $SLURM_NODEID under srun, else "
                             "its place in the hostfile, found by hostname); global ranks follow it, node 0 first")
    parser.add_argument("--no_ssh", action="store_true",
                        help="DeepSpeed's flag for running the command on every node with --node_rank; fsdpzero "
                             "launch never ssh-es, so it only makes --node_rank required, as DeepSpeed does")
    parser.add_argument("--rdzv_id", default=None,
                        help="rendezvous job id, the same on every node (default: $SLURM_JOB_ID, else "
                             "'fsdpzero-<port>')")
    parser.add_argument("--module", action="store_true", help="run the script as a module (python -m)")
    parser.add_argument("--no_python", action="store_true", help="run the script as an executable (no shim)")
    parser.add_argument("--no_local_rank", action="store_true",
                        help="do not pass --local_rank=N to the script (LOCAL_RANK is always in its environment)")
    parser.add_argument("--no_shim", action="store_true",
                        help="run the script unchanged, without making `import deepspeed` / transformers' Trainer "
                             "run on fsdpzero")
    parser.add_argument("--config_file", default=None,
                        help="accelerate's launch config for DeepSpeed (the YAML `accelerate config` writes): its "
                             "process layout and ACCELERATE_* settings; flags given here take precedence "
                             "(docs/accelerate_trl.md)")
    parser.add_argument("--bind_cores_to_rank", action="store_true",
                        help="pin each rank to its own slice of the CPUs (whole cores, NUMA-node order) and set its "
                             "OMP_NUM_THREADS to the slice's size, as DeepSpeed's flag (fsdpzero/host.py)")
    parser.add_argument("--bind_core_list", default=None,
                        help="with --bind_cores_to_rank: the CPUs to split among the ranks, e.g. 0-15,32-47 "
                             "(default: every CPU this process may use)")
    parser.add_argument("--dry_run", action="store_true", help="print the torchrun command and exit")
    parser.add_argument("user_script", help="the training script (or module with --module)")
    parser.add_argument("user_args", nargs=argparse.REMAINDER, help="the script's own arguments, passed unchanged")


# -- DeepSpeed's resource rules (deepspeed/launcher/runner.py, 0.19.8) ---------------------------------------------

def parse_hostfile(lines: list[str]) -> collections.OrderedDict:
    """host -> slots, from `host slots=N` lines; '#' comments and blank lines skipped. A host listed twice, a line
    that is not `host slots=N`, or no host at all is an error, as in DeepSpeed."""
    pool: collections.OrderedDict = collections.OrderedDict()
    for line in lines:
        line = line.strip()
        if line.startswith("#") or line == "":
            continue
        match = _HOST_LINE.search(line)
        if not match:
            raise ValueError(f"hostfile: bad entry {line!r}: each line is `HOSTNAME slots=N` (or a # comment)")
        host, slots = match.group(1), int(match.group(2))
        if slots > MAX_SLOTS:
            raise ValueError(f"hostfile: {host} slots={slots}: at most {MAX_SLOTS} processes per host")
        if host in pool:
            raise ValueError(f"hostfile: {host} is listed twice; give each host one `slots=N` line")
        pool[host] = slots
    if not pool:
        raise ValueError("hostfile: no `HOSTNAME slots=N` line (it is empty or only comments)")
    return pool


def read_hostfile(path: str | None) -> collections.OrderedDict | None:
    """The hostfile's pool; None when no hostfile is given and DeepSpeed's default path does not exist."""
    if path is None:
        if not os.path.isfile(DEFAULT_HOSTFILE):
            return None
        path = DEFAULT_HOSTFILE
    if not os.path.isfile(path):
        raise ValueError(f"--hostfile {path}: no such file (leave --hostfile out to run on this machine only)")
    with open(path) as f:
        return parse_hostfile(f.readlines())


def _node_specs(spec: str) -> dict[str, list[int]]:
    """`NAME[:SLOT[,SLOT...]]@...` -> name -> sorted unique slots ([] = the whole host). A name given twice merges
    its slot lists, as DeepSpeed does (so `w0@w0:1` means slot 1 of w0)."""
    nodes: dict[str, list[int]] = collections.defaultdict(list)
    for part in spec.split("@"):
        if part.count(":") > 1:
            raise ValueError(f"{spec!r}: {part!r} has more than one ':' (write NAME:SLOT,SLOT)")
        host, _, slots = part.partition(":")
        if ":" in part:
            try:
                nodes[host] += [int(s) for s in slots.split(",")]
            except ValueError:
                raise ValueError(f"{spec!r}: slots of {host!r} must be integers, got {slots!r}") from None
        else:
            nodes[host] += []
    return {h: sorted(set(s)) for h, s in nodes.items()}


def filter_resources(pool: dict[str, int], include: str = "", exclude: str = "") -> collections.OrderedDict:
    """DeepSpeed's parse_inclusion_exclusion: host -> slot ids to use, in hostfile order."""
    if include and exclude:
        raise ValueError("--include and --exclude are mutually exclusive")
    hosts = collections.OrderedDict((h, list(range(n))) for h, n in pool.items())
    if not include and not exclude:
        return hosts
    chosen: dict[str, list[int]] = {} if include else {h: list(s) for h, s in hosts.items()}
    for host, slots in _node_specs(include or exclude).items():
        if host not in hosts:
            raise ValueError(f"--{'include' if include else 'exclude'}: host {host!r} is not in the hostfile "
                             f"(hosts: {', '.join(hosts)})")
        for slot in slots:
            if slot not in hosts[host]:
                raise ValueError(f"--{'include' if include else 'exclude'}: host {host!r} has no slot {slot} "
                                 f"(slots 0..{len(hosts[host]) - 1})")
        if include:
            chosen[host] = slots or hosts[host]
        else:
            chosen[host] = [s for s in chosen[host] if s not in slots] if slots else []
    return collections.OrderedDict((h, chosen[h]) for h in hosts if chosen.get(h))


def trim_resources(active: dict[str, list[int]], num_nodes: int, num_gpus: int) -> collections.OrderedDict:
    """DeepSpeed's apply_num_nodes_and_gpus: the first num_nodes hosts; slots [0, num_gpus) on each."""
    out = collections.OrderedDict(active)
    if num_nodes > 0:
        out = collections.OrderedDict(list(out.items())[:num_nodes])
    if num_gpus > 0:
        out = collections.OrderedDict((h, list(range(num_gpus))) for h in out)
    return out


def select_resources(pool: dict[str, int] | None, args: argparse.Namespace, gpu_count: int) -> collections.OrderedDict:
    """host -> slots for this job, from the hostfile (or this machine) and the filters, with DeepSpeed's checks."""
    if args.num_gpus > MAX_SLOTS:
        raise ValueError(f"--num_gpus {args.num_gpus}: at most {MAX_SLOTS} processes per host")
    if (args.num_nodes >= 0 or args.num_gpus >= 0) and (args.include or args.exclude):
        raise ValueError("--num_nodes/--num_gpus cannot be combined with --include/--exclude (DeepSpeed's rule): "
                         "choose the slots with one or the other")
    if pool is None:
        per_node = gpu_count if gpu_count > 0 else max(args.num_gpus, 1)
        if args.num_nodes > 1:
            # torchrun's --nnodes: N nodes of equal size, each told its --node_rank (DeepSpeed needs a hostfile)
            if args.node_rank < 0:
                raise ValueError(f"--num_nodes {args.num_nodes} without a --hostfile: pass --node_rank (this node's "
                                 f"index, 0..{args.num_nodes - 1}) on each node, or a --hostfile listing the nodes")
            return trim_resources(collections.OrderedDict((f"node{i}", list(range(per_node)))
                                                          for i in range(args.num_nodes)), -1, args.num_gpus)
        # a machine without GPUs: --num_gpus N means N processes (DeepSpeed refuses to start at all)
        pool = {"localhost": per_node}
    active = filter_resources(pool, args.include, args.exclude)
    active = trim_resources(active, args.num_nodes, args.num_gpus)
    if not active:
        raise ValueError("no resources left to run on after --include/--exclude")
    return active


# -- the torchrun command --------------------------------------------------------------------------------------------

@dataclass
class LaunchPlan:
    torchrun_args: list[str]                 # what torch.distributed.run's parser receives
    local_ranks: int = 0                     # the processes it starts on this node (--nproc-per-node)
    env: dict[str, str] = field(default_factory=dict)
    summary: str = ""


def _this_node(active: dict[str, list[int]], node_rank: int, hostname: str) -> tuple[str, int | None]:
    """This machine's host entry and node index (None: not known, and not needed because every node uses the same
    slots; the c10d rendezvous then numbers the nodes)."""
    hosts = list(active)
    if node_rank >= 0:
        if node_rank >= len(hosts):
            raise ValueError(f"--node_rank {node_rank}: the job has {len(hosts)} node(s), so --node_rank is "
                             f"0..{len(hosts) - 1} (one value per node; check --num_nodes / the hostfile)")
        return hosts[node_rank], node_rank
    if len(hosts) == 1:
        return hosts[0], 0       # DeepSpeed too runs a one-host job locally, whatever the host's name
    short = hostname.split(".")[0]
    for i, host in enumerate(hosts):
        if host == hostname or host.split(".")[0] == short:
            return host, i
    if len({tuple(s) for s in active.values()}) == 1:
        return hosts[0], None    # every node uses the same slots: which one we are does not matter
    raise ValueError(f"this machine ({hostname}) is not in the hostfile and the nodes use different slots: pass "
                     f"--node_rank (its index among {', '.join(hosts)})")


def slurm_first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[07-09,12],cpu1' -> 'gpu07' (what `scontrol show hostnames | head
    -n 1` prints), without calling scontrol."""
    depth, end = 0, len(nodelist)
    for i, c in enumerate(nodelist):
        depth += (c == "[") - (c == "]")
        if c == "," and depth == 0:
            end = i
            break
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], nodelist[:end].strip())


def apply_slurm(args: argparse.Namespace, pool: dict | None, environ) -> str | None:
    """Under `srun` (one task per node), SLURM says what the multi-node flags would: --node_rank = $SLURM_NODEID,
    --num_nodes = the step's node count (without a hostfile), --master_addr = the first host of the node list.
    Flags given win. Returns what was taken from SLURM (for the summary), None outside a multi-node SLURM step."""
    nnodes = environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES")
    if "SLURM_NODEID" not in environ or not nnodes or int(nnodes) <= 1:
        return None
    nnodes = int(nnodes)
    tasks = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS")
    if tasks and int(tasks) != nnodes:
        raise ValueError(f"SLURM: {tasks} tasks on {nnodes} nodes: run one `fsdpzero launch` per node "
                         f"(srun --ntasks-per-node=1); it starts the node's ranks itself")
    taken = []
    if args.node_rank < 0:
        args.node_rank = int(environ["SLURM_NODEID"])
        taken.append(f"--node_rank {args.node_rank}")
    if pool is None and args.num_nodes < 0 and not (args.include or args.exclude):
        args.num_nodes = nnodes
        taken.append(f"--num_nodes {nnodes}")
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if not args.master_addr and nodelist:
        args.master_addr = slurm_first_host(nodelist)
        taken.append(f"--master_addr {args.master_addr}")
    return ", ".join(taken) or None


def plan_launch(args: argparse.Namespace, pool: dict[str, int] | None, *, gpu_count: int, hostname: str,
                visible: str | None = None, environ: dict | None = None, python: str = "python") -> LaunchPlan:
    """The torchrun arguments and environment for `args` (pure: the caller supplies what it detected, and the
    interpreter that runs the ranks under --bind_cores_to_rank)."""
    environ = os.environ if environ is None else environ
    if args.module and args.no_python:
        raise ValueError("--module and --no_python cannot be used together (as with DeepSpeed)")
    if args.bind_core_list is not None:
        if not args.bind_cores_to_rank:
            raise ValueError(f"--bind_core_list {args.bind_core_list}: add --bind_cores_to_rank (the list says "
                             "which CPUs the ranks are pinned to)")
        from fsdpzero.host import parse_cpulist
        parse_cpulist(args.bind_core_list)   # a bad list fails here, once, not in every rank
    if args.no_ssh and args.node_rank < 0 and "SLURM_NODEID" not in environ:
        raise ValueError("--no_ssh: pass --node_rank (this node's index, 0..N-1), as DeepSpeed requires")
    from_slurm = apply_slurm(args, pool, environ)
    active = select_resources(pool, args, gpu_count)
    host, node_index = _this_node(active, args.node_rank, hostname)
    slots = active[host]
    if not slots:
        raise ValueError(f"hostfile: {host} has slots=0: nothing to run there (remove the line or give it slots)")
    nnodes = len(active)
    out = ["--nnodes", str(nnodes), "--nproc-per-node", str(len(slots))]
    env: dict[str, str] = {}
    if gpu_count > 0:
        ids = visible.split(",") if visible else [str(i) for i in range(gpu_count)]
        if max(slots) >= len(ids):
            raise ValueError(f"slot {max(slots)} of {host}: this machine has {len(ids)} visible GPU(s)")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[s] for s in slots)
    if nnodes == 1 and not args.master_addr and args.master_port is None:
        out += ["--standalone"]                    # a free port: concurrent jobs on one machine do not collide
        where = "this machine"
    else:
        addr = args.master_addr or ("127.0.0.1" if nnodes == 1 else "")
        if not addr:
            first = f", e.g. --master_addr {list(active)[0]}" if pool is not None else ""
            raise ValueError(f"{nnodes} nodes: pass --master_addr (node 0's address{first}; DeepSpeed would ask "
                             f"node 0 over ssh, fsdpzero launch does not ssh)")
        port = args.master_port if args.master_port is not None else DEFAULT_PORT
        if node_index is not None:
            # DeepSpeed's layout: node k's ranks follow those of nodes 0..k-1, rank 0 on node 0, which hosts the
            # store at --master_addr (torchrun's static rendezvous; GROUP_RANK = k)
            out += ["--node-rank", str(node_index), "--master-addr", addr, "--master-port", str(port)]
            where = f"node {node_index} ({host}) of {nnodes}, master {addr}:{port}"
        else:
            rdzv_id = args.rdzv_id or environ.get("SLURM_JOB_ID") or f"fsdpzero-{port}"
            out += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{addr}:{port}", "--rdzv-id", str(rdzv_id)]
            where = f"node {host} of {nnodes}, rendezvous {addr}:{port}"
        if from_slurm:
            where += f" (from SLURM: {from_slurm})"
    local_rank = [] if args.no_local_rank else ["--local_rank=${local_rank}"]   # torchrun fills it in per process
    if args.no_python:
        program = [args.user_script, *local_rank, *args.user_args]
    elif args.no_shim:
        program = (["-m"] if args.module else []) + [args.user_script, *local_rank, *args.user_args]
    else:
        target = ["-m", args.user_script] if args.module else [args.user_script]
        program = ["-m", "fsdpzero.compat.bootstrap", *target, *local_rank, *args.user_args]
    if args.bind_cores_to_rank:   # each rank starts as fsdpzero.host's binder, which pins it and execs the program
        core_list = ["--bind_core_list", args.bind_core_list] if args.bind_core_list else []
        out += ["--no-python", python, "-u", "-m", "fsdpzero.host", "--bind_cores_to_rank", *core_list, "--",
                *([] if args.no_python else [python, "-u"]), *program]
    elif args.no_python:
        out += ["--no-python", *program]
    elif program[0] == "-m":
        out += ["--module", *program[1:]]
    else:
        out += program
    world = sum(len(s) for s in active.values())
    kind = f"GPU(s) {env['CUDA_VISIBLE_DEVICES']}" if gpu_count > 0 else "CPU processes (gloo)"
    summary = f"{len(slots)} {kind} on {where}; world size {world}" + (
        f"; each rank pinned to its own CPUs ({args.bind_core_list or 'all usable'})" if args.bind_cores_to_rank
        else "")
    return LaunchPlan(out, len(slots), env, summary)


# argparse defaults of the flags an accelerate config may set: a flag still at its default takes the config's value
_DEFAULTS = {"hostfile": None, "include": "", "exclude": "", "num_nodes": -1, "num_gpus": -1, "master_addr": "",
             "master_port": None, "node_rank": -1}


def apply_accelerate_config(args: argparse.Namespace, path: str):
    """Read `--config_file` (fsdpzero/compat/accelerate_config.py) into `args`; returns the config's launch (its
    environment for the ranks, and its fate rows). Flags given on the command line win, as with accelerate."""
    from fsdpzero.compat.accelerate_config import read_accelerate_config
    config = read_accelerate_config(path)
    for dest, value in config.flags.items():
        if getattr(args, dest) == _DEFAULTS[dest]:
            setattr(args, dest, value)
    if (args.include or args.exclude) and args.num_gpus >= 0 and "num_gpus" in config.flags \
            and "include" not in config.flags and "exclude" not in config.flags:
        args.num_gpus = -1          # --include/--exclude on the command line picks the slots instead
    args.no_local_rank = True       # accelerate launch passes no --local_rank: accelerate scripts do not parse it
    return config


def machines_pool(config, args: argparse.Namespace) -> dict[str, int] | None:
    """Several machines of an accelerate config and no hostfile: one entry per machine (machine_rank picks ours),
    each with num_processes / num_machines slots."""
    if config is None or config.machines <= 1 or args.hostfile is not None:
        return None
    per = args.num_gpus if args.num_gpus > 0 else 1
    return collections.OrderedDict((f"machine{i}", per) for i in range(config.machines))


def run(args: argparse.Namespace) -> int:
    import shlex
    import sys

    config = apply_accelerate_config(args, args.config_file) if args.config_file else None
    pool = machines_pool(config, args) or read_hostfile(args.hostfile)   # reported before torch is imported
    import torch
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    plan = plan_launch(args, pool, gpu_count=gpu_count, hostname=socket.gethostname(),
                       visible=os.environ.get("CUDA_VISIBLE_DEVICES") if pool is None and not (
                           args.include or args.exclude or args.num_gpus > 0) else None, python=sys.executable)
    if args.bind_cores_to_rank:   # a binding this node cannot make: one line here, not from every rank after start
        from fsdpzero.host import launcher_binding
        launcher_binding(0, plan.local_ranks, args.bind_core_list)
    if config is not None:
        from fsdpzero.compat.accelerate_config import format_rows
        plan.env.update(config.env)
        print(f"fsdpzero launch: {format_rows(config.rows, args.config_file)}", file=sys.stderr)
    print(f"fsdpzero launch: {plan.summary}", file=sys.stderr, flush=True)
    if args.dry_run:
        env = " ".join(f"{k}={v}" for k, v in plan.env.items())
        print(f"{env + ' ' if env else ''}torchrun {shlex.join(plan.torchrun_args)}")
        return 0
    os.environ.update(plan.env)
    try:
        # the script's own arguments bypass torchrun's parser: its argparse pre-scan rejects one that abbreviates
        # two of its flags (`--run` could be --run-path or --run_path) even after the script's name
        head = plan.torchrun_args[:len(plan.torchrun_args) - len(args.user_args)]
        config = torchrun.parse_args(head)
        config.training_script_args = [*config.training_script_args, *args.user_args]
        torchrun.run(config)
    except ChildFailedError as e:      # torchrun has printed which rank failed and how; exit with its status
        codes = [f.exitcode for f in e.failures.values() if f.exitcode and f.exitcode > 0]
        return codes[0] if codes else 1
    return 0
