"""The code's shape: imports form a DAG (inside functions too), few imports hide in functions,
only the kernel families know their own names, and the package is one folder that imports as it
installs (the kernels in tvm_qconv/schedules/, the models in tvm_qconv/models/)."""
import ast
import functools
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where the package's source lives: one folder, the kernels (tvm_qconv.schedules) and models inside it.
PACKAGES = {"tvm_qconv": "tvm_qconv"}
KERNELS = os.path.join("tvm_qconv", "schedules")
# The command-line scripts at the root, where there are any: they import the package, which imports
# none of them.
SCRIPTS = [s for s in ("deploy.py", "tune.py", "train.py") if os.path.isfile(os.path.join(ROOT, s))]


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


def _type_checking(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): a block that never runs."""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_statements(tree: ast.AST) -> list[tuple[ast.stmt, bool]]:
    """Every import statement of ``tree``, with whether it sits inside a function: at module
    level, in classes, in functions at any depth.  The body of an ``if TYPE_CHECKING:`` block is
    left out (it never runs: names for annotations only); its ``else`` is read."""
    out = []

    def visit(node, in_function):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append((node, in_function))
            return
        if isinstance(node, ast.If) and _type_checking(node):
            children = node.orelse
        else:
            children = list(ast.iter_child_nodes(node))
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for child in children:
            visit(child, inner)

    visit(tree, False)
    return out


def _absolute(name: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module an ``ImportFrom`` in module ``name`` names, its dots resolved."""
    if not node.level:
        return node.module or ""
    base = name.split(".") if is_package else name.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(name: str, path: str, node) -> list[str]:
    """The module names an import statement of module ``name`` (file ``path``) may load."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    mod = _absolute(name, path.endswith("__init__.py"), node)
    return [mod] + [f"{mod}.{a.name}" for a in node.names]


def _edges(name: str, path: str, modules: dict) -> dict[str, tuple[int, bool]]:
    """The package modules ``name`` imports, at module level or inside functions: module ->
    (line, whether only inside a function)."""
    out: dict[str, tuple[int, bool]] = {}
    for node, in_function in _import_statements(ast.parse(open(path).read(), path)):
        for t in _targets(name, path, node):
            if t in modules and t != name and (t not in out or out[t][1] and not in_function):
                out[t] = (node.lineno, in_function)
    return out


def _import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of ``graph`` that has more than one
    module (Tarjan's algorithm), the shortest back to the component's first module."""
    index, low, stack, components = {}, {}, [], []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set(stack[stack.index(v):])
            del stack[stack.index(v):]
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for component in components:
        start = min(component)
        paths, queue = {start: [start]}, [start]
        for v in queue:       # breadth first inside the component, back to start
            if start in graph[v]:
                cycles.append(paths[v] + [start])
                break
            for w in sorted(graph[v] & component):
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    queue.append(w)
    return sorted(cycles)


def test_package_imports_form_a_dag():
    """Counting the imports inside functions: one that runs late still needs the other module
    whole, and a cycle through it breaks on the day someone moves it to the top."""
    modules = _modules()
    edges = {name: _edges(name, path, modules) for name, path in modules.items()}
    # A package's __init__ importing its own submodules is not a cycle through them: drop
    # the edge from a submodule back to its package's __init__ (Python runs the parent first).
    graph = {name: {d for d in deps if not name.startswith(d + ".")} for name, deps in edges.items()}
    cycles = _import_cycles(graph)

    def step(a, b):
        line, in_function = edges[a][b]
        return f"{a} (line {line}{', in a function' if in_function else ''}) -> {b}"

    assert not cycles, "import cycles:\n" + "\n".join(
        "  " + "; ".join(step(a, b) for a, b in zip(c, c[1:])) for c in cycles)


# Function-level imports of the project's own modules are for what cannot be at the top: an
# optional dependency, a spawned worker's body, a CLI's import time (measured).  Each says why.
MAX_FUNCTION_IMPORTS = 15


def _comment_lines(source: str) -> set[int]:
    """The lines of ``source`` that carry a ``#`` comment."""
    return {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT}


