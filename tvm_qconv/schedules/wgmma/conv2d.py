"""The fused int8 conv on Hopper's warpgroup MMA: a hand-written TIRx kernel.

Same layer, layouts and arguments as the ``mma.sync`` family (``schedules/tensorcore/conv2d.py``):
data ``[N, H, W, C_p]`` int8 (NHWC32), weight ``[O_p, KH*KW*C_p]`` (``k = (ky*KW + kx)*C_p + c``),
bias / mult / shift ``[O_p]`` (a padded conv of an unsigned input: the bias ``[rows, O_p]``, one
row per border class, the compute's ``border`` form), out ``[N, OH, OW, O_p]`` int8; the implicit GEMM is
``M = N*OH*OW`` rows x ``O_p`` columns x ``K`` and the epilogue is the project's integer
requantization, so the result is bit-identical to every other family.

Why hand-written: TVM 0.27 has no wgmma tensor intrinsic, so neither ``sch.tensorize`` nor
MetaSchedule reaches it (``docs/wgmma.md``).  The kernel is a TIRx PrimFunc; its decisions are the
fields of :class:`Config`.

The kernel (one CTA per SM, persistent; 3 warpgroups of 128 threads)::

    warpgroup 0  producer   one thread: for each of the CTA's tiles, for each K step, wait for a
                            free ring stage (``empty``), then two TMA loads into it, completing
                            on ``full``: A = the im2col rows of BM output pixels for one tap and
                            BK channels (TMA im2col mode: padding and the M tail become zeros in
                            hardware), B = the weight tile [BN, BK] (TMA tiled)
    warpgroups 1, 2   consumers, ping-pong: they take the CTA's tiles in turn.  One runs its K
                            loop of ``wgmma.mma_async m64nWNk32`` from the ring (BM/64 x BN/WN
                            accumulator blocks, ``wait_group(1)``: one K step in flight) while
                            the other runs its epilogue; an ``order`` mbarrier pair hands the
                            ring from one to the other (an mbarrier waiter may be one phase
                            ahead of the barrier, never more, so the second may not start
                            waiting on its stages before the first has taken all of its own)

    stage s of the ring: A [BM, BK] and B [BN, BK], both K-major with the swizzle of one BK-byte
    row (128B for BK = 128), as wgmma's shared-memory descriptors read them

Epilogue: accumulator register i of thread t in its m64 x WN block holds row
``16*(t/32) + (t%32)/4 + 8*((i/2)%2)``, column ``8*(i/4) + 2*(t%4) + i%2``; two adjacent columns
are requantized and stored as one 16-bit word.

Measured on an H100 (``docs/history.md``, "The wgmma family"): VGG16's 3x3 convs at batch 64
run 1.4-2.6x faster than the mma.sync family.
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from .. import border_bias, epilogue_table
from ..requantize import requantize_i32_ok, requantize_tir, requantize_tir_i32
from ..tensorcore.conv2d import gemm_shape
from ..tensorcore.layout import ceil32
from ..workload import ConvWorkload
from .tensormap import ENCODE_IM2COL

SMEM_BUDGET = 200 * 1024     # the ring's bytes; the H100's opt-in limit is 227 KB per block
SMEM_LIMIT = 227 * 1024      # the ring and the staged epilogue's tiles together
# The staged epilogue's row padding: a tile row is BN + 16 bytes, so the 8 rows one warp's
# accumulators write land on distinct banks (row r starts at bank 4r mod 32) and every row
# stays 16-byte aligned for the vector copy-out.
STORE_PAD = 16
MAX_STAGES = 6               # the depth measured with the 128 x 128 tile (docs/history.md); deeper: not measured
MAX_ACC = 128                # accumulator registers per consumer thread (of the 232 it gets)
PRODUCER_REGS, CONSUMER_REGS = 40, 232   # setmaxnreg: 128*40 + 256*232 <= 64K registers per SM
# The s8 wgmma shapes TVM 0.27's PTX table spells, m64nNk32: N a multiple of 8 up to 32, of 16
# up to 224.  The ISA also has n240 / n256 (TVM's table lacks them), so a 256-column tile is two
# n128 blocks: the same tensor-core work, one more descriptor add per K step.
WGMMA_N = (8, 16, 24, 32, *range(48, 225, 16))
# TMA im2col limits (CUDA driver, cuTensorMapEncodeIm2col, 4-D tensors): box corners in
# [-128, 127], traversal strides <= 8, channels per pixel <= 256.  The tap offsets are 16-bit
# operands; they are held to the corners' range too (the limit the CUDA docs state for them is
# not confirmed), i.e. (k - 1) * dilation <= 127.
MIN_CORNER, MAX_CORNER, MAX_STRIDE = -128, 127, 8

FENCE_SRC = ('__device__ __forceinline__ void qconv_wg_fence(uint32_t& r) '
             '{ asm volatile("" : "+r"(r) :: "memory"); }')
# The staged epilogue's shared-memory accesses and barrier as device functions: TVM's ThreadSync
# pass would otherwise place a __syncthreads (a whole-CTA barrier the producer never reaches)
# inside the consumers' branch and refuse to build; the barrier is the consumer warpgroup's own
# (named barrier ``wg``), with a memory clobber so no access moves across it.
STORE_SRC = ('__device__ __forceinline__ void qconv_st_u16(void* p, unsigned short v) '
             '{ *(unsigned short*)p = v; }')
COPY_SRC = ('__device__ __forceinline__ void qconv_copy16(void* dst, void* src) '
            '{ *(int4*)dst = *(const int4*)src; }')
STORE_I2_SRC = ('__device__ __forceinline__ void qconv_st_i2(void* p, int a, int b) '
                '{ *(int2*)p = make_int2(a, b); }')
BAR_SRC = ('__device__ __forceinline__ void qconv_wg_bar(int id) '
           '{ asm volatile("bar.sync %0, 128;" :: "r"(id) : "memory"); }')
TMA_IM2COL = "cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes"
TMA_TILE = "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"


@dataclass(frozen=True)
class Config:
    """The decisions of one kernel.

    Attributes:
        bm: rows (output pixels) of a consumer's tile: 64 or 128 (one or two m64 blocks).
        bn: columns (output channels) of a tile; a wgmma N, or 256 as two n128 blocks.
        stages: depth of the TMA ring.
        staged_store: the epilogue writes the requantized tile to shared memory and copies it
            out in 16-byte row segments (``STORE_PAD``); else each thread stores its own pairs
            of channels, 2 bytes at a time, straight to global memory.
    """

    bm: int = 128
    bn: int = 128
    stages: int = 6
    staged_store: bool = True

    @property
    def wn(self) -> int:
        """N of one wgmma."""
        return 128 if self.bn == 256 else self.bn

    def accumulators(self) -> int:
        """int32 accumulator registers per consumer thread: an m64 x N block holds N / 2."""
        return self.bm // 64 * self.bn // 2

    def store_bytes(self) -> int:
        """Shared memory of the staged epilogue: one [BM, BN + STORE_PAD] int8 tile per consumer."""
        return 2 * self.bm * (self.bn + STORE_PAD) if self.staged_store else 0


def k_tile(channels_padded: int) -> int:
    """BK: the bytes of one tap's channels a K step takes (a power of two dividing C_p), which is
    also the swizzle span of the shared-memory rows."""
    return 128 if channels_padded % 128 == 0 else 64 if channels_padded % 64 == 0 else 32


def im2col_corners(wl: ConvWorkload) -> tuple[int, int, int, int]:
    """(lower_h, lower_w, upper_h, upper_w): the box the windows' top-left corners traverse, as
    offsets from the image's corners (``tensormap.encode_im2col``)."""
    (kh, kw), (dh, dw) = wl.kernel, wl.dilation
    pt, pl, pb, pr = wl.padding
    return -pt, -pl, pb - (kh - 1) * dh, pr - (kw - 1) * dw


