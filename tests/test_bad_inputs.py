"""Bad inputs refused in one short line that says what to do, before any long work: weights of
another architecture, a library of another dataset given to ``eval --dataset digits``, a folder
that is not a tuning database given as ``--tuning-log``, output paths that cannot take the file
(``/proc``, a symbolic link or a loop of them), image sizes a model cannot take or memory cannot
hold, a skip list that leaves nothing in int8, a model whose output is not one tensor."""
import json
import os
import time

import numpy as np
import pytest
import torch
import torchvision

import deploy
import tune
from tvm_qconv.errors import InputError
from tvm_qconv.evaluate import check_digits_library, evaluate_library
from tvm_qconv.frontend import load_state_dict_file
from tvm_qconv.tuning.database import RECORD_FILE, WORKLOAD_FILE, database_target

COMMITTED = os.path.join(os.path.dirname(__file__), "..", "tuning_logs")


# --- --weights of another architecture ------------------------------------------------------


def test_weights_of_another_architecture_are_named_in_one_short_line(tmp_path):
    path = tmp_path / "vgg11.pt"
    torch.save(torchvision.models.get_model("vgg11", weights=None).state_dict(), path)
    with pytest.raises(InputError) as err:
        load_state_dict_file(torchvision.models.resnet18(), str(path))
    msg = str(err.value)
    # torch's own message lists all 144 keys (~5 KB here): this one counts them and names a few
    assert len(msg) < 600 and "\n" not in msg, (len(msg), msg)
    assert msg.startswith(f"weights file {path} does not fit this model: 22 of its 22 tensors do not match and "
                          f"122 of this ResNet's 122 are missing (missing: conv1.weight, ")
    assert "unexpected: features.0.weight, " in msg and " more" in msg
    assert msg.endswith("were they saved from another architecture? give the weights of this ResNet")


def test_a_classifier_of_another_width_is_named_with_both_shapes(tmp_path):
    path = tmp_path / "r18_10.pt"
    torch.save(torchvision.models.resnet18(num_classes=10).state_dict(), path)
    with pytest.raises(InputError, match=r"2 of its 122 tensors do not match \(size mismatch: fc\.weight 10x512 "
                                         r"\(model 1000x512\), fc\.bias 10 \(model 1000\)\)"):
        load_state_dict_file(torchvision.models.resnet18(), str(path))


def test_weights_that_fit_still_load(tmp_path):
    src = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    path = tmp_path / "w.pt"
    torch.save({"state_dict": src.state_dict(), "epoch": 3}, path)
    dst = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    assert load_state_dict_file(dst, str(path))["epoch"] == 3
    assert torch.equal(dst[0].weight, src[0].weight)


# --- eval --dataset digits of a library of another dataset -----------------------------------

DIGITS_META = dict(model="small_vgg", input_shape=[1, 3, 32, 32], categories=[str(d) for d in range(10)],
                   dataset=dict(name="digits", seed=0, image_size=32))
NOT_DIGITS = [
    (dict(model="resnet18", input_shape=[1, 3, 224, 224], categories=["tench"] * 1000),
     "built from resnet18 with input shape (1, 3, 224, 224), not from a digits checkpoint"),
    (dict(DIGITS_META, dataset=dict(name="imagenet")), "not from a digits checkpoint"),
    (dict(DIGITS_META, input_shape=[1, 3, 64, 64]),
     "input shape (1, 3, 64, 64), but its input does not take the 32 px images"),
    (dict(DIGITS_META, categories=["x"] * 1000), "but it has 1000 outputs, not the 10 digits"),
]
NOT_DIGITS_IDS = ["imagenet_model", "other_dataset", "other_size", "other_width"]


@pytest.mark.parametrize("meta, says", NOT_DIGITS, ids=NOT_DIGITS_IDS)
def test_a_library_not_built_from_a_digits_checkpoint_is_refused(meta, says):
    with pytest.raises(InputError, match="^--lib m.so was built from ") as err:
        check_digits_library("m.so", meta)
    assert says in str(err.value)
    assert str(err.value).endswith("`eval --dataset digits` takes a library built with `python deploy.py build "
                                   "--checkpoint CKPT -o LIB` from a checkpoint of `python train.py --qat --out CKPT`")


def test_a_digits_library_passes_the_check():
    assert check_digits_library("m.so", DIGITS_META) == DIGITS_META["dataset"]
    assert check_digits_library("m.so", dict(DIGITS_META, categories=None))["seed"] == 0