def _project_import(node) -> bool:
    """Whether an import statement names one of the project's modules (tvm_qconv, its schedules
    and models, relatively or absolutely)."""
    ours = ("tvm_qconv", "schedules", "models")
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] in ours for a in node.names)
    return bool(node.level) or (node.module or "").split(".")[0] in ours


def _function_imports() -> list[tuple[str, int, str, bool]]:
    """Every import of a project module inside a function, in the package and the root scripts:
    (file, line, the statement, whether a comment on its lines gives the reason)."""
    paths = [os.path.join(ROOT, s) for s in SCRIPTS] + sorted(_modules().values())
    out = []
    for path in paths:
        source = open(path).read()
        comments = _comment_lines(source)
        for node, in_function in _import_statements(ast.parse(source, path)):
            if in_function and _project_import(node):
                lines = range(node.lineno, (node.end_lineno or node.lineno) + 1)
                out.append((os.path.relpath(path, ROOT), node.lineno, ast.unparse(node),
                            any(n in comments for n in lines)))
    return out


def test_few_imports_hide_in_functions_and_each_says_why():
    found = _function_imports()
    listing = "\n".join(f"  {f}:{n}: {stmt}{'' if why else '   <- no reason given'}" for f, n, stmt, why in found)
    assert len(found) <= MAX_FUNCTION_IMPORTS, (
        f"{len(found)} function-level imports of project modules, at most {MAX_FUNCTION_IMPORTS}: move them to "
        f"the top (or break the cycle that kept them down)\n{listing}")
    assert all(why for *_, why in found), f"a function-level import without its reason (a comment):\n{listing}"


# Words that name a family yet are ordinary words too, matched only where they stand for the family:
# in an implementation's registered name (``conv2d.nchw4c.cpu``) or an import of its folder.
ORDINARY_WORDS = {"cpu": "a torch or TVM device", "generic": "the ordinary word",
                  "depthwise": "a conv's kind, which the passes and the graph name",
                  "grouped": "a conv's kind, as depthwise", "stem": "a file name's stem"}
# Modules outside schedules/ that may name a family word, each with the words and the reason.
NAMES_ON_PURPOSE = {
    # the GPU's instructions (PTX), which the families' ``applies`` read: the hardware, not a family
    "tvm_qconv/target.py": {"dp4a", "mma", "wgmma"},
}
# Keyword arguments whose text is a command's documentation (argparse's help), as a docstring is.
DOC_KEYWORDS = ("help", "description", "epilog")


@functools.lru_cache(maxsize=None)
def _families():
    """Every family's names -- the registry's implementations' families and the folders under
    ``schedules/`` that hold a family's implementations (``impls.py``) -- and the registered
    implementation names.  A layout's name is the registry's to answer (``select(...,
    layout=...)``), not a family's, unless a family's folder carries it (``nchw4c``)."""
    from tvm_qconv import registry
    folders = {d for d in os.listdir(os.path.join(ROOT, KERNELS))
               if os.path.isfile(os.path.join(ROOT, KERNELS, d, "impls.py"))}
    names = {impl.family.lower() for impl in registry.IMPLEMENTATIONS} | folders
    return names, folders, {impl.name for impl in registry.IMPLEMENTATIONS}