def supports(wl: ConvWorkload) -> bool:
    """Whether TMA im2col can gather this conv (and the layer is one this kernel computes)."""
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    # int32: the training convs' accumulators (a split reduction in whole K steps of the kernel's,
    # each slice's sums exact in int32), the input signed (TMA's zero fill is its zero point)
    cp = ceil32(wl.in_channels)
    steps = kh * kw * (cp // k_tile(cp))
    computes = wl.out_dtype == "int8" or (wl.out_dtype == "int32" and not wl.pads_with_zero_point
                                          and steps % wl.splits == 0
                                          and steps // wl.splits * k_tile(cp) * 127 * 127 < 1 << 31)
    return (wl.groups == 1 and computes and max(sh, sw) <= MAX_STRIDE
            and all(MIN_CORNER <= c <= MAX_CORNER for c in im2col_corners(wl))
            and (kh - 1) * dh <= MAX_CORNER and (kw - 1) * dw <= MAX_CORNER)


def default_config(wl: ConvWorkload, staged_store: bool = True) -> Config:
    """The tile of ``wl`` (measured on VGG16's convs, H100, docs/history.md): 128 x BN, the
    ring as deep as fits beside the staged epilogue's tiles (5 stages at BK = 128); 64 x 256 (two
    n128 blocks) for layers of K >= 4608 whose output channels come in 256s (VGG16's 512->512:
    1.08-1.12x over 128 x 128; equal at 256 input channels, where K = 2304 keeps 128 x 128).
    ``staged_store=False``: the direct-store epilogue (only to measure against: it was slower on
    every layer measured, ``benchmarks/wgmma_epilogue.py``), its ring up to 6 stages deep.  An
    int32 output (the training forward) always stores directly: its tile would be 4x the int8 one's."""
    staged_store = staged_store and wl.out_dtype == "int8"
    _, _, op, k = gemm_shape(wl)
    bk = k_tile(ceil32(wl.in_channels))
    if op % 256 == 0 and k >= 4608:
        bm, bn = 64, 256
    else:
        bn = max(n for n in WGMMA_N if n <= 128 and op % n == 0)
        if op <= 224 and op in WGMMA_N:      # one block across all columns
            bn = op
        bm = 128 if bn <= 128 else 64
    return Config(bm, bn, ring_stages(bm, bn, bk, staged_store), staged_store)


def ring_stages(bm: int, bn: int, bk: int, staged_store: bool = True) -> int:
    """The deepest TMA ring (up to ``MAX_STAGES``) of a BM x BN tile with K tile ``bk`` that fits
    in shared memory beside the staged epilogue's tiles."""
    epilogue = Config(bm, bn, 2, staged_store).store_bytes()
    return max(2, min(MAX_STAGES, SMEM_BUDGET // ((bm + bn) * bk), (SMEM_LIMIT - epilogue) // ((bm + bn) * bk)))


def tiles(wl: ConvWorkload, config: Config) -> int:
    """Output tiles of ``wl`` under ``config``: the work items of the persistent grid."""
    m, _, op, _ = gemm_shape(wl)
    return (m + config.bm - 1) // config.bm * (op // config.bn)


def conv2d_wgmma(wl: ConvWorkload, config: Config, num_sm: int) -> tirx.PrimFunc:
    """The kernel ``(data, weight, bias, mult, shift, out)`` of ``wl`` (module docstring), for a
    GPU of ``num_sm`` SMs (the persistent grid)."""
    assert supports(wl), wl
    N, H, W = wl.batch, wl.height, wl.width
    CP = ceil32(wl.in_channels)
    M, _, OP, K = gemm_shape(wl)
    OH, OW = wl.out_height, wl.out_width
    (KH, KW), (SH, SW), (DH, DW) = wl.kernel, wl.stride, wl.dilation
    PT, PL = wl.padding[:2]
    LO_H, LO_W, UP_H, UP_W = im2col_corners(wl)
    LO, HI = wl.act_min, wl.act_max
    # TMA fills the padding with 0: where it must read the zero point, the bias is a table per
    # border class (``schedules/border_bias.py``) that adds what the padding's -128 would have
    TABLE = wl.pads_with_zero_point
    ROWS = border_bias.table_rows(wl)
    BIAS_SHAPE = (ROWS, OP) if TABLE else (OP,)
    BM, BN, STAGES, WN = config.bm, config.bn, config.stages, config.wn
    assert BM in (64, 128) and OP % BN == 0 and WN in WGMMA_N and BN % WN == 0, (config, OP)
    assert config.accumulators() <= MAX_ACC, config
    # |acc| < 2**30: the 32-bit requantize holds; int32 sums: one slice's must not wrap
    assert (K // wl.splits * 127 * 127 < 1 << 31) if wl.out_dtype == "int32" else (K * 128 * 128 < 1 << 30), K
    INT32 = wl.out_dtype == "int32"            # the training forward: the accumulators stored as they are
    assert not (INT32 and config.staged_store), config
    # The epilogue in the 32-bit requantize's form too, where it was measured to pay (H100, VGG16's
    # convs at batch 64, docs/history.md): 128-row tiles, 1.00-1.10x; on 64 x 256 tiles the
    # second copy of the 128-accumulator epilogue made 512->512 @28 1.26x slower: those keep one.
    FORMS = 2 if config.bm == 128 else 1
    BK = k_tile(CP)
    SWIZZLE = {32: 1, 64: 2, 128: 3}[BK]      # CUtensorMapSwizzle / wgmma layout: 32B, 64B, 128B
    SBO = (8 * BK) >> 4                        # descriptor: 8-row swizzle atom, in 16-byte units
    CBLK = CP // BK                            # K steps per tap (channel blocks of BK)
    KT = KH * KW * CBLK                        # K steps of the whole reduction
    S = wl.splits                              # K slices (the training dw: split-K, int32 sums per slice)
    KTS = KT // S                              # K steps per tile: one slice's
    MW, NW = BM // 64, BN // WN                # m64 and nWN blocks per tile
    ACC = 64 * WN // 128                       # registers of one m64nWN block per thread
    NACC = MW * NW * ACC
    A_ST, B_ST = BM * BK, BN * BK              # bytes per stage
    NB = OP // BN
    TPS = tiles(wl, config)                    # tiles of one slice, column-block fastest (A shared in L2)
    NT = S * TPS                               # the grid's tiles, slice by slice
    GRID = min(num_sm, NT)
    WGMMA = f"wgmma.mma_async.sync.aligned.m64n{WN}k32.s32.s8.s8"
    A_BLOCK, B_BLOCK = (64 * BK) >> 4, (WN * BK) >> 4     # descriptor step to the next m64 / nWN block
    OHW = OH * OW
    RING = STAGES * (A_ST + B_ST)
    STAGED = config.staged_store
    ROW = BN + STORE_PAD                       # staged tile row, bytes
    SEGS = BN // 16                            # 16-byte segments of a tile row
    assert RING + config.store_bytes() <= SMEM_LIMIT, config
    # the copy-out: whole 16-byte segments, the same number for each of the 128 threads
    assert not STAGED or (BN % 16 == 0 and BM * SEGS % 128 == 0), config

    LUT = epilogue_table.script_table(wl)     # wl.table: the function after the conv (epilogue_table.py)
    C = wl.out_channels

    # The kernel's body, for both signatures below (Python-level ``if INT32`` picks its parts;
    # ``lut``, the epilogue's table, is an argument so that the int8 signature's decorator sees it).
    @T.macro
    def body(data, weight, bias, mult, shift, out, lut):
        A_map: T.let[T.TensorMap()] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed(ENCODE_IM2COL, A_map, data.data, N, H, W, CP, LO_H, LO_W, UP_H, UP_W, BK, BM, SH, SW,
                      SWIZZLE)
        B_map: T.let[T.TensorMap()] = T.tvm_stack_alloca("tensormap", 1)
        T.tensormap_encode_tiled(B_map, weight.data, K, OP, K, BK, BN, 1, 1,
                                 descriptor_dtype="int8", rank=2, swizzle=SWIZZLE)
        T.device_entry()
        cta = T.cta_id([GRID])
        wg = T.warpgroup_id([3])
        tid = T.thread_id_in_wg([128])
        ring = T.alloc_buffer((RING + config.store_bytes(),), "uint8", scope="shared.dyn", align=1024)
        A_s = T.decl_buffer((STAGES, BM, BK), "int8", data=ring.data, scope="shared.dyn")
        B_s = T.decl_buffer((STAGES, BN, BK), "int8", data=ring.data, elem_offset=STAGES * A_ST,
                            scope="shared.dyn")
        if INT32:
            out32 = T.decl_buffer((S * M * OP,), "int32", data=out.data)
        else:
            out16 = T.decl_buffer((M * OP // 2,), "uint16", data=out.data)   # two channels per store
            # the staged epilogue: each consumer's tile [BM, ROW] in shared memory, written as pairs of
            # channels, read and copied out as 16-byte vectors
            tile8 = T.decl_buffer((2 * BM * ROW,), "int8", data=ring.data, elem_offset=RING, scope="shared.dyn")
            out8 = T.decl_buffer((M * OP,), "int8", data=out.data)
        full = T.alloc_buffer((STAGES,), "uint64", scope="shared", align=8)
        empty = T.alloc_buffer((STAGES,), "uint64", scope="shared", align=8)
        order = T.alloc_buffer((2,), "uint64", scope="shared", align=8)
        ntiles = T.meta_var((NT - cta + GRID - 1) // GRID)    # this CTA's tiles: cta, cta + GRID, ...
        if wg == 0 and tid == 0:
            for s in T.unroll(STAGES):
                T.ptx.mbarrier.init.shared.b64(full.ptr_to([s]), T.uint32(1))
                T.ptx.mbarrier.init.shared.b64(empty.ptr_to([s]), T.uint32(1))
            for s in T.unroll(2):
                T.ptx.mbarrier.init.shared.b64(order.ptr_to([s]), T.uint32(1))
            T.ptx.fence.mbarrier_init.release.cluster()
        # 1 where this tile shape has the 32-bit requantize (``requantize_tir_i32``) and every channel
        # allows it: CTA-uniform, so the epilogue's forms never diverge; the barrier also publishes
        # the mbarriers
        ok = T.alloc_buffer((2,), "int32", scope="local")
        ok[0] = FORMS - 1
        if not INT32:
            for i in T.serial((OP + 383) // 384):
                if i * 384 + wg * 128 + tid < OP:
                    for r in T.serial(ROWS):
                        if not requantize_i32_ok(_bias(bias, r, i * 384 + wg * 128 + tid, TABLE),
                                                 shift[i * 384 + wg * 128 + tid]):
                            ok[0] = 0
        ok[1] = T.call_extern("int32", "__syncthreads_and", ok[0])
        if wg == 0:                                           # ---- producer
            T.ptx["setmaxnreg.dec.sync.aligned.u32"](PRODUCER_REGS)
            if tid == 0:
                for j in T.serial(ntiles):
                    t = T.meta_var(_in_slice(cta + j * GRID, TPS, S))     # the tile within its slice
                    k0 = T.meta_var(_slice(cta + j * GRID, TPS, S) * KTS)   # its slice's first K step
                    m0 = T.meta_var(t // NB * BM)
                    img = T.meta_var(m0 // OHW)
                    oh = T.meta_var(m0 // OW % OH)
                    ow = T.meta_var(m0 % OW)
                    for kt in T.serial(KTS):
                        step = T.meta_var(j * KTS + kt)       # the ring's step count: stage, lap
                        st = T.meta_var(step % STAGES)
                        kg = T.meta_var(_plus(kt, k0))        # the K step in the whole reduction
                        tap = T.meta_var(kg // CBLK)
                        # wait for lap - 1's release of the stage (lap 0: passes at once)
                        T.cuda.mbarrier_wait(empty.ptr_to([st]), (step // STAGES + 1) % 2)
                        T.ptx.mbarrier.arrive.expect_tx.shared.b64(full.ptr_to([st]), T.uint32(A_ST + B_ST))
                        T.ptx[TMA_IM2COL](A_s.ptr_to([st, 0, 0]), T.address_of(A_map),
                                          kg % CBLK * BK, ow * SW - PL, oh * SH - PT, img, full.ptr_to([st]),
                                          T.Cast("uint16", tap % KW * DW), T.Cast("uint16", tap // KW * DH))
                        T.ptx[TMA_TILE](B_s.ptr_to([st, 0, 0]), T.address_of(B_map), kg * BK, t % NB * BN,
                                        full.ptr_to([st]))
        else:                                                 # ---- consumers
            T.ptx["setmaxnreg.inc.sync.aligned.u32"](CONSUMER_REGS)
            acc = T.alloc_buffer((NACC,), "int32", scope="local")
            acc_u = acc.view("uint32")
            dA = T.alloc_buffer((1,), "uint64", scope="local")
            dB = T.alloc_buffer((1,), "uint64", scope="local")
            for jj in T.serial((ntiles - (wg - 1) + 1) // 2):
                j = T.meta_var(jj * 2 + (wg - 1))             # consumer 1 takes tiles 0, 2, ...
                t = T.meta_var(_in_slice(cta + j * GRID, TPS, S))
                sl = T.meta_var(_slice(cta + j * GRID, TPS, S))
                for i in T.unroll(NACC):
                    acc[i] = 0
                # the turn: consumer 2 may start its jj-th main loop once consumer 1 has passed
                # the waits of its jj-th (order[1], phase jj); consumer 1 its jj-th once consumer
                # 2 has passed its (jj-1)-th (order[0], phase jj - 1)
                if wg == 1:
                    if jj > 0:
                        T.cuda.mbarrier_wait(order.ptr_to([0]), (jj - 1) % 2)
                else:
                    T.cuda.mbarrier_wait(order.ptr_to([1]), jj % 2)
                for kt in T.serial(KTS):
                    step = T.meta_var(j * KTS + kt)
                    st = T.meta_var(step % STAGES)
                    T.cuda.mbarrier_wait(full.ptr_to([st]), step // STAGES % 2)
                    T.cuda.wgmma.encode_matrix_descriptor(T.address_of(dA[0]), A_s.ptr_to([st, 0, 0]), 1, SBO,
                                                          SWIZZLE)
                    T.cuda.wgmma.encode_matrix_descriptor(T.address_of(dB[0]), B_s.ptr_to([st, 0, 0]), 1, SBO,
                                                          SWIZZLE)
                    for i in T.unroll(NACC):
                        T.cuda.func_call("qconv_wg_fence", acc_u[i], source_code=FENCE_SRC)
                    T.ptx.wgmma.fence.sync.aligned()
                    for kk in T.unroll(BK // 32):             # +32 bytes along K = +2 in the address field
                        for mw in T.unroll(MW):
                            for nw in T.unroll(NW):
                                T.ptx[WGMMA](*[acc_u[(mw * NW + nw) * ACC + i] for i in range(ACC)],
                                             dA[0] + T.uint64(kk * 2 + mw * A_BLOCK),
                                             dB[0] + T.uint64(kk * 2 + nw * B_BLOCK), True)
                    T.ptx.wgmma.commit_group.sync.aligned()
                    T.ptx.wgmma.wait_group.sync.aligned(1)    # the previous step's wgmmas are done
                    for i in T.unroll(NACC):
                        T.cuda.func_call("qconv_wg_fence", acc_u[i], source_code=FENCE_SRC)
                    if kt > 0 and tid == 0:
                        T.ptx.mbarrier.arrive.shared.b64(empty.ptr_to([(step + STAGES - 1) % STAGES]), T.uint32(1))
                if tid == 0:                                  # the other consumer's turn
                    T.ptx.mbarrier.arrive.shared.b64(order.ptr_to([2 - wg]), T.uint32(1))
                T.ptx.wgmma.wait_group.sync.aligned(0)
                for i in T.unroll(NACC):
                    T.cuda.func_call("qconv_wg_fence", acc_u[i], source_code=FENCE_SRC)
                if tid == 0:
                    T.ptx.mbarrier.arrive.shared.b64(empty.ptr_to([(j * KTS + KTS - 1) % STAGES]), T.uint32(1))
                if INT32:     # the accumulators as they are: two channels' int32s a store, 8 bytes
                    for mw in T.unroll(MW):
                        for nw in T.unroll(NW):
                            for i in T.unroll(ACC // 4):
                                for h in T.unroll(2):
                                    row = T.meta_var(t // NB * BM + mw * 64 + tid // 32 * 16 + tid % 32 // 4 + 8 * h)
                                    col = T.meta_var(t % NB * BN + nw * WN + i * 8 + tid % 4 * 2)
                                    reg = T.meta_var((mw * NW + nw) * ACC + i * 4 + h * 2)
                                    if row < M:
                                        T.cuda.func_call("qconv_st_i2", out32.ptr_to([_plus(row * OP + col, sl * M * OP)]), acc[reg],
                                                         acc[reg + 1], source_code=STORE_I2_SRC)
                else:
                    for fast in T.unroll(FORMS):                  # the requantize's forms
                        if fast == ok[1]:
                            for mw in T.unroll(MW):
                                for nw in T.unroll(NW):
                                    for i in T.unroll(ACC // 4):
                                        for h in T.unroll(2):
                                            row = T.meta_var(t // NB * BM + mw * 64 + tid // 32 * 16 + tid % 32 // 4
                                                             + 8 * h)
                                            col = T.meta_var(t % NB * BN + nw * WN + i * 8 + tid % 4 * 2)
                                            reg = T.meta_var((mw * NW + nw) * ACC + i * 4 + h * 2)
                                            cls = T.meta_var(_border_class(wl, row, TABLE))
                                            q0 = T.meta_var(epilogue_table.finish_int32(_requant(fast, acc[reg], _bias(bias, cls, col, TABLE),
                                                                             mult[col], shift[col], LO, HI), col, lut, C))
                                            q1 = T.meta_var(epilogue_table.finish_int32(_requant(fast, acc[reg + 1],
                                                                             _bias(bias, cls, col + 1, TABLE),
                                                                             mult[col + 1], shift[col + 1], LO, HI),
                                                                    col + 1, lut, C))
                                            pair = T.meta_var(T.Cast("uint16", T.bitwise_or(   # two int8s, little-endian
                                                T.bitwise_and(q0, 255), T.shift_left(T.bitwise_and(q1, 255), 8))))
                                            if STAGED:
                                                T.cuda.func_call("qconv_st_u16", tile8.ptr_to(
                                                    [(wg - 1) * BM * ROW + (row - t // NB * BM) * ROW + col - t % NB * BN]),
                                                    pair, source_code=STORE_SRC)
                                            elif row < M:
                                                out16[(row * OP + col) // 2] = pair
                    if STAGED:      # the tile to global memory, each warp 4 rows x 128 bytes per step
                        T.cuda.func_call("qconv_wg_bar", wg, source_code=BAR_SRC)
                        for v in T.unroll(BM * SEGS // 128):
                            r = T.meta_var((v * 128 + tid) // SEGS)
                            seg = T.meta_var((v * 128 + tid) % SEGS * 16)
                            if t // NB * BM + r < M:
                                T.cuda.func_call("qconv_copy16", out8.ptr_to([(t // NB * BM + r) * OP + t % NB * BN + seg]),
                                                 tile8.ptr_to([(wg - 1) * BM * ROW + r * ROW + seg]), source_code=COPY_SRC)
                        T.cuda.func_call("qconv_wg_bar", wg, source_code=BAR_SRC)   # read before the next tile's writes

    if INT32:     # the training forward's int32 accumulators (``conv2d_nhwc_int32``): no epilogue
        @T.prim_func(private=True)
        def main(data: T.Buffer((N, H, W, CP), "int8", align=16), weight: T.Buffer((OP, K), "int8", align=16),
                 out: T.Buffer(((S,) if S > 1 else ()) + (N, OH, OW, OP), "int32", align=16)):
            T.func_attr({"tirx.noalias": True})
            body(data, weight, None, None, None, out, None)
        return main

    # the table's buffer becomes a parameter after parsing (with_table_param): not well-formed before
    @T.prim_func(private=True, check_well_formed=LUT is None)
    def main(data: T.Buffer((N, H, W, CP), "int8", align=16), weight: T.Buffer((OP, K), "int8", align=16),
             bias: T.Buffer(BIAS_SHAPE, "int32"), mult: T.Buffer((OP,), "int32"), shift: T.Buffer((OP,), "int32"),
             out: T.Buffer((N, OH, OW, OP), "int8", align=16)):
        T.func_attr({"tirx.noalias": True})
        body(data, weight, bias, mult, shift, out, LUT)

    return epilogue_table.with_table_param(main, LUT)


def _in_slice(tile, tiles_per_slice: int, splits: int):
    """The grid tile ``tile``'s index within its K slice (``tile`` itself without a split)."""
    return tile if splits == 1 else tile % tiles_per_slice


def _slice(tile, tiles_per_slice: int, splits: int):
    """The K slice of grid tile ``tile`` (0 without a split)."""
    return 0 if splits == 1 else tile // tiles_per_slice


def _plus(x, offset):
    """``x + offset``, or ``x`` itself where ``offset`` is the int 0: the one-slice kernel's code
    stays what it was before split-K."""
    return x if isinstance(offset, int) and offset == 0 else x + offset


def _bias(bias, row, col, table: bool):
    """``bias[col]``, or the border-class table's entry ``bias[row, col]``."""
    return bias[row, col] if table else bias[col]


def _border_class(wl: ConvWorkload, m, table: bool):
    """The border class (the table's row) of GEMM row ``m``'s output pixel (0 without a table)."""
    return border_bias.table_row(wl, m) if table else 0


def _requant(fast, acc, bias, mult, shift, lo: int, hi: int):
    """``requantize_tir`` (``schedules/requantize.py``) on ``acc + bias``, as an int32; ``fast``
    (1 or 0 once unrolled) takes its 32-bit form ``requantize_tir_i32`` (|acc| < 2**30: the
    kernel asserts K < 2**16)."""
    return tirx.if_then_else(fast == 1, requantize_tir_i32(acc, bias, mult, shift, lo, hi),
                             requantize_tir(acc.astype("int64") + bias.astype("int64"), mult, shift, lo, hi)
                             .astype("int32"))
