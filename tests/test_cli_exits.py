"""How the CLIs end when the work inside them fails (``tvm_qconv/cli.py``): one line on stderr,
no traceback, and the exit code of its kind -- Ctrl-C 130 with what was kept, an internal
failure 1 with how to get the traceback -- for deploy.py, tune.py and train.py alike; with
``TVM_QCONV_DEBUG=1`` the exception itself."""
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
