"""benchmarks/goal.py, the driver of issue 34's goal measurement: which (model, batch) units are
left, the commands it runs, and the table it makes of finished comparisons (CPU: no GPU is run)."""
import json
import os
import subprocess
import sys

from benchmarks import goal


def _finished(out, model, batch, int8_ms, torch_ms, best="torch.compile max-autotune fp16"):
    """A finished unit as ``deploy.py compare`` writes it (the fields ``table`` reads)."""
    d = goal.unit_dir(str(out), model, batch)
    os.makedirs(d)
    summary = [dict(batch=batch, best=dict(tvm_qconv=dict(name="tvm_qconv int8 + CUDA graph", median_ms=int8_ms),
                                           pytorch=dict(name=best, median_ms=torch_ms)),
                    speedup=dict(pytorch=torch_ms / int8_ms))]
    with open(os.path.join(d, f"compare_{model}.json"), "w") as f:
        json.dump(dict(model=model, device="cuda", summary=summary,
                       environment=dict(date="2026-11-28 05:36 UTC", gpu=dict(name="NVIDIA H200"))), f)


def test_finished_units_are_skipped_and_batch_64_goes_first(tmp_path):
    _finished(tmp_path, "resnet18", 64, 0.5, 1.7)
    os.makedirs(goal.unit_dir(str(tmp_path), "vgg16", 1))   # started, cut short: no compare_vgg16.json
    assert goal.pending(str(tmp_path), ["resnet18", "vgg16"], [1, 64]) == [
        ("vgg16", 64), ("resnet18", 1), ("vgg16", 1)]


def test_the_table_gives_each_unit_its_speed_up_and_verdict(tmp_path):
    _finished(tmp_path, "resnet18", 64, 0.5, 1.7)               # 3.4x: the moonshot
    _finished(tmp_path, "densenet121", 64, 8.6, 8.61, "PyTorch fp16 channels_last + CUDA graph")   # 1.00x
    _finished(tmp_path, "convnext_tiny", 1, 0.49, 0.80)         # 1.63x
    summary = goal.table(str(tmp_path))
    verdicts = {(r["model"], r["batch"]): (round(r["speedup"], 2), r["goal"], r["moonshot"]) for r in summary["rows"]}
    assert verdicts == {("resnet18", 64): (3.4, True, True), ("densenet121", 64): (1.0, False, False),
                        ("convnext_tiny", 1): (1.63, True, False)}
    assert summary["missed"] == ["densenet121 b64"]
    text = (tmp_path / "goal.md").read_text()
    assert ("| densenet121 | 64 | 8.600 | 8.610 | PyTorch fp16 channels_last + CUDA graph | 1.00x | no | NVIDIA H200 | "
            "2026-11-28 05:36 UTC |") in text          # which GPU and when: the units run on several machines
    assert json.loads((tmp_path / "goal.json").read_text())["goal_met"] == 2


