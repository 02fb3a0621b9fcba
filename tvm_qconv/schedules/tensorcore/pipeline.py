"""Compiling the tensor-core kernels: TVM's own S-TIR pipeline with four passes spliced in.

Three work around TVM 0.27 behaviour the mma kernels hit (found building them; the exact error
messages are in ``docs/tensorcore.md`` and beside each pass):

* ``qconv.PredicatedInt8AsyncCopy`` -- TVM turns ``shared = if_then_else(p, global, 0)`` into a
  predicated ``cp.async`` (zero-fill) only when the 0 is a float; the int8 im2col gather is the
  int8 form, and would stay a synchronous load.
* ``qconv.FixWarpMemory`` -- ``LowerWarpMemory`` lowers only the first "warp" buffer of a
  statement sequence (the ldmatrix fragments would stay thread-indexed arrays in local memory),
  and leaves truncdiv register indices and self-shuffles in the epilogue.
* ``qconv.PrintableInt8Vectors`` -- the CUDA codegen prints an int8 vector constant of 8 or 16
  lanes as a ``make_int4`` of one argument per byte, which nvcc rejects; the im2col gather stores
  one where a tap lies in the padding at every output pixel.

and one that is not a workaround: ``qconv.GatherThroughL1`` prints the im2col gather as
``cp.async.ca`` (TVM prints every 16-byte cp.async as ``.cg``, bypassing L1).

The same pipeline compiles the hand-written TIRx kernels of the wgmma family
(``schedules/wgmma``), marked ``tvm_qconv.tirx``: TVM's ``tirx`` pipeline fails on S-TIR
functions and the S-TIR pipeline on TIRx ones, so :func:`lower_tirx_kernels` first lowers the
marked functions' TIRx constructs (``LowerTIRx``, ``LowerTIRxOpaque``), after which the S-TIR
pipeline takes every function of the module.

:func:`compile_options` is what a build of a module holding these kernels passes to
``tvm.compile``: the registered pipeline and ``tirx.use_async_copy``.  The passes touch only
async-scope shared stores, "warp" buffers and 8-bit vector constants (which nvcc would reject),
so the other kernels of the module compile as with TVM's default pipeline.
"""
from __future__ import annotations

import tvm
import tvm_ffi
import tvm.s_tir.pipeline  # noqa: F401  (registers the "s_tir" pipeline this one extends)
from tvm import tirx
from tvm.backend.cuda.op import cuda_func_call
from tvm.sym import Analyzer
from tvm.tirx import compilation_pipeline as cp

from ..kernel import TIRX_ATTR

PIPELINE = "qconv_mma"  # the name the pipeline is registered under

# Predicated (zero-fill) cp.async for the im2col gather
#
# TVM's InjectPTXAsyncCopy turns ``shared[ramp] = global[ramp]`` (4/8/16 bytes) inside a software
# pipeline's async stage into cp.async, and ``shared[ramp] = if_then_else(p, global[ramp], 0)``
# into a predicated cp.async (zero-fill when !p) -- but only when the 0 is a *float* immediate
# (src/s_tir/transform/inject_ptx_async_copy.cc checks FloatImmNode).  The im2col gather of an
# int8 conv is exactly the int8 form (p = row < M and the tap lies inside the image), so without
# help it stays a synchronous ld.global + st.shared.  The pass below, run just before
# InjectPTXAsyncCopy, rewrites the int8 form into the same predicated ``cp_async_raw`` call the
# pass would have emitted for floats.  The padding of an unsigned input is its zero point, -128,
# not 0 (``ConvWorkload.in_zero``): such a copy's predicate is wrapped as
# ``qconv_pred_fill(p, word)`` (``cp_async_raw`` has no fill argument, and TVM's passes check its
# argument count), which ``GatherThroughL1`` (below) unwraps into the copy that stores ``word``
# where ``p`` is false.  Only that 16-byte int8 copy is so printed: the pass leaves a nonzero fill
# of any other size a synchronous copy (correct, slower), and an unwrapped marker would be an
# undefined function in the CUDA source, a compile error, never a silent zero-fill.


