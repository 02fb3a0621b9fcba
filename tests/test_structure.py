"""The code's shape: imports form a DAG, only the kernel families know their own names, and the
package imports from the source tree as from a wheel."""
import ast
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where each package's source lives (schedules/ and models/ install as tvm_qconv.schedules / .models).
PACKAGES = {"tvm_qconv": "tvm_qconv", "tvm_qconv.schedules": "schedules", "tvm_qconv.models": "models"}


def _modules() -> dict[str, str]:
    """Module name -> file, for every module of the package."""
    found = {}
    for package, folder in PACKAGES.items():
        for d, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(d, f), os.path.join(ROOT, folder))[:-3].replace(os.sep, ".")
                name = package if rel == "__init__" else f"{package}.{rel.removesuffix('.__init__')}"
                found[name] = os.path.join(d, f)
    return found


def _imports(name: str, path: str, modules: dict) -> set[str]:
    """The package modules ``name`` imports at module level (not inside functions)."""
    tree = ast.parse(open(path).read())
    is_package = path.endswith("__init__.py")
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in modules and t != name)
    return out


def test_package_imports_form_a_dag():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # A package's __init__ importing its own submodules is not a cycle through them: drop
    # the edge from a submodule back to its package's __init__ (Python runs the parent first).
    for name, deps in graph.items():
        deps.difference_update({p for p in deps if name.startswith(p + ".")})
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for dep in graph[node]:
            if state.get(dep) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


FAMILY_WORDS = ("dp4a", "nchw4c")


def _code_words(path: str) -> set[str]:
    """Identifiers and string literals of a file, docstrings left out."""
    tree = ast.parse(open(path).read())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    words = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            words.add(n.id)
        elif isinstance(n, ast.Attribute):
            words.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
            words.add(n.value)
        elif isinstance(n, ast.alias):
            words.add(n.name)
        elif isinstance(n, ast.ImportFrom) and n.module:
            words.add(n.module)
    return words


# The registry lists the families (that is its job); everything else asks it.
ASKS_THE_REGISTRY = ["quantization/planner.py", "quantization/conv.py", "quantization/pools.py",
                     "quantization/elementwise.py", "quantization/channels.py", "lowering/relax.py",
                     "lowering/onnx.py", "transform/schedule_kernels.py", "tuning/tasks.py",
                     "tuning/driver.py", "tuning/apply.py", "tuning/database.py", "nn/tvm_kernels.py", "build.py",
                     "quantize.py"]


@pytest.mark.parametrize("rel", ASKS_THE_REGISTRY)
def test_passes_tuner_and_training_kernels_name_no_kernel_family(rel):
    words = _code_words(os.path.join(ROOT, "tvm_qconv", rel))
    named = sorted(w for w in words if any(f in w.lower() for f in FAMILY_WORDS))
    assert not named, f"{rel} names {named}: ask tvm_qconv.registry instead"


def test_every_source_folder_is_an_installed_package():
    """A folder of modules that pyproject.toml does not list (or that has no __init__.py) imports
    in an editable install only: a wheel leaves it out (schedules/tensorcore/ once did)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    for package, folder in PACKAGES.items():
        for d, _, files in os.walk(os.path.join(ROOT, folder)):
            if "__pycache__" in d or not any(f.endswith(".py") for f in files):
                continue
            rel = os.path.relpath(d, os.path.join(ROOT, folder))
            name = package if rel == "." else f"{package}.{rel.replace(os.sep, '.')}"
            assert name in listed, f"{name} ({d}) is not in pyproject.toml's packages"
            assert "__init__.py" in files, f"{d} has no __init__.py"


# Where each layout puts the sources: the repository's (schedules/ and models/ at the root, run
# uninstalled with PYTHONPATH=. as on the GPU machine) and a wheel's (both inside tvm_qconv/).
LAYOUTS = {
    "source_tree": {"tvm_qconv": "tvm_qconv", "schedules": "schedules", "models": "models",
                    "pyproject.toml": "pyproject.toml"},
    "wheel": {"tvm_qconv": "tvm_qconv", "schedules": "tvm_qconv/schedules", "models": "tvm_qconv/models"},
}
PROBE = """
import importlib.util, json, sys
# Nothing installed: the editable install's finder (pip install -e .) must not answer for the copy.
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
import tvm_qconv.registry
print(json.dumps({"path": tvm_qconv.__path__, "models": importlib.util.find_spec("tvm_qconv.models").origin,
                  "files": {n: getattr(m, "__file__", None) for n, m in sys.modules.items()}}))
"""


@pytest.mark.parametrize("layout", sorted(LAYOUTS), ids=sorted(LAYOUTS))
def test_schedules_and_models_import_once_each_as_subpackages_from_either_layout(layout, tmp_path):
    tree = os.path.realpath(tmp_path)
    for src, dst in LAYOUTS[layout].items():
        if os.path.isdir(os.path.join(ROOT, src)):
            shutil.copytree(os.path.join(ROOT, src), os.path.join(tree, dst),
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(os.path.join(ROOT, src), os.path.join(tree, dst))
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tree, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": tree})
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    package = os.path.join(tree, "tvm_qconv")
    # A wheel's site folder must never join the package's path: every installed package would
    # then import a second time under tvm_qconv.
    assert found["path"] == ([package, tree] if layout == "source_tree" else [package])
    kernels = os.path.join(tree, LAYOUTS[layout]["schedules"])
    assert found["files"]["tvm_qconv.schedules.kernel"] == os.path.join(kernels, "kernel.py")
    assert found["models"] == os.path.join(tree, LAYOUTS[layout]["models"], "__init__.py")
    # One module per file, all under tvm_qconv (a second copy of schedules/kernel.py would hold a
    # second kernel registry).
    ours = {name: f for name, f in found["files"].items() if f and f.startswith(tree + os.sep)}
    assert all(name == "tvm_qconv" or name.startswith("tvm_qconv.") for name in ours), sorted(ours)
    assert len(set(ours.values())) == len(ours)
    assert "tvm_qconv.schedules.wgmma.conv2d" in ours


def _top_level_imports(path: str) -> set[str]:
    """The first component of every absolute import in the Python file ``path``."""
    names = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_source_imports_schedules_or_models_as_top_level_packages():
    # From the source tree, `import schedules` would load a second copy of tvm_qconv.schedules (a
    # second kernel registry, a second TVMScript frame patch: a benchmark's did, and a later test
    # failed); everything goes through tvm_qconv.
    paths = [os.path.join(ROOT, s) for s in ("train.py", "deploy.py", "tune.py")]
    for folder in ("tvm_qconv", "schedules", "models", "benchmarks", "tests"):
        paths += [os.path.join(d, f) for d, _, files in os.walk(os.path.join(ROOT, folder))
                  for f in files if f.endswith(".py")]
    offenders = sorted(os.path.relpath(p, ROOT) for p in paths if _top_level_imports(p) & {"schedules", "models"})
    assert not offenders, offenders