def _code_words(path: str) -> list[tuple[int, str]]:
    """(line, word) for every identifier, imported name and string literal of a file, docstrings
    and a command's help text (``DOC_KEYWORDS``) left out."""
    tree = ast.parse(open(path).read(), path)
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    docs |= {id(c) for n in ast.walk(tree) if isinstance(n, ast.keyword) and n.arg in DOC_KEYWORDS
             for c in ast.walk(n.value)}
    words = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            words.append((n.lineno, n.id))
        elif isinstance(n, ast.Attribute):
            words.append((n.lineno, n.attr))
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            words.append((n.lineno, n.value))
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            words.append((n.lineno, n.name))
        elif isinstance(n, ast.arg):
            words.append((n.lineno, n.arg))
        elif isinstance(n, ast.keyword) and n.arg:
            words.append((n.value.lineno, n.arg))
        elif isinstance(n, ast.Import):
            words += [(n.lineno, a.asname or "") for a in n.names] + [(n.lineno, a.name) for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            words += [(n.lineno, n.module or "")] + [(n.lineno, a.asname or a.name) for a in n.names]
    return words


def _tokens(word: str) -> set[str]:
    """The lower-case parts of an identifier or text: split at every non-alphanumeric character
    and between camel-case humps (``Conv2dDp4a`` -> conv2d, dp4a; ``has_int8_mma`` -> mma)."""
    parts = re.split(r"[^0-9A-Za-z]+", word)
    humps = re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", word)
    return {p.lower() for p in parts + humps if p}


def _outside_the_kernels() -> list[str]:
    """The project's files that must ask the registry: all but ``tvm_qconv/schedules/`` and the registry."""
    paths = [os.path.join(ROOT, s) for s in SCRIPTS]
    paths += [os.path.join(d, f) for d, _, files in os.walk(os.path.join(ROOT, "tvm_qconv"))
              if not (d + os.sep).startswith(os.path.join(ROOT, KERNELS) + os.sep) for f in files if f.endswith(".py")]
    return sorted(os.path.relpath(p, ROOT) for p in paths if os.path.relpath(p, ROOT) != "tvm_qconv/registry.py")


def test_the_check_covers_every_registered_family():
    # each family is matched as a word, or (an ordinary word) by its implementations' registered
    # names and its folder; the exceptions name only families and files that exist
    names, folders, impl_names = _families()
    assert {"dp4a", "nchw4c", "mma", "wgmma", "tensorcore", "stem"} <= names    # dp4a, nchw4c: once listed by hand
    assert {"nchw4c", "tensorcore", "wgmma", "stem"} <= folders
    assert set(ORDINARY_WORDS) <= names
    assert all(w in folders or any(n.endswith("." + w) for n in impl_names) for w in ORDINARY_WORDS)
    assert all(os.path.isfile(os.path.join(ROOT, rel)) and words <= names for rel, words in NAMES_ON_PURPOSE.items())


@pytest.mark.parametrize("rel", _outside_the_kernels())
def test_no_module_outside_the_kernels_names_a_family(rel):
    names, folders, impl_names = _families()
    words = sorted(names - set(ORDINARY_WORDS) - NAMES_ON_PURPOSE.get(rel, set()))
    named = set()
    for line, text in _code_words(os.path.join(ROOT, rel)):
        tokens = _tokens(text)
        hit = [w for w in words if w in tokens]
        hit += [n for n in impl_names if n in text]
        hit += [f for f in folders if re.search(rf"\bschedules\.{f}\b", text)]
        named.update(f"{w} (line {line})" for w in hit)
    assert not named, f"{rel} names {sorted(named)}: ask tvm_qconv.registry (or the kernel interface) instead"


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


PROBE = """
import importlib.util, json, sys
# Nothing installed: the editable install's finder (pip install -e .) must not answer for the copy.
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
import tvm_qconv.registry
print(json.dumps({"path": tvm_qconv.__path__, "models": importlib.util.find_spec("tvm_qconv.models").origin,
                  "files": {n: getattr(m, "__file__", None) for n, m in sys.modules.items()}}))
"""


def test_the_package_is_one_folder_whose_kernels_and_models_import_once_each(tmp_path):
    """A copy of ``tvm_qconv/`` alone (a wheel's site folder, or the source tree on PYTHONPATH) is
    the whole package: its path is that folder only (no folder joins it, as the repository root did
    while the kernels lived at the root), and every module is one file under it."""
    tree = os.path.realpath(tmp_path)
    shutil.copytree(os.path.join(ROOT, "tvm_qconv"), os.path.join(tree, "tvm_qconv"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tree, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": tree})
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    package = os.path.join(tree, "tvm_qconv")
    assert found["path"] == [package]
    assert found["files"]["tvm_qconv.schedules.kernel"] == os.path.join(package, "schedules", "kernel.py")
    assert found["models"] == os.path.join(package, "models", "__init__.py")
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
    for folder in ("tvm_qconv", "benchmarks", "tests"):
        paths += [os.path.join(d, f) for d, _, files in os.walk(os.path.join(ROOT, folder))
                  for f in files if f.endswith(".py")]
    offenders = sorted(os.path.relpath(p, ROOT) for p in paths if _top_level_imports(p) & {"schedules", "models"})
    assert not offenders, offenders