def _rewrite_int8_predicated_copies(body):
    ite = tvm.ir.Op.get("prim.if_then_else")
    cp_async = tvm.ir.Op.get("tirx.s_tir.cp_async_raw")
    state = {"async": 0}

    def on_attr(node, mutator):
        if node.attr_key != "async_scope":
            return mutator.default_mutate(node)
        state["async"] += 1
        try:
            return mutator.default_mutate(node)
        finally:
            state["async"] -= 1

    def on_store(node, mutator):
        if not state["async"] or node.buffer.scope() not in ("shared", "shared.dyn"):
            return node
        value = node.value
        if not (isinstance(value, tvm.ir.Call) and value.op.same_as(ite) and len(value.args) == 3):
            return node
        cond, load, other = value.args
        if not isinstance(load, tvm.ir.TensorLoad) or load.source.scope() != "global":
            return node
        fill = other.value if isinstance(other, tvm.tirx.Broadcast) else other
        if not isinstance(fill, tvm.tirx.IntImm):
            return node
        if len(node.indices) != 1 or len(load.indices) != 1:
            return node
        dst, src = node.indices[0], load.indices[0]
        if not (isinstance(dst, tvm.tirx.Ramp) and isinstance(src, tvm.tirx.Ramp)):
            return node
        lanes = int(dst.lanes)
        nbytes = lanes * tvm.DataType(str(node.buffer.dtype)).bits // 8
        if nbytes not in (4, 8, 16) or int(src.lanes) != lanes:
            return node
        if str(node.buffer.dtype) != str(load.source.dtype):
            return node  # merged shared.dyn byte buffers: leave to InjectPTXAsyncCopy
        if fill.value != 0 and not (nbytes == 16 and str(node.buffer.dtype) == "int8"):
            return node  # only GatherThroughL1's 16-byte int8 copy stores another fill
        if isinstance(cond, tvm.tirx.Broadcast):
            cond = cond.value
        if fill.value != 0:
            cond = tvm.tirx.call_pure_extern("int32", _PRED_FILL, cond, _fill_word(int(fill.value)))
        call = tvm.ir.Call(cp_async, [node.buffer.data, dst.base, load.source.data, src.base,
                                      tvm.tirx.IntImm("int32", nbytes), cond],
                           ret_ty=str(node.buffer.dtype))
        return tvm.tirx.Evaluate(call)

    return tvm_ffi.structural_mutate(body, [(tvm.tirx.AttrStmt, on_attr), (tvm.tirx.BufferStore, on_store)])


_PRED_FILL = "qconv_pred_fill"   # the marker: (predicate, fill word) of a nonzero-fill copy


def _unwrap_fill(pred):
    """``(predicate, fill word)`` of a copy's predicate argument (fill 0 where not wrapped)."""
    if (isinstance(pred, tvm.ir.Call) and pred.op.same_as(tvm.ir.Op.get("tirx.call_pure_extern"))
            and str(pred.args[0].value) == _PRED_FILL):
        return pred.args[1], pred.args[2]
    return pred, tvm.tirx.IntImm("int32", 0)


def _fill_word(byte: int) -> int:
    """An int8 fill value repeated in the four bytes of a (signed) 32-bit word."""
    word = (byte & 0xFF) * 0x01010101
    return word - (1 << 32) if word >= 1 << 31 else word


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="qconv.PredicatedInt8AsyncCopy")
def predicated_int8_async_copy(func, mod, ctx):
    return func.with_body(_rewrite_int8_predicated_copies(func.body))


