"""Deploying and tuning through TVM RPC, on loopback with the llvm target (CPU only, in CI).

The tests start a real tracker (``python -m tvm.exec.rpc_tracker``) and real servers
(``python -m tvm_qconv.cli.rpc_server``) bound to 127.0.0.1, and kill them by PID at the end.  What
they check: ``deploy.py rpc`` prints what ``deploy.py run`` prints (the same top-5 from the same
library) and a remote latency; tuning measured on two servers fills the database a build then
uses, bit-exact with the untuned build; every fault (nothing listening, no server with the key,
busy servers, a server killed before tuning, a CUDA library on a CPU-only server or on another
arch) is one line and exit code 2; nothing the project starts listens beyond 127.0.0.1.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import deploy
import tune
from tvm_qconv.runtime import artifact
from tvm_qconv.build import BuildOptions, compile_model
from tvm_qconv.config import QuantConfig
from tvm_qconv.errors import InputError
from tvm_qconv.models import SmallVGG
from tvm_qconv.ranges import Calibrate
from tvm_qconv.runtime.remote import LOOPBACK, Remote, local_cluster
from tvm_qconv.runtime import CompiledModel
from tvm_qconv.tuning import tune_model
from tvm_qconv.tuning.database import load_database

KEY = "test-cpu"
SIZE = 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _wait(predicate, what: str, limit: float = 60.0) -> None:
    deadline = time.time() + limit
    while not predicate():
        assert time.time() < deadline, f"{what} within {limit} s"
        time.sleep(0.2)


def _listening(port: int, host: str = LOOPBACK) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def tracker():
    """A tracker and two servers under KEY; yields (Remote, [server ports])."""
    port = _free_port()
    procs = [_start(["tvm.exec.rpc_tracker", "--host", LOOPBACK, "--port", str(port), "--port-end", str(port + 1),
                     "--silent"])]
    try:
        _wait(lambda: _listening(port), "the tracker listens")
        ports = [_free_port() for _ in range(2)]
        for p in ports:
            procs.append(_start(["tvm_qconv.cli.rpc_server", "--port", str(p), "--port-end", str(p),
                                 "--tracker", f"{LOOPBACK}:{port}", "--key", KEY, "--silent"]))
        remote = Remote(tracker_host=LOOPBACK, tracker_port=port, key=KEY, timeout_s=20)
        _wait(lambda: remote.servers()[0] == 2, "both servers register")
        yield remote, ports
    finally:
        _kill(procs)
    assert all(p.poll() is not None for p in procs)  # killed by PID, none left running


@pytest.fixture(scope="module")
def server():
    """One server of its own (no tracker): yields its port."""
    port = _free_port()
    proc = _start(["tvm_qconv.cli.rpc_server", "--port", str(port), "--port-end", str(port), "--silent"])
    try:
        _wait(lambda: _listening(port), "the server listens")
        yield port
    finally:
        _kill([proc])


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("lib") / "small.so"
    x = np.random.default_rng(0).normal(0, 1, (4, 3, SIZE, SIZE)).astype(np.float32)
    compile_model(SmallVGG(), str(out), options=BuildOptions(image_size=SIZE), ranges=Calibrate(x),
                  config=QuantConfig(num_calib_images=4), progress=False)
    return str(out)


def _servers_of(key: str) -> list:
    """The ``tvm_qconv.cli.rpc_server`` processes started with ``--key key`` (psutil: no pgrep needed)."""
    import psutil
    return [p for p in psutil.process_iter(["pid", "cmdline"])
            if "tvm_qconv.cli.rpc_server" in (p.info["cmdline"] or []) and key in (p.info["cmdline"] or [])]


def _top5(out: str) -> list[str]:
    return [line for line in out.splitlines() if re.match(r"\s+\d\.\d{3}\s+\d+\s", line)]


def _one_line_error(capsys, main, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_deploy_rpc_prints_the_local_top5_and_a_remote_latency(lib, server, tracker, capsys):
    assert deploy.main(["run", "--lib", lib, "--image", "skimage:coffee", "--repeat", "2"]) == 0
    local = _top5(capsys.readouterr().out)
    assert len(local) == 5
    remote, _ = tracker
    for where in (["--host", LOOPBACK, "--port", str(server)],
                  ["--tracker", f"{remote.tracker_host}:{remote.tracker_port}", "--key", KEY]):
        assert deploy.main(["rpc", "--lib", lib, "--image", "skimage:coffee", "--repeat", "20", *where]) == 0
        out = capsys.readouterr().out
        assert _top5(out) == local  # same library, same image: same classes and probabilities
        lat = re.search(r"latency on cpu \(remote, 20 runs\): ([\d.]+) ms median, p90 ([\d.]+), p99 ([\d.]+)", out)
        assert lat, out
        median, p90, p99 = map(float, lat.groups())
        assert 0 < median <= p90 <= p99


def test_remote_outputs_equal_local_ones(lib, server):
    from tvm_qconv.runtime.remote_model import RemoteModel
    x = np.random.default_rng(1).normal(0, 1, (1, 3, SIZE, SIZE)).astype(np.float32)
    with RemoteModel(lib, Remote.parse(LOOPBACK, server)) as remote:
        np.testing.assert_array_equal(remote(x), CompiledModel(lib)(x))  # the same int8 code: bit-exact


def test_tuning_measured_on_two_servers_builds_bit_exact_and_resumes(tracker, tmp_path, capsys):
    remote, _ = tracker
    torch.manual_seed(0)
    rows = tune_model("small_vgg", 1, target="llvm", trials_per_task=3, work_dir=str(tmp_path / "db"),
                      image_size=SIZE, model=SmallVGG(), num_trials_per_iter=3, max_workers=2, remote=remote)
    out = capsys.readouterr().out
    assert f"measuring on 2 RPC server(s) of tracker {LOOPBACK}:{remote.tracker_port}, key {KEY}" in out
    assert len(rows) == 4 and all(r["trials"] >= 3 and r["best_us"] > 0 for r in rows)  # SmallVGG's 4 convs
    load_database(str(tmp_path / "db"))  # whole: every record parses
    # a re-run finds every task done: nothing measured, no server asked
    tune_model("small_vgg", 1, target="llvm", trials_per_task=3, work_dir=str(tmp_path / "db"), image_size=SIZE,
               model=SmallVGG(), remote=Remote(tracker_host=LOOPBACK, tracker_port=1, key=KEY))
    assert "nothing to tune" in capsys.readouterr().out
    x = np.random.default_rng(0).normal(0, 1, (4, 3, SIZE, SIZE)).astype(np.float32)
    outs = []
    for log in (None, str(tmp_path / "db")):
        torch.manual_seed(0)
        res = compile_model(SmallVGG(), str(tmp_path / f"m{len(outs)}.so"), ranges=Calibrate(x),
                            options=BuildOptions(image_size=SIZE, tuning_log=log),
                            config=QuantConfig(num_calib_images=4), progress=False)
        outs.append(CompiledModel(str(tmp_path / f"m{len(outs)}.so"))(x[:1]))
    assert len(res.meta["report"]["tuned"]) == 4  # every conv took its tuned schedule
    from tvm_qconv.report import format_report
    assert "tuned layers (4, from 4 tuned kernels): features.0, features.3, features.6, features.8" \
        in format_report(res.meta)  # the build report names them
    np.testing.assert_array_equal(outs[0], outs[1])  # tuning changes the loops, not the integers


def test_tuning_survives_a_server_killed_before_it_starts(tmp_path, capsys):
    with local_cluster(2, gpus=False, key="test-kill") as remote:
        # kill one server by PID: its registration may still be at the tracker, its sessions fail
        servers = _servers_of("test-kill")
        assert len(servers) == 2
        os.killpg(servers[0].pid, signal.SIGKILL)
        torch.manual_seed(0)
        rows = tune_model("small_vgg", 1, target="llvm", trials_per_task=2, work_dir=str(tmp_path / "db"),
                          image_size=SIZE, model=SmallVGG(), num_trials_per_iter=2, max_workers=2,
                          remote=remote, only=["32to64_3x3s1_8x8_b1"])
        load_database(str(tmp_path / "db"))  # intact
        if rows[0]["trials"] < 2:  # trials lost with the server are topped up by a re-run
            rows = tune_model("small_vgg", 1, target="llvm", trials_per_task=2, work_dir=str(tmp_path / "db"),
                              image_size=SIZE, model=SmallVGG(), remote=remote, only=["32to64_3x3s1_8x8_b1"])
        assert rows[0]["trials"] >= 2


def test_nothing_listening_is_one_line(lib, capsys):
    port = _free_port()
    err = _one_line_error(capsys, deploy.main, ["rpc", "--lib", lib, "--image", "skimage:coffee", "--host",
                                                LOOPBACK, "--port", str(port)])
    assert f"connection refused by {LOOPBACK}:{port}: no RPC server is listening there" in err
    assert "python -m tvm_qconv.cli.rpc_server" in err
    err = _one_line_error(capsys, tune.main, ["--model", "vgg16", "--target", "llvm", "--rpc-tracker",
                                              f"{LOOPBACK}:{port}", "--rpc-key", KEY, "--work-dir",
                                              str(lib) + "_db"])
    assert f"connection refused by {LOOPBACK}:{port}: no RPC tracker is listening there" in err


def test_a_tracker_without_the_key_names_the_keys_it_has(lib, tracker, capsys):
    remote, _ = tracker
    err = _one_line_error(capsys, deploy.main, ["rpc", "--lib", lib, "--image", "skimage:coffee", "--tracker",
                                                f"{LOOPBACK}:{remote.tracker_port}", "--key", "h100"])
    assert f"no RPC server with key 'h100' is registered at tracker {LOOPBACK}:{remote.tracker_port} " \
           f"(keys there: {KEY})" in err


def test_busy_servers_time_out_in_one_line(lib, tracker, capsys):
    remote, _ = tracker
    held = [remote.connect(session_timeout=30) for _ in range(2)]  # both servers in a session
    err = _one_line_error(capsys, deploy.main, ["rpc", "--lib", lib, "--image", "skimage:coffee", "--tracker",
                                                f"{LOOPBACK}:{remote.tracker_port}", "--key", KEY, "--timeout", "2"])
    assert f"every RPC server with key '{KEY}'" in err and "stayed busy for 2 s" in err
    del held


def test_a_server_of_a_tracker_refuses_a_direct_session(lib, tracker, capsys):
    _, ports = tracker
    err = _one_line_error(capsys, deploy.main, ["rpc", "--lib", lib, "--image", "skimage:coffee", "--host",
                                                LOOPBACK, "--port", str(ports[0])])
    assert "takes sessions only through it (use --tracker H:P --key K)" in err


def _as_cuda_library(lib: str, tmp_path, arch: str = "sm_90") -> str:
    """A copy of ``lib`` whose record says CUDA (a consistent set: the build id recomputed), to
    reach the checks a CUDA library meets at a server without a GPU here."""
    import json
    import shutil
    out = str(tmp_path / "cuda.so")
    params, meta_path = artifact.artifact_paths(lib)
    shutil.copy(lib, out)
    shutil.copy(params, artifact.artifact_paths(out)[0])
    meta = json.load(open(meta_path))
    meta.update(target="cuda", arch=arch)
    meta["build_id"] = artifact.build_id(out, artifact.artifact_paths(out)[0], meta)
    with open(artifact.artifact_paths(out)[1], "w") as f:
        json.dump(meta, f)
    return out


def test_a_cuda_library_on_a_server_without_a_gpu_is_one_line(lib, server, tmp_path, capsys):
    err = _one_line_error(capsys, deploy.main, ["rpc", "--lib", _as_cuda_library(lib, tmp_path), "--image",
                                                "skimage:coffee", "--host", LOOPBACK, "--port", str(server)])
    assert "the remote machine has no CUDA GPU" in err


def test_a_library_for_another_gpu_arch_is_refused_before_upload(lib, server, tmp_path, capsys, monkeypatch):
    from tvm_qconv.runtime import remote_model
    monkeypatch.setattr(remote_model, "remote_gpu", lambda session: (None, "sm_80", "NVIDIA A100"))
    cuda_lib = _as_cuda_library(lib, tmp_path, arch="sm_90a")
    err = _one_line_error(capsys, deploy.main, ["rpc", "--lib", cuda_lib, "--image", "skimage:coffee", "--host",
                                                LOOPBACK, "--port", str(server)])
    assert f"{cuda_lib} was built for sm_90a, this GPU is sm_80: rebuild with --arch sm_80" in err


def test_remote_cuda_tuning_needs_a_gpu_behind_the_tracker(tracker, tmp_path):
    remote, _ = tracker
    with pytest.raises(InputError, match="the remote machine has no CUDA GPU"):
        tune_model("small_vgg", 1, target="cuda", arch="sm_90", trials_per_task=2, work_dir=str(tmp_path / "db"),
                   image_size=SIZE, model=SmallVGG(), remote=remote)


@pytest.mark.parametrize("argv,says", [
    (["--local-gpus", "2", "--rpc-tracker", "127.0.0.1:9190"], "--local-gpus starts its own tracker"),
    (["--rpc-key", "h100"], "--rpc-key needs --rpc-tracker HOST:PORT"),
    (["--rpc-tracker", "127.0.0.1"], "--tracker '127.0.0.1' is not HOST:PORT"),
    (["--rpc-tracker", "127.0.0.1:9190"], "--tracker 127.0.0.1:9190 needs --key"),
    (["--local-gpus", "1", "--target", "llvm"], "--local-gpus measures on GPUs: it needs --target cuda"),
], ids=["both", "key_alone", "no_port", "no_key", "llvm_gpus"])
def test_tune_rpc_flags_are_checked_in_one_line(argv, says, tmp_path, capsys):
    assert says in _one_line_error(capsys, tune.main, ["--model", "vgg16", "--work-dir", str(tmp_path / "db"),
                                                       *argv])


def test_local_gpus_beyond_the_machine_is_one_line(tmp_path, capsys):
    from tvm_qconv.target import device_arch
    n = sum(device_arch(i) is not None for i in range(8)) + 1
    err = _one_line_error(capsys, tune.main, ["--model", "vgg16", "--local-gpus", str(n), "--work-dir",
                                              str(tmp_path / "db")])
    assert f"--local-gpus {n}, but this machine has {n - 1} CUDA GPU(s)" in err


def _other_address() -> str | None:
    """An address of this machine that is not loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: it only picks the outgoing interface
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def test_what_the_project_starts_listens_on_loopback_only():
    from tvm_qconv.cli import rpc_server
    assert rpc_server.build_parser().parse_args([]).host == LOOPBACK
    other = _other_address()
    with local_cluster(1, gpus=False, key="test-bind") as remote:
        ports = [remote.tracker_port]
        for proc in _servers_of("test-bind"):
            args = proc.info["cmdline"]
            ports.append(int(args[args.index("--port") + 1]))
        assert len(ports) == 2
        for port in ports:
            assert _listening(port)
            if other is not None:
                assert not _listening(port, other), f"port {port} answers on {other}"
