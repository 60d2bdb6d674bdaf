"""The import structure: layers that import in one direction only, and no import cycle.

An AST scan (no imports executed) of every ``import`` in ``torchtpu/`` and ``ray_integration/``,
module level and inside functions alike, relative imports resolved. See docs/architecture.md.
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROJECT = ("torchtpu", "torchtpu_models", "torchtpu_rl", "torchtpu_rec", "ray_integration", "torchtpu_autoload")

# torchtpu's layers, lowest first: a module may import its own layer and the ones below it.
TORCHTPU_LAYERS = {
    "torchtpu.base": 0,
    "torchtpu.runtime": 1,
    "torchtpu.dispatch": 2,
    "torchtpu.ops": 3,
    "torchtpu.bucketing": 4,
    "torchtpu.interop": 4,
    "torchtpu.serialization": 4,
    "torchtpu.distributed": 4,
    "torchtpu.profiler": 4,
    "torchtpu.quantization": 4,
    "torchtpu.jagged": 4,  # fbgemm's jagged ops, installed by torchtpu_rec (imports fbgemm_gpu)
    "torchtpu.compile": 5,
    "torchtpu": 6,  # __init__ wires the layers together
}
# which project packages each package may import (arrows point down)
ALLOWED_PACKAGES = {
    "torchtpu": {"torchtpu"},
    "torchtpu_models": {"torchtpu_models", "torchtpu"},
    "ray_integration": {"ray_integration", "torchtpu"},
    "torchtpu_rl": {"torchtpu_rl", "torchtpu", "torchtpu_models", "ray_integration"},
    "torchtpu_rec": {"torchtpu_rec", "torchtpu", "ray_integration"},
    # torch's entry point: above everything, imports torchtpu / torchtpu_rec only on first use
    "torchtpu_autoload": {"torchtpu_autoload", "torchtpu", "torchtpu_rec"},
}


def _module_name(path: pathlib.Path) -> tuple[str, bool]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts = parts[:-1]
    return ".".join(parts), is_pkg


def _is_module(name: str) -> bool:
    p = ROOT.joinpath(*name.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def _imports(path: pathlib.Path) -> list[tuple[str, int]]:
    """(imported project module, line) for every import statement of the file."""
    mod, is_pkg = _module_name(path)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PROJECT:
                    out.append((a.name, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] not in PROJECT:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((sub if _is_module(sub) else target, node.lineno))
    return out


def _graph(packages):
    graph = {}
    for pkg in packages:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            mod, _ = _module_name(path)
            graph[mod] = (path, _imports(path))
    return graph


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components with more than one module (or a self-import), Tarjan's."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def deps(m):
        return {d for d, _ in graph[m][1] if d in graph and d != m}

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in deps(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _layer(mod: str) -> int:
    best = None
    for prefix, rank in TORCHTPU_LAYERS.items():
        if mod == prefix or mod.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, rank)
    assert best is not None, f"{mod} is in no layer of TORCHTPU_LAYERS: add it"
    return best[1]


@pytest.mark.parametrize("package", ["torchtpu", "ray_integration", "torchtpu_rl", "torchtpu_rec", "torchtpu_models"])
def test_no_import_cycle(package):
    cycles = _cycles(_graph([package]))
    assert not cycles, f"import cycles in {package}: {cycles}"


def test_torchtpu_imports_point_down_only():
    bad = []
    for mod, (path, imports) in _graph(["torchtpu"]).items():
        for dep, line in imports:
            if dep.split(".")[0] != "torchtpu":
                continue
            if _layer(dep) > _layer(mod):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {mod} (layer {_layer(mod)}) imports {dep} "
                           f"(layer {_layer(dep)})")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_packages_import_only_the_layers_below():
    bad = []
    for pkg, allowed in ALLOWED_PACKAGES.items():
        for mod, (path, imports) in _graph([pkg]).items():
            for dep, line in imports:
                if dep.split(".")[0] not in allowed:
                    bad.append(f"{path.relative_to(ROOT)}:{line}: {pkg} imports {dep}")
    assert not bad, "\n".join(bad)


def test_the_scan_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    """The checker itself: a cycle hidden in a function-level relative import is found."""
    pkg = tmp_path / "torchtpu_rl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n    return x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _cycles(_graph(["torchtpu_rl"])) == [["torchtpu_rl.a", "torchtpu_rl.b"]]


# torchtpu_rl: the modules below the Ray layer (the learner, the rollout engine, rewards, scoring, checkpoints,
# data) import neither Ray nor the modules that hold actors (driver, workers, topology, sharded_learner, train):
# they run and are tested in one process.
RL_RAY_LAYER = {"torchtpu_rl.driver", "torchtpu_rl.workers", "torchtpu_rl.topology", "torchtpu_rl.sharded_learner",
                "torchtpu_rl.train", "torchtpu_rl.worker_group", "torchtpu_rl.sync_controller", "torchtpu_rl.recovery"}
RL_BELOW_RAY = ("algorithms", "rewards", "scoring", "checkpoint_policy", "checkpoint", "data", "learner", "lora",
                "policy", "hf", "rollout", "protocol", "config")
# the bottom of torchtpu_rl: the wire types and the typed configs stand on no other module of it
RL_BOTTOM = ("protocol", "config")


def _imports_ray(path: pathlib.Path) -> list:
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        lines += [node.lineno for n in names if n.split(".")[0] == "ray"]
    return lines


@pytest.mark.parametrize("name", RL_BELOW_RAY)
def test_rl_modules_below_the_ray_layer_import_no_ray(name):
    path = ROOT / "torchtpu_rl" / f"{name}.py"
    up = [(m, line) for m, line in _imports(path) if m in RL_RAY_LAYER]
    assert not up, f"torchtpu_rl.{name} imports the Ray layer: {up}"
    assert not _imports_ray(path), f"torchtpu_rl.{name} imports ray at lines {_imports_ray(path)}"


@pytest.mark.parametrize("name", RL_BOTTOM)
def test_rl_protocol_and_config_are_the_bottom(name):
    path = ROOT / "torchtpu_rl" / f"{name}.py"
    up = [(m, line) for m, line in _imports(path) if m.startswith("torchtpu_rl")]
    assert not up, f"torchtpu_rl.{name} is the bottom of torchtpu_rl and imports {up}"


def test_rl_learner_and_rollout_engines_never_import_each_other():
    learner = {"torchtpu_rl.learner", "torchtpu_rl.sharded_learner"}
    engines = {"torchtpu_rl.rollout", "torchtpu_rl.serving"}
    bad = []
    for side, other in ((learner, engines), (engines, learner)):
        for mod in side:
            path = ROOT / "torchtpu_rl" / f"{mod.split('.')[-1]}.py"
            bad += [f"{mod} imports {m} (line {line})" for m, line in _imports(path) if m in other]
    assert not bad, "\n".join(bad)
