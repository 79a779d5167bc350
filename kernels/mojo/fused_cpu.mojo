# Fused elementwise kernels of a Qwen3 decoder layer on the CPU: each is one pass over its rows
# where torch runs 3 to 30 small kernels. Semantics and shapes: mili/engine/fused_ops.py, whose
# TorchFusedOps is the reference these are tested against (tests/kernels/test_fused_parity.py).
#
#   add_rms_norm   residual += x; out = rms_norm(residual) * weight    (or without the add)
#   qk_norm_rope   per-head RMSNorm of q and k, RoPE from the cos/sin table, K/V into the cache
#   silu_mul       out = silu(gate) * up
#
# Rounding follows HF's torch code step by step, so bf16/fp16 results match the reference to the
# last bit wherever torch rounds exactly there: every value is widened to fp32, each op torch
# performs in the activation dtype is followed by a round to that dtype (`_round`), and only
# RMSNorm's sum of squares (torch sums in another order) and exp (another implementation) may
# differ in the last fp32 bit.
#
# Rows are independent: small calls run inline on the caller's thread (num_threads == 1, the
# usual decode step), big ones are split by rows across the Mojo runtime's workers.
from std.math import exp, sqrt
from std.memory import bitcast
from std.python import PythonObject
from std.sys import simd_width_of
from max.algorithm import parallelize

comptime _F32 = DType.float32
comptime _W = simd_width_of[_F32]()  # fp32 lanes per vector (16 with AVX-512, 8 with AVX2)


# bf16 <-> fp32 by bit arithmetic: bf16 is fp32's top half, so widening is a shift and rounding
# an integer add; SIMD.cast to and from bfloat16 is many times slower here.
@always_inline
def _bf16_bits[w: Int](x: SIMD[_F32, w]) -> SIMD[DType.uint32, w]:
    """x rounded to bfloat16 (nearest, ties to even) in the top 16 bits; NaN stays NaN."""
    var bits = bitcast[DType.uint32, w](x)
    var rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return x.ne(x).select(bits | 0x00400000, rounded) & 0xFFFF0000


@always_inline
def _widen[dt: DType, w: Int](x: SIMD[dt, w]) -> SIMD[_F32, w]:
    comptime if dt == DType.bfloat16:
        return bitcast[_F32, w](bitcast[DType.uint16, w](x).cast[DType.uint32]() << 16)
    else:
        return x.cast[_F32]()


@always_inline
def _narrow[dt: DType, w: Int](x: SIMD[_F32, w]) -> SIMD[dt, w]:
    comptime if dt == DType.bfloat16:
        return bitcast[dt, w]((_bf16_bits[w](x) >> 16).cast[DType.uint16]())
    else:
        return x.cast[dt]()


@always_inline
def _round[dt: DType, w: Int](x: SIMD[_F32, w]) -> SIMD[_F32, w]:
    """x rounded to dt and widened back; the identity for float32."""
    comptime if dt == _F32:
        return x
    elif dt == DType.bfloat16:
        return bitcast[_F32, w](_bf16_bits[w](x))
    else:
        return x.cast[dt]().cast[_F32]()


# ---- add + RMSNorm ----------------------------------------------------------------------------


def add_rms_norm_cpu(ptrs: PythonObject, dims: PythonObject, eps: PythonObject) raises -> PythonObject:
    """ptrs = (out, x, residual, weight) as ints (data_ptr(); residual 0 when absent).

    dims = (dtype_code, num_rows, dim, has_residual, num_threads). x, residual, out: [rows, dim],
    weight: [dim]. With has_residual: residual = residual + x, out = norm(residual); without:
    out = norm(x). out may be x (in place).
    """
    var code = Int(py=dims[0])
    var a = _NormArgs(
        out=Int(py=ptrs[0]),
        x=Int(py=ptrs[1]),
        residual=Int(py=ptrs[2]),
        weight=Int(py=ptrs[3]),
        rows=Int(py=dims[1]),
        dim=Int(py=dims[2]),
        has_residual=Int(py=dims[3]) != 0,
        threads=Int(py=dims[4]),
        eps=Float32(Float64(py=eps)),
    )
    if code == 0:
        _add_rms_norm[DType.float32](a)
    elif code == 1:
        _add_rms_norm[DType.bfloat16](a)
    elif code == 2:
        _add_rms_norm[DType.float16](a)
    else:
        raise Error("add_rms_norm: unsupported dtype code ", code)
    return PythonObject(None)


