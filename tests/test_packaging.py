"""The package as `pip install` gives it (issue 57, items 5 and 6): the public API at the package
top, each name the object of its home module; a wheel that holds every package and the console
scripts; and those scripts building and running a library from a fresh venv that has only the
wheel (the dependencies come from this venv through a .pth file: nothing is downloaded)."""
import configparser
import importlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

import tvm_qconv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The public API: name -> the module it is defined in (or, for the nn classes, exported from).
PUBLIC = {
    "compile_model": "tvm_qconv.build", "BuildOptions": "tvm_qconv.build",
    "QuantConfig": "tvm_qconv.config", "PRESETS": "tvm_qconv.config",
    "Calibrate": "tvm_qconv.ranges",
    "CompiledModel": "tvm_qconv.runtime",
    "export_onnx": "tvm_qconv.onnx_export",
    "skimage_photos": "tvm_qconv.data",
    "InputError": "tvm_qconv.errors",
    "QuantizedConv2d": "tvm_qconv.nn", "QuantizedConv2dReLU": "tvm_qconv.nn",
    "TorchConv2d": "tvm_qconv.nn", "TorchConv2dReLU": "tvm_qconv.nn",
}
# pyproject.toml's [project.scripts]; each also runs from the source tree as the root script
CONSOLE_SCRIPTS = {
    "tvm-qconv": "tvm_qconv.cli.deploy:main",
    "tvm-qconv-tune": "tvm_qconv.cli.tune:main",
    "tvm-qconv-train": "tvm_qconv.cli.train:main",
    "tvm-qconv-rpc-server": "tvm_qconv.cli.rpc_server:main",
}
# Where the installed package's sources are: one folder (the kernels and models are inside it).
SOURCES = {"tvm_qconv": "tvm_qconv"}
# A model file small enough that the wheel's `tvm-qconv build` takes seconds (most of it importing
# torch and TVM): two convs with ReLU, a pool and a classifier, at 16 x 16.
TINY = """import torch
from torch import nn


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
"""


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_name_is_the_object_of_its_home_module(name):
    assert getattr(tvm_qconv, name) is getattr(importlib.import_module(PUBLIC[name]), name)
    assert name in dir(tvm_qconv)


def test_all_lists_exactly_the_public_api():
    assert sorted(tvm_qconv.__all__) == sorted(PUBLIC)
    with pytest.raises(AttributeError, match="no attribute 'compile_models'"):
        tvm_qconv.compile_models   # noqa: B018 (a misspelt name is an AttributeError, not a lazy import)


def test_importing_the_package_loads_neither_torch_nor_tvm():
    # every console script imports the package before parsing its flags: --help answers at once
    out = subprocess.run([sys.executable, "-c", "import sys, tvm_qconv\n"
                          "print([m for m in ('torch', 'tvm', 'numpy', 'skimage') if m in sys.modules])"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# Modules issue 57 moved -> where they are now (tvm_qconv/moved.py keeps the old paths importing)
MOVED = {"tvm_qconv.calibrate": "tvm_qconv.ranges.calibrate", "tvm_qconv.observers": "tvm_qconv.ranges.observers",
         "tvm_qconv.range_search": "tvm_qconv.ranges.search", "tvm_qconv.weight_rounding": "tvm_qconv.ranges.weight_rounding",
         "tvm_qconv.artifact": "tvm_qconv.runtime.artifact", "tvm_qconv.remote": "tvm_qconv.runtime.remote",
         "tvm_qconv.remote_model": "tvm_qconv.runtime.remote_model", "tvm_qconv.rpc_server": "tvm_qconv.cli.rpc_server",
         "tvm_qconv.quantize": "tvm_qconv.int8_module", "tvm_qconv.onnx_import": "tvm_qconv.frontend.onnx_model",
         "tvm_qconv.onnx_qdq": "tvm_qconv.frontend.onnx_qdq"}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_module_imports_at_its_old_path_as_the_same_object(old):
    """Code written against the old paths keeps working, and a monkeypatch through either name is
    seen through the other: one module object, with a warning naming the new path."""
    new = importlib.import_module(MOVED[old])
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        assert importlib.import_module(old) is new
    assert new.__spec__.name == MOVED[old]          # the import of the old name left the module's own spec


def test_the_old_modules_public_names_are_the_new_ones():
    # what the code of issue 56 and before imported from the two modules that became packages
    from tvm_qconv.ranges import Calibrate, GivenRanges, LearnedRanges, map_learned_ranges
    from tvm_qconv.ranges import sources
    from tvm_qconv.runtime import CompiledModel, check_arch, class_scores, flatten, summarize
    from tvm_qconv.runtime import compiled_model
    assert (Calibrate, GivenRanges, LearnedRanges, map_learned_ranges) == (
        sources.Calibrate, sources.GivenRanges, sources.LearnedRanges, sources.map_learned_ranges)
    assert (CompiledModel, check_arch, class_scores, flatten, summarize) == (
        compiled_model.CompiledModel, compiled_model.check_arch, compiled_model.class_scores, compiled_model.flatten,
        compiled_model.summarize)


def test_python_m_of_the_old_rpc_server_path_runs_the_server():
    out = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", "-m", "tvm_qconv.rpc_server", "--help"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m tvm_qconv.cli.rpc_server ")


def _bdist_wheel_missing() -> str | None:
    """Why this venv's setuptools cannot build a wheel offline (None: it can)."""
    try:
        importlib.import_module("setuptools.command.bdist_wheel")   # setuptools 70.1+
    except ImportError:
        try:
            importlib.import_module("wheel.bdist_wheel")
        except ImportError:
            return "this venv's setuptools predates 70.1 and `wheel` is not installed: pip install -e '.[test]'"
    return None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    """`pip wheel .` of a copy of the sources, offline, with this venv's setuptools.  A copy: an
    in-tree build leaves build/lib behind in the repository, whose stale files a later build
    would put in its wheel."""
    missing = _bdist_wheel_missing()
    assert missing is None, missing
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for folder in SOURCES.values():
        shutil.copytree(os.path.join(ROOT, folder), src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                          "--no-index", "--disable-pip-version-check", "-q", "-w", str(tmp / "dist")],
                         cwd=src, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    (path,) = (tmp / "dist").glob("tvm_qconv-*.whl")
    return str(path)


def test_the_wheel_installs_the_console_scripts(wheel):
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        entry_points = configparser.ConfigParser()
        entry_points.read_string(z.read(name).decode())
    assert dict(entry_points["console_scripts"]) == CONSOLE_SCRIPTS


def test_the_wheel_holds_every_module_of_every_package(wheel):
    expected = {"tvm_qconv/imagenet_synsets.txt"}
    for package, folder in SOURCES.items():
        for d, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            rel = os.path.relpath(d, os.path.join(ROOT, folder))
            expected |= {os.path.normpath(os.path.join(package, rel, f)) for f in files if f.endswith(".py")}
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert sorted(expected - names) == []
    for package in ("cli", "frontend", "schedules", "schedules/wgmma", "models", "nn", "tuning"):
        assert f"tvm_qconv/{package}/__init__.py" in names


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> str:
    """A fresh venv with the wheel installed and nothing else: its dependencies are this venv's,
    through a .pth file (a folder named in a .pth joins sys.path after the venv's own, and its own
    .pth files -- this venv's editable install of the source tree -- are not run)."""
    tmp = tmp_path_factory.mktemp("venv")
    env_dir = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = str(env_dir / "bin" / "python")
    out = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
                          "--disable-pip-version-check", "-q", wheel], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    # the .pth after the install: pip then never sees this venv's own tvm_qconv (to replace it)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_path(k) for k in ("purelib", "platlib"))
    with open(os.path.join(site, "_tvm_qconv_deps.pth"), "w") as f:
        f.write("".join(p + "\n" for p in ours))
    return str(env_dir)


