"""Which modules import which: the leaves stay leaves and no two modules need each other.

Two ways to look: every import statement in a module's source (at its top or inside a
function, where a deferred import would hide a circle), and ``sys.modules`` after importing
in a fresh process (what an import really pulls in)."""

from __future__ import annotations

import ast
import subprocess

import pytest

from conftest import BIN, REPO, RUN_TIMEOUT, rank_env


def import_statements(module: str) -> list[tuple[str | None, list[str]]]:
    """Every import statement anywhere in ``module``'s source (at its top or inside a
    function): (the module of ``from ... import``, else None; the names imported)."""
    path = REPO / module.replace(".", "/")
    source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    return [(node.module if isinstance(node, ast.ImportFrom) else None,
             [alias.name for alias in node.names])
            for node in ast.walk(ast.parse(source.read_text()))
            if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and node.module)]


def imports_in(module: str) -> set[str]:
    """Every module an import statement anywhere in ``module``'s source names."""
    named: set[str] = set()
    for origin, names in import_statements(module):
        named |= set(names) if origin is None else {origin, *(f"{origin}.{n}" for n in names)}
    return named


def under(names: set[str], *packages: str) -> set[str]:
    """The names that are one of ``packages`` or inside one."""
    return {name for name in names for package in packages
            if name == package or name.startswith(package + ".")}


