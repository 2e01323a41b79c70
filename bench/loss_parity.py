"""Loss parity on one GPU: the first forward's loss (before any update) and the bf16 loss curve of fsdpzero at
stages 2/3 with and without CPU and NVMe offload, next to DeepSpeed 0.19.8 and hand-written FSDP2, from the same
weights and batches (bench/common.py: seed 1234, fixed batches). One torchrun per run (bench/vs_deepspeed.py's).

    python bench/loss_parity.py --out out/parity --preset 0.25b --steps 24 [--nvme-path /tmp/nv]

Prints JSON (out/parity.json) and a table. `first loss` is compared bit for bit (float32 hex) against DeepSpeed
stage 2; the curve as max |ours - DeepSpeed same config| over all steps, relative to the first loss.
DeepSpeed's NVMe rows need its async_io op (see bench/vs_deepspeed.py); they are skipped when they fail.
FSDPZERO_BENCH_CPU=1 runs the tiny preset on gloo/CPU in fp32 (a smoke of the script, not a measurement).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import vs_deepspeed as vsd  # noqa: E402


def entries(nvme_path: str | None) -> list[dict]:
    both = ("fsdpzero", "deepspeed")
    rows = [vsd.entry(2), vsd.entry(3), vsd.entry(2, offload="opt", impls=both),
            vsd.entry(3, offload="both", impls=both)]
    if nvme_path:
        # fsdpzero only: DeepSpeed's NVMe rows need its async_io op built (bench/vs_deepspeed.py); the first
        # loss is compared bit for bit with DeepSpeed stage 2 all the same
        rows += [dict(vsd.entry(3, offload=o, impls=("fsdpzero",)), nvme_path=nvme_path) for o in ("optnvme", "nvme")]
    return rows


def first_hex(x: float) -> str:
    import struct
    return struct.pack(">f", x).hex()


def compare(rows: list[dict]) -> list[dict]:
    """One line per (config, impl): first loss, its float32 bits, equal to DeepSpeed stage 2's, curve gap."""
    by = {(r["config"], r["impl"]): r for r in rows}
    ref = (by.get(("z2_bf16_ga1", "deepspeed")) or by.get(("z2_bf16_ga1_off-opt", "deepspeed"))   # stage 2, the
           or by.get(("z2_fp32_ga1", "deepspeed")))   # untouched model's first loss either way (--only picks rows)
    out = []
    for (cfg, impl), r in sorted(by.items()):
        ds = by.get((cfg, "deepspeed"))
        gap = None
        if ds and impl != "deepspeed":
            gap = max(abs(a - b) for a, b in zip(r["losses"], ds["losses"])) / abs(ds["losses"][0])
        out.append({"config": cfg, "impl": impl, "first_loss": r["losses"][0], "first_bits": first_hex(r["losses"][0]),
                    "first_equal_ds_z2": bool(ref) and first_hex(r["losses"][0]) == first_hex(ref["losses"][0]),
                    "steps": len(r["losses"]), "last_loss": r["losses"][-1], "max_rel_gap_vs_ds": gap,
                    "step_s": r["step_s"], "peak_alloc_gib": r["peak_alloc_gib"], "device": r.get("device")})
    return out


def table(lines: list[dict]) -> str:
    md = ["| config | impl | first loss | bits | = DS z2 | last loss | max rel gap vs DS | step s | peak GiB |",
          "|---|---|---|---|---|---|---|---|---|"]
    for x in lines:
        gap = "-" if x["max_rel_gap_vs_ds"] is None else f"{x['max_rel_gap_vs_ds']:.2e}"
        md.append(f"| {x['config']} | {x['impl']} | {x['first_loss']:.6f} | {x['first_bits']} | "
                  f"{'yes' if x['first_equal_ds_z2'] else 'NO'} | {x['last_loss']:.4f} | {gap} | "
                  f"{x['step_s']:.3f} | {x['peak_alloc_gib']:.2f} |")
    return "\n".join(md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/parity")
    ap.add_argument("--preset", choices=sorted(common.PRESETS), default="tiny" if common.CPU else "0.25b")
    ap.add_argument("--steps", type=int, default=24, help="all of them recorded (no warm-up is excluded)")
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--run-timeout", type=int, default=600)
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these entries (e.g. z3_bf16_ga1_off-nvme)")
    args = ap.parse_args()
    args.warmup = 0   # vs_deepspeed.launch reads it: every step's loss is kept, the first is the untouched model's
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for e in [e for e in entries(args.nvme_path) if not args.only or e["name"] in args.only]:
        for impl in e["impls"]:
            if impl == "plain_fsdp2" and e["offload"] != "none":
                continue
            r = vsd.launch(e, impl, args.nproc, args, out, args.run_timeout)
            if r:
                rows.append(r)
                lines = compare(rows)   # written after every run: a run cut short keeps what it measured
                (out / "parity.json").write_text(json.dumps({"rows": lines, "preset": args.preset}, indent=1))
    lines = compare(rows)
    print(json.dumps(lines))
    print(table(lines))


if __name__ == "__main__":
    main()
