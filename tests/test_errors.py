"""Bad input gets a one-line error that says what to do; nothing half-written is left behind."""
import os

import numpy as np
import pytest
import torch
import tvm

import deploy
from tvm_qconv import artifact
from tvm_qconv.build import BuildOptions, compile_model
from tvm_qconv.config import QuantConfig
from tvm_qconv.errors import InputError
from tvm_qconv.fileio import TEMP_PREFIX
from tvm_qconv.models import SmallVGG
from tvm_qconv.ranges import Calibrate
from tvm_qconv.runtime import CompiledModel, check_arch


def cli_error(capsys, *argv) -> str:
    assert deploy.main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err  # one line
    return err


def test_unknown_model_names_the_choices(capsys, tmp_path):
    err = cli_error(capsys, "build", "--model", "vgg17", "-o", str(tmp_path / "m.so"))
    assert "unknown model 'vgg17'" in err and "vgg16" in err


def test_unreadable_weights_file(capsys, tmp_path):
    bad = tmp_path / "w.pt"
    bad.write_bytes(b"not a checkpoint")
    err = cli_error(capsys, "build", "--model", "vgg11", "--weights", str(bad), "-o", str(tmp_path / "m.so"))
    assert f"weights file {bad} is a text file, not a state dict: give a file saved with torch.save(" in err


def test_weights_of_another_model(capsys, tmp_path):
    path = tmp_path / "small.pt"
    torch.save(SmallVGG().state_dict(), path)
    err = cli_error(capsys, "build", "--model", "vgg11", "--weights", str(path), "-o", str(tmp_path / "m.so"))
    assert "does not fit this model" in err


def test_a_tuning_database_on_a_cpu_build_is_refused_before_any_work(capsys, tmp_path):
    # it used to be applied and fail deep in TVM ("Unknown device id") after calibration
    err = cli_error(capsys, "build", "--model", "vgg11", "--target", "llvm", "--tuning-log", "tuning_logs/vgg16-b1-sm_90a",
                    "-o", str(tmp_path / "m.so"))
    assert "tuning log tuning_logs/vgg16-b1-sm_90a holds cuda schedules; a llvm build cannot use it: build with " \
           "--target cuda, or tune for llvm (tune.py --target llvm)" in err
    assert not os.listdir(tmp_path)