def test_eval_refuses_an_imagenet_library_before_loading_it(tmp_path):
    """The check reads the json only: a .so that is not a library at all is never opened."""
    lib = tmp_path / "resnet18.so"
    lib.write_bytes(b"not a shared object")
    np.savez(tmp_path / "resnet18.params.npz", p0=np.zeros(1, np.float32))
    (tmp_path / "resnet18.json").write_text(json.dumps(dict(model="resnet18", input_shape=[1, 3, 224, 224],
                                                            target="llvm", categories=["x"] * 1000)))
    with pytest.raises(InputError, match=r"resnet18\.so was built from resnet18 with input shape \(1, 3, 224, 224\), "
                                         r"not from a digits checkpoint"):
        evaluate_library(str(lib))


# --- --tuning-log that is not a tuning database ----------------------------------------------


def _random_text(folder):
    folder.mkdir()
    (folder / "notes.txt").write_text("hello")
    return folder


def _empty(folder):
    folder.mkdir()
    return folder


def _a_file(folder):
    folder.write_text("not a folder")
    return folder


def _no_target(folder):  # database files, but no config.json and no readable record
    folder.mkdir()
    (folder / WORKLOAD_FILE).write_text("garbage\n")
    (folder / RECORD_FILE).write_text("garbage\n")
    return folder


NOT_A_DATABASE = [
    (_random_text, f"no {WORKLOAD_FILE} and {RECORD_FILE}, plain, .xz or .gz; it holds notes.txt"),
    (_empty, f"no {WORKLOAD_FILE} and {RECORD_FILE}, plain, .xz or .gz; it holds nothing"),
    (lambda folder: folder, "no such folder"),
    (_a_file, "a file, not a folder"),
    (_no_target, "no cuda or llvm target in its config.json or in its first tuning record"),
]
NOT_A_DATABASE_IDS = ["random_text", "empty", "missing", "file", "no_target"]


@pytest.mark.parametrize("make, what", NOT_A_DATABASE, ids=NOT_A_DATABASE_IDS)
def test_a_folder_that_is_not_a_tuning_database_is_named_so(tmp_path, make, what):
    path = make(tmp_path / "log")
    with pytest.raises(InputError) as err:
        database_target(str(path))
    assert str(err.value) == (f"--tuning-log {path} is not a tuning database ({what}): give a folder written by "
                              f"tune.py (tuning_logs/<model>-b<batch>-<arch>)")


def test_an_llvm_build_with_a_garbage_tuning_log_is_not_told_it_holds_cuda_schedules(tmp_path):
    from tvm_qconv.build import BuildOptions
    with pytest.raises(InputError, match=r"is not a tuning database \(no database_workload\.json") as err:
        BuildOptions(target="llvm", tuning_log=str(_random_text(tmp_path / "log")))
    assert "cuda" not in str(err.value)


def test_the_committed_databases_are_cuda_ones():
    assert database_target(os.path.join(COMMITTED, "vgg16-b1-sm_90a")) == "cuda"


def test_a_database_without_config_takes_its_records_target(tmp_path):
    """A folder of database files copied without config.json: the records name their target."""
    record = json.dumps([0, [[[], []], [1e-5], {"kind": "llvm", "keys": ["cpu"], "tag": ""}, []]])
    (tmp_path / WORKLOAD_FILE).write_text("[]\n")
    (tmp_path / RECORD_FILE).write_text("not json\n" + record + "\n")
    assert database_target(str(tmp_path)) == "llvm"


# --- tune.py --help --------------------------------------------------------------------------


def test_tune_help_loads_no_tvm_and_says_it_tunes_the_cpu_too(capsys):
    """tune.py imports TVM and torch (~4 s) after parsing: --help answers at once."""
    import subprocess
    import sys
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", "import sys, tune; sys.argv[1:] = ['--help']\n"
                          "try:\n    tune.main()\nexcept SystemExit:\n    pass\n"
                          "print([m for m in ('tvm', 'torch', 'tvm_qconv.tuning') if m in sys.modules])"],
                         cwd=os.path.dirname(tune.__file__), capture_output=True, text=True, check=True).stdout
    seconds = time.perf_counter() - start
    assert out.strip().endswith("[]"), out[-200:]  # none of the heavy modules
    assert "for a CUDA GPU (--target cuda, the default) or for the CPU (--target llvm)" in " ".join(out.split())
    assert seconds < 3.0, seconds  # 0.04 s alone; a loaded 2-core machine gets slack


# --- deploy.py build: checked before any work ---------------------------------------------------

def _cli_error(capsys, *argv) -> str:
    """The one stderr line of a CLI call that must end with exit 2 before any phase began."""
    assert deploy.main(list(argv)) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and "\n" not in err.strip(), err
    assert "[build " not in out, out  # no phase had started: refused before any work
    return err


def test_an_output_folder_that_takes_no_files_is_refused_before_any_work(capsys):
    # as root, access() says /proc is writable: the build ran for a minute and failed at the save
    err = _cli_error(capsys, "build", "--model", "vgg11", "--image-size", "32", "-o", "/proc/vgg11.so")
    assert "library /proc/vgg11.so cannot be written: /proc does not take new files" in err


