"""``deploy.py compare``: every baseline is a row (measured, or saying why not), the run survives
a failing baseline, and it writes a JSON, a markdown table and a PNG chart.  CPU runs use a
small model at 32 px; the GPU test runs the CUDA rows."""
import json
import os

import numpy as np
import pytest
import torch
from torch import nn

import deploy
from tvm_qconv.build import BuildOptions, compile_model
from tvm_qconv.compare import BASELINE_KEYS, CompareOptions, compare
from tvm_qconv.compare import baselines as baselines_mod
from tvm_qconv.compare import report
from tvm_qconv.compare.measure import agreement, time_calls
from tvm_qconv.compare.run import Context, tuning_log_for
from tvm_qconv.errors import InputError

SIZE = 32


class SmallNet(nn.Module):
    """Convs with bias + ReLU, a residual add, a max pool and a linear layer: one of each int8
    kernel kind, built in a few seconds."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(16 * (SIZE // 2) ** 2, 10)

    def forward(self, x):
        x = self.stem(x)
        x = torch.relu(x + self.block(x))
        return self.head(self.pool(x).flatten(1))


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return SmallNet().eval()


CPU_ROWS = ("int8", "torch-fp32", "torch-bf16", "torch-fp16", "torch-compile", "ort-cpu", "tensorrt")


def _options(tmp_path, **kw) -> CompareOptions:
    base = dict(model="small_net", batches=(1, 3), image_size=SIZE, device="cpu", out_dir=str(tmp_path / "out"),
                work_dir=str(tmp_path / "work"), budget_s=0.2, baselines=CPU_ROWS)
    return CompareOptions(**{**base, **kw})


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare")
    options = _options(tmp)
    return options, compare(options, model=small_net(), progress=lambda line: None)


def _row(results, key, batch):
    return next(r for r in results["rows"] if r["key"] == key and r["batch"] == batch)


def test_every_chosen_baseline_is_a_row_at_every_batch(cpu_run):
    options, results = cpu_run
    # in the table's order (BASELINE_KEYS), whatever the order they were asked for in
    assert [(r["batch"], r["key"]) for r in results["rows"]] == [(b, k) for b in options.batches
                                                                 for k in BASELINE_KEYS if k in CPU_ROWS]


def test_the_int8_library_is_timed_and_agrees_with_fp32_pytorch(cpu_run):
    _, results = cpu_run
    for batch in (1, 3):
        row = _row(results, "int8", batch)
        assert row["status"] == "ok", row.get("reason")
        assert row["runs"] >= 3 and 0 < row["median_ms"] <= row["p99_ms"]
        assert row["images_per_s"] == pytest.approx(batch / row["median_ms"] * 1e3)
        assert row["build_s"] > 0
        # int8 against float on 15 photos: this small net keeps > 30 dB (measured 38-40 dB);
        # 25 dB still catches a wrong scale or layout (those give < 10 dB)
        assert row["sqnr_db"] > 25 and row["top1_agree"] >= 0.8
    # the same library semantics at both batch sizes: the same logits, so the same agreement
    assert _row(results, "int8", 1)["sqnr_db"] == pytest.approx(_row(results, "int8", 3)["sqnr_db"], abs=1e-3)


def test_fp32_pytorch_is_the_reference_and_bf16_is_below_it(cpu_run):
    _, results = cpu_run
    fp32, bf16 = _row(results, "torch-fp32", 1), _row(results, "torch-bf16", 1)
    # the reference ran the 15 photos as one batch, the row one at a time: only the summation
    # order differs (> 100 dB); bf16 keeps 8 bits of mantissa (~ 40-50 dB)
    assert fp32["status"] == "ok" and (fp32["sqnr_db"] == "inf" or fp32["sqnr_db"] > 100)
    assert fp32["top1_agree"] == 1.0
    assert bf16["status"] == "ok" and 20 < bf16["sqnr_db"] < 80


def test_onnx_runtime_runs_the_exported_qdq_model_with_the_same_ranges(cpu_run):
    _, results = cpu_run
    ort, int8 = _row(results, "ort-cpu", 3), _row(results, "int8", 3)
    assert ort["status"] == "ok", ort.get("reason")
    # the same int8 weights and scales; ONNX rounds half to even and requantizes in float: within
    # a few dB of the project's own agreement with float
    assert abs(ort["sqnr_db"] - int8["sqnr_db"]) < 6 and ort["top1_agree"] >= 0.8


def test_rows_that_cannot_run_here_say_why(cpu_run):
    _, results = cpu_run
    for key in ("torch-fp16", "torch-compile"):
        row = _row(results, key, 1)
        assert row["status"] == "skipped" and "needs a CUDA GPU" in row["reason"]
    trt = _row(results, "tensorrt", 1)
    assert trt["status"] == "skipped" and ("not installed" in trt["reason"] or "CUDA GPU" in trt["reason"])


def test_it_writes_strict_json_a_table_per_batch_and_a_png(cpu_run):
    options, results = cpu_run
    out = options.out_dir
    with open(os.path.join(out, "compare_small_net.json")) as f:
        saved = json.loads(f.read(), parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert saved["environment"]["versions"]["torch"] == torch.__version__
    assert saved["environment"]["date"] and saved["environment"]["cpu"]
    table = open(os.path.join(out, "compare_small_net.md")).read()
    assert "## Batch 1" in table and "## Batch 3" in table
    assert table.count("| tvm_qconv int8 |") == 2 and table.count("skipped: needs a CUDA GPU") >= 4
    with open(os.path.join(out, "compare_small_net.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    best = {e["batch"]: e for e in results["summary"]}
    pytorch = _row(results, "torch-fp32", 1)["median_ms"]
    ours = _row(results, "int8", 1)["median_ms"]
    assert best[1]["speedup"]["pytorch"] == pytest.approx(min(pytorch, _row(results, "torch-bf16", 1)["median_ms"])
                                                          / ours)


def test_a_failing_baseline_is_a_failed_row_and_the_run_carries_on(tmp_path, monkeypatch):
    def broken(ctx, batch):
        raise RuntimeError("kernel exploded\nsecond line")
    rows = [baselines_mod.Baseline("torch-fp32", "broken", "pytorch", broken)] + \
        [b for b in baselines_mod.baselines() if b.key == "torch-bf16"]
    monkeypatch.setattr("tvm_qconv.compare.run.baselines", lambda: rows)
    results = compare(_options(tmp_path, batches=(2,), baselines=("torch-fp32", "torch-bf16")), model=small_net(),
                      progress=lambda line: None)
    failed, after = results["rows"]
    assert failed["status"] == "failed" and failed["reason"] == "RuntimeError: kernel exploded"
    assert "kernel exploded" in open(failed["log"]).read()  # the traceback is kept for a report
    assert after["status"] == "ok"


def test_a_library_from_other_weights_is_timed_but_not_compared(tmp_path):
    lib = str(tmp_path / "other.so")
    torch.manual_seed(1)
    compile_model(SmallNet().eval(), lib, options=BuildOptions(target="llvm", image_size=SIZE, batch=2, verify=False),
                  progress=False)
    results = compare(_options(tmp_path, batches=(2,), baselines=("int8",), libs=(lib,)), model=small_net(),
                      progress=lambda line: None)
    row = results["rows"][0]
    assert row["status"] == "ok" and row["build_s"] is None
    assert "other weights" in row["note"] and "sqnr_db" not in row


@pytest.mark.parametrize("kw, message", [
    (dict(batches=(0,)), "batch sizes must be positive"),
    (dict(baselines=("torch-fp64",)), "unknown baseline 'torch-fp64'"),
    (dict(libs=("/nonexistent/model.so",)), "does not exist"),
    (dict(tuning_log="/nonexistent"), "is not a folder"),
], ids=["batch-0", "unknown-baseline", "missing-lib", "missing-tuning-log"])
def test_bad_options_are_refused_by_name(tmp_path, kw, message):
    with pytest.raises(InputError, match=message):
        _options(tmp_path, **kw)


def test_a_library_of_another_image_size_is_refused(tmp_path):
    lib = str(tmp_path / "big.so")
    compile_model(small_net(), lib, options=BuildOptions(target="llvm", image_size=SIZE, verify=False), progress=False)
    with pytest.raises(InputError, match=r"takes \(3, 32, 32\) images.*--image-size 32"):
        compare(_options(tmp_path, image_size=16, baselines=("int8",), libs=(lib,)),
                model=nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 14 * 14, 3)).eval(),
                progress=lambda line: None)


def test_input_sets_are_distinct_batches_of_the_photos(tmp_path):
    ctx = Context(_options(tmp_path, input_sets=4), model=small_net())
    from tvm_qconv.data import skimage_photos
    ctx.photos = skimage_photos(SIZE)
    sets = ctx.input_sets(2)
    assert len(sets) == 4 and all(s.shape == (2, 3, SIZE, SIZE) for s in sets)
    assert all(not np.array_equal(a, b) for i, a in enumerate(sets) for b in sets[i + 1:])


def test_tuning_log_for_finds_the_batchs_database(tmp_path):
    for name in ("vgg16-b1-sm_90", "vgg16-b64-sm_90"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "database_workload.json.gz").write_bytes(b"")
    assert tuning_log_for(str(tmp_path), "vgg16", 64, "sm_90a") == str(tmp_path / "vgg16-b64-sm_90")
    assert tuning_log_for(str(tmp_path), "vgg16", 16, "sm_90a") is None
    assert tuning_log_for(str(tmp_path / "vgg16-b1-sm_90"), "vgg16", 16, "sm_90") == str(tmp_path / "vgg16-b1-sm_90")
    (tmp_path / "resnet50-b16-sm_90a").mkdir()   # tuned with wgmma, found by a build the GPU calls sm_90
    assert tuning_log_for(str(tmp_path), "resnet50", 16, "sm_90") == str(tmp_path / "resnet50-b16-sm_90a")


def test_time_calls_cycles_over_the_inputs_and_keeps_its_bounds():
    seen = []
    timing = time_calls(seen.append, ["a", "b", "c"], cuda=False, warmup=2, min_runs=5, max_runs=7, budget_s=10)
    assert timing.runs == 7 and seen[2:] == ["a", "b", "c", "a", "b", "c", "a"]  # 2 warm-up calls first
    assert time_calls(lambda x: None, [0], cuda=False, warmup=0, min_runs=3, budget_s=1e-9).runs == 3


def test_a_row_whose_logits_are_not_the_models_is_marked_wrong_and_left_out(tmp_path):
    rows = [dict(key="int8", name="ours", family="tvm_qconv", batch=1, status="ok", median_ms=1.0, sqnr_db=30.0,
                 top1_agree=1.0),
            dict(key="torch-fp16-graph", name="graph", family="pytorch", batch=1, status="ok", median_ms=0.5,
                 sqnr_db="-inf", top1_agree=0.0),
            dict(key="torch-fp16", name="eager", family="pytorch", batch=1, status="ok", median_ms=2.0, sqnr_db=60.0,
                 top1_agree=1.0)]
    results = dict(environment=dict(date="d", command="c", cpu="cpu", versions={}), model="m", weights="w",
                   image_size=32, batches=[1], rows=rows, input_sets=4, budget_s=1.0)
    path = tmp_path / "compare_m.json"
    path.write_text(json.dumps(results))
    out = report.render(str(path), floor_db=10.0)
    assert [r["status"] for r in out["rows"]] == ["ok", "wrong", "ok"]
    assert "-inf dB" in out["rows"][1]["reason"]
    # the speed-up is over the fastest row that computes the model: eager 2.0 ms, not the 0.5 ms replay
    assert out["summary"][0]["speedup"]["pytorch"] == pytest.approx(2.0)
    assert "**wrong outputs**" in (tmp_path / "compare_m.md").read_text()
    assert (tmp_path / "compare_m.png").stat().st_size > 0


def test_agreement_counts_top1_and_sqnr():
    ref = np.array([[1.0, 0.0], [0.0, 1.0]])
    assert agreement(ref, ref) == dict(top1_agree=1.0, sqnr_db=float("inf"))
    assert agreement(ref, np.array([[1.0, 0.0], [1.0, 0.0]]))["top1_agree"] == 0.5
    assert agreement(ref, np.full((2, 2), np.nan))["top1_agree"] == 0.0


def test_every_baseline_key_is_documented_in_the_cli_help():
    text = deploy.build_parser()._subparsers._group_actions[0].choices["compare"].format_help()
    assert all(key in text for key in BASELINE_KEYS)


@pytest.mark.parametrize("argv, message", [
    (["--batch", "1,x"], "batch sizes"),
    (["--baselines", "nope"], "unknown baseline"),
], ids=["bad-batch", "bad-baseline"])
def test_the_cli_refuses_bad_input_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        deploy.main(["compare", "--model", "resnet18", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.gpu
def test_compare_on_the_gpu_runs_the_cuda_rows(tmp_path):
    keys = ("int8-graph", "int8", "torch-fp16", "torch-fp16-graph", "torch-fp32")
    results = compare(CompareOptions(model="small_net", batches=(4,), image_size=SIZE, device="cuda", baselines=keys,
                                     out_dir=str(tmp_path), work_dir=str(tmp_path / "work"), budget_s=0.5),
                      model=small_net(), progress=print)
    for row in results["rows"]:
        assert row["status"] == "ok", row
        assert row["peak_mem_mib"] is not None and row["peak_mem_mib"] >= 0
        # every row computes the model: int8 ~40 dB on this net, fp16 ~60 dB (the CUDA-graph rows
        # of PyTorch once timed replays whose logits were not the model's)
        assert float(row["sqnr_db"]) > 25 and row["top1_agree"] >= 0.8, row
    graph, plain = (_row(results, k, 4) for k in ("int8-graph", "int8"))
    assert graph["sqnr_db"] == pytest.approx(plain["sqnr_db"], abs=1e-3)  # the same kernels, with or without graphs


@pytest.mark.gpu
def test_a_captured_graph_keeps_the_model_it_reads_alive():
    # compare's CUDA-graph rows once timed garbage: prepare_torch let the model go after the
    # capture, and the replays read its freed weights, which the next allocations overwrote
    # (H100, 2026-11-25).  Here the caller drops the model and refills its freed blocks with NaN.
    model = small_net().cuda().eval()
    x = torch.randn(4, 3, SIZE, SIZE, device="cuda")
    with torch.no_grad():
        want = model(x)
        call, _ = baselines_mod.capture(model, x.clone())
        shapes = [p.shape for p in model.parameters()]
        del model
        junk = [torch.full(s, float("nan"), device="cuda") for s in shapes]  # noqa: F841 - reuses freed blocks
        got = call(x.flip(0)).flip(0)
    # cuDNN may pick other (TF32) algorithms inside the capture: ~1e-3 apart; freed weights: NaN
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_a_replay_is_checked_against_eager_and_an_overflowing_model_is_named():
    # The check that keeps compare and the zoo from timing a replay that is not the model (CPU:
    # the "replay" here is a plain call into the static output buffer).
    model = nn.Linear(4, 2).eval()
    x = torch.ones(3, 4)
    out = torch.empty(3, 2)
    with torch.no_grad():
        baselines_mod.check_replay(lambda v: out.copy_(model(v)), out, model, x)        # the model: passes
        with pytest.raises(RuntimeError, match="does not reproduce eager PyTorch"):
            baselines_mod.check_replay(lambda v: out.copy_(model(v) + 1), out, model, x)  # off by ~1: refused
        # random-init Inception-V3 in fp16 reaches 1.6e12 (zoo run on the H100, 2026-11-26): eager
        # PyTorch itself gives inf / NaN, so the error must say it is the model, not the capture
        model.weight.fill_(1e38)
        with pytest.raises(baselines_mod.NonFiniteOutput, match=r"not finite \(6 of 6 values\).*float32"):
            baselines_mod.check_replay(lambda v: out.copy_(model(v)), out, model, x)


def test_an_onnx_file_compares_against_onnx_runtimes_fp32_with_accuracy_columns(tmp_path):
    # a float ONNX file: its int8 library and ONNX Runtime's rows run, the PyTorch rows say why they
    # cannot; with --data every comparable row also has its top-1 / top-5 on the labelled folder
    from PIL import Image
    path = str(tmp_path / "small.onnx")
    torch.onnx.export(small_net(), (torch.randn(1, 3, SIZE, SIZE),), path, opset_version=17, dynamo=False,
                      input_names=["image"], output_names=["logits"], dynamic_axes={"image": {0: "N"}})
    data = tmp_path / "data"
    for i in range(4):
        (data / str(i % 2)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((40, 40, 3), 60 * i, np.uint8)).save(data / str(i % 2) / f"{i}.png")
    options = _options(tmp_path, model=path, batches=(1,), baselines=("int8", "torch-fp32", "ort-cpu"),
                       data=str(data))
    results = compare(options, progress=lambda line: None)
    assert results["reference"] == "fp32 ONNX Runtime (CPU)"
    torch_row, int8 = _row(results, "torch-fp32", 1), _row(results, "int8", 1)
    assert torch_row["status"] == "skipped" and "ONNX file" in torch_row["reason"]
    assert int8["status"] == "ok" and int8["sqnr_db"] > 15      # against ONNX Runtime's fp32 logits
    assert 0 <= int8["top1"] <= int8["top5"] <= 100
    reference = results["labelled"]["reference"]
    assert results["labelled"]["images"] == 4 and 0 <= reference["top1"] <= reference["top5"] <= 100
    table = open(os.path.join(options.out_dir, f"compare_{options.tag}.md")).read()
    assert options.tag == "small" and "top-1 % | top-5 %" in table and "a smoke test" in table


def test_a_qdq_file_compares_with_its_own_scales_and_onnx_runtime_runs_the_file(tmp_path):
    from tvm_qconv.onnx_export import export_onnx
    path = str(tmp_path / "small_qdq.onnx")
    export_onnx(small_net(), path, input_shape=(1, 3, SIZE, SIZE), progress=False)
    options = _options(tmp_path, model=path, batches=(1,), baselines=("int8", "ort-cpu"))
    results = compare(options, progress=lambda line: None)
    int8, ort_row = _row(results, "int8", 1), _row(results, "ort-cpu", 1)
    assert int8["status"] == "ok" and ort_row["status"] == "ok"
    # the library is built from the file's scales and ONNX Runtime runs the file itself: the two int8
    # results differ only in rounding (ONNX's half to even, in float) and agree far above int8's noise
    assert ort_row["sqnr_db"] > 15 and int8["sqnr_db"] > 15


def test_compare_data_takes_the_class_name_folders_eval_data_takes(tmp_path, capsys):
    # folders named by the model's ImageNet category names (resolved as `eval --data` resolves
    # them, from the names its library records) and by a WordNet id: refused by compare until
    # issue 56, which passed it no category names
    from PIL import Image
    data = tmp_path / "data"
    for i, folder in enumerate(["tench", "Great_White_Shark", "n01443537"]):
        (data / folder).mkdir(parents=True)
        for j in range(2):
            Image.fromarray(np.full((40, 40, 3), 40 * i + 20 * j, np.uint8)).save(data / folder / f"{j}.png")
    out = tmp_path / "out"
    argv = ["compare", "--model", "squeezenet1_1", "--image-size", str(SIZE), "--batch", "1", "--device", "cpu",
            "--baselines", "torch-fp32", "--budget", "0.1", "--input-sets", "1", "--data", str(data),
            "--out", str(out), "--work-dir", str(tmp_path / "work"), "--quiet"]
    assert deploy.main(argv) == 0, capsys.readouterr().err
    labelled = json.loads((out / "compare_squeezenet1_1.json").read_text())["labelled"]
    assert labelled["images"] == 6 and labelled["layout"].startswith("3 class folders")
    row = json.loads((out / "compare_squeezenet1_1.json").read_text())["rows"][0]
    assert row["key"] == "torch-fp32" and 0 <= row["top1"] <= row["top5"] <= 100
