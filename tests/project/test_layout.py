"""The house rules the folder layout promises, checked on the source (AST and text, no imports):

- the import graph of fsdpzero and fsdpzero_ops has no cycle (imports inside functions count: they are arrows too);
- the ops sit at the top of the repository (ops/fsdpzero_ops, ops/csrc), a package of their own that never imports
  the library; the library never imports its CLI;
- no private name (`_x`) is imported from another module: a name that crosses modules is public in its wing;
- FSDP2's private state is touched in one module only (fsdpzero/fsdp2_internals.py);
- no module but fsdpzero/tuning.py reads the process-wide knob state (tuning.current(), the last engine's explicit
  settings): an engine's settings are passed down, so two engines in one process keep theirs;
- the process defaults (the FSDPZERO_* environment) are read only where settings are built, once: wrap (the
  engine's), the `fsdpzero env` report, and `or_defaults(<a parameter>)` for a call made without an engine;
- fsdpzero_ops keeps no settings (no module global rebound but a warning latch, none set from the library);
- no method of a module, optimizer or FSDP2 parameter group is replaced on an instance, but the one FSDP2 leaves no
  hook for, in fsdpzero/fsdp2_internals.py.
"""
from __future__ import annotations

import ast
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "fsdpzero"
OPS = ROOT / "ops" / "fsdpzero_ops"   # the package fsdpzero_ops, installed beside fsdpzero
LIBRARY = ("fsdpzero", "fsdpzero_ops")
FSDP_STATE = PKG / "fsdp2_internals.py"
# torch's private _fully_shard state, as attribute or getattr name
FSDP_PRIVATE = re.compile(r"\b(_get_fsdp_state|_fsdp_param_groups?|_sharded_param_data|_local_tensor|_lazy_init|"
                          r"_states_to_(forward|backward)_prefetch|_post_reduce_event|_comm_ctx|_fully_shard|"
                          r"_fsdp_param|_unsharded_param|_reshard_after_forward|_post_forward_indices)\b")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(OPS.parent if path.is_relative_to(OPS) else ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _ours(module: str) -> bool:
    return any(module == top or module.startswith(top + ".") for top in LIBRARY)


MODULES = {_module_name(p): p for p in sorted([*PKG.rglob("*.py"), *OPS.rglob("*.py")])}


def _imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import in the file, relative ones resolved."""
    out = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out.append((base, [a.name for a in node.names], node.lineno))
    return out


def _targets(module: str, names: list[str]) -> list[str]:
    """The fsdpzero(_ops) modules an import reaches: `from a.b import c` is a.b.c when c is a module, else a.b."""
    if not _ours(module):
        return []
    subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
    if subs and len(subs) == len(names):
        return subs
    return subs + [module] if module in MODULES else subs


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _graph() -> dict[str, set[str]]:
    """module -> the modules its imports run: the targets and the packages above them (their __init__ runs first),
    except the importer's own packages, which are already being imported when it runs."""
    graph = {}
    for name, path in MODULES.items():
        own = set(_ancestors(name))
        edges = set()
        for mod, names, _ in _imports(name, path):
            for t in _targets(mod, names):
                edges |= {t, *(a for a in _ancestors(t) if a in MODULES and a not in own)}
        graph[name] = edges - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_wings_exist():
    wings = {p.name for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    assert {"config", "plan", "optim", "offload", "checkpoint", "cli", "hf"} <= wings
    assert len(MODULES) > 50


def test_ops_sit_at_the_top_of_the_repository():
    """The design card's place: ops/csrc (C++) and ops/fsdpzero_ops (its Python package), beside fsdpzero/."""
    assert not (PKG / "ops").exists(), "fsdpzero/ops is back inside the library; the ops live in ops/fsdpzero_ops"
    assert {"fsdpzero_ops", "fsdpzero_ops.cpu_adam", "fsdpzero_ops.aio", "fsdpzero_ops.stage1"} <= set(MODULES)
    sources = {p.name for p in (ROOT / "ops" / "csrc").iterdir()}
    assert {"cpu_adam.cpp", "aio.cpp"} <= sources
    # the package's csrc (what the wheel ships, what build.py compiles) is the same folder
    assert (OPS / "csrc").resolve() == (ROOT / "ops" / "csrc").resolve()


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def _library_imports_of_ops() -> list[str]:
    return [f"{name}:{line} imports {mod}" for name, path in MODULES.items() if name.split(".")[0] == "fsdpzero_ops"
            for mod, _, line in _imports(name, path) if mod.split(".")[0] == "fsdpzero"]


def test_ops_never_import_the_library():
    assert len([n for n in MODULES if n.split(".")[0] == "fsdpzero_ops"]) >= 8, "the ops' modules are not scanned"
    bad = _library_imports_of_ops()
    assert not bad, bad


def test_library_never_imports_the_cli():
    bad = [f"{name}:{line} imports {mod}" for name, path in MODULES.items() if not name.startswith("fsdpzero.cli")
           for mod, names, line in _imports(name, path)
           if any(t.startswith("fsdpzero.cli") for t in _targets(mod, names))]
    assert not bad, bad


def test_no_private_name_crosses_modules():
    bad = [f"{name}:{line} takes {n} from {mod}" for name, path in MODULES.items()
           for mod, names, line in _imports(name, path) if _ours(mod)
           for n in names if n.startswith("_") and not n.startswith("__")]
    assert not bad, bad


def _fsdp_private_uses(path: Path) -> list[str]:
    """Code that names FSDP2 private state: an identifier (attribute, import) or a string that is exactly such a
    name (getattr, hasattr). Comments and docstrings may mention them."""
    uses = []
    with tokenize.open(path) as f:
        for tok in tokenize.generate_tokens(f.readline):
            text = tok.string
            if tok.type == tokenize.STRING:
                text = text.strip("\"'rbfRBF")
            if tok.type in (tokenize.NAME, tokenize.STRING) and FSDP_PRIVATE.fullmatch(text):
                uses.append(f"{path.relative_to(ROOT)}:{tok.start[0]}: {tok.line.strip()}")
    return uses


def _private_definitions(path: Path) -> set[str]:
    """Private names a module defines: functions, classes, class attributes and `self._x = ...` attributes."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name.startswith("_"):
            names.add(node.name)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr.startswith("_")
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id.startswith("_"):
            names.add(node.id)
    return {n for n in names if not n.startswith("__")}


def test_no_module_reaches_into_anothers_private_attributes():
    """`other._x`, where `_x` is private to another fsdpzero module, is a seam: make the name public there."""
    import torch
    # torch's own attributes (a module's _buffers, an optimizer's hook dicts) are torch's API surface, not ours
    torch_owned = set(vars(torch.nn.Module())) | set(vars(torch.optim.SGD([torch.zeros(1, requires_grad=True)])))
    torch_owned |= set(dir(torch.Tensor))   # a tensor's _version (autograd's in-place counter) is torch's too
    defined = {name: _private_definitions(path) - torch_owned for name, path in MODULES.items()}
    bad = []
    for name, path in MODULES.items():
        elsewhere = set().union(*(d for m, d in defined.items() if m != name)) - defined[name]
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in elsewhere
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    assert not bad, bad


def test_fsdp2_private_state_in_one_module():
    assert len(_fsdp_private_uses(FSDP_STATE)) >= 10, "the pattern no longer matches what fsdp2_internals.py touches"
    bad = [use for path in MODULES.values() if path != FSDP_STATE for use in _fsdp_private_uses(path)]
    assert not bad, "FSDP2 private state outside fsdpzero/fsdp2_internals.py:\n" + "\n".join(bad)


def test_every_module_is_in_a_package():
    loose = [str(p) for p in MODULES.values() if not (p.parent / "__init__.py").is_file()]
    assert not loose, f"not inside a package, so the wheel would miss them: {loose}"


# The modules that may read the process's knob state (fsdpzero.tuning.current), each with why it is process-wide.
PROCESS_TUNING_READERS = {
    "fsdpzero.cli.env": "`fsdpzero env` reports the process's environment; no engine exists there",
}
TUNING_STATE = {"current", "_explicit"}


def _process_tuning_reads(source: str) -> list[int]:
    """Lines that take fsdpzero.tuning's process state: `from fsdpzero.tuning import current`, or `current` /
    `_explicit` reached through the module (`tuning.current()`, `fsdpzero.tuning.current()`)."""
    tree = ast.parse(source)
    aliases = {"fsdpzero.tuning"}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "fsdpzero.tuning":
            lines += [node.lineno for a in node.names if a.name in TUNING_STATE]
        elif isinstance(node, ast.ImportFrom) and node.module == "fsdpzero":
            aliases |= {a.asname or a.name for a in node.names if a.name == "tuning"}
        elif isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "fsdpzero.tuning" and a.asname}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in TUNING_STATE and ast.unparse(node.value) in aliases:
            lines.append(node.lineno)
    return sorted(lines)


def test_the_finder_sees_each_way_to_read_the_process_tuning():
    assert _process_tuning_reads("from fsdpzero.tuning import Tuning, current as cur\n") == [1]
    assert _process_tuning_reads("from fsdpzero import tuning as knobs\nknobs.current()\n") == [2]
    assert _process_tuning_reads("import fsdpzero.tuning\nx = fsdpzero.tuning._explicit\n") == [2]
    assert _process_tuning_reads("from fsdpzero.tuning import resolve\nengine.tuning.current\n") == []


def test_no_module_reads_process_wide_knob_state():
    bad = [f"{path.relative_to(ROOT)}:{line}" for name, path in MODULES.items()
           if name != "fsdpzero.tuning" and name not in PROCESS_TUNING_READERS
           for line in _process_tuning_reads(path.read_text())]
    assert not bad, ("process-wide knob state (fsdpzero.tuning.current) read outside fsdpzero/tuning.py; pass the "
                     "engine's settings (engine.tuning) instead:\n" + "\n".join(bad))


# Where the process defaults (defaults < FSDPZERO_* environment) are read, each with why: the places settings are
# built, once. Everything else is handed an engine's settings; a function that may be called without an engine
# takes `tuning=None` and calls or_defaults(tuning) on that parameter (its call builds them, once, and passes them
# down). So an engine never sees the environment after wrap, and two engines in one process keep their own.
SETTINGS_BUILDERS = {
    ("fsdpzero.api", "wrap"): "builds the engine's settings (tuning.use), once, before any process group",
    ("fsdpzero.cli.env", "report"): "`fsdpzero env` reports the process's environment; no engine exists there",
}
PROCESS_DEFAULTS = {"resolve", "from_env", "use", "sources", "current", "_explicit"}


def _settings_reads(source: str) -> list[tuple[int, str, str]]:
    """(line, enclosing function, what) for each read of the process defaults through fsdpzero.tuning (a name of
    PROCESS_DEFAULTS imported from it or reached through it), and each or_defaults(x) whose x is not a parameter
    of the enclosing function."""
    tree = ast.parse(source)
    modules, names = {"fsdpzero.tuning"}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "fsdpzero.tuning":
            names.update({a.asname or a.name: a.name for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module == "fsdpzero":
            modules |= {a.asname or a.name for a in node.names if a.name == "tuning"}
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name == "fsdpzero.tuning" and a.asname}
    out = []

    def visit(node, func: str, params: set[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            params = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x is not None}
            func = getattr(node, "name", func)
        target = None
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in names:
            target = names[node.id]
        elif isinstance(node, ast.Attribute) and ast.unparse(node.value) in modules:
            target = node.attr
        if target in PROCESS_DEFAULTS:
            out.append((node.lineno, func, target))
        if isinstance(node, ast.Call):
            callee = (names.get(node.func.id) if isinstance(node.func, ast.Name) else
                      node.func.attr if isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value) in modules
                      else None)
            if callee == "or_defaults" and not (len(node.args) == 1 and isinstance(node.args[0], ast.Name)
                                                and node.args[0].id in params):
                out.append((node.lineno, func, "or_defaults(<not a parameter>)"))
        for child in ast.iter_child_nodes(node):
            visit(child, func, params)
    visit(tree, "<module>", set())
    return sorted(out)


def test_the_settings_finder_sees_each_read():
    assert _settings_reads("from fsdpzero.tuning import resolve as r\ndef f():\n    return r()\n") == \
        [(3, "f", "resolve")]
    assert _settings_reads("from fsdpzero import tuning\ndef g():\n    tuning.from_env()\n") == \
        [(3, "g", "from_env")]
    assert _settings_reads("import fsdpzero.tuning as t\nx = t.use\n") == [(2, "<module>", "use")]
    ok = "from fsdpzero.tuning import or_defaults\ndef f(tuning=None):\n    return or_defaults(tuning)\n"
    assert _settings_reads(ok) == []
    late = "from fsdpzero.tuning import or_defaults\ndef f(engine):\n    return or_defaults(None)\n"
    assert _settings_reads(late) == [(3, "f", "or_defaults(<not a parameter>)")]
    assert _settings_reads("def f(engine):\n    return engine.tuning.resolve\n") == []


def test_process_defaults_are_read_only_where_settings_are_built():
    bad = [f"{path.relative_to(ROOT)}:{line} {func}: {what}" for name, path in MODULES.items()
           if name != "fsdpzero.tuning"
           for line, func, what in _settings_reads(path.read_text()) if (name, func) not in SETTINGS_BUILDERS]
    assert not bad, ("the process's knob defaults read where no settings are built; pass the engine's settings "
                     "(engine.tuning), or take tuning=None and call or_defaults(tuning) at the entry:\n"
                     + "\n".join(bad))
    for (name, func), why in SETTINGS_BUILDERS.items():   # each entry still names a place that reads them
        assert any(f == func for _, f, _ in _settings_reads(MODULES[name].read_text())), (name, func, why)


# A module global of fsdpzero_ops that may be rebound, with why it is not a setting.
OPS_LATCHES = {"_warned_fallback": "the no_build warning, given once per process"}


def _ops_state_writes(name: str, source: str) -> list[tuple[int, str]]:
    """In module `name`: `global x` statements of fsdpzero_ops (x not a latch), and assignments to an attribute of
    an fsdpzero_ops module it imported (`cpu_adam.DEFAULT_IMPL = ...`, `setattr(build, ...)`)."""
    tree = ast.parse(source)
    out = []
    if name.startswith("fsdpzero_ops"):
        out += [(node.lineno, f"global {', '.join(node.names)}") for node in ast.walk(tree)
                if isinstance(node, ast.Global) and set(node.names) - set(OPS_LATCHES)]
    ops_names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fsdpzero_ops"):
            ops_names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            ops_names |= {a.asname or a.name for a in node.names if a.name.startswith("fsdpzero_ops")}
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        hits = [t for t in targets if isinstance(t, ast.Attribute) and ast.unparse(t.value) in ops_names]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and node.args and ast.unparse(node.args[0]) in ops_names):
            hits.append(node)
        out += [(node.lineno, ast.unparse(h)[:60]) for h in hits]
    return out


def test_the_ops_state_finder_sees_each_write():
    assert _ops_state_writes("fsdpzero_ops.x", "D = 1\ndef set_d(v):\n    global D\n    D = v\n") == \
        [(3, "global D")]
    assert _ops_state_writes("fsdpzero_ops.x", "def warn():\n    global _warned_fallback\n") == []
    assert _ops_state_writes("fsdpzero.t", "from fsdpzero_ops import cpu_adam\ncpu_adam.DEFAULT_IMPL = 'x'\n") == \
        [(2, "cpu_adam.DEFAULT_IMPL")]
    assert _ops_state_writes("fsdpzero.t", "import fsdpzero_ops.build as b\nsetattr(b, 'NO_BUILD', 1)\n") == \
        [(2, "setattr(b, 'NO_BUILD', 1)")]
    assert _ops_state_writes("fsdpzero.t", "from fsdpzero_ops import cpu_adam\nopt = cpu_adam.CPUAdam([])\n"
                                           "opt.impl = 'x'\n") == []


def test_ops_keep_no_settings():
    """The ops take each choice (CPU Adam kernel, aio engine, build) as an argument: a module default set by the
    library (the old apply_to_ops) would be the last engine's, read by every engine in the process."""
    bad = [f"{path.relative_to(ROOT)}:{line}: {what}" for name, path in MODULES.items()
           for line, what in _ops_state_writes(name, path.read_text())]
    assert not bad, ("fsdpzero_ops state set or rebound (pass the value as an argument instead):\n" + "\n".join(bad))


def _method_overrides(source: str, methods: set[str]) -> list[tuple[int, str]]:
    """(line, target) for each `obj.<method> = ...` or `setattr(obj, "<method>", ...)`: a method replaced on one
    instance, which a reader of the object's class cannot see."""
    out = []
    for node in ast.walk(ast.parse(source)):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        out += [(node.lineno, ast.unparse(t)) for t in targets if isinstance(t, ast.Attribute) and t.attr in methods]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in methods):
            out.append((node.lineno, f"setattr(..., {node.args[1].value!r})"))
    return out


def _wrapped_methods() -> set[str]:
    """The methods of what the library wraps: modules, optimizers, FSDP2's parameter groups (dunders aside: Python
    looks those up on the class)."""
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    return {n for cls in (torch.nn.Module, torch.optim.Optimizer, FSDPParamGroup) for n in dir(cls)
            if callable(getattr(cls, n, None)) and not n.startswith("__")}


def test_the_override_finder_sees_each_form():
    methods = _wrapped_methods()
    assert {"forward", "post_backward", "zero_grad", "state_dict", "step", "named_parameters"} <= methods
    found = _method_overrides("block.forward = f\nsetattr(opt, 'step', g)\nself.model.zero_grad = h\n"
                              "x.forward_count = 1\nt.compiled_forward = c\n", methods)
    assert sorted(line for line, _ in found) == [1, 2, 3]


def test_no_instance_overrides_a_method_but_the_fsdp2_one():
    """Behaviour comes from classes (a mixin in front of the object's class, as fully_shard does), wrappers or
    documented hooks; the one override FSDP2 leaves no hook for (a unit's post-backward) is in fsdp2_internals.py."""
    methods = _wrapped_methods()
    found = {path: _method_overrides(path.read_text(), methods) for path in MODULES.values()}
    assert [target for _, target in found.pop(FSDP_STATE)] == ["group.post_backward"]
    bad = [f"{path.relative_to(ROOT)}:{line}: {target}" for path, hits in found.items() for line, target in hits]
    assert not bad, "methods replaced on an instance:\n" + "\n".join(bad)