# LowerWarpMemory (finalize_device_passes) lowers the epilogue's per-lane reads of the "warp"
# accumulator C_warp[g*256 + tx*8 + l] to ``shfl(C_local[truncdiv(g*256 + tx*8 + l, 256)*8 + l],
# lane=tx)``: its analyzer cannot fold the truncdiv (it does fold floordiv), so the register
# array gets a thread-dependent index -- it is demoted to local memory (stack) -- and each read
# becomes a shuffle from the lane itself (the same truncdiv appears in the ldmatrix / mma
# register offsets).  The pass below, run right after LowerWarpMemory, (1) drops
# ``tvm_warp_shuffle(mask, v, lane, 32, 32)`` with lane provably == threadIdx.x (a read of the
# lane's own value) and (2) rewrites every truncdiv/truncmod whose numerator is provably >= 0
# (and divisor > 0) into floordiv/floormod -- the same value -- which the StmtSimplify that
# follows folds to constants.


def _is_lane_id(lane, tx_var, analyzer) -> bool:
    """lane provably equals threadIdx.x (with the CSE let-bindings seen so far)."""
    return lane.same_as(tx_var) or bool(analyzer.can_prove_equal(lane, tx_var))


def _fix_self_shuffles(func):
    shuffle = tvm.ir.Op.get("tirx.tvm_warp_shuffle")
    analyzer = Analyzer()
    tx = {}

    def on_attr(node, mutator):
        if node.attr_key == "thread_extent":
            iv = node.node
            if isinstance(node.value, tvm.tirx.IntImm):
                analyzer.bind(iv.var, tvm.ir.Range.from_min_extent(0, int(node.value)))
            if iv.thread_tag == "threadIdx.x":
                tx["var"] = iv.var
        return mutator.default_mutate(node)

    def on_for(node, mutator):
        if isinstance(node.min, tvm.tirx.IntImm) and isinstance(node.extent, tvm.tirx.IntImm):
            analyzer.bind(node.loop_var, tvm.ir.Range.from_min_extent(int(node.min), int(node.extent)))
        return mutator.default_mutate(node)

    def on_bind(node, mutator):  # CSE'd index parts: ``cse_v19: T.let = threadIdx_x * 8``
        value = mutator.mutate(node.value)
        analyzer.bind(node.var, value)
        return node if value.same_as(node.value) else tvm.tirx.Bind(node.var, value)

    def on_div(node, mutator):
        node = mutator.default_mutate(node)
        if isinstance(node, tvm.tirx.Div) and analyzer.can_prove(node.a >= 0) and analyzer.can_prove(node.b > 0):
            return tvm.tirx.floordiv(node.a, node.b)
        return node

    def on_mod(node, mutator):
        node = mutator.default_mutate(node)
        if isinstance(node, tvm.tirx.Mod) and analyzer.can_prove(node.a >= 0) and analyzer.can_prove(node.b > 0):
            return tvm.tirx.floormod(node.a, node.b)
        return node

    def on_call(node, mutator):
        node = mutator.default_mutate(node)
        if (isinstance(node, tvm.ir.Call) and node.op.same_as(shuffle) and "var" in tx
                and len(node.args) == 5 and _is_lane_id(node.args[2], tx["var"], analyzer)
                and int(node.args[3]) == int(node.args[4])):
            return node.args[1]
        return node

    body = tvm_ffi.structural_mutate(func.body, [
        (tvm.tirx.AttrStmt, on_attr), (tvm.tirx.For, on_for), (tvm.tirx.Bind, on_bind),
        (tvm.tirx.Div, on_div), (tvm.tirx.Mod, on_mod), (tvm.ir.Call, on_call)])
    return func.with_body(body)


