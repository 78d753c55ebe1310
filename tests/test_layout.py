"""The library apart from the lab: ``sparsemixer_jax`` never imports ``lab`` (the repository's
benchmarks, studies and experiments), nor ``experiments``, and the wheel holds the library alone."""

import ast
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
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
                 "lm_generate.py", "benchmarks", "studies", "router_bench", "exact/experiment.py"):
        assert not (package / name).exists(), name


def test_the_readme_is_at_most_12000_bytes():
    """The README is a newcomer's page; detail belongs in docs/."""
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 12_000, f"README.md is {size} bytes; move detail into docs/ (limit 12,000)"