def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(capsys, tmp_path):
    # these failed after calibration and compilation (IsADirectoryError, NotADirectoryError)
    (tmp_path / "afile").write_text("x")
    for out, message in ((tmp_path, "is a folder: give a file path"),
                         (tmp_path / "afile" / "m.so", f"{tmp_path / 'afile'} is a file, not a folder")):
        err = cli_error(capsys, "build", "--model", "vgg11", "--image-size", "32", "-o", str(out))
        assert message in err
    assert sorted(os.listdir(tmp_path)) == ["afile"]
    import train
    capsys.readouterr()
    assert train.main(["--model", "small_vgg", "--epochs", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: checkpoint") and "is a folder" in err and "\n" not in err


def test_empty_calibration_folder(capsys, tmp_path):
    (tmp_path / "calib").mkdir()
    err = cli_error(capsys, "build", "--model", "vgg11", "--image-size", "32", "--calib-dir",
                    str(tmp_path / "calib"), "-o", str(tmp_path / "m.so"))
    assert "no images (.jpg, .jpeg, .png, " in err and "in calibration folder" in err


def test_calibration_images_with_nan_name_the_layer(tmp_path):
    x = np.zeros((2, 3, 32, 32), np.float32)
    x[1, 0, 3, 3] = np.nan
    with pytest.raises(InputError, match=r"calibration at features\.0\.in0: .*NaN"):
        compile_model(SmallVGG(), str(tmp_path / "m.so"), options=BuildOptions(image_size=32), ranges=Calibrate(x),
                      config=QuantConfig(num_calib_images=2), progress=False)
    assert not os.listdir(tmp_path)  # nothing was written


@pytest.fixture(scope="module")
def small_lib(tmp_path_factory):
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("lib") / "small.so"
    x = np.random.default_rng(0).normal(0, 1, (4, 3, 32, 32)).astype(np.float32)
    compile_model(SmallVGG(), str(out), options=BuildOptions(image_size=32), ranges=Calibrate(x),
                  config=QuantConfig(num_calib_images=4), progress=False)
    return str(out)


BAD_SHAPES = [(1, 3, 64, 64), (1, 1, 32, 32), (2, 3, 32, 32), (3, 32, 32)]


@pytest.mark.parametrize("shape", BAD_SHAPES, ids=["size", "channels", "batch", "rank"])
def test_wrong_input_shape_at_run_time(small_lib, shape):
    with pytest.raises(InputError, match=r"this library was built for \(1, 3, 32, 32\)"):
        CompiledModel(small_lib)(np.zeros(shape, np.float32))


def test_run_cli_prints_top5_and_latency(small_lib, capsys):
    assert deploy.main(["run", "--lib", small_lib, "--image", "skimage:coffee", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("class ") == 5 and "latency:" in out


def test_missing_library(capsys, tmp_path):
    err = cli_error(capsys, "run", "--lib", str(tmp_path / "none.so"), "--image", "skimage:coffee")
    assert "not found" in err and "deploy.py build" in err


def test_a_build_that_fails_while_saving_leaves_the_previous_library_whole(small_lib, tmp_path, monkeypatch):
    import shutil
    lib = str(tmp_path / "small.so")
    for path in (small_lib, *artifact.artifact_paths(small_lib)):
        shutil.copy(path, tmp_path)
    before = {p: open(p, "rb").read() for p in (lib, *artifact.artifact_paths(lib))}
    x = np.random.default_rng(1).normal(0, 1, (4, 3, 32, 32)).astype(np.float32)

    def export_then_fail(self, path, *args, **kwargs):
        open(path, "wb").write(b"half a library")
        raise KeyboardInterrupt  # Ctrl-C while the new library is being written

    monkeypatch.setattr(tvm.runtime.Executable, "export_library", export_then_fail)
    with pytest.raises(KeyboardInterrupt):
        compile_model(SmallVGG(), lib, options=BuildOptions(image_size=32), ranges=Calibrate(x),
                      config=QuantConfig(num_calib_images=4), progress=False)
    assert {p: open(p, "rb").read() for p in before} == before  # the old library, byte for byte
    assert not [f for f in os.listdir(tmp_path) if f.startswith(TEMP_PREFIX)]  # no temporaries left
    monkeypatch.undo()
    out = CompiledModel(lib)(x[:1])
    assert out.shape == (1, 10) and np.isfinite(out).all()  # and it still loads and runs


def test_a_library_whose_files_come_from_two_builds_is_refused(small_lib, tmp_path):
    # the .json carries the build id of its .so and .params.npz: new code beside an old .json (a
    # save cut short between its renames) or params copied from another build is refused by name
    import json
    import shutil
    lib = str(tmp_path / "small.so")
    for path in (small_lib, *artifact.artifact_paths(small_lib)):
        shutil.copy(path, tmp_path)
    params, meta = artifact.artifact_paths(lib)
    assert CompiledModel(lib)(np.zeros((1, 3, 32, 32), np.float32)).shape == (1, 10)   # whole
    with np.load(params) as npz:
        arrays = {k: npz[k] for k in npz.files}
    first = next(iter(arrays))
    arrays[first] = arrays[first] + 1 if arrays[first].dtype != np.int8 else arrays[first] ^ 1
    np.savez(params, **arrays)                                                            # another build's params
    with pytest.raises(InputError, match="are not the files of one build.*rebuild it"):
        CompiledModel(lib)
    shutil.copy(artifact.artifact_paths(small_lib)[0], params)                          # whole again
    record = json.load(open(meta))
    assert len(record["build_id"]) == 20
    json.dump(dict(record, input_shape=[2, 3, 32, 32]), open(meta, "w"))                # an edited batch
    with pytest.raises(InputError, match="are not the files of one build"):
        CompiledModel(lib)


def test_a_library_run_on_another_device_kind_is_refused(small_lib):
    with pytest.raises(InputError, match="built for the CPU \\(llvm\\), it cannot run on --device cuda: run it with "
                                         "--device llvm, or rebuild with --target cuda"):
        CompiledModel(small_lib, "cuda")


@pytest.mark.parametrize("built, gpu, runs", [
    ("sm_90a", "sm_90", True), ("sm_90a", "sm_100", False), ("sm_90", "sm_80", False),
    ("sm_80", "sm_90", False), ("sm_80", "sm_86", True), ("sm_86", "sm_80", False), ("sm_90", "sm_90", True)])
def test_a_library_for_another_gpu_arch_is_refused_by_name(built, gpu, runs):
    # TVM builds cubins: one runs on its own major arch at its minor version or later; sm_90a
    # code (wgmma, setmaxnreg) on sm_90 only
    if runs:
        check_arch("m.so", built, gpu)
    else:
        with pytest.raises(InputError, match=f"built for {built}, this GPU is {gpu}: rebuild with --arch {gpu}"):
            check_arch("m.so", built, gpu)


def _json_edit(path, key, value):
    import json
    with open(path) as f:
        meta = json.load(f)
    meta[key] = value
    with open(path, "w") as f:
        json.dump(meta, f)


def _pickled(path):
    with open(path, "wb") as f:
        np.save(f, np.array([{"a": 1}], dtype=object), allow_pickle=True)


def _truncate(path, size):
    data = open(path, "rb").read()
    open(path, "wb").write(data[:size])


def _halve(path):
    _truncate(path, os.path.getsize(path) // 2)


NOT_ONE_BUILD = "are not the files of one build"
# (damage done to one of the library's three files, what the one-line error must say). A damaged
# .so must never reach the dynamic loader (a truncated one used to kill the process with SIGBUS).
DAMAGED = [
    ("params_empty", lambda so, npz, js: open(npz, "wb").close(), NOT_ONE_BUILD),
    ("params_truncated", lambda so, npz, js: _truncate(npz, 100), NOT_ONE_BUILD),
    ("params_pickled", lambda so, npz, js: _pickled(npz), NOT_ONE_BUILD),
    ("so_is_text", lambda so, npz, js: open(so, "w").write("not a library\n"), NOT_ONE_BUILD),
    ("so_truncated", lambda so, npz, js: _halve(so), NOT_ONE_BUILD),
    ("json_batch_edited", lambda so, npz, js: _json_edit(js, "input_shape", [2, 3, 32, 32]), NOT_ONE_BUILD),
    ("json_not_json", lambda so, npz, js: open(js, "w").write("{\n"), "is not the JSON record of a build"),
    ("json_a_list", lambda so, npz, js: open(js, "w").write("[1]"), "is not the JSON record of a build"),
]


@pytest.mark.parametrize("damage,message", [d[1:] for d in DAMAGED], ids=[d[0] for d in DAMAGED])
def test_a_damaged_library_is_refused_in_one_line(small_lib, tmp_path, capsys, damage, message):
    import shutil
    for path in (small_lib, *artifact.artifact_paths(small_lib)):
        shutil.copy(path, tmp_path)
    lib = str(tmp_path / os.path.basename(small_lib))
    npz, js = artifact.artifact_paths(lib)
    damage(lib, npz, js)
    err = cli_error(capsys, "run", "--lib", lib, "--image", "skimage:coffee")
    assert message in err and "deploy.py build" in err, err


# A process killed at each step of publishing a library: before the commit record, after it,
# between the renames, after them (before the staging folder is removed).
KILL_SCRIPT = """
import os, shutil, signal, sys
import numpy as np, torch
from tvm_qconv import artifact, build
from tvm_qconv.build import BuildOptions, compile_model
from tvm_qconv.config import QuantConfig
from tvm_qconv.models import SmallVGG
from tvm_qconv.ranges import Calibrate
lib, kill_at = sys.argv[1], int(sys.argv[2])
events = []
real_replace, real_rmtree, real_save = os.replace, shutil.rmtree, artifact.save_artifact

def step(real):
    def wrapped(*args, **kwargs):
        if artifact.STAGE in str(args[0]):  # the publish's own steps (not export_library's temporaries)
            if len(events) == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            events.append(real.__name__)
        return real(*args, **kwargs)
    return wrapped

def save(*args, **kwargs):
    os.replace, shutil.rmtree = step(real_replace), step(real_rmtree)
    real_save(*args, **kwargs)
build.save_artifact = save
torch.manual_seed(1)  # another model than the library already there
x = np.random.default_rng(0).normal(0, 1, (4, 3, 32, 32)).astype(np.float32)
compile_model(SmallVGG(), lib, options=BuildOptions(image_size=32), ranges=Calibrate(x),
              config=QuantConfig(num_calib_images=4), progress=False)
print("events", events)
"""
# os.replace calls of a publish: the commit record, the .so, the .params.npz, the .json; then
# the staging folder's removal.  Killed at step 0 the new set was never committed.
KILL_STEPS = {0: "old", 1: "new", 2: "new", 3: "new", 4: "new"}


@pytest.mark.parametrize("kill_at", sorted(KILL_STEPS), ids=["before_commit", "after_commit", "after_so",
                                                             "after_params", "after_json"])
def test_a_build_killed_at_each_step_of_the_save_leaves_one_whole_library(small_lib, tmp_path, kill_at):
    import shutil
    import subprocess
    import sys
    lib = str(tmp_path / "small.so")
    for src, dst in zip((small_lib, *artifact.artifact_paths(small_lib)), (lib, *artifact.artifact_paths(lib))):
        shutil.copy(src, dst)
    x = np.random.default_rng(2).normal(0, 1, (1, 3, 32, 32)).astype(np.float32)
    old = CompiledModel(lib)(x)
    old_bytes = [open(p, "rb").read() for p in (lib, *artifact.artifact_paths(lib))]
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, lib, str(kill_at)], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == -9, proc.stderr[-2000:]  # SIGKILL: nothing of the save ran after the kill
    out = CompiledModel(lib)(x)  # the load finishes (or drops) what the killed save left
    if KILL_STEPS[kill_at] == "old":
        np.testing.assert_array_equal(out, old)
        assert [open(p, "rb").read() for p in (lib, *artifact.artifact_paths(lib))] == old_bytes  # unchanged
    else:
        assert not np.array_equal(out, old)  # the new model (another seed), whole: its build id checks
    assert not [f for f in os.listdir(tmp_path) if f.startswith(TEMP_PREFIX)]  # nothing left behind


PUBLISH_MODEL = """
import torch
from torch import nn


def make(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 5))


def other():
    return make(1)
"""


def _publish_setup(tmp_path, capsys):
    (tmp_path / "m.py").write_text(PUBLISH_MODEL)
    lib = str(tmp_path / "lib.so")
    assert deploy.main(["build", "--model", f"{tmp_path / 'm.py'}:make", "--image-size", "32", "-q", "-o", lib]) == 0
    capsys.readouterr()
    files = (lib, *artifact.artifact_paths(lib))
    return lib, files, [open(p, "rb").read() for p in files]


def _assert_previous_library_stays(lib, files, before, tmp_path, capsys):
    assert [open(p, "rb").read() for p in files] == before   # the previous library, byte for byte
    assert not [f for f in os.listdir(tmp_path) if f.startswith(TEMP_PREFIX)]  # no staging folder left ...
    assert deploy.main(["run", "--lib", lib, "--image", "skimage:coffee", "--repeat", "1", "-q"]) == 0
    assert [open(p, "rb").read() for p in files] == before   # ... so no later load installs the failed build
    capsys.readouterr()


@pytest.mark.parametrize("fails", [0, 1, 2], ids=["on-the-so", "on-the-params", "on-the-json"])
def test_a_publish_that_fails_midway_puts_the_previous_library_back_and_installs_nothing_later(
        fails, tmp_path, capsys, monkeypatch):
    # issue 56, item 6: the staging folder stayed (with its commit record), and the next `run`
    # silently rolled the build reported as failed into place
    lib, files, before = _publish_setup(tmp_path, capsys)
    real = os.replace

    def replace(src, dst):
        if os.path.abspath(dst) == os.path.abspath(files[fails]):
            raise PermissionError(1, "Operation not permitted")
        return real(src, dst)
    monkeypatch.setattr(artifact.os, "replace", replace)
    assert deploy.main(["build", "--model", f"{tmp_path / 'm.py'}:other", "--image-size", "32", "-q",
                        "-o", lib]) == 2
    err = capsys.readouterr().err
    assert f"could not put the new library in place: {files[fails]} cannot be replaced (Operation not permitted); " \
           f"nothing was installed, the files at {lib} are as they were" in err, err
    monkeypatch.setattr(artifact.os, "replace", real)
    _assert_previous_library_stays(lib, files, before, tmp_path, capsys)


def test_an_immutable_library_file_fails_the_build_in_one_line_and_is_never_replaced_later(tmp_path, capsys):
    import subprocess
    lib, files, before = _publish_setup(tmp_path, capsys)
    if subprocess.run(["chattr", "+i", files[1]], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here (needs root and a file system with attributes)")
    try:
        assert deploy.main(["build", "--model", f"{tmp_path / 'm.py'}:other", "--image-size", "32", "-q",
                            "-o", lib]) == 2
        assert f"{files[1]} cannot be replaced" in capsys.readouterr().err
    finally:
        subprocess.run(["chattr", "-i", files[1]], check=True)
    _assert_previous_library_stays(lib, files, before, tmp_path, capsys)


@pytest.mark.parametrize("cli,argv,says", [
    ("deploy", ["build", "--model", "vgg11", "--target", "cuda", "--arch", "sm_1", "-o", "{tmp}/m.so"],
     "--arch 'sm_1' is not a CUDA arch such as sm_90 or sm_80"),
    ("deploy", ["build", "--model", "alexnet", "--image-size", "64", "--skip", "nolayer", "-o", "{tmp}/m.so"],
     "skip list entry 'nolayer' matches no layer of this model; its conv and linear layers are ['features.0'"),
    ("tune", ["--model", "vgg16", "--work-dir", "{tmp}/a_file"],
     "the tuning folder (--work-dir) {tmp}/a_file cannot be written: {tmp}/a_file is a file, not a folder"),
], ids=["arch_sm_1", "skip_no_layer", "tune_work_dir_is_a_file"])
def test_more_bad_cli_inputs_are_one_line(cli, argv, says, tmp_path, capsys):
    import tune
    (tmp_path / "a_file").write_text("not a folder")
    main = {"deploy": deploy.main, "tune": tune.main}[cli]
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert says.format(tmp=tmp_path) in err
    assert not (tmp_path / "m.so").exists()


def test_a_library_of_another_tvm_version_is_refused(small_lib, tmp_path, capsys):
    import json
    import shutil
    lib = str(tmp_path / "small.so")
    for src, dst in zip((small_lib, *artifact.artifact_paths(small_lib)), (lib, *artifact.artifact_paths(lib))):
        shutil.copy(src, dst)
    meta_path = artifact.artifact_paths(lib)[1]
    meta = json.load(open(meta_path))
    assert meta["tvm_version"] == tvm.__version__  # recorded at build
    meta["tvm_version"] = "0.26.0"  # as a library built by an older TVM would say
    json.dump(meta, open(meta_path, "w"))
    err = cli_error(capsys, "run", "--lib", lib, "--image", "skimage:coffee")
    assert f"{lib} was built with TVM 0.26.0, this runtime is TVM {tvm.__version__}: rebuild it" in err