def _run(venv: str, cwd, *argv: str) -> subprocess.CompletedProcess:
    """A command of the venv's bin/, from ``cwd`` (outside the source tree), with no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([os.path.join(venv, "bin", argv[0]), *argv[1:]], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_wheel_imports_from_its_own_install_not_the_source_tree(venv, tmp_path):
    # (found, not imported: schedules would bring TVM, models torch)
    out = _run(venv, tmp_path, "python", "-c", "from importlib.util import find_spec\n"
               "for name in ('tvm_qconv', 'tvm_qconv.cli.deploy', 'tvm_qconv.schedules.kernel', "
               "'tvm_qconv.models'):\n    print(find_spec(name).origin)")
    assert out.returncode == 0, out.stderr
    paths = out.stdout.split()
    assert len(paths) == 4 and all(path.startswith(venv + os.sep) for path in paths), out.stdout


@pytest.mark.parametrize("script", sorted(CONSOLE_SCRIPTS))
def test_each_console_script_answers_help(venv, tmp_path, script):
    out = _run(venv, tmp_path, script, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: {script} ")     # argparse names the script as it was called


def test_the_wheels_tvm_qconv_builds_a_model_file_and_runs_the_library(venv, tmp_path):
    (tmp_path / "tiny.py").write_text(TINY)
    build = _run(venv, tmp_path, "tvm-qconv", "build", "--model", "tiny.py:make", "--target", "llvm", "--image-size",
                 "16", "--quiet", "-o", "tiny.so")
    assert build.returncode == 0, build.stderr[-2000:]
    assert "wrote tiny.so (+ .params.npz, .json)" in build.stdout
    run = _run(venv, tmp_path, "tvm-qconv", "run", "--lib", "tiny.so", "--image", "skimage:coffee", "--repeat", "1")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "skimage:coffee:" in run.stdout and "latency: " in run.stdout


def test_the_root_script_and_the_wheels_console_script_build_the_same_library(venv, tmp_path):
    """Behaviour unchanged by the move (issue 57): ``python deploy.py build`` from the source tree (the old
    path) and the wheel's ``tvm-qconv build`` give a library with every parameter and range bit-identical."""
    import numpy as np

    (tmp_path / "tiny.py").write_text(TINY)
    argv = ["build", "--model", "tiny.py:make", "--target", "llvm", "--image-size", "16", "--seed", "0", "--quiet"]
    old = subprocess.run([sys.executable, os.path.join(ROOT, "deploy.py"), *argv, "-o", "old.so"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert old.returncode == 0, old.stderr[-2000:]
    new = _run(venv, tmp_path, "tvm-qconv", *argv, "-o", "new.so")
    assert new.returncode == 0, new.stderr[-2000:]
    a, b = np.load(tmp_path / "old.params.npz"), np.load(tmp_path / "new.params.npz")
    assert sorted(a.files) == sorted(b.files) and all(a[k].tobytes() == b[k].tobytes() for k in a.files)
    old_meta, new_meta = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("old", "new"))
    assert old_meta["amax"] == new_meta["amax"] and old_meta["float_weights"] == new_meta["float_weights"]
