"""How the CLIs end when the work inside them fails (``tvm_qconv/cli/exits.py``): one line on stderr,
no traceback, and the exit code of its kind -- Ctrl-C 130 with what was kept, an internal
failure 1 with how to get the traceback -- for deploy.py, tune.py and train.py alike; with
``TVM_QCONV_DEBUG=1`` the exception itself.  And the thread count TVM's pool starts with, checked
before the command (issue 56, item 2)."""
import os
import subprocess
import sys

import pytest

import deploy
import train
import tune
from tvm_qconv import cli
from tvm_qconv.errors import InputError

# (CLI, arguments, the function its work runs in, what its Ctrl-C line says was kept)
CLIS = [
    (deploy, ["build", "--model", "vgg16", "--target", "llvm", "-o", "out/vgg16.so"], "cmd_build",
     "out/vgg16.so was not written; the library there before, if any, is whole and unchanged"),
    (deploy, ["run", "--lib", "out/vgg16.so", "--image", "skimage:coffee"], "cmd_run", "nothing was written"),
    (tune, ["--model", "vgg16", "--work-dir", "logs/vgg16"], "run_job",
     "the measurements made so far are kept in logs/vgg16: run the same command to go on from them"),
    (train, ["--out", "ckpt.pt"], "run_training", "ckpt.pt was not written (a checkpoint there before is unchanged)"),
]
IDS = ["deploy_build", "deploy_run", "tune", "train"]
TVM_ERROR = ("Traceback (most recent call last):\n  3: tvm::relax::Foo\n  File \"x.cc\", line 1\n"
             "InternalError: Check failed: (lhs == rhs) is false: shapes differ")
FAULTS = [  # (raised inside the command, exit code, the line's start, what else it must say)
    (KeyboardInterrupt(), 130, "interrupted: ", None),
    (InputError("the image is 3 x 32 x 32, the library takes 224 px:\n  rebuild with --image-size 32"), 2,
     "error: the image is 3 x 32 x 32", "rebuild with --image-size 32"),
    (RuntimeError(TVM_ERROR), 1, "error: RuntimeError: InternalError: Check failed: (lhs == rhs) is false",
     "TVM_QCONV_DEBUG=1"),
    (ValueError("bad thing\nsecond line"), 1, "error: ValueError: bad thing (an internal failure", None),
]


# the variables TVM sizes its CPU thread pool from, the first one set (cli.THREAD_ENVS)
THREAD_ENVS = ("TVM_NUM_THREADS", "OMP_NUM_THREADS")


@pytest.fixture(autouse=True)
def _no_thread_env(monkeypatch):
    # every test from the same environment: a thread count set in the shell would add its line
    for name in THREAD_ENVS:
        monkeypatch.delenv(name, raising=False)


def _raiser(exc):
    def fail(*args, **kwargs):
        raise exc
    return fail


@pytest.mark.parametrize("fault", FAULTS, ids=["ctrl_c", "bad_input", "tvm_internal", "other"])
@pytest.mark.parametrize("mod,argv,inner,kept", CLIS, ids=IDS)
def test_a_failure_inside_a_cli_is_one_line_and_its_exit_code(mod, argv, inner, kept, fault, monkeypatch, capsys):
    exc, code, start, also = fault
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    monkeypatch.setattr(mod, inner, _raiser(exc))
    assert mod.main(argv) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(start), err
    if isinstance(exc, KeyboardInterrupt):
        assert err == f"interrupted: {kept}"
    if also:
        assert also in err


@pytest.mark.parametrize("mod,argv,inner,kept", CLIS[::2], ids=IDS[::2])
def test_debug_env_gives_the_exception_itself(mod, argv, inner, kept, monkeypatch):
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    monkeypatch.setattr(mod, inner, _raiser(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        mod.main(argv)


BAD_THREADS = ["abc", "0", "-2", "2.5", ""]


@pytest.mark.parametrize("value", BAD_THREADS, ids=["word", "zero", "negative", "fraction", "empty"])
@pytest.mark.parametrize("mod,argv,inner,kept", CLIS, ids=IDS)
def test_a_thread_count_that_is_not_a_positive_number_is_refused_before_the_command(mod, argv, inner, kept, value,
                                                                                    monkeypatch, capsys):
    # TVM reads it with atoi, at least 1: "abc", "0", "-2" would quietly run on one thread, "2.5" on two
    called = []
    monkeypatch.setenv("TVM_NUM_THREADS", value)
    monkeypatch.setattr(mod, inner, lambda *a, **k: called.append(1) or 0)
    assert mod.main(argv) == 2 and not called
    err = capsys.readouterr().err.strip()
    cores = len(os.sched_getaffinity(0))
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"error: TVM_NUM_THREADS={value!r} is not a positive whole number")
    assert f"from 1 to {cores} (this machine's cores), or unset it" in err


@pytest.mark.parametrize("name", THREAD_ENVS)
def test_a_thread_count_above_the_cores_is_lowered_to_them_with_one_line(name, monkeypatch, capsys):
    seen = []
    monkeypatch.setenv(name, "1000")
    monkeypatch.setattr(deploy, "cmd_build", lambda args: seen.append(os.environ[name]) or 0)
    assert deploy.main(CLIS[0][1]) == 0
    cores = len(os.sched_getaffinity(0))
    assert seen == [str(cores)]          # what TVM's pool, torch and every worker process read
    err = capsys.readouterr().err.strip()
    assert err == (f"warning: {name}=1000 is more than this machine's {cores} cores: using {cores} threads "
                   "(threads beyond the cores only wait for one, and each slows the exit: minutes for hundreds); "
                   f"set {name}={cores} or lower to silence this")


def test_a_build_with_a_thousand_tvm_threads_ends_promptly(tmp_path):
    # the user's command: TVM's pool with 1000 spinning workers on this box ran the build, then took
    # minutes to join them at exit (16 workers: +9 s, 64: +48 s); lowered to the cores it ends as a
    # build does (~15 s here, most of it importing torch and TVM)
    (tmp_path / "tiny.py").write_text("import torch\nfrom torch import nn\n\n\ndef make():\n"
                                      "    torch.manual_seed(0)\n    return nn.Sequential(nn.Conv2d(3, 8, 3), "
                                      "nn.ReLU(), nn.Conv2d(8, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), "
                                      "nn.Linear(8, 4))\n")
    env = dict(os.environ, TVM_NUM_THREADS="1000")
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "deploy.py", "build", "--model", f"{tmp_path / 'tiny.py'}:make",
                          "--target", "llvm", "--image-size", "32", "--quiet", "-o", str(tmp_path / "tiny.so")],
                         capture_output=True, text=True, env=env, timeout=150,     # (raises past it)
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "warning: TVM_NUM_THREADS=1000 is more than this machine's" in out.stderr