def _has_warp_alloc(func) -> bool:
    found = []
    tvm_ffi.structural_walk(func.body, [(tvm.tirx.AllocBuffer, lambda n: found.append(n.buffer.scope() == "warp"))])
    return any(found)


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="qconv.FixWarpMemory")
def fix_warp_memory(func, mod, ctx):
    """Finish LowerWarpMemory's job, then clean up after it.

    TVM 0.27's LowerWarpMemory lowers only the *first* "warp" AllocBuffer of each statement
    sequence (WarpMemoryRewriter::VisitStmt_(SeqStmtNode) rewrites the remaining siblings for
    that buffer and ``break``s without revisiting them), so the ldmatrix fragments A_shared_warp /
    W_shared_warp stay full warp-sized per-thread arrays indexed by threadIdx.x (local memory).
    Re-running the pass lowers the next one each time.  Then :func:`_fix_self_shuffles`.
    """
    for _ in range(32):
        if not _has_warp_alloc(func):
            break
        func = _inline_lets_in_warp_calls(func)
        func = tvm.tirx.transform.LowerWarpMemory()(tvm.IRModule({"main": func}))["main"]
    return _fix_self_shuffles(func)


_WARP_CALLS = ("tirx.ptx_legacy.ldmatrix", "tirx.ptx_legacy.mma", "tirx.mma_store_legacy",
               "tirx.mma_fill_legacy", "tirx.mma_store", "tirx.mma_fill")


def _inline_lets_in_warp_calls(func):
    """Substitute CSE let-variables inside the arguments of the warp-register intrinsics.

    CommonSubexprElim (main pipeline) runs before LowerWarpMemory (finalize) and turns e.g. the
    ldmatrix register offset ``ax0 * 512 + threadIdx.x * 16`` into ``ax0 * 512 + cse_v9``; the
    pass then finds no threadIdx.x coefficient ("require positive constant coefficient on warp
    index threadIdx_x but get 0").  (Disabling CSE instead breaks the first, accumulator,
    buffer: its epilogue loads then show threadIdx.x inside the truncdiv and hit an ICHECK.)
    """
    lets = {}

    def on_bind(node):
        lets[node.var.name] = node.value

    tvm_ffi.structural_walk(func.body, [(tvm.tirx.Bind, on_bind)])
    if not lets:
        return func

    def subst(e, depth=0):
        def on_var(v, mutator):
            name = getattr(v, "name", None)
            if name in lets and depth < 16:
                return subst(lets[name], depth + 1)
            return v

        return tvm_ffi.structural_mutate(e, [(tvm.ir.Var, on_var)])

    ops = [tvm.ir.Op.get(n) for n in _WARP_CALLS if n in tvm.ir.Op.list_op_names()]

    def on_call(node, mutator):
        if isinstance(node, tvm.ir.Call) and any(node.op.same_as(o) for o in ops):
            args = [subst(a) for a in node.args]
            return tvm.ir.Call(node.op, args, node.attrs, ret_ty=node.ty)
        return mutator.default_mutate(node)

    return func.with_body(tvm_ffi.structural_mutate(func.body, [(tvm.ir.Call, on_call)]))


# The im2col gather through L1: ``cp.async.ca``
#
# TVM prints every 16-byte cp.async as ``cp.async.cg`` (L2 only).  The im2col gather of a KxK
# conv reads each input byte once per tap: the row of tap (ky, kx + 1) is the row of tap (ky, kx)
# shifted by one pixel, C_p / BK pipeline steps later, so ``.ca`` lets those reads hit in L1
# instead of going to L2 each time (H100, batch 64, VGG16's convs: 1.06-1.29x faster; ncu on
# 256->256 @56: L1 hit rate 15 -> 42 %, L2 throughput 83 -> 63 %; docs/tensorcore.md).  The
# predicated 16-byte int8 copies are the gathers (of the conv's im2col, the dense layer's rows;
# weight copies are never predicated, and no other kernel of this project makes such copies: a
# test checks that the dp4a kernels compile to the same CUDA with and without these passes);
# the pass, run after shared memory is merged, prints them with ``.ca`` (a legal size for it)
# and leaves every other copy as TVM emits it.

