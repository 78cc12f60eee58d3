"""The house has floors (README "Layout", DESIGN.md): a module imports only from its own floor or
below, at module level and inside functions alike; and the server, the Triton model, the bench and
training decode only through the engine seam and the backend factory, never through the loop.

Every first-party import (ast: `import x`, `from x import y`, relative imports, function-local
ones, TYPE_CHECKING blocks) of every module under dflash_trt/ and plugins/ is checked.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (module prefix, floor): the longest matching prefix wins. Keep in step with README "Layout".
FLOORS: dict[str, int] = {
    "dflash_trt": 0,  # the package root: __version__ and the error types
    "dflash_trt.errors": 0, "dflash_trt.config": 0, "dflash_trt.engine": 0, "dflash_trt.fileio": 0,
    "dflash_trt.prompts": 0, "dflash_trt.trtllm_release": 0,
    "dflash_trt.quant": 1, "plugins.kernels": 1, "plugins.trt": 1,
    "dflash_trt.models": 2, "dflash_trt.checkpoint": 2,
    "dflash_trt.speculative": 3,
    "dflash_trt.runtime": 4,
    "dflash_trt.serve": 5, "dflash_trt.builder": 5, "dflash_trt.bench": 5, "dflash_trt.train": 5,
    "dflash_trt.cli": 6, "dflash_trt.commands": 6,
    "plugins": 6, "plugins.bench_kernels": 6,  # a benchmark script over the kernels and their references
}
DECODE_LOOP = "dflash_trt.speculative.decoder"
LOOP_USERS = ("dflash_trt.speculative", "dflash_trt.runtime.factory", "dflash_trt.runtime.mpi")
SEAM_ONLY = ("dflash_trt.serve", "dflash_trt.bench", "dflash_trt.train", "dflash_trt.commands")


def floor_of(module: str) -> int:
    best = max((p for p in FLOORS if module == p or module.startswith(p + ".")), key=len, default=None)
    assert best is not None, f"{module} has no floor: add it to FLOORS (and to the README layout table)"
    return FLOORS[best]


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(list((ROOT / "dflash_trt").rglob("*.py")) + list((ROOT / "plugins").rglob("*.py"))):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, imported first-party module) for every import statement in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            # `from pkg import submodule` imports the submodule
            found += [(node.lineno, f"{target}.{a.name}") for a in node.names if f"{target}.{a.name}" in MODULES]
    return [(line, t) for line, t in found if t.split(".")[0] in ("dflash_trt", "plugins")]


MODULES = modules()


def test_every_module_has_a_floor():
    for module in MODULES:
        floor_of(module)


def test_no_module_imports_from_a_higher_floor():
    climbs = []
    for module, path in MODULES.items():
        mine = floor_of(module)
        for line, target in imports_of(module, path):
            if floor_of(target) > mine:
                climbs.append(f"{path.relative_to(ROOT)}:{line} (floor {mine}) imports {target} "
                              f"(floor {floor_of(target)})")
    assert not climbs, "upward imports:\n" + "\n".join(climbs)


def test_only_the_seam_and_the_factory_lead_to_the_decode_loop():
    users = sorted(f"{MODULES[m].relative_to(ROOT)}:{line}" for m in MODULES for line, t in imports_of(m, MODULES[m])
                   if t == DECODE_LOOP and not m.startswith(LOOP_USERS))
    assert not users, f"import the engine seam and runtime.factory instead of {DECODE_LOOP}: {users}"
    adapter = sorted(f"{MODULES[m].relative_to(ROOT)}:{line}" for m in MODULES for line, t in imports_of(m, MODULES[m])
                     if t == "dflash_trt.runtime.trtllm" and m.startswith(SEAM_ONLY))
    assert not adapter, f"reach the TensorRT-LLM adapter through runtime.factory: {adapter}"


@pytest.mark.parametrize("source, expected", [
    ("from dflash_trt.runtime import factory\n", "dflash_trt.runtime.factory"),
    ("def f():\n    from ..speculative.decoder import DFlashEngine\n", "dflash_trt.speculative.decoder"),
])
def test_the_walker_sees_submodule_and_function_local_imports(tmp_path, source, expected):
    path = tmp_path / "mod.py"
    path.write_text(source)
    assert expected in [t for _, t in imports_of("dflash_trt.models.mod", path)]
