# Fused elementwise kernels of a Qwen3 decoder layer for NVIDIA GPUs (sm_90), compiled ahead of
# time to PTX by kernels/fused/ptx.py and launched by kernels/fused/gpu.py. Semantics, shapes and
# rounding: mili/engine/fused_ops.py (TorchFusedOps is the reference) and fused_cpu.mojo, whose
# rounding steps these repeat: widen to fp32, round to the activation dtype wherever torch's
# ops would (`_round`), so bf16 results match torch's to the last bit except where RMSNorm's
# fp32 sum of squares (a tree here, another order in torch) or exp tip a rounding.
#
#   add_rms_norm_kernel   grid (rows), block NORM_THREADS: one row per CTA, two passes over it
#   qk_norm_rope_kernel   grid (T, ceil((H + 2 KVH) / (ROPE_THREADS / 32))), block ROPE_THREADS:
#                         one warp per head of one token
#   silu_mul_kernel       grid (rows, ceil(I / SILU_THREADS)), block SILU_THREADS
#   gemv_kernel           grid (ceil(N / GEMV_WARPS)), block 32 * GEMV_WARPS: one warp per
#                         output column n of y [T, N] = x [T, K] @ W[N, K]^T, T <= GEMV_MAX_TOKENS
#   gemv_silu_kernel      the same over x = silu(gate) * up of gate_up [T, 2 K]
#   gemv_norm_kernel      the same over x = rms_norm(x + residual), each CTA norming the rows

from std.math import exp, sqrt
from max.gpu import thread_idx, block_idx, barrier, lane_id
from max.gpu.memory import AddressSpace
from max.gpu.primitives import warp
from grid_order_gpu import grid_order_start
from std.memory import stack_allocation
from std.sys import size_of

comptime NORM_THREADS = 256
comptime ROPE_THREADS = 128
comptime SILU_THREADS = 256
comptime GEMV_WARPS = 4
comptime GEMV_MAX_TOKENS = 4
comptime GEMV_UNROLL = 8  # 16-byte weight loads a lane has in flight
comptime GEMV_NORM_MAX_FEATURES = 5120  # gemv_norm's rows in shared memory: 4 x 5120 x 2 B
comptime _F32 = DType.float32


@always_inline
def _round[dt: DType](x: Float32) -> Float32:
    """x rounded to dt (nearest even, as torch) and widened back; the identity for float32."""
    comptime if dt == _F32:
        return x
    else:
        return x.cast[dt]().cast[_F32]()


