"""The package's layers, read from its imports: ground <- kernels <- functions <- shells, no circle,
no private name used outside its own file, and no module over 500 lines but the named ones."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_kl"

# what each layer may import from the package (a layer also imports its own folder's modules)
LAYER_OF = {
    "ground": 0,
    "kernels": 1,
    "estimators": 1,
    "inputs": 2,
    "kept_inputs": 2,
    "compute": 2,
    "reduce": 2,
    "functional": 2,
    "sequence": 2,
    "logprobs": 2,
    "divergences": 2,
    "distill": 2,
    "deprecated": 2,
    "accumulation": 2,
    "mismatch": 2,
}  # shells and integrations (the rest: loss, coefficient, metric, controllers, callbacks/, refresh/, hf...): 3

#: Modules over 500 lines, each one idea (see the README's layout): the controllers (one state machine each,
#: their tensor and float paths side by side), the mismatch metrics (verl's set of keys, computed in one pass),
#: the vocabulary engine (one chunked autograd engine: sources x partitions x sampler x quantities), and lk.hf
#: (one public namespace, the Hugging Face glue a user reaches as ``lk.hf.*``; a split is left to its owner).
LONG = {"lightning_kl/controllers.py", "lightning_kl/mismatch.py", "lightning_kl/kernels/engine.py", "lightning_kl/hf.py"}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        out[name] = ast.parse(path.read_text())
    return out


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return 4  # the package's __init__ re-exports everything
    return LAYER_OF.get(parts[1], 3)


def _imports(tree: ast.Module) -> list[tuple[str, list[str]]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_kl"):
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("lightning_kl")]
    return found


def test_each_layer_imports_only_its_own_and_the_layers_below_it_without_a_circle():
    modules = _modules()
    graph = {m: {t for t, _ in _imports(tree) if t != m} for m, tree in modules.items()}
    for module, targets in graph.items():
        for target in targets:
            assert _layer(target) <= _layer(module), f"{module} imports {target}, a layer above it"

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import circle: {' -> '.join(path + (module,))}"
        for target in graph.get(module, ()):
            visit(target, path + (module,))

    for module in graph:
        visit(module, ())


def test_no_private_name_is_imported_from_another_file():
    for module, tree in _modules().items():
        for target, names in _imports(tree):
            private = [n for n in names if n.startswith("_")]
            assert not private, f"{module} imports private {private} from {target}"


def test_no_module_is_over_500_lines_but_the_named_ones():
    long = {
        str(path.relative_to(PACKAGE.parent)).replace("\\", "/")
        for path in PACKAGE.rglob("*.py")
        if len(path.read_text().splitlines()) > 500
    }
    assert long <= LONG, long - LONG