def test_an_output_path_that_is_a_symbolic_link_loop_is_refused_and_kept(capsys, tmp_path):
    loop = tmp_path / "m.so"
    os.symlink(str(tmp_path / "other.so"), loop)
    os.symlink(str(loop), tmp_path / "other.so")
    err = _cli_error(capsys, "build", "--model", "vgg11", "--image-size", "32", "-o", str(loop))
    assert f"library {loop} is a symbolic link loop" in err
    assert os.readlink(loop) == str(tmp_path / "other.so")  # the link is still there, untouched


def test_an_output_path_that_is_a_symbolic_link_is_refused_naming_its_target(capsys, tmp_path):
    (tmp_path / "real.so").write_bytes(b"a library")
    os.symlink(str(tmp_path / "real.so"), tmp_path / "m.so")
    err = _cli_error(capsys, "build", "--model", "vgg11", "--image-size", "32", "-o", str(tmp_path / "m.so"))
    assert f"is a symbolic link (to {tmp_path / 'real.so'})" in err
    assert os.path.islink(tmp_path / "m.so") and (tmp_path / "real.so").read_bytes() == b"a library"


def test_an_image_size_the_model_cannot_take_is_one_line_before_any_work(capsys, tmp_path):
    # VGG16's fifth max pool would make 0x0 at 16 px; torch printed a 20-line traceback first
    err = _cli_error(capsys, "build", "--model", "vgg16", "--image-size", "16", "-o", str(tmp_path / "m.so"))
    assert "vgg16 cannot take input (1, 3, 16, 16): RuntimeError: Given input size: (512x1x1)" in err
    assert "choose another --image-size" in err
    assert os.listdir(tmp_path) == []


def test_an_image_size_whose_activations_cannot_fit_memory_is_refused_at_once(capsys, tmp_path):
    # it tried to allocate 120 GB, then ended in an internal failure
    t = time.time()
    err = _cli_error(capsys, "build", "--model", "vgg16", "--image-size", "100000", "-o", str(tmp_path / "m.so"))
    assert "vgg16 at input (1, 3, 100000, 100000) needs about" in err and "use a smaller --image-size" in err
    assert "features.0 alone makes 2.6 TB of float32 activations" in err  # 64 x 100000^2 x 4 bytes
    assert time.time() - t < 30  # fake tensors: nothing was allocated


def test_a_skip_list_that_leaves_nothing_in_int8_is_refused(capsys, tmp_path):
    assert deploy.main(["build", "--model", "vgg11", "--image-size", "32", "--skip", "*", "-o",
                        str(tmp_path / "m.so")]) == 2
    err = capsys.readouterr().err.strip()
    assert "skip list '*' keeps all 11 conv and linear layers of this model in float: nothing would run in int8" in err
    assert os.listdir(tmp_path) == []


TUPLE_MODEL = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        features = self.body(x).mean((2, 3))
        return {OUT}


def make():
    return Net()
"""


def test_a_model_returning_a_tuple_builds_its_first_tensor_and_says_so(tmp_path, capsys):
    from tvm_qconv.runtime import CompiledModel
    (tmp_path / "net.py").write_text(TUPLE_MODEL.replace("{OUT}", "self.head(features), features"))
    assert deploy.main(["build", "--model", f"{tmp_path / 'net.py'}:make", "--image-size", "16", "-o",
                        str(tmp_path / "m.so")]) == 0
    out = capsys.readouterr().out
    assert "output: forward returns a tuple of 2: the library computes its first tensor, output[0]" in out
    assert "verification: logits SQNR" in out  # against the float model's first output
    assert CompiledModel(str(tmp_path / "m.so")).meta["report"]["verify"]["status"] == "ok"


def test_a_model_returning_no_tensor_is_refused_by_name(tmp_path, capsys):
    (tmp_path / "net.py").write_text(TUPLE_MODEL.replace("{OUT}", "{'kind': 'no tensor here'}"))
    err = _cli_error(capsys, "build", "--model", f"{tmp_path / 'net.py'}:make", "--image-size", "16", "-o",
                     str(tmp_path / "m.so"))
    assert "forward returns a dict of 1 with no tensor in it" in err


@pytest.mark.parametrize("suffix,magic", [(".gz", b"\x1f\x8b\x08\x00"), (".xz", b"\xfd7zXZ\x00")])
def test_a_corrupt_packed_database_is_a_bad_input_not_an_internal_failure(tmp_path, suffix, magic):
    # zlib.error and lzma.LZMAError are no OSError: it ended in "internal failure", exit 1
    for name in (WORKLOAD_FILE, RECORD_FILE):
        (tmp_path / f"{name}{suffix}").write_bytes(magic + b"not compressed data" * 4)
    with pytest.raises(InputError, match=str(tmp_path)):
        database_target(str(tmp_path))