_CA_PRED_16 = "qconv_cp_async_ca_pred_16"
_CA_PRED_16_SRC = f"""
__forceinline__ __device__ void {_CA_PRED_16}(void* dst, int dst_off, void* src, int src_off, int predicate,
                                              int fill) {{
  unsigned int dst_addr = __cvta_generic_to_shared((unsigned char*)dst + dst_off);
  __asm__ __volatile__(
    "{{\\n"
    " .reg .pred p;\\n"
    " setp.eq.u32 p, %2, 1;\\n"
    " @p cp.async.ca.shared.global [%0], [%1], 16;\\n"
    " @!p st.shared.v4.u32 [%0], {{%3, %3, %3, %3}};\\n"
    "}}\\n"
    :: "r"(dst_addr), "l"((unsigned char*)src + src_off), "r"(predicate), "r"(fill));
}}
"""


def _byte_pointer(ptr) -> bool:
    """A pointer to scalar bytes (the helper's offsets are byte offsets)."""
    et = getattr(getattr(ptr, "ty", None), "element_type", None)
    if et is None:
        return False
    dtype = tvm.DataType(str(getattr(et, "dtype", "void")))
    return dtype.bits == 8 and dtype.lanes == 1


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="qconv.GatherThroughL1")
def gather_through_l1(func, mod, ctx):
    cp_async = tvm.ir.Op.get("tirx.s_tir.cp_async_raw")

    def on_call(node, mutator):
        node = mutator.default_mutate(node)
        if (isinstance(node, tvm.ir.Call) and node.op.same_as(cp_async) and len(node.args) == 6
                and isinstance(node.args[4], tvm.tirx.IntImm) and int(node.args[4]) == 16
                and _byte_pointer(node.args[0]) and _byte_pointer(node.args[2])
                and not (isinstance(node.args[5], tvm.tirx.IntImm) and int(node.args[5]) == -1)):  # -1: no predicate
            dst, dst_off, src, src_off, _, pred = node.args
            pred, fill = _unwrap_fill(pred)
            return cuda_func_call(_CA_PRED_16, dst, dst_off, src, src_off, pred, fill, source_code=_CA_PRED_16_SRC)
        return node

    return func.with_body(tvm_ffi.structural_mutate(func.body, [(tvm.ir.Call, on_call)]))


# 8-bit vector constants nvcc can compile
#
# TVM 0.27's CUDA codegen (CodeGenCUDA::VisitExpr_(BroadcastNode)) packs an 8-bit broadcast of 4
# lanes into one 32-bit word, but prints one of 8 or 16 lanes as ``make_int2`` / ``make_int4``
# (``make_uint2`` / ``make_uint4``) with one argument per byte, which nvcc rejects ("error: too
# many arguments in function call").  The im2col gather stores such a constant wherever the
# simplifier proves that a whole 16-byte copy reads the padding: the software pipeline's prologue
# unrolls its first k-steps with a constant k, so a tap that lies in the padding for every output
# pixel (dilation >= the feature map, as deeplabv3's ASPP 3x3 at dilation 36 on a 32x32 map; or
# a 3x3 conv, padding 1, on a 1-pixel-high map) folds ``if_then_else(p, data, zero)`` into a
# broadcast of the padding value (0, or -128 for an unsigned input).  The pass below, last of the
# device passes, prints every such broadcast as a call of a helper that repeats the byte in
# 32-bit words: the same bytes, whatever made the constant.

# (dtype, lanes) -> (the CUDA vector type TVM stores it as, its 32-bit words)
_SPLAT_TYPES = {("int8", 8): ("int2", 2), ("int8", 16): ("int4", 4),
                ("uint8", 8): ("uint2", 2), ("uint8", 16): ("uint4", 4)}