@fieldwise_init
struct _NormArgs(Copyable, ImplicitlyCopyable):
    var out: Int
    var x: Int
    var residual: Int
    var weight: Int
    var rows: Int
    var dim: Int
    var has_residual: Bool
    var threads: Int
    var eps: Float32


def _add_rms_norm[dt: DType](a: _NormArgs):
    var out = Pointer[Scalar[dt], MutAnyOrigin](unsafe_from_address=a.out)
    var x = Pointer[Scalar[dt], MutAnyOrigin](unsafe_from_address=a.x)
    # Without a residual the norm reads x; with one it reads the sum it stored in residual.
    var src = Pointer[Scalar[dt], MutAnyOrigin](
        unsafe_from_address=a.residual if a.has_residual else a.x
    )
    var w = Pointer[Scalar[dt], MutAnyOrigin](unsafe_from_address=a.weight)
    var dim = a.dim
    var has_residual = a.has_residual
    var eps = a.eps
    var body = dim - dim % _W  # whole vectors; the rest element by element

    def row(r: Int) {var out, var x, var src, var w, var dim, var has_residual, var eps, var body}:
        var base = r * dim
        # Pass 1: residual += x (rounded as torch's add is) and the sum of squares in fp32.
        var acc = SIMD[_F32, _W](0)
        var tail = Float32(0)
        for i in range(0, body, _W):
            var v = _widen[dt, _W](x.unsafe_load[width=_W](base + i))
            if has_residual:
                v = _round[dt, _W](v + _widen[dt, _W](src.unsafe_load[width=_W](base + i)))
                src.unsafe_store(base + i, _narrow[dt, _W](v))
            acc += v * v
        for i in range(body, dim):
            var v = _widen[dt, 1](x[unsafe_offset=base + i])
            if has_residual:
                v = _round[dt, 1](v + _widen[dt, 1](src[unsafe_offset=base + i]))
                src[unsafe_offset=base + i] = _narrow[dt, 1](v)
            tail += v * v
        var inv = 1 / sqrt((acc.reduce_add() + tail) / Float32(dim) + eps)
        # Pass 2: HF's order: normalise in fp32, round, then multiply by the weight and round.
        for i in range(0, body, _W):
            var y = _round[dt, _W](_widen[dt, _W](src.unsafe_load[width=_W](base + i)) * inv)
            var o = y * _widen[dt, _W](w.unsafe_load[width=_W](i))
            out.unsafe_store(base + i, _narrow[dt, _W](o))
        for i in range(body, dim):
            var y = _round[dt, 1](_widen[dt, 1](src[unsafe_offset=base + i]) * inv)
            out[unsafe_offset=base + i] = _narrow[dt, 1](y * _widen[dt, 1](w[unsafe_offset=i]))

    if a.threads <= 1:
        for r in range(a.rows):
            row(r)
    else:
        parallelize(row, a.rows, a.threads)


# ---- QK-norm + RoPE + KV write ------------------------------------------------------------------


def qk_norm_rope_cpu(ptrs: PythonObject, dims: PythonObject, eps: PythonObject) raises -> PythonObject:
    """ptrs = (q_out, qkv, q_weight, k_weight, cos_sin, positions, slot_mapping, k_cache, v_cache).

    dims = (dtype_code, num_tokens, num_q_heads, num_kv_heads, head_dim, num_threads).
    qkv [T, (H + 2 KVH) * D] (k normalised and rotated in place), q_out [T, H, D], weights [D],
    cos_sin [P, D] float32, positions/slot_mapping [T] int64, caches [N, S, KVH, D].
    """
    var code = Int(py=dims[0])
    var head_dim = Int(py=dims[4])
    var a = _RopeArgs(
        q_out=Int(py=ptrs[0]),
        qkv=Int(py=ptrs[1]),
        q_weight=Int(py=ptrs[2]),
        k_weight=Int(py=ptrs[3]),
        cos_sin=Int(py=ptrs[4]),
        positions=Int(py=ptrs[5]),
        slots=Int(py=ptrs[6]),
        k_cache=Int(py=ptrs[7]),
        v_cache=Int(py=ptrs[8]),
        tokens=Int(py=dims[1]),
        heads=Int(py=dims[2]),
        kv_heads=Int(py=dims[3]),
        threads=Int(py=dims[5]),
        eps=Float32(Float64(py=eps)),
    )
    if code == 0:
        _rope_head_dim[DType.float32](a, head_dim)
    elif code == 1:
        _rope_head_dim[DType.bfloat16](a, head_dim)
    elif code == 2:
        _rope_head_dim[DType.float16](a, head_dim)
    else:
        raise Error("qk_norm_rope: unsupported dtype code ", code)
    return PythonObject(None)