def loaded_after(*modules: str) -> list[set[str]]:
    """The modules loaded after importing each of ``modules`` in turn, in one new process."""
    code = "import sys\n" + "".join(
        f"import {module}\nprint(' '.join(sorted(sys.modules)))\n" for module in modules)
    result = subprocess.run([str(BIN / "python"), "-c", code], cwd=REPO, env=rank_env(),
                            text=True, capture_output=True, timeout=RUN_TIMEOUT,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    return [set(line.split()) for line in result.stdout.splitlines()]


PRODUCERS = ("hvdtrain.data.sources", "hvdtrain.data.user", "hvdtrain.data.load")


@pytest.mark.slow   # a fresh Python per loaded_after (TensorFlow): make test, not test-fast
def test_the_data_contract_is_a_leaf():
    assert not under(imports_in("hvdtrain.data.contract"), *PRODUCERS, "hvdtrain.config")
    [loaded] = loaded_after("hvdtrain.data.contract")
    assert "hvdtrain.data.contract" in loaded
    assert not under(loaded, *PRODUCERS, "hvdtrain.config")


def test_builtin_sources_and_user_data_do_not_import_each_other():
    assert not under(imports_in("hvdtrain.data.sources"), "hvdtrain.data.user")
    assert not under(imports_in("hvdtrain.data.user"), "hvdtrain.data.sources")


def test_config_and_options_load_neither_tensorflow_nor_the_registries():
    """``hvdtrain --help`` reads the options: their choices come from a leaf of names. The
    fields (``config``) do not need how they are read (``options``)."""
    assert not under(imports_in("hvdtrain.config"), "hvdtrain.options")
    [loaded] = loaded_after("hvdtrain.options")
    assert "hvdtrain.config" in loaded
    assert not under(loaded, "tensorflow", "keras", "hvdtrain.data", "hvdtrain.models")


def test_the_builtin_names_are_the_registries_keys():
    from hvdtrain.builtin_names import DATASETS, MODELS
    from hvdtrain.data.sources import SOURCES
    from hvdtrain.models import BUILTIN

    assert tuple(SOURCES) == DATASETS
    assert tuple(BUILTIN) == MODELS


def modules_of(package: str) -> set[str]:
    """``package`` and every module inside it, by dotted name."""
    return {module for module in package_modules()
            if module == package or module.startswith(package + ".")}


# The drop-in's facades may build on these and on each other (hvdtrain.keras on
# hvdtrain.tensorflow, not the other way round), nothing else of the package.
FACADE_BASES = ("hvdtrain.dropin", "hvdtrain.collectives", "hvdtrain.keras_internals",
                "hvdtrain.errors")


def test_the_optimizer_wrappers_do_not_import_the_trainer():
    """The drop-in builds on them, and the drop-in does not load the trainer."""
    modules = package_modules()
    for module in modules_of("hvdtrain.optimizers"):
        assert not under(module_edges(module, modules), "hvdtrain.training"), module


def test_the_dropin_package_does_not_import_the_trainer_or_its_facades():
    modules = package_modules()
    for module in modules_of("hvdtrain.dropin"):
        assert not under(module_edges(module, modules), "hvdtrain.training", "hvdtrain.keras",
                         "hvdtrain.tensorflow"), module
    assert not under(imports_in("hvdtrain.dropin.core"), "hvdtrain.dropin.tf_ops",
                     "hvdtrain.dropin.tensor_operations")
    assert not under(imports_in("hvdtrain.dropin.ops"), "hvdtrain", "horovod")
    assert not under(imports_in("hvdtrain.dropin.elastic"), "horovod")
    assert not under(imports_in("hvdtrain.dropin.tensor_operations"), "hvdtrain.dropin",
                     "horovod")
    assert not under(imports_in("hvdtrain.collectives.tf_graph_mode"), "hvdtrain", "horovod")


def test_the_facades_build_only_on_the_dropin():
    modules = package_modules()
    for module in modules_of("hvdtrain.keras") | modules_of("hvdtrain.tensorflow"):
        beyond = {name for name in module_edges(module, modules)
                  if not under({name}, "hvdtrain.keras", "hvdtrain.tensorflow", *FACADE_BASES)}
        assert beyond == set(), f"{module} imports {sorted(beyond)}"
    for module in modules_of("hvdtrain.tensorflow"):
        assert not under(module_edges(module, modules), "hvdtrain.keras"), module


@pytest.mark.slow
@pytest.mark.parametrize("first, second", [("hvdtrain.keras", "hvdtrain.tensorflow"),
                                           ("hvdtrain.tensorflow", "hvdtrain.keras")])
def test_the_dropin_apis_import_in_either_order(first, second):
    alone, both = loaded_after(first, second)
    if first == "hvdtrain.tensorflow":
        assert not under(alone, "hvdtrain.keras")
    assert not under(both, "hvdtrain.training")


def package_modules() -> set[str]:
    """Every module of the hvdtrain package, by dotted name."""
    return {".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            for path in (REPO / "hvdtrain").rglob("*.py")}


def module_edges(module: str, modules: set[str]) -> set[str]:
    """The package's modules that ``module``'s import statements (deferred ones too) load:
    ``from package import name`` loads ``package.name`` where that is a module, else
    ``package`` (Python's implicit import of a parent package is not counted)."""
    edges: set[str] = set()
    for origin, names in import_statements(module):
        edges |= set(names) if origin is None else {
            f"{origin}.{name}" if f"{origin}.{name}" in modules else origin for name in names}
    return (edges & modules) - {module}


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of imports in ``graph`` (a module, the modules it imports, ..., the first
    again), or [] when there is none."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str]:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return []
        for named in sorted(graph[module]):
            found = visit(named, path + [module])
            if found:
                return found
        done.add(module)
        return []

    for module in sorted(graph):
        found = visit(module, [])
        if found:
            return found
    return []


def test_no_module_of_the_package_needs_itself_through_others():
    """A deferred import (inside a function) only hides a circle, so it counts."""
    modules = package_modules()
    assert import_cycle({module: module_edges(module, modules) for module in modules}) == []
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]


@pytest.mark.slow
def test_mlflow_is_imported_in_one_place_and_not_by_training():
    """The optional client: only ``tracking.mlflow_run`` names it, and the trainer's own
    modules load without it (an untracked job and every rank but a tracked job's 0)."""
    importers = [module for module in package_modules()
                 if under(imports_in(module), "mlflow")]
    assert importers == ["hvdtrain.tracking.mlflow_run"]
    [loaded] = loaded_after("hvdtrain.training.run")
    assert "hvdtrain.tracking" in loaded and not under(loaded, "mlflow")
