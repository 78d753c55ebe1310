"""The library's layout: ``sparsemixer_jax`` never imports ``lab`` (the repository's benchmarks,
studies and experiments), nor ``experiments``, and the wheel holds the library alone; the models
never import the data pipelines (what both need, such as the token ids, lives below both); no
module of the library uses another module's private (underscore) name; the experiment config's
type is named only where a config is read (the doors) and defined (the schema); no import cycle
among the library's or the lab's modules, counting every import (inside functions and under
``TYPE_CHECKING`` too), and none between the library's packages; library modules at most 600
lines, entry points at most 150."""

import ast
import pathlib
import re
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIBRARY = "sparsemixer_jax"
REPOSITORY_PACKAGES = ("lab", "experiments", "tests")


def _imported_modules(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"):
            names.append(node.args[0].value)  # importlib.import_module("...")
    return names


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _library_imports(path: pathlib.Path, tree: ast.AST, package: str = LIBRARY
                     ) -> list[tuple[int, str, str | None]]:
    """``(line, module, name)`` for every import of a library module in ``tree`` (``name`` is
    what ``from module import name`` takes, ``None`` for ``import module``); relative imports
    are resolved against ``path``'s package."""
    module = _module_name(path)
    here = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = here.split(".")[:len(here.split(".")) - node.level + 1]
                source = ".".join(base + ([source] if source else []))
            found += [(node.lineno, source, alias.name) for alias in node.names]
    return [entry for entry in found if entry[1].split(".")[0] == package]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_names_used_across_modules(path: pathlib.Path, tree: ast.AST) -> list[str]:
    """``from other import _name`` and ``other._name`` (through any attribute chain rooted at a
    name bound by an import of the library) in ``tree``, as ``"line: module.name"``."""
    module = _module_name(path)
    bound, found = {}, []
    for line, source, name in _library_imports(path, tree):
        if name is None:  # ``import a.b.c`` binds ``a``; ``import a.b as c`` binds ``c``
            bound[source.split(".")[0]] = LIBRARY
            continue
        if _is_private(name) and source != module:
            found.append(f"{line}: {source}.{name}")
        bound[name] = f"{source}.{name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def _library_sources() -> list[tuple[pathlib.Path, ast.AST]]:
    return [(path, ast.parse(path.read_text(), filename=str(path)))
            for path in sorted((ROOT / LIBRARY).rglob("*.py"))]


def test_the_models_never_import_the_data_pipelines():
    """The models sit below the data pipelines: token ids both need live in ``token_ids``."""
    offending = sorted({f"{path.relative_to(ROOT)}:{line}: {source}"
                        for path, tree in _library_sources() if path.parent.name == "models"
                        for line, source, name in _library_imports(path, tree)
                        if source.startswith(f"{LIBRARY}.data")
                        or (source == LIBRARY and name == "data")})
    assert not offending, offending


LONG_FUNCTION_LINES = 80


def _long_functions_without_a_reason() -> list[str]:
    """Library functions over :data:`LONG_FUNCTION_LINES` lines (docstring included) whose
    docstring has no paragraph beginning "Long" that says why."""
    found = []
    for path, tree in _library_sources():
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if node.end_lineno - node.lineno + 1 <= LONG_FUNCTION_LINES:
                continue
            paragraphs = (ast.get_docstring(node) or "").split("\n\n")
            if not any(p.strip().startswith("Long") for p in paragraphs):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name}")
    return found


def test_every_long_library_function_says_why():
    """A library function runs to at most about 80 lines; a longer one says why in its
    docstring (a paragraph beginning "Long ...")."""
    offending = _long_functions_without_a_reason()
    assert not offending, offending


def test_the_long_function_check_sees_long_functions(monkeypatch):
    """The check is not blind: with a lower limit, functions without a reason are found."""
    monkeypatch.setattr(sys.modules[__name__], "LONG_FUNCTION_LINES", 40)
    assert _long_functions_without_a_reason()