@fieldwise_init
struct _RopeArgs(Copyable, ImplicitlyCopyable):
    var q_out: Int
    var qkv: Int
    var q_weight: Int
    var k_weight: Int
    var cos_sin: Int
    var positions: Int
    var slots: Int
    var k_cache: Int
    var v_cache: Int
    var tokens: Int
    var heads: Int
    var kv_heads: Int
    var threads: Int
    var eps: Float32


def _rope_head_dim[dt: DType](a: _RopeArgs, head_dim: Int) raises:
    if head_dim == 64:
        _qk_norm_rope[dt, 64](a)
    elif head_dim == 128:
        _qk_norm_rope[dt, 128](a)
    elif head_dim == 256:
        _qk_norm_rope[dt, 256](a)
    else:
        raise Error("qk_norm_rope: unsupported head_dim ", head_dim)


@always_inline
def _norm_rope[
    dt: DType, D: Int
](
    x: SIMD[_F32, D],
    w: SIMD[_F32, D],
    cos: SIMD[_F32, D // 2],
    sin: SIMD[_F32, D // 2],
    eps: Float32,
) -> SIMD[dt, D]:
    """One head: RMSNorm over D, then rotate the halves (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
    comptime HALF = D // 2
    var inv = 1 / sqrt((x * x).reduce_add() / Float32(D) + eps)
    var y = _round[dt, D](_round[dt, D](x * inv) * w)
    var x1 = y.slice[HALF, offset=0]()
    var x2 = y.slice[HALF, offset=HALF]()
    var o1 = _round[dt, HALF](_round[dt, HALF](x1 * cos) - _round[dt, HALF](x2 * sin))
    var o2 = _round[dt, HALF](_round[dt, HALF](x2 * cos) + _round[dt, HALF](x1 * sin))
    return rebind[SIMD[dt, D]](_narrow[dt, D](rebind[SIMD[_F32, D]](o1.join(o2))))  # 2 * HALF == D


def _qk_norm_rope[dt: DType, D: Int](a: _RopeArgs):
    comptime HALF = D // 2
    var q_out = Pointer[Scalar[dt], MutAnyOrigin](unsafe_from_address=a.q_out)
    var qkv = Pointer[Scalar[dt], MutAnyOrigin](unsafe_from_address=a.qkv)
    var q_weight = Pointer[Scalar[dt], MutAnyOrigin](unsafe_from_address=a.q_weight)
    var k_weight = Pointer[Scalar[dt], MutAnyOrigin](unsafe_from_address=a.k_weight)
    var table = Pointer[Float32, MutAnyOrigin](unsafe_from_address=a.cos_sin)
    var positions = Pointer[Int64, MutAnyOrigin](unsafe_from_address=a.positions)
    var slots = Pointer[Int64, MutAnyOrigin](unsafe_from_address=a.slots)
    var k_cache = Pointer[Scalar[dt], MutAnyOrigin](unsafe_from_address=a.k_cache)
    var v_cache = Pointer[Scalar[dt], MutAnyOrigin](unsafe_from_address=a.v_cache)
    var H = a.heads
    var KVH = a.kv_heads
    var eps = a.eps

    def token(t: Int) {var q_out, var qkv, var q_weight, var k_weight, var table, var positions,
                       var slots, var k_cache, var v_cache, var H, var KVH, var eps}:
        var pos = Int(positions[unsafe_offset=t])
        var slot = Int(slots[unsafe_offset=t])
        # HF casts cos/sin to the activation dtype before rotating.
        var cos = _round[dt, HALF](table.unsafe_load[width=HALF](pos * D))
        var sin = _round[dt, HALF](table.unsafe_load[width=HALF](pos * D + HALF))
        var wq = _widen[dt, D](q_weight.unsafe_load[width=D](0))
        var wk = _widen[dt, D](k_weight.unsafe_load[width=D](0))
        var row = t * (H + 2 * KVH) * D  # this token's q | k | v in qkv
        for h in range(H):
            var x = _widen[dt, D](qkv.unsafe_load[width=D](row + h * D))
            q_out.unsafe_store((t * H + h) * D, _norm_rope[dt, D](x, wq, cos, sin, eps))
        for g in range(KVH):
            var k_off = row + (H + g) * D
            var k = _norm_rope[dt, D](_widen[dt, D](qkv.unsafe_load[width=D](k_off)), wk, cos, sin, eps)
            qkv.unsafe_store(k_off, k)  # the returned k view: backends may read new keys there
            var cache_off = (slot * KVH + g) * D  # [slot, g, :] of [N * S, KVH, D]
            k_cache.unsafe_store(cache_off, k)
            v_cache.unsafe_store(cache_off, qkv.unsafe_load[width=D](row + (H + KVH + g) * D))

    if a.threads <= 1:
        for t in range(a.tokens):
            token(t)
    else:
        parallelize(token, a.tokens, a.threads)


# ---- SiLU * mul -------------------------------------------------------------------------------


def silu_mul_cpu(ptrs: PythonObject, dims: PythonObject) raises -> PythonObject:
    """ptrs = (out, gate_up); dims = (dtype_code, num_rows, intermediate, num_threads).

    gate_up [rows, 2 I] (gate | up), out [rows, I] = silu(gate) * up.
    """
    var code = Int(py=dims[0])
    var out = Int(py=ptrs[0])
    var gate_up = Int(py=ptrs[1])
    var rows = Int(py=dims[1])
    var inter = Int(py=dims[2])
    var threads = Int(py=dims[3])
    if code == 0:
        _silu_mul[DType.float32](out, gate_up, rows, inter, threads)
    elif code == 1:
        _silu_mul[DType.bfloat16](out, gate_up, rows, inter, threads)
    elif code == 2:
        _silu_mul[DType.float16](out, gate_up, rows, inter, threads)
    else:
        raise Error("silu_mul: unsupported dtype code ", code)
    return PythonObject(None)


@always_inline
def _silu_mul_vec[dt: DType, w: Int](g: SIMD[_F32, w], u: SIMD[_F32, w]) -> SIMD[dt, w]:
    # torch's silu: x / (1 + exp(-x)) in fp32, rounded to dt; then the multiply in dt.
    var s = _round[dt, w](g / (1 + exp(-g)))
    return _narrow[dt, w](s * u)


def _silu_mul[dt: DType](out_addr: Int, gate_up_addr: Int, rows: Int, inter: Int, threads: Int):
    var out = Pointer[Scalar[dt], MutAnyOrigin](unsafe_from_address=out_addr)
    var gu = Pointer[Scalar[dt], MutAnyOrigin](unsafe_from_address=gate_up_addr)
    var body = inter - inter % _W

    def row(r: Int) {var out, var gu, var inter, var body}:
        var g0 = r * 2 * inter  # gate of row r; up follows at + inter
        for i in range(0, body, _W):
            var g = _widen[dt, _W](gu.unsafe_load[width=_W](g0 + i))
            var u = _widen[dt, _W](gu.unsafe_load[width=_W](g0 + inter + i))
            out.unsafe_store(r * inter + i, _silu_mul_vec[dt, _W](g, u))
        for i in range(body, inter):
            var g = _widen[dt, 1](gu.unsafe_load[width=1](g0 + i))
            var u = _widen[dt, 1](gu.unsafe_load[width=1](g0 + inter + i))
            out.unsafe_store(r * inter + i, _silu_mul_vec[dt, 1](g, u))

    if threads <= 1:
        for r in range(rows):
            row(r)
    else:
        parallelize(row, rows, threads)
