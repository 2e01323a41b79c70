"""Malformed and hostile DeepSpeed checkpoints (issue 32 item 8): `fsdpzero convert` and the load path end in one
clear error line or a correct conversion, never a traceback; no file makes fsdpzero allocate beyond the file's real
size (a stride-0 tensor, a compressed zip entry, aliased views); a file that shrinks while it is read does not kill
the process (no mmap of untrusted files); a bounded, seeded fuzz over the recorded DeepSpeed checkpoints shows it.

The memory guarantee is checked from outside: the conversions run in a child process whose address space is capped
(RLIMIT_AS) at what it had after start-up plus 768 MiB, far below the 6-8 GiB the hostile tensors ask for and far
above what the ~100 KB checkpoints need, and an allocation failure anywhere counts as a failure.
"""
from __future__ import annotations

import io
import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from fsdpzero.checkpoint import deepspeed as dc
from fsdpzero.checkpoint.deepspeed_reader import load_ds_file
from tests.checkpoint.ds_mutate import one_line_error as _one_line_error
from tests.checkpoint.ds_mutate import run_child as _run_child
from tests.checkpoint.ds_mutate import save   # the child processes import it too

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "deepspeed_ckpts"
VARIANTS = sorted(p.name for p in ASSETS.iterdir() if p.is_dir())


def _copy(variant: str, tmp_path: Path) -> tuple[Path, Path]:
    ckpt = tmp_path / variant
    shutil.copytree(ASSETS / variant, ckpt)
    return ckpt, ckpt / "global_step3"


# ---- one case each ----------------------------------------------------------------------------------------------

def test_stride0_tensor_in_a_tiny_file_is_refused_before_any_allocation(tmp_path):
    """A 45 KB optimizer file whose flat fp32 partition is a stride-0 view claiming 1.5e9 elements: DeepSpeed never
    writes overlapping views; the reader refuses the file (naming it) instead of letting the conversion
    materialise 6 GB."""
    ckpt, tag = _copy("z2_fp32", tmp_path)
    target = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    sd = load_ds_file(target)
    sd["optimizer_state_dict"]["single_partition_of_fp32_groups"][0] = torch.zeros(1).expand(1_500_000_000)
    save(sd, target)
    assert target.stat().st_size < 100_000
    with pytest.raises(ValueError, match=f"{target.name}.*overlap"):
        load_ds_file(target)
    child = _run_child(f'''
        cap_memory()
        rc, err = convert([{str(ckpt)!r}, "--from", "deepspeed", "--to", "safetensors",
                           "--out", {str(tmp_path / "o")!r}])
        print(rc, err.strip())
    ''')
    assert child.returncode == 0, child.stderr
    rc, err = child.stdout.split(" ", 1)
    assert _one_line_error(int(rc), err) and target.name in err, child.stdout


def test_compressed_zip_entry_is_refused(tmp_path):
    """torch.save never compresses; a deflated entry is a zip bomb (389 KB inflating to 400 MB)."""
    ckpt, tag = _copy("z2_fp32", tmp_path)
    target = tag / "mp_rank_00_model_states.pt"
    raw = io.BytesIO()
    torch.save({"module": {"w": torch.zeros(50_000_000)}}, raw)
    src = zipfile.ZipFile(io.BytesIO(raw.getvalue()))
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as z:
        for info in src.infolist():
            z.writestr(info.filename, src.read(info))
    assert target.stat().st_size < 1_000_000
    with pytest.raises(ValueError, match=f"{target.name}.*compressed"):
        load_ds_file(target)


def test_aliased_views_beyond_the_file_size_are_refused(tmp_path):
    """Distinct views of one storage whose bytes add up to far more than the file: each is in bounds, but the
    conversion would copy every one."""
    ckpt, tag = _copy("z2_fp32", tmp_path)
    target = tag / "mp_rank_00_model_states.pt"
    base = torch.zeros(25_000)
    save({"module": {f"w{i}": base[i:] for i in range(200)}}, target)
    with pytest.raises(ValueError, match=f"{target.name}.*more than the file"):
        load_ds_file(target)


def test_a_tensor_hidden_deep_in_containers_is_still_checked(tmp_path):
    ckpt, tag = _copy("z2_fp32", tmp_path)
    target = tag / "mp_rank_00_model_states.pt"
    nested = torch.zeros(1).expand(1_500_000_000)
    for _ in range(100):
        nested = [nested]
    save({"module": {}, "deep": nested}, target)
    with pytest.raises(ValueError, match=f"{target.name}.*nested more than 64 deep"):
        load_ds_file(target)