def test_no_private_name_is_used_across_library_modules():
    """A name another module needs is public; an underscore means "this module's own"."""
    offending = [f"{path.relative_to(ROOT)}:{entry}" for path, tree in _library_sources()
                 for entry in _private_names_used_across_modules(path, tree)]
    assert not offending, offending


def test_the_private_name_check_sees_private_names():
    path = ROOT / LIBRARY / "models" / "example.py"
    tree = ast.parse("from sparsemixer_jax.routers.registry import _taking, public\n"
                     "from sparsemixer_jax import routers\n"
                     "from . import _own_package_helper\n"
                     "import sparsemixer_jax.moe.layer\n"
                     "import os\n"
                     "routers.registry._taking('x')\n"
                     "sparsemixer_jax.moe.layer._split(1)\n"
                     "os._exit(0)\n"
                     "public.__doc__, self._own\n")
    assert _private_names_used_across_modules(path, tree) == [
        "1: sparsemixer_jax.routers.registry._taking",
        "3: sparsemixer_jax.models._own_package_helper",
        "6: routers.registry._taking",
        "7: sparsemixer_jax.moe.layer._split"]
    data_import = ast.parse("from sparsemixer_jax import data\nfrom ..data.text import PAD_ID\n")
    assert [source for _, source, _ in _library_imports(path, data_import)] == [
        LIBRARY, f"{LIBRARY}.data.text"]


# Where an experiment config is read into typed sections (the tasks, the command-line helpers, the
# compile command) and where its schema lives; everywhere else code takes the sections.
CONFIG_DOORS = ("sparsemixer_jax/tasks/", "sparsemixer_jax/training/cli.py",
                "sparsemixer_jax/aot/command.py", "sparsemixer_jax/training/config.py",
                "sparsemixer_jax/section.py")
CONFIG_TYPE = re.compile(r"ml_collections|ConfigDict")
# The install hint names ml_collections as a package an extra installs, not as the config's type.
PACKAGE_NAMES = {"sparsemixer_jax/extras.py": '"ml_collections"'}


def _config_type_mentions(relative: str, text: str) -> list[str]:
    """``"file:line: text"`` of each line of ``text`` that names the config's type
    (``ml_collections`` or ``ConfigDict``, in code, docstrings or comments alike)."""
    if relative.startswith(CONFIG_DOORS):
        return []
    allowed = PACKAGE_NAMES.get(relative)
    return [f"{relative}:{number}: {line.strip()}"
            for number, line in enumerate(text.splitlines(), 1)
            if CONFIG_TYPE.search(line.replace(allowed, "") if allowed else line)]


def test_only_the_doors_and_the_schema_name_the_config_type():
    """Past the doors the code takes typed sections: no module names ``ml_collections`` or
    ``ConfigDict``, not even in a docstring or a comment."""
    offending = [mention for path in sorted((ROOT / LIBRARY).rglob("*.py"))
                 for mention in _config_type_mentions(path.relative_to(ROOT).as_posix(),
                                                      path.read_text())]
    assert not offending, "\n".join(offending)


def test_the_config_type_check_sees_mentions():
    text = ('import ml_collections\n"""A ConfigDict section."""\nx = 1  # no config here\n'
            'EXTRA = ("flax", "ml_collections")\n')
    assert _config_type_mentions("sparsemixer_jax/training/loop.py", text) == [
        "sparsemixer_jax/training/loop.py:1: import ml_collections",
        'sparsemixer_jax/training/loop.py:2: """A ConfigDict section."""',
        'sparsemixer_jax/training/loop.py:4: EXTRA = ("flax", "ml_collections")']
    assert _config_type_mentions("sparsemixer_jax/extras.py", text) == [
        "sparsemixer_jax/extras.py:1: import ml_collections",
        'sparsemixer_jax/extras.py:2: """A ConfigDict section."""']
    assert _config_type_mentions("sparsemixer_jax/tasks/translation.py", text) == []


