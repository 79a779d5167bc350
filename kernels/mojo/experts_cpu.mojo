# A MoE layer's expert GEMM on the CPU: rows sorted by expert, each slice times its expert's
# weight, for the few rows per expert that decode steps and small batches give.
#
#   x        [R, K]     dtype dt: rows sorted by expert (mili/engine/model/moe.py)
#   weight   [E, N, K]  dt: expert e's [N, K] matrix, rows contiguous (HF's gate_up_proj / down_proj)
#   offsets  [E]        int32: expert e's rows are [offsets[e - 1], offsets[e]) (offsets[-1] = 0)
#   active   [A]        int32: the experts with at least one row, ascending
#   out      [R, N]     dt: out[r] = x[r] . weight[e(r)]^T, accumulated in fp32, rounded once
#
# With a few rows per expert the GEMM is a read of the active experts' weights (at 64 tokens of
# Qwen3-30B-A3B, 127 experts x ~4 rows); torch's grouped_mm there leaves a third of the read
# bandwidth unused (docs/benchmarks.md, "Qwen3-MoE experts"). So this kernel is built around the
# weight stream:
# - A work item is (active expert, block of _BLOCK weight rows); items are split evenly across
#   the workers, so experts without rows cost nothing and never unbalance them.
# - Within an item, a tile of NR = 4 weight rows is loaded once per K-step of one vector and
#   multiplied into MR <= 4 rows of x: 16 fp32 accumulators, a horizontal sum at the end. More
#   than 4 rows of an expert take more passes over the tile, which then comes from L1.
# - Each K-step prefetches the next tile's weights (they follow ours in memory): without it the
#   hardware prefetcher alone left each core at ~7 GB/s on the shorter down_proj rows.
# bf16 is widened to fp32 by a shift, as fused_cpu.mojo does. The sum's order differs from
# torch's GEMMs, so results agree to fp32 rounding (bf16: to one rounding of the output).
from std.memory import bitcast, stack_allocation
from std.python import PythonObject
from std.sys import PrefetchOptions, prefetch, simd_width_of, size_of
from max.algorithm import parallelize

comptime _F32 = DType.float32
comptime _W = simd_width_of[_F32]()  # fp32 lanes per vector (16 with AVX-512, 8 with AVX2)
comptime _BLOCK = 32  # weight rows per work item
comptime _NR = 4  # weight rows per tile
comptime _MR = 4  # x rows per tile
comptime _LINE = 64  # cache line bytes


@always_inline
def _widen[dt: DType, w: Int](x: SIMD[dt, w]) -> SIMD[_F32, w]:
    comptime if dt == DType.bfloat16:
        return bitcast[_F32, w](bitcast[DType.uint16, w](x).cast[DType.uint32]() << 16)
    else:
        return x.cast[_F32]()


@always_inline
def _narrow[dt: DType](x: Float32) -> Scalar[dt]:
    """x rounded to dt (bf16: nearest, ties to even; NaN stays NaN)."""
    comptime if dt == DType.bfloat16:
        var bits = bitcast[DType.uint32, 1](x)
        var rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        var kept = x.ne(x).select(bits | 0x00400000, rounded)
        return bitcast[dt, 1]((kept >> 16).cast[DType.uint16]())
    else:
        return x.cast[dt]()


def grouped_gemm_cpu(ptrs: PythonObject, dims: PythonObject) raises -> PythonObject:
    """ptrs = (out, x, weight, offsets, active) as ints (data_ptr()).

    dims = (dtype_code, rows, n, k, num_active, num_threads). Validated by the Python wrapper
    (kernels/fused/checks.py check_grouped_gemm).
    """
    var a = _Args(
        out=Int(py=ptrs[0]),
        x=Int(py=ptrs[1]),
        weight=Int(py=ptrs[2]),
        offsets=Int(py=ptrs[3]),
        active=Int(py=ptrs[4]),
        n=Int(py=dims[2]),
        k=Int(py=dims[3]),
        num_active=Int(py=dims[4]),
        threads=Int(py=dims[5]),
    )
    var code = Int(py=dims[0])
    if code == 0:
        _grouped_gemm[DType.float32](a)
    elif code == 1:
        _grouped_gemm[DType.bfloat16](a)
    elif code == 2:
        _grouped_gemm[DType.float16](a)
    else:
        raise Error("grouped_gemm: unsupported dtype code ", code)
    return PythonObject(None)