def add_rms_norm_kernel[
    dtype: DType
](
    out_ptr: Pointer[Scalar[dtype], MutAnyOrigin],
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    residual: Pointer[Scalar[dtype], MutAnyOrigin],
    weight: Pointer[Scalar[dtype], MutAnyOrigin],
    dim: Int32,
    has_residual: Int32,
    eps: Float32,
):
    """Row r: with has_residual, residual += x and out = norm(residual); else out = norm(x).

    out may be x: each thread reads and writes only its own elements of the row.
    """
    grid_order_start()  # grid_order_gpu.mojo: nothing is read before it
    comptime NUM_WARPS = NORM_THREADS // 32
    var row = Int(block_idx.x)
    var tid = Int(thread_idx.x)
    var n = Int(dim)
    var base = row * n
    var add = has_residual != 0
    var src = residual if add else x
    var acc = Float32(0)
    for i in range(tid, n, NORM_THREADS):
        var v = x[unsafe_offset=base + i].cast[_F32]()
        if add:
            v = _round[dtype](v + residual[unsafe_offset=base + i].cast[_F32]())
            residual[unsafe_offset=base + i] = v.cast[dtype]()
        acc += v * v
    var sums = stack_allocation[NUM_WARPS, Float32, address_space=AddressSpace.SHARED]()
    acc = warp.sum(acc)
    if Int(lane_id()) == 0:
        sums[unsafe_offset=tid // 32] = acc
    barrier()
    var total = Float32(0)
    comptime for w in range(NUM_WARPS):
        total += sums[unsafe_offset=w]
    var inv = 1 / sqrt(total / Float32(n) + eps)
    # HF's order: normalise in fp32, round, then multiply by the weight and round.
    for i in range(tid, n, NORM_THREADS):
        var y = _round[dtype](src[unsafe_offset=base + i].cast[_F32]() * inv)
        out_ptr[unsafe_offset=base + i] = (y * weight[unsafe_offset=i].cast[_F32]()).cast[dtype]()


def qk_norm_rope_kernel[
    dtype: DType, D: Int
](
    q_out: Pointer[Scalar[dtype], MutAnyOrigin],
    qkv: Pointer[Scalar[dtype], MutAnyOrigin],
    q_weight: Pointer[Scalar[dtype], MutAnyOrigin],
    k_weight: Pointer[Scalar[dtype], MutAnyOrigin],
    cos_sin: Pointer[Float32, MutAnyOrigin],
    positions: Pointer[Int64, MutAnyOrigin],
    slot_mapping: Pointer[Int64, MutAnyOrigin],
    k_cache: Pointer[Scalar[dtype], MutAnyOrigin],
    v_cache: Pointer[Scalar[dtype], MutAnyOrigin],
    num_q_heads: Int32,
    num_kv_heads: Int32,
    eps: Float32,
):
    """Token t = block_idx.x. Heads 0..H-1 are q (normalised, rotated, into q_out [T, H, D]),
    H..H+KVH-1 k (normalised, rotated, written back into qkv and into k_cache at the token's
    slot), H+KVH..H+2KVH-1 v (copied into v_cache). Warp w of CTA (t, y) takes head
    y * NUM_WARPS + w: at decode's few tokens the heads run side by side, not 8 after another
    in one CTA's warps.

    Lane l holds elements l + 32 j (j < D / 32): element i's RoPE partner i + D/2 is then the
    same lane's j + D/64, so the rotation needs no shuffles.
    """
    grid_order_start()  # grid_order_gpu.mojo: nothing is read before it
    comptime assert D % 64 == 0, "head_dim must be a multiple of 64"
    comptime PER_LANE = D // 32
    comptime HALF_J = PER_LANE // 2  # j < HALF_J: first half of the head
    comptime NUM_WARPS = ROPE_THREADS // 32
    var t = Int(block_idx.x)
    var head = Int(block_idx.y) * NUM_WARPS + Int(thread_idx.x) // 32
    var lane = Int(lane_id())
    var H = Int(num_q_heads)
    var KVH = Int(num_kv_heads)
    if head >= H + 2 * KVH:
        return  # the whole warp: the last CTA's spare warps
    var pos = Int(positions[unsafe_offset=t])
    var slot = Int(slot_mapping[unsafe_offset=t])
    var row = t * (H + 2 * KVH) * D
    var src = row + head * D
    if head >= H + KVH:  # v: straight into the cache
        var cache_off = (slot * KVH + head - H - KVH) * D
        comptime for j in range(PER_LANE):
            v_cache[unsafe_offset=cache_off + lane + 32 * j] = qkv[
                unsafe_offset=src + lane + 32 * j
            ]
        return
    var is_q = head < H
    var wt = q_weight if is_q else k_weight
    var x = SIMD[_F32, PER_LANE](0)
    comptime for j in range(PER_LANE):
        x[j] = qkv[unsafe_offset=src + lane + 32 * j].cast[_F32]()
    var inv = 1 / sqrt(warp.sum((x * x).reduce_add()) / Float32(D) + eps)
    var y = SIMD[_F32, PER_LANE](0)
    comptime for j in range(PER_LANE):
        var i = lane + 32 * j
        y[j] = _round[dtype](_round[dtype](x[j] * inv) * wt[unsafe_offset=i].cast[_F32]())
    var o = SIMD[_F32, PER_LANE](0)
    comptime for j in range(HALF_J):
        var i = lane + 32 * j  # < D / 2
        # HF casts cos/sin to the activation dtype before rotating.
        var c = _round[dtype](cos_sin[unsafe_offset=pos * D + i])
        var s = _round[dtype](cos_sin[unsafe_offset=pos * D + D // 2 + i])
        var x1 = y[j]
        var x2 = y[j + HALF_J]
        o[j] = _round[dtype](_round[dtype](x1 * c) - _round[dtype](x2 * s))
        o[j + HALF_J] = _round[dtype](_round[dtype](x2 * c) + _round[dtype](x1 * s))
    if is_q:
        var dst = (t * H + head) * D
        comptime for j in range(PER_LANE):
            q_out[unsafe_offset=dst + lane + 32 * j] = o[j].cast[dtype]()
    else:
        var cache_off = (slot * KVH + head - H) * D
        comptime for j in range(PER_LANE):
            var value = o[j].cast[dtype]()
            qkv[unsafe_offset=src + lane + 32 * j] = value  # the returned k view
            k_cache[unsafe_offset=cache_off + lane + 32 * j] = value


def silu_mul_kernel[
    dtype: DType
](
    out_ptr: Pointer[Scalar[dtype], MutAnyOrigin],
    gate_up: Pointer[Scalar[dtype], MutAnyOrigin],
    intermediate: Int32,
):
    """out[r, i] = silu(gate[r, i]) * up[r, i]; gate_up rows are gate | up, each I wide."""
    grid_order_start()  # grid_order_gpu.mojo: nothing is read before it
    var inter = Int(intermediate)
    var r = Int(block_idx.x)  # rows on x: a prefill chunk may have more than 65535 tokens
    var i = Int(block_idx.y) * SILU_THREADS + Int(thread_idx.x)
    if i >= inter:
        return
    var g = gate_up[unsafe_offset=r * 2 * inter + i].cast[_F32]()
    var u = gate_up[unsafe_offset=r * 2 * inter + inter + i].cast[_F32]()
    # torch's silu: x / (1 + exp(-x)) in fp32, rounded to dtype; then the multiply in dtype.
    var s = _round[dtype](g / (1 + exp(-g)))
    out_ptr[unsafe_offset=r * inter + i] = (s * u).cast[dtype]()


def gemv_kernel[
    dtype: DType
](
    out_ptr: Pointer[Scalar[dtype], MutAnyOrigin],
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    weight: Pointer[Scalar[dtype], MutAnyOrigin],
    tokens: Int32,
    out_features: Int32,
    in_features: Int32,
):
    """y[t, n] = sum_k x[t, k] W[n, k] for t < tokens (<= GEMV_MAX_TOKENS): F.linear without a
    bias at decode's batch sizes, where cuBLAS's GEMM tiles read the weights at a third of the
    copy bandwidth. x [T, K]; see _gemv."""
    grid_order_start()  # grid_order_gpu.mojo: nothing is read before it
    var unused = stack_allocation[1, Scalar[dtype], address_space=AddressSpace.SHARED]()
    _gemv[dtype, _X_GLOBAL](out_ptr, x, unused, weight, tokens, out_features, in_features)


def gemv_silu_kernel[
    dtype: DType
](
    out_ptr: Pointer[Scalar[dtype], MutAnyOrigin],
    gate_up: Pointer[Scalar[dtype], MutAnyOrigin],
    weight: Pointer[Scalar[dtype], MutAnyOrigin],
    tokens: Int32,
    out_features: Int32,
    in_features: Int32,
):
    """The MLP's down projection of silu(gate) * up, the product made where the gemv reads its
    x (silu_mul_kernel's rounding): gate_up [T, 2 K], gate | up; no silu_mul launch between."""
    grid_order_start()  # grid_order_gpu.mojo: nothing is read before it
    var unused = stack_allocation[1, Scalar[dtype], address_space=AddressSpace.SHARED]()
    _gemv[dtype, _X_SILU](out_ptr, gate_up, unused, weight, tokens, out_features, in_features)


def gemv_norm_kernel[
    dtype: DType
](
    out_ptr: Pointer[Scalar[dtype], MutAnyOrigin],
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    residual: Pointer[Scalar[dtype], MutAnyOrigin],
    residual_out: Pointer[Scalar[dtype], MutAnyOrigin],
    norm_weight: Pointer[Scalar[dtype], MutAnyOrigin],
    weight: Pointer[Scalar[dtype], MutAnyOrigin],
    tokens: Int32,
    out_features: Int32,
    in_features: Int32,
    has_residual: Int32,
    eps: Float32,
):
    """A projection of a normed input, the norm made by every CTA for itself (add_rms_norm_kernel's
    rounding) before its columns: r = x (+ residual), h = rms_norm(r) * norm_weight,
    y = h @ W^T; with a residual CTA 0 writes r to residual_out [T, K] (x and residual are only
    read, so no CTA sees another's write). No add_rms_norm launch before the gemv.
    K <= GEMV_NORM_MAX_FEATURES.
    """
    grid_order_start()  # grid_order_gpu.mojo: nothing is read before it
    comptime T = GEMV_MAX_TOKENS
    comptime VEC = 16 // size_of[dtype]()
    # 16-byte aligned: the rows are read and written a 16-byte vector at a time
    var hs = stack_allocation[
        T * GEMV_NORM_MAX_FEATURES, Scalar[dtype], alignment=16, address_space=AddressSpace.SHARED
    ]()
    var sums = stack_allocation[T * GEMV_WARPS, Float32, address_space=AddressSpace.SHARED]()
    var tid = Int(thread_idx.x)
    var K = Int(in_features)
    var nt = Int(tokens)
    var add = has_residual != 0
    var writes = add and Int(block_idx.x) == 0  # without a residual, r is x itself
    # Pass 1: r = x (+ residual), rounded, into hs (and residual_out); its sum of squares.
    comptime for t in range(T):
        if t < nt:
            var acc = Float32(0)
            for i in range(tid, K // VEC, 32 * GEMV_WARPS):
                var at = t * K + i * VEC
                var v = x.unsafe_load[width=VEC, alignment=16](at).cast[_F32]()
                if add:
                    var r = residual.unsafe_load[width=VEC, alignment=16](at).cast[_F32]()
                    v = (v + r).cast[dtype]().cast[_F32]()
                if writes:
                    residual_out.unsafe_store[alignment=16](at, v.cast[dtype]())
                hs.unsafe_store[alignment=16](t * GEMV_NORM_MAX_FEATURES + i * VEC, v.cast[dtype]())
                acc += (v * v).reduce_add()
            acc = warp.sum(acc)
            if Int(lane_id()) == 0:
                sums[unsafe_offset=t * GEMV_WARPS + tid // 32] = acc
    barrier()
    # Pass 2, over the elements this thread wrote: h = round(round(r * inv) * norm_weight).
    comptime for t in range(T):
        if t < nt:
            var total = Float32(0)
            comptime for w in range(GEMV_WARPS):
                total += sums[unsafe_offset=t * GEMV_WARPS + w]
            var inv = 1 / sqrt(total / Float32(K) + eps)
            for i in range(tid, K // VEC, 32 * GEMV_WARPS):
                var at = t * GEMV_NORM_MAX_FEATURES + i * VEC
                var v = hs.unsafe_load[width=VEC, alignment=16](at).cast[_F32]()
                var y = (v * inv).cast[dtype]().cast[_F32]()
                var wn = norm_weight.unsafe_load[width=VEC, alignment=16](i * VEC).cast[_F32]()
                hs.unsafe_store[alignment=16](at, (y * wn).cast[dtype]())
    barrier()  # the gemv's warps read every thread's h
    _gemv[dtype, _X_SHARED](out_ptr, x, hs, weight, tokens, out_features, in_features)


# Where _gemv reads x: a global [T, K], silu(gate) * up of a global gate_up [T, 2 K], or the
# normed rows gemv_norm_kernel left in shared memory [T, GEMV_NORM_MAX_FEATURES].
comptime _X_GLOBAL = 0
comptime _X_SILU = 1
comptime _X_SHARED = 2


@always_inline
def _gemv[
    dtype: DType, X: Int
](
    out_ptr: Pointer[Scalar[dtype], MutAnyOrigin],
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    hs: Pointer[Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    weight: Pointer[Scalar[dtype], MutAnyOrigin],
    tokens: Int32,
    out_features: Int32,
    in_features: Int32,
):
    """Accumulates in fp32 and rounds once, as cuBLAS does.

    Warp w of CTA c computes column n = c * GEMV_WARPS + w: its lanes stride along row n of W
    in 16-byte vectors, GEMV_UNROLL loads in flight at a time (predicated at the row's end),
    each vector times the same columns of every token's x (x is a few KB: L1 or shared memory
    serves the warps), then a butterfly sums the lanes. K must be a multiple of the vector (the
    host checks). X says where x comes from (the constants above).
    """
    comptime VEC = 16 // size_of[dtype]()
    comptime T = GEMV_MAX_TOKENS
    var n = Int(block_idx.x) * GEMV_WARPS + Int(thread_idx.x) // 32
    var N = Int(out_features)
    if n >= N:
        return  # the whole warp: n is the warp's
    var lane = Int(lane_id())
    var K = Int(in_features)
    var nt = Int(tokens)
    var vectors = K // VEC
    var row = n * K
    var acc = SIMD[_F32, T * VEC](0)  # acc[t * VEC + e]: token t's partial sums
    for base in range(lane, vectors, 32 * GEMV_UNROLL):
        var w = SIMD[dtype, GEMV_UNROLL * VEC](0)
        comptime for u in range(GEMV_UNROLL):
            var i = base + 32 * u
            if i < vectors:
                w = w.insert[offset=u * VEC](
                    weight.unsafe_load[width=VEC, alignment=16](row + i * VEC)
                )
        comptime for u in range(GEMV_UNROLL):
            var i = base + 32 * u
            if i < vectors:
                var wf = w.slice[VEC, offset=u * VEC]().cast[_F32]()
                comptime for t in range(T):
                    if t < nt:
                        var xf: SIMD[_F32, VEC]
                        comptime if X == _X_SHARED:
                            xf = hs.unsafe_load[width=VEC, alignment=16](
                                t * GEMV_NORM_MAX_FEATURES + i * VEC
                            ).cast[_F32]()
                        else:
                            xf = _x_vector[dtype, VEC, X == _X_SILU](x, t, K, i * VEC)
                        acc = acc.insert[offset=t * VEC](
                            wf.fma(xf, acc.slice[VEC, offset=t * VEC]())
                        )
    comptime for t in range(T):
        if t < nt:
            var total = warp.sum(acc.slice[VEC, offset=t * VEC]().reduce_add())
            if lane == 0:
                out_ptr[unsafe_offset=t * N + n] = total.cast[dtype]()


@always_inline
def _x_vector[
    dtype: DType, VEC: Int, SILU: Bool
](x: Pointer[Scalar[dtype], MutAnyOrigin], t: Int, K: Int, k: Int) -> SIMD[_F32, VEC]:
    """Elements k .. k + VEC - 1 of x's row t, widened: x [T, K]; with SILU, gate_up [T, 2 K]
    and silu(gate) * up rounded as silu_mul_kernel rounds it."""
    comptime if SILU:
        var g = x.unsafe_load[width=VEC, alignment=16](t * 2 * K + k).cast[_F32]()
        var u = x.unsafe_load[width=VEC, alignment=16](t * 2 * K + K + k).cast[_F32]()
        var s = (g / (1 + exp(-g))).cast[dtype]().cast[_F32]()
        return (s * u).cast[dtype]().cast[_F32]()
    else:
        return x.unsafe_load[width=VEC, alignment=16](t * K + k).cast[_F32]()