def test_a_dry_run_prints_one_compare_per_pending_unit_and_refuses_unknown_models(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "benchmarks", "goal.py")
    res = subprocess.run([sys.executable, script, "run", "--models", "resnet18", "--batches", "1", "64", "--dry-run",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if "deploy.py compare" in ln]
    assert len(lines) == 2 and all(f"--baselines {goal.BASELINES}" in ln for ln in lines)
    assert "--batch 64" in lines[0] and "--batch 1 " in lines[1]
    bad = subprocess.run([sys.executable, script, "run", "--models", "resnet19", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "not zoo models: ['resnet19']" in bad.stderr


def test_each_unit_gets_its_share_of_the_cores_for_every_thread_pool():
    limits = goal.thread_limits(4, cpus=64)
    assert limits == {"OMP_NUM_THREADS": "16", "MKL_NUM_THREADS": "16", "TVM_NUM_THREADS": "16",
                      "TORCHINDUCTOR_COMPILE_THREADS": "16"}
    assert goal.thread_limits(8, cpus=4)["OMP_NUM_THREADS"] == "1"      # never 0


def _timings(folder, name, timings):
    """An inductor autotune cache file as ``codecache.PersistentCache`` writes it."""
    os.makedirs(os.path.join(folder, "cache"), exist_ok=True)
    with open(os.path.join(folder, "cache", name), "w") as f:
        json.dump({"system": {"hash": name}, "cache": timings}, f)


def test_max_autotune_timings_of_a_unit_cut_short_are_kept_for_the_next_call(tmp_path):
    store, first, second = (str(tmp_path / d) for d in ("store", "unit1", "unit2"))
    # a unit interrupted after benchmarking two ops, on a GPU whose system hash is "h200"
    _timings(first, "h200", {"mm": {"64x1280": {"highest": {"triton_a": 0.012, "triton_b": 0.015}}},
                             "convolution": {"64x32x112": {"highest": {"triton_c": 0.30}}}})
    assert goal.save_timings(first, store) == 2
    # the next call's unit starts from them, benchmarks one op more, and a choice of the first again
    goal.seed_timings(store, second)
    with open(os.path.join(second, "cache", "h200")) as f:
        assert json.load(f)["cache"]["mm"]["64x1280"]["highest"]["triton_a"] == 0.012
    _timings(second, "h200", {"mm": {"64x1280": {"highest": {"triton_d": 0.011}}, "1x1280": {"highest": {"x": 1.0}}}})
    _timings(second, "not-json", {})
    with open(os.path.join(second, "cache", "not-json"), "w") as f:
        f.write("{half a file")
    assert goal.save_timings(second, store) == 3
    with open(os.path.join(store, "cache", "h200")) as f:
        kept = json.load(f)["cache"]
    assert kept["mm"]["64x1280"]["highest"] == {"triton_a": 0.012, "triton_b": 0.015, "triton_d": 0.011}
    assert "convolution" in kept and not os.path.exists(os.path.join(store, "cache", "not-json"))
    assert goal.inductor_dir("resnet18", 1) != goal.inductor_dir("resnet18", 64)   # units never share a file


def test_pad_mm_timings_a_flat_key_to_time_file_are_kept_too(tmp_path):
    # inductor's pad_mm writes {key: time or flag} into the same cache folder (seen on an H200 run,
    # 2026-11-28: the counter took len() of a float and ended the goal run after its first unit)
    store, unit = str(tmp_path / "store"), str(tmp_path / "unit")
    _timings(unit, "pad", {"base mm time: (49, 3072)": 0.062, "(49, 3072) exclude_pad": False})
    assert goal.save_timings(unit, store) == 2
    with open(os.path.join(store, "cache", "pad")) as f:
        assert json.load(f)["cache"]["base mm time: (49, 3072)"] == 0.062


def test_a_run_on_chosen_gpus_gives_each_unit_that_gpu_and_one_gpus_share_of_the_cores(tmp_path, monkeypatch):
    # a host's GPU 0 busy with another job: units on GPU 1 only, each with half the cores of a
    # 2-GPU host, not all of them (two runs side by side would take every core twice)
    started = []

    class Done:     # a unit that ends at once, without results
        returncode = 0

        def __init__(self, cmd, env, stdout, stderr):
            started.append(env)

        def poll(self):
            return 0

    monkeypatch.setattr(goal.subprocess, "Popen", Done)
    monkeypatch.setattr(goal.os, "cpu_count", lambda: 32)
    goal.run(str(tmp_path), ["resnet18"], [1, 64], [1], deadline=60, unit_seconds=0, size=224, host_gpus=2)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in started] == ["1", "1"]
    assert {e["OMP_NUM_THREADS"] for e in started} == {"16"}


def test_a_unit_times_the_prebuilt_library_of_lib_dir_and_builds_where_there_is_none(tmp_path):
    libs = tmp_path / "libs"
    libs.mkdir()
    (libs / "resnet18_b64.so").write_bytes(b"")        # built elsewhere with `goal.py build`
    with_lib = goal.command(str(tmp_path), "resnet18", 64, 224, str(libs))
    assert with_lib[-2:] == ["--lib", str(libs / "resnet18_b64.so")]
    assert "--lib" not in goal.command(str(tmp_path), "resnet18", 1, 224, str(libs))   # none: compare builds it
    build = goal.build_command("resnet18", 1, 224, str(libs), "sm_90a")
    # the library compare's int8-graph row would build: CUDA, the GPU's arch, CUDA graphs, the seed's weights
    assert {"--cuda-graph", "--no-verify"} <= set(build) and build[build.index("-o") + 1] == str(libs / "resnet18_b1.so")
    assert build[build.index("--arch") + 1] == "sm_90a" and "--weights" not in build