@fieldwise_init
struct _Args(Copyable, ImplicitlyCopyable):
    var out: Int
    var x: Int
    var weight: Int
    var offsets: Int
    var active: Int
    var n: Int
    var k: Int
    var num_active: Int
    var threads: Int


def _grouped_gemm[dt: DType](a: _Args):
    var blocks = (a.n + _BLOCK - 1) // _BLOCK

    def item(i: Int) {var a, var blocks}:
        var offsets = Pointer[Int32, MutAnyOrigin](unsafe_from_address=a.offsets)
        var active = Pointer[Int32, MutAnyOrigin](unsafe_from_address=a.active)
        var e = Int(active[unsafe_offset=i // blocks])
        var start = 0 if e == 0 else Int(offsets[unsafe_offset=e - 1])
        var end = Int(offsets[unsafe_offset=e])
        var n0 = (i % blocks) * _BLOCK
        var n1 = min(a.n, n0 + _BLOCK)
        var n = n0
        while n + _NR <= n1:
            _tiles[dt, _NR](a, e, start, end, n)
            n += _NR
        while n < n1:
            _tiles[dt, 1](a, e, start, end, n)
            n += 1

    var items = a.num_active * blocks
    if a.threads <= 1:
        for i in range(items):
            item(i)
    else:
        parallelize(item, items, a.threads)


@always_inline
def _tiles[dt: DType, NR: Int](a: _Args, e: Int, start: Int, end: Int, n: Int):
    """Weight rows [n, n + NR) of expert e times its x rows [start, end), MR rows at a time."""
    var r = start
    while r + _MR <= end:
        _tile[dt, _MR, NR](a, e, r, n)
        r += _MR
    var rest = end - r
    if rest == 3:
        _tile[dt, 3, NR](a, e, r, n)
    elif rest == 2:
        _tile[dt, 2, NR](a, e, r, n)
    elif rest == 1:
        _tile[dt, 1, NR](a, e, r, n)


@always_inline
def _tile[dt: DType, MR: Int, NR: Int](a: _Args, e: Int, r0: Int, n0: Int):
    """out[r0 : r0 + MR, n0 : n0 + NR] = x[r0 : r0 + MR] . weight[e, n0 : n0 + NR]^T."""
    var x = Pointer[Scalar[dt], MutAnyOrigin](unsafe_from_address=a.x)
    var w = Pointer[Scalar[dt], MutAnyOrigin](unsafe_from_address=a.weight)
    var out = Pointer[Scalar[dt], MutAnyOrigin](unsafe_from_address=a.out)
    var K = a.k
    var w0 = (e * a.n + n0) * K  # the tile's NR rows are contiguous: [w0, w0 + NR * K)
    var x0 = r0 * K
    # [MR * NR] accumulators and [MR] widened x vectors; fully unrolled, they live in registers.
    var acc = stack_allocation[MR * NR * _W, Float32]()
    var xv = stack_allocation[MR * _W, Float32]()
    comptime for q in range(MR * NR):
        acc.unsafe_store(q * _W, SIMD[_F32, _W](0))
    var kk = 0
    while kk + _W <= K:
        comptime for p in range(0, NR * _W, _LINE // size_of[dt]()):
            prefetch[PrefetchOptions().for_read().low_locality()](
                w.unsafe_offset(w0 + NR * K + kk * NR + p)
            )
        comptime for i in range(MR):
            xv.unsafe_store(i * _W, _widen[dt, _W](x.unsafe_load[width=_W](x0 + i * K + kk)))
        comptime for j in range(NR):
            var wv = _widen[dt, _W](w.unsafe_load[width=_W](w0 + j * K + kk))
            comptime for i in range(MR):
                var q = (i * NR + j) * _W
                acc.unsafe_store(q, xv.unsafe_load[width=_W](i * _W).fma(wv, acc.unsafe_load[width=_W](q)))
        kk += _W
    comptime for i in range(MR):
        comptime for j in range(NR):
            var s = acc.unsafe_load[width=_W]((i * NR + j) * _W).reduce_add()
            for t in range(kk, K):  # K's tail past the last whole vector
                var xt = _widen[dt, 1](x[unsafe_offset=x0 + i * K + t])
                s += xt * _widen[dt, 1](w[unsafe_offset=w0 + j * K + t])
            out[unsafe_offset=(r0 + i) * a.n + n0 + j] = _narrow[dt](s)
