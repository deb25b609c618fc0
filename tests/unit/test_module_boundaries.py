"""Which modules import which: the leaves stay leaves and no two modules need each other.

Two ways to look: every import statement in a module's source (at its top or inside a
function, where a deferred import would hide a circle), and ``sys.modules`` after importing
in a fresh process (what an import really pulls in)."""

from __future__ import annotations

import ast
import subprocess

import pytest

from conftest import BIN, REPO, RUN_TIMEOUT, rank_env


def imports_in(module: str) -> set[str]:
    """Every module an import statement anywhere in ``module``'s source names."""
    path = REPO / module.replace(".", "/")
    source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    named: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            named |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
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


def test_the_data_contract_is_a_leaf():
    assert not under(imports_in("hvdtrain.data.contract"), *PRODUCERS, "hvdtrain.config")
    [loaded] = loaded_after("hvdtrain.data.contract")
    assert "hvdtrain.data.contract" in loaded
    assert not under(loaded, *PRODUCERS, "hvdtrain.config")


def test_builtin_sources_and_user_data_do_not_import_each_other():
    assert not under(imports_in("hvdtrain.data.sources"), "hvdtrain.data.user")
    assert not under(imports_in("hvdtrain.data.user"), "hvdtrain.data.sources")


def test_config_loads_neither_tensorflow_nor_the_registries():
    """``hvdtrain --help`` reads the config: the option choices come from a leaf of names."""
    [loaded] = loaded_after("hvdtrain.config")
    assert not under(loaded, "tensorflow", "keras", "hvdtrain.data", "hvdtrain.models")


def test_the_builtin_names_are_the_registries_keys():
    from hvdtrain.builtin_names import DATASETS, MODELS
    from hvdtrain.data.sources import SOURCES
    from hvdtrain.models import BUILTIN

    assert tuple(SOURCES) == DATASETS
    assert tuple(BUILTIN) == MODELS


def test_the_dropin_apis_share_a_leaf_and_only_keras_builds_on_tensorflow():
    assert not under(imports_in("hvdtrain.dropin"), "hvdtrain.keras", "hvdtrain.tensorflow",
                     "hvdtrain.dropin_tf")
    assert not under(imports_in("hvdtrain.tensorflow"), "hvdtrain.keras")
    assert not under(imports_in("hvdtrain.dropin_tf"), "hvdtrain.keras", "hvdtrain.tensorflow")
    assert not under(imports_in("hvdtrain.dropin_ops"), "hvdtrain", "horovod")
    assert not under(imports_in("hvdtrain.dropin_elastic"), "hvdtrain.keras",
                     "hvdtrain.tensorflow", "horovod")
    assert not under(imports_in("hvdtrain.tf_graph_mode"), "hvdtrain", "horovod")


@pytest.mark.parametrize("first, second", [("hvdtrain.keras", "hvdtrain.tensorflow"),
                                           ("hvdtrain.tensorflow", "hvdtrain.keras")])
def test_the_dropin_apis_import_in_either_order(first, second):
    alone, _ = loaded_after(first, second)
    if first == "hvdtrain.tensorflow":
        assert not under(alone, "hvdtrain.keras")