def test_every_registered_tasks_code_exists():
    """A task is registered once (``sparsemixer_jax.tasks.TASKS``): its sections' class and its
    trainer, each found where the registration says. The compile command keeps its own map of
    the tasks it compiles (the arrow runs from it to the tasks), each a registered one whose
    typed task resolves its dispatch for a target's platform."""
    from sparsemixer_jax import tasks
    from sparsemixer_jax.aot import command

    for name, task in tasks.TASKS.items():
        assert callable(tasks.load(task.sections_of).from_config), name
        assert not task.trainer or callable(tasks.load(task.trainer)), (name, task.trainer)
    assert list(command.COMPILERS) == ["translation", "lm"]
    for name in command.COMPILERS:
        assert callable(tasks.load(tasks.TASKS[name].sections_of).for_platform), name
    source = (ROOT / LIBRARY / "tasks" / "__init__.py").read_text()
    assert "sparsemixer_jax.aot" not in source  # the tasks name no code built on them


def test_the_library_never_imports_the_lab():
    offending = []
    for path in sorted((ROOT / "sparsemixer_jax").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        offending += [f"{path.relative_to(ROOT)}: {name}" for name in _imported_modules(tree)
                      if name.split(".")[0] in REPOSITORY_PACKAGES]
        # Lazy-name tables (module __getattr__) hold their targets as strings.
        offending += [f"{path.relative_to(ROOT)}: {node.value!r}" for node in ast.walk(tree)
                      if isinstance(node, ast.Constant) and isinstance(node.value, str)
                      and node.value.split(".")[0] == "lab" and "." in node.value
                      and " " not in node.value]
    assert not offending, offending


def test_the_import_check_sees_imports():
    tree = ast.parse("import lab.studies\nfrom lab import exact_experiment\n"
                     "importlib.import_module('lab.benchmarks')\n")
    assert _imported_modules(tree) == ["lab.studies", "lab", "lab.benchmarks"]


def test_the_wheel_packages_only_the_library():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["tool"]["setuptools"]["packages"]["find"]["include"] == ["sparsemixer_jax*"]
    assert (ROOT / "lab" / "__init__.py").is_file()


def test_no_modules_left_at_the_old_paths():
    package = ROOT / "sparsemixer_jax"
    for name in ("models.py", "encoder.py", "electra.py", "causal_lm.py", "lm_config.py",
                 "lm_generate.py", "benchmarks", "studies", "router_bench", "exact/experiment.py",
                 "attention.py", "packed_attention.py", "layers.py", "models/rope.py", "bleu.py",
                 "glue_metrics.py", "decode.py", "translate.py", "sharding.py",
                 "partitioning.py", "config.py", "runtime.py", "cli.py", "checkpoint.py",
                 "model_flops.py"):
        assert not (package / name).exists(), name


def test_the_readme_is_at_most_12000_bytes():
    """The README is a newcomer's page; detail belongs in docs/."""
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 12_000, f"README.md is {size} bytes; move detail into docs/ (limit 12,000)"


MODULE_LINES, ENTRY_POINT_LINES = 600, 150


def test_library_modules_are_at_most_600_lines():
    """A module that grows past 600 lines is split before it takes a third concern."""
    long = [f"{path.relative_to(ROOT)}: {n} lines"
            for path in sorted((ROOT / LIBRARY).rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MODULE_LINES]
    assert not long, long


def test_entry_points_are_at_most_150_lines():
    """An entry point (``python -m experiments.NAME``) parses its flags and calls the library."""
    long = [f"{path.relative_to(ROOT)}: {n} lines"
            for path in sorted((ROOT / "experiments").glob("*.py"))
            if (n := len(path.read_text().splitlines())) > ENTRY_POINT_LINES]
    assert not long, long


def _every_import(path: pathlib.Path, tree: ast.Module, modules: set[str]) -> set[str]:
    """The library modules ``path`` imports anywhere: at module level, inside functions, under
    ``TYPE_CHECKING`` and as ``importlib.import_module("...")`` strings, ``from package import
    module`` read as the submodule. An import inside a function still ties the two modules
    together: hiding it there only moves the cycle from load time to call time."""
    found = set()
    for _, source, name in _library_imports(path, tree, _module_name(path).split(".")[0]):
        if name and f"{source}.{name}" in modules:
            found.add(f"{source}.{name}")
        elif source in modules:
            found.add(source)
    found.update(node.args[0].value for node in ast.walk(tree)
                 if isinstance(node, ast.Call) and node.args
                 and isinstance(node.args[0], ast.Constant)
                 and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
                 and node.args[0].value in modules)
    return found


def _import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself)."""
    order, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node):
        order[node] = low[node] = len(order)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in order:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], order[target])
        if low[node] == order[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1 or node in graph.get(node, ()):
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return cycles


def _import_graph(package: str) -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in sorted((ROOT / package).rglob("*.py"))}
    return {module: _every_import(path, ast.parse(path.read_text()), set(paths))
            for module, path in paths.items()}


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The imports between the library's subpackages and root modules (each module read as the
    one below the root that holds it), leaving out imports of the root package itself (its
    ``__init__``'s names)."""
    def top(module: str) -> str:
        return ".".join(module.split(".")[:2])

    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        packages.setdefault(top(module), set()).update(
            top(target) for target in targets
            if top(target) not in (top(module), LIBRARY))
    return packages


@pytest.mark.parametrize("package", [LIBRARY, "lab"])
def test_no_import_cycle_among_modules(package):
    """No two modules import each other, directly or through others, counting every import
    (:func:`_every_import`)."""
    graph = _import_graph(package)
    assert sum(map(len, graph.values())) > 30  # the graph was read, not left empty
    assert not _import_cycles(graph), _import_cycles(graph)


def test_no_arrow_back_up_among_the_library_packages():
    """The library's subpackages (and root modules) import each other in one direction: no
    package imports one that imports it back, through any of their modules."""
    cycles = _import_cycles(_package_graph(_import_graph(LIBRARY)))
    assert not cycles, cycles


def test_the_import_graph_sees_imports_hidden_in_functions(tmp_path):
    """A cycle hidden in a function, under ``TYPE_CHECKING`` or in an ``import_module`` string
    is a cycle; and a package importing another that imports it back is an arrow back up."""
    modules = {"sparsemixer_jax.a", "sparsemixer_jax.b", "sparsemixer_jax.c",
               "sparsemixer_jax.p.x", "sparsemixer_jax.q.y"}
    sources = {
        "a": "def f():\n    from sparsemixer_jax import b\n",
        "b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import sparsemixer_jax.c\n",
        "c": "import importlib\nimportlib.import_module('sparsemixer_jax.a')\n",
        "p/x": "def g():\n    from sparsemixer_jax.q.y import h\n",
        "q/y": "from sparsemixer_jax.p import x\n",
    }
    graph = {}
    for name, text in sources.items():
        path = ROOT / LIBRARY / f"{name}.py"  # only its name is read
        graph[_module_name(path)] = _every_import(path, ast.parse(text), modules)
    assert _import_cycles(graph) == [["sparsemixer_jax.a", "sparsemixer_jax.b",
                                      "sparsemixer_jax.c"],
                                     ["sparsemixer_jax.p.x", "sparsemixer_jax.q.y"]]
    assert _import_cycles(_package_graph(graph)) == [
        ["sparsemixer_jax.a", "sparsemixer_jax.b", "sparsemixer_jax.c"],
        ["sparsemixer_jax.p", "sparsemixer_jax.q"]]


def test_the_cycle_check_sees_cycles():
    assert _import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _import_cycles({"a": {"a"}}) == [["a"]]
    assert _import_cycles({"a": {"b"}, "b": set()}) == []