def _splat(dtype: str, lanes: int, value):
    """``value`` (an 8-bit scalar expression) repeated over ``lanes`` bytes, as a helper call."""
    ctype, words = _SPLAT_TYPES[(dtype, lanes)]
    name = f"qconv_splat_{dtype}x{lanes}"
    word = "(int)w" if ctype.startswith("int") else "w"
    source = f"""
__forceinline__ __device__ {ctype} {name}(int byte) {{
  unsigned int w = ((unsigned int)byte & 0xFFu) * 0x01010101u;
  return make_{ctype}({", ".join([word] * words)});
}}
"""
    return cuda_func_call(name, value.astype("int32"), source_code=source, return_type=f"{dtype}x{lanes}")


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="qconv.PrintableInt8Vectors")
def printable_int8_vectors(func, mod, ctx):
    target = func.attrs.get("target") if func.attrs is not None else None
    if target is None or target.kind.name != "cuda":
        return func

    def on_broadcast(node, mutator):
        node = mutator.default_mutate(node)
        key = (str(node.value.ty), int(node.lanes))
        return _splat(*key, node.value) if key in _SPLAT_TYPES else node

    return func.with_body(tvm_ffi.structural_mutate(func.body, [(tvm.tirx.Broadcast, on_broadcast)]))


@tvm.transform.module_pass(opt_level=0, name="qconv.LowerTIRxKernels")
def lower_tirx_kernels(mod, ctx):
    """Lower the TIRx constructs of the functions marked ``tvm_qconv.tirx``; the others as they are."""
    marked = {gv: f for gv, f in mod.functions.items()
              if isinstance(f, tirx.PrimFunc) and f.attrs is not None and f.attrs.get(TIRX_ATTR, False)}
    if not marked:
        return mod
    lowered = tvm.ir.transform.Sequential([tirx.transform.LowerTIRx(), tirx.transform.LowerTIRxOpaque()])(
        tvm.IRModule(marked, attrs=mod.attrs))
    mod = mod.clone()
    for gv, func in lowered.functions.items():
        mod.update_func(mod.get_global_var(gv.name_hint), func)
    return mod


# (pass name, pass to insert, insert "before" or "after" it)
_EXTRA_PASSES = [
    ("s_tir.InjectPTXAsyncCopy", predicated_int8_async_copy, "before"),
    ("tirx.LowerWarpMemory", fix_warp_memory, "after"),
    ("tirx.LowerWarpMemory", gather_through_l1, "after"),
    ("tirx.LowerIntrin", printable_int8_vectors, "after"),   # last: no pass after it folds a new constant
]


def _with_extra_passes(make):
    """Call ``make()`` (which builds ``tvm.ir.transform.Sequential`` pass lists) with
    :data:`_EXTRA_PASSES` spliced into every list that contains their anchor pass."""
    original = tvm.ir.transform.Sequential

    def sequential(passes, *args, **kwargs):
        passes = list(passes)
        for anchor, extra, where in _EXTRA_PASSES:
            names = [p.info.name for p in passes]
            if anchor in names:
                passes.insert(names.index(anchor) + (where == "after"), extra)
        return original(passes, *args, **kwargs)

    tvm.ir.transform.Sequential = sequential
    try:
        return make()
    finally:
        tvm.ir.transform.Sequential = original


def _register_pipeline() -> str:
    """The default S-TIR pipeline (whatever the installed TVM ships) with :data:`_EXTRA_PASSES`
    spliced in, registered as TIR pipeline ``PIPELINE``."""
    name = PIPELINE
    if name in cp.PIPELINE_MAP:
        return name

    base = cp.PIPELINE_MAP["s_tir"]

    def factory():
        pipeline, finalize_host, finalize_device = base()

        @tvm.transform.module_pass(opt_level=0, name="qconv_mma.pipeline")
        def _pipeline(mod, ctx):
            mod = lower_tirx_kernels(mod)
            return _with_extra_passes(lambda: pipeline(mod))

        return _pipeline, finalize_host, (lambda: _with_extra_passes(finalize_device))

    cp.register_tir_pipeline(name, factory)
    return name


def compile_options() -> dict:
    """``tvm.compile`` keyword arguments and PassContext config for a module with mma kernels."""
    return dict(tir_pipeline=_register_pipeline(), config={"tirx.use_async_copy": True})