@pytest.mark.parametrize("mutate,expect", [
    ("del d['optim']['optimizer_state_dict']", "optimizer_state_dict"),
    ("d['optim']['optimizer_state_dict']['partition_count'] = 'two'", "partition_count"),
    ("d['model']['param_shapes'] = [3]", "param_shapes"),
    ("d['optim']['optimizer_state_dict']['single_partition_of_fp32_groups'] = None",
     "single_partition_of_fp32_groups"),
    ("d['model'] = [1, 2]", "mp_rank_00_model_states.pt"),
    ("del d['optim']['optimizer_state_dict']['base_optimizer_state']['state'][0]['exp_avg']", "exp_avg"),
    ("d['model']['param_shapes'][0]['transformer.wte.weight'] = [10**9, 10**9]", "transformer.wte.weight"),
    # values the resumed run computes with: converted as they were, then a TypeError mid-training
    ("d['model']['global_steps'] = 'x'", "global_steps"),
    ("d['optim']['optimizer_state_dict']['base_optimizer_state']['param_groups'][0]['lr'] = 'fast'", "lr"),
    ("d['optim']['optimizer_state_dict']['loss_scaler'].cur_scale = [1, 2]", "cur_scale"),
])
def test_malformed_structure_is_one_clear_line(tmp_path, mutate, expect, capsys):
    """KeyError / TypeError / AttributeError inside the conversion became tracebacks of `fsdpzero convert`."""
    from fsdpzero.cli.main import main
    ckpt, tag = _copy("z2_fp32", tmp_path)
    d = {"model": load_ds_file(tag / "mp_rank_00_model_states.pt"),
         "optim": load_ds_file(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")}
    exec(mutate)
    save(d["model"], tag / "mp_rank_00_model_states.pt")
    save(d["optim"], tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    for to in ("dcp", "safetensors"):
        rc = main(["convert", str(ckpt), "--from", "deepspeed", "--to", to, "--out", str(tmp_path / to)])
        err = capsys.readouterr().err
        assert _one_line_error(rc, err) and expect in err, err
    with pytest.raises(ValueError, match=str(ckpt)):
        dc.training_state(ckpt)


def test_a_file_that_shrinks_during_conversion_is_an_error_not_sigbus(tmp_path):
    """Truncate each file right after the reader returned it (a concurrent writer, a network filesystem): with the
    file mmap-ed, touching the tensors later killed the process with SIGBUS. The files are read, not mapped."""
    ckpt, tag = _copy("z3_fp32", tmp_path)
    child = _run_child(f'''
        import fsdpzero.checkpoint.deepspeed_reader as reader
        original = reader.load_ds_file
        def load_then_shrink(path):
            out = original(path)
            os.truncate(path, 64)
            return out
        reader.load_ds_file = load_then_shrink
        rc, err = convert([{str(ckpt)!r}, "--from", "deepspeed", "--to", "safetensors",
                           "--out", {str(tmp_path / "o")!r}])
        print("rc", rc, err.strip())
    ''')
    assert child.returncode == 0, f"child died with {child.returncode}: {child.stderr[-2000:]}"
    assert "rc 0" in child.stdout, child.stdout   # read into memory before the truncation: a correct load
    expected = load_file_weights(ASSETS / "z3_fp32")
    from safetensors.torch import load_file
    got = load_file(tmp_path / "o" / "model.safetensors")
    assert set(expected) - set(got) == {"lm_head.weight"}   # tied to wte: the export keeps one copy
    assert all(torch.equal(got[k], expected[k]) for k in got)


def load_file_weights(variant_dir: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(variant_dir / "zero_to_fp32.safetensors")


# ---- the bounded fuzz -------------------------------------------------------------------------------------------

FUZZ_CASES = 200
FUZZ_SEED = 32


def test_fuzz_malformed_deepspeed_checkpoints(tmp_path):
    """Seeded mutations of the recorded checkpoints (structure: keys dropped, values of the wrong type, tensors
    truncated / reshaped / re-typed / stride-0 expanded; bytes: flipped, truncated files) through `fsdpzero convert`
    (alternately --to safetensors and --to dcp) and, for some, engine.load_checkpoint on the DeepSpeed directory, in
    one memory-capped child: every case is a conversion / load or one clear error line; none is a traceback, none an
    allocation failure."""
    child = _run_child(f'''
        import json, shutil
        assets, work = Path({str(ASSETS)!r}), Path({str(tmp_path)!r})
        variants = {VARIANTS!r}
        mutator = Mutator({FUZZ_SEED})
        rng = mutator.rng
        cap_memory()

        # the load path: engine.load_checkpoint(<DeepSpeed dir>) converts (into the ckpt_convert_dir cache) and loads
        os.environ["FSDPZERO_CKPT_CONVERT_DIR"] = str(work / "convert-cache")
        from transformers import GPT2Config, GPT2LMHeadModel
        from fsdpzero.api import wrap
        model = GPT2LMHeadModel(GPT2Config.from_pretrained(assets))
        model.transformer.wpe.weight.requires_grad_(False)
        engine = wrap(model, json.loads((assets / "record.json").read_text())["variants"]["z2_fp32"]["config"])

        def load(ckpt):
            try:
                engine.load_checkpoint(str(ckpt))
                return 0, ""
            except Exception as e:
                return 2, f"fsdpzero convert: error: {{e}}"   # judged as the CLI's line: one line, no traceback
            except BaseException as e:
                return 99, f"Traceback: {{type(e).__name__}}: {{e}}"

        def status(field):
            return int([l for l in open("/proc/self/status") if l.startswith(field)][0].split()[1]) << 10

        hwm = status("VmHWM:")
        results = {{"cases": 0, "converted": 0, "errors": 0, "loads": 0, "bad": []}}
        for case in range({FUZZ_CASES}):
            variant = rng.choice(variants)
            ckpt = work / f"c{{case}}"
            shutil.copytree(assets / variant, ckpt, ignore=shutil.ignore_patterns("*.safetensors"))
            files = sorted((ckpt / "global_step3").glob("*.pt"))
            target = rng.choice(files)
            mutator.mutate(target)
            to = "dcp" if case % 4 == 0 else "safetensors"
            runs = [convert([str(ckpt), "--from", "deepspeed", "--to", to, "--out", str(work / f"o{{case}}")])]
            if case % 3 == 0 and variant.endswith("fp32"):
                runs.append(load(ckpt))
                results["loads"] += 1
            for rc, err in runs:
                if rc == 0:
                    results["converted"] += 1
                elif one_line_error(rc, err):
                    results["errors"] += 1
                else:
                    results["bad"].append([case, variant, target.name, rc, err[-400:]])
            results["cases"] += 1
            shutil.rmtree(ckpt)
            shutil.rmtree(work / f"o{{case}}", ignore_errors=True)
        results["peak_rss_growth"] = status("VmHWM:") - hwm
        print(json.dumps(results))
    ''', timeout=600)
    assert child.returncode == 0, f"fuzz child died ({child.returncode}): {child.stderr[-3000:]}"
    results = json.loads(child.stdout.strip().splitlines()[-1])
    print({k: v for k, v in results.items() if k != "bad"})
    assert results["cases"] == FUZZ_CASES
    assert results["bad"] == [], json.dumps(results["bad"][:10], indent=1)
    assert results["errors"] > FUZZ_CASES // 4   # the mutations do reach the error paths
    assert results["loads"] >= 8
    # what the 200 conversions and loads touched beyond the engine set up before them: a few of the ~50 KB files'
    # worth, nowhere near one hostile tensor's 8 GB
    assert results["peak_rss_growth"] < 128 << 20, results["peak_rss_growth"]


def test_convert_from_a_read_only_mount(tmp_path, capsys):
    """`fsdpzero convert` only reads the checkpoint: with --out it converts from a read-only mount; without, whose
    default output is beside the checkpoint, it says so and names --out (it used to fail deep in the save with a
    raw EROFS)."""
    import subprocess
    from fsdpzero.cli.main import main
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        shutil.copytree(ASSETS / "z3_fp32", ro, dirs_exist_ok=True)
        assert subprocess.run(["mount", "-o", "remount,ro", str(ro)], capture_output=True).returncode == 0
        for to in ("dcp", "safetensors"):
            assert main(["convert", str(ro), "--from", "deepspeed", "--to", to]) == 2
            err = capsys.readouterr().err
            assert _one_line_error(2, err) and "read-only" in err and "--out" in err, err
            assert main(["convert", str(ro), "--from", "deepspeed", "--to", to, "--out", str(tmp_path / to)]) == 0
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)
