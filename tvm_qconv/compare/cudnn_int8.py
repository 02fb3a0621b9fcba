"""cuDNN's int8 fused conv, every engine plan timed and the fastest kept: the yardstick of the
project's per-layer figures and the ``cudnn-int8`` row of ``deploy.py compare`` (the closest
runnable stand-in for TensorRT's int8 tactics, which time every candidate the same way).

The layer is the project's: int8 NHWC input, int8 weights, int32 accumulation, then a
per-output-channel float scale, a bias, ReLU and an int8 NHWC output, one cuDNN graph (frontend
graph API: ``conv_fprop`` -> ``mul`` -> ``add`` -> ``relu``, int8 out).  Needs the optional
``nvidia-cudnn-frontend`` package (1.12 has no dependencies; the cuDNN library is PyTorch's).
cuDNN wants the input channels a multiple of 4: fewer are padded with zeros, and a layer of
fewer than 16 is also timed padded to 16 (the faster kept, its channel count reported).
"""
from __future__ import annotations

import torch

from .measure import cuda_median_ms


def missing() -> str | None:
    """None when cuDNN's frontend can run here, else why not (one line)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    try:
        torch.backends.cudnn.version()           # loads PyTorch's libcudnn for the frontend
        import cudnn  # noqa: F401  (optional: nvidia-cudnn-frontend)
    except ImportError as e:
        return f"nvidia-cudnn-frontend not installed ({e})"
    return None


def _graph(n, c, h, w, k, kernel, stride, padding, dilation, int32_acc: bool):
    """The fused int8 conv graph and its tensors, built with every plan cuDNN offers; the conv's
    virtual output is float (the frontend's intermediate type) or, ``int32_acc``, int32."""
    import cudnn  # optional (nvidia-cudnn-frontend): missing() says whether it is there
    # the conv accumulates in int32; the pointwise epilogue computes in float (cuDNN supports no
    # other math precision there)
    g = cudnn.pygraph(io_data_type=cudnn.data_type.INT8, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT)
    x = g.tensor(name="x", dim=[n, c, h, w], stride=[c * h * w, 1, w * c, c], data_type=cudnn.data_type.INT8)
    wt = g.tensor(name="w", dim=[k, c, *kernel], stride=[c * kernel[0] * kernel[1], 1, kernel[1] * c, c],
                  data_type=cudnn.data_type.INT8)
    scale = g.tensor(name="scale", dim=[1, k, 1, 1], stride=[k, 1, k, k], data_type=cudnn.data_type.FLOAT)
    bias = g.tensor(name="bias", dim=[1, k, 1, 1], stride=[k, 1, k, k], data_type=cudnn.data_type.FLOAT)
    acc = g.conv_fprop(image=x, weight=wt, padding=list(padding), stride=list(stride), dilation=list(dilation),
                       compute_data_type=cudnn.data_type.INT32)
    if int32_acc:
        acc.set_data_type(cudnn.data_type.INT32)
    f32 = cudnn.data_type.FLOAT
    y = g.relu(input=g.add(a=g.mul(a=acc, b=scale, compute_data_type=f32), b=bias, compute_data_type=f32),
               compute_data_type=f32)
    y.set_output(True).set_data_type(cudnn.data_type.INT8)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans(cudnn.build_plan_policy.ALL)
    return g, (x, wt, scale, bias, y)


def time_fused_conv(n, c, h, w, k, kernel=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1),
                    iters: int = 20) -> dict:
    """Every plan of the fused int8 conv timed (CUDA events, median of ``iters`` after warm-up);
    returns ``{"ms": fastest, "plan": its name, "plans": how many ran, "heuristic_ms": cuDNN's
    own first choice, "in_channels": the (padded) channels timed}``."""
    cands = [-(-c // 4) * 4] + ([16] if c < 16 else [])
    best = None
    for cp in cands:
        errors = []
        for int32_acc in (False, True):        # whichever form this cuDNN supports
            try:
                g, (x, wt, scale, bias, y) = _graph(n, cp, h, w, k, kernel, stride, padding, dilation, int32_acc)
                break
            except Exception as e:             # cudnnGraphNotSupportedError and kin
                errors.append(f"{type(e).__name__}: {e}")
        else:
            raise RuntimeError(f"cuDNN builds no int8 conv graph for C={cp}: {' | '.join(errors)}")
        dev = "cuda"
        xt = torch.randint(-128, 128, (n, cp, h, w), dtype=torch.int8, device=dev).to(memory_format=torch.channels_last)
        wtt = torch.randint(-127, 128, (k, cp, *kernel), dtype=torch.int8, device=dev).to(
            memory_format=torch.channels_last)
        st = torch.full((1, k, 1, 1), 1e-3, device=dev).to(memory_format=torch.channels_last)
        bt = torch.zeros((1, k, 1, 1), device=dev).to(memory_format=torch.channels_last)
        yt = torch.empty(tuple(y.get_dim()), dtype=torch.int8, device=dev).to(memory_format=torch.channels_last)
        pack = {x: xt, wt: wtt, scale: st, bias: bt, y: yt}
        times = {}
        for i in range(g.get_execution_plan_count()):
            try:
                ws = torch.empty(max(1, g.get_workspace_size_plan_at_index(i)), dtype=torch.uint8, device=dev)
                times[i] = cuda_median_ms(lambda: g.execute_plan_at_index(pack, ws, index=i), iters=iters, warmup=3)
            except Exception:                    # a plan that does not run here is not a candidate
                continue
        if not times:
            continue
        i = min(times, key=times.get)
        row = dict(ms=times[i], plan=g.get_plan_name_at_index(i), plans=len(times), heuristic_ms=times.get(0),
                   in_channels=cp)
        if best is None or row["ms"] < best["ms"]:
            best = row
    if best is None:
        raise RuntimeError(f"cuDNN ran no plan of the int8 conv {n}x{c}x{h}x{w} -> {k}")
    return best


def time_workload(wl) -> dict:
    """:func:`time_fused_conv` for a project ``ConvWorkload`` (symmetric padding only)."""
    pt, pl, pb, pr = wl.padding
    if (pt, pl) != (pb, pr):
        raise ValueError(f"cuDNN takes symmetric padding only, this layer has {wl.padding}")
    return time_fused_conv(wl.batch, wl.in_channels, wl.height, wl.width, wl.out_channels, wl.kernel, wl.stride,
                           (pt, pl), wl.dilation)
