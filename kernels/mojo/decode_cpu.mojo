# Paged decode attention on the CPU: one query per sequence (its newest token) against every
# cached position of that sequence, grouped-query, online softmax in fp32.
#
#   q, out            [B, H, D]        dtype dt (float32 / bfloat16 / float16)
#   k_cache, v_cache  [N, S, KVH, D]   dt; position p of sequence b lives at
#                                      cache[block_tables[b, p // S], p % S, kvh, :]
#   block_tables      [B, max_blocks]  int32
#   seq_lens          [B]              int32 >= 1: sequence b attends to positions [0, seq_lens[b])
#
# Design (decode is memory-bound: every K/V byte is read once, the math is cheap):
# - One work item = (sequence b, kv-head chunk, split s). The G = H // KVH query heads that share
#   a kv head are processed together, so each K/V row is loaded once per group, not once per head.
#   A chunk is normally all KVH kv heads: rows [t, 0:KVH, :] of a block are then one contiguous
#   run, far faster than one kv head per item (512 B strided reads every 4 KB starve the
#   hardware prefetcher; docs/benchmarks.md, "Measurements behind choices in the code").
#   Chunks of fewer kv heads only fill idle threads.
# - Per cache block: all scores of the block first (q pre-scaled by scale*log2(e), so exp2 is the
#   softmax exponent), then one online-softmax update (max, rescale, sum) per head, then the P.V
#   accumulation. K/V rows are loaded as one D-wide SIMD value (D is a compile-time parameter;
#   LLVM splits it into simd_width_of[float32] registers), widened to fp32 once per row.
# - Block tables scatter a sequence's blocks, so each block software-prefetches the next one.
# - Flash-decoding: with P > 1 splits each item covers a contiguous run of the sequence's blocks
#   and leaves an unnormalised partial (m, l, acc[D]) per head in a scratch buffer; a second
#   parallel pass combines the P partials per (b, h). With P == 1 the item writes `out` directly.
# - Compile-time dispatch over 3 dtypes x 3 head dims; bf16/fp16 are widened to fp32 on load and
#   rounded on store.
from std.math import exp2
from std.python import PythonObject
from std.sys import PrefetchOptions, prefetch, simd_width_of, size_of

from std.utils.numerics import FlushDenormals
from max.algorithm import parallelize

comptime _F32 = DType.float32
comptime _W = simd_width_of[_F32]()  # fp32 lanes per vector (16 with AVX-512, 8 with AVX2)
comptime _LOG2E = 1.4426950408889634
comptime _NEG_INF = Float32.MIN  # -inf for float32
comptime _LINE = 64  # cache line bytes


@always_inline
def _prefetch_span[dt: DType](p: Pointer[Scalar[dt], MutAnyOrigin], off: Int, count: Int):
    """Prefetch elements [off, off + count) of p into cache (one hint per cache line)."""
    comptime step = _LINE // size_of[dt]()
    for e in range(off, off + count, step):
        prefetch[PrefetchOptions().for_read().medium_locality()](p.unsafe_offset(e))


def decode_cpu(ptrs: PythonObject, dims: PythonObject, scale: PythonObject) raises -> PythonObject:
    """ptrs = (out, q, k_cache, v_cache, block_tables, seq_lens) as ints (data_ptr()).

    dims = (dtype_code, num_seqs, num_tokens, num_q_heads, num_kv_heads, head_dim, num_blocks,
            block_size, max_blocks, num_threads, num_splits). Validated by the Python wrapper.
    """
    var a = _Args(
        out=Int(py=ptrs[0]),
        q=Int(py=ptrs[1]),
        k=Int(py=ptrs[2]),
        v=Int(py=ptrs[3]),
        tables=Int(py=ptrs[4]),
        lens=Int(py=ptrs[5]),
        num_seqs=Int(py=dims[1]),
        num_q_heads=Int(py=dims[3]),
        num_kv_heads=Int(py=dims[4]),
        block_size=Int(py=dims[7]),
        max_blocks=Int(py=dims[8]),
        num_threads=Int(py=dims[9]),
        num_splits=Int(py=dims[10]),
        scale=Float32(Float64(py=scale)),
    )
    var dtype_code = Int(py=dims[0])
    var head_dim = Int(py=dims[5])
    if a.num_seqs == 0:
        return PythonObject(None)
    if dtype_code == 0:
        _dispatch_head_dim[DType.float32](a, head_dim)
    elif dtype_code == 1:
        _dispatch_head_dim[DType.bfloat16](a, head_dim)
    elif dtype_code == 2:
        _dispatch_head_dim[DType.float16](a, head_dim)
    else:
        raise Error("decode_cpu: unsupported dtype code ", dtype_code)
    return PythonObject(None)


@fieldwise_init
struct _Args(Copyable, ImplicitlyCopyable):
    """Raw addresses and sizes of one call (see the file header for shapes)."""

    var out: Int
    var q: Int
    var k: Int
    var v: Int
    var tables: Int
    var lens: Int
    var num_seqs: Int
    var num_q_heads: Int
    var num_kv_heads: Int
    var block_size: Int
    var max_blocks: Int
    var num_threads: Int
    var num_splits: Int
    var scale: Float32


def _dispatch_head_dim[dt: DType](a: _Args, head_dim: Int) raises:
    if head_dim == 64:
        _decode[dt, 64](a)
    elif head_dim == 128:
        _decode[dt, 128](a)
    elif head_dim == 256:
        _decode[dt, 256](a)
    else:
        raise Error("decode_cpu: unsupported head_dim ", head_dim)


def _choose_splits(a: _Args, lens: Pointer[Int32, MutAnyOrigin]) -> Int:
    """Number of splits P along every sequence (flash-decoding); forced when num_splits >= 1.

    Measured on 2 cores (16/8 heads, D=128): splitting only pays when the longest sequence
    holds more than ~1/(4 * threads) of all the K/V to read (one long sequence, or a few);
    then P=4..8 beats P=1 by 25-35% at B=1, while a batch of equal sequences >= 4 * threads
    wants P=1. So: P = ceil(longest * 4 * threads / total) blocks-wise, and no split shorter
    than 8 blocks (its fixed cost: q load, partial write, combine).
    """
    if a.num_splits >= 1:
        return a.num_splits
    var longest = 0
    var total = 0
    for b in range(a.num_seqs):
        var blocks = (Int(lens[unsafe_offset=b]) + a.block_size - 1) // a.block_size
        longest = max(longest, blocks)
        total += blocks
    if a.num_threads <= 1:
        return 1  # one worker: splits only add the partials' writes and a combine pass
    var want = (longest * 4 * a.num_threads + total - 1) // max(total, 1)
    return max(1, min(want, longest // 8))


def _choose_kv_chunks(a: _Args, splits: Int) -> Int:
    """Number of kv-head chunks per sequence: 1 (all heads per item, contiguous reads) unless
    sequences x splits leave threads idle; then the largest divisor of KVH that fills them."""
    var want = 2 * max(a.num_threads, 1)
    var have = a.num_seqs * splits
    if have >= want:
        return 1
    var need = (want + have - 1) // have
    var best = 1
    for d in range(1, a.num_kv_heads + 1):
        if a.num_kv_heads % d == 0 and d <= need:
            best = d
    return best


def _decode[dt: DType, D: Int](a: _Args) raises:
    comptime assert D % _W == 0, "head_dim must be a multiple of the SIMD width"
    comptime C = D // _W  # vectors per row
    var out = Pointer[Scalar[dt], MutAnyOrigin](unsafe_from_address=a.out)
    var q = Pointer[Scalar[dt], MutAnyOrigin](unsafe_from_address=a.q)
    var kc = Pointer[Scalar[dt], MutAnyOrigin](unsafe_from_address=a.k)
    var vc = Pointer[Scalar[dt], MutAnyOrigin](unsafe_from_address=a.v)
    var tables = Pointer[Int32, MutAnyOrigin](unsafe_from_address=a.tables)
    var lens = Pointer[Int32, MutAnyOrigin](unsafe_from_address=a.lens)
    var H = a.num_q_heads
    var KVH = a.num_kv_heads
    var G = H // KVH  # q heads per kv head
    var S = a.block_size
    var SP = ((S + _W - 1) // _W) * _W  # block scores padded to whole vectors
    var MB = a.max_blocks
    var P = _choose_splits(a, lens)
    var NCH = _choose_kv_chunks(a, P)
    var KC = KVH // NCH  # kv heads per item
    var HI = KC * G  # q heads per item: q rows h0 .. h0 + HI - 1 of one sequence
    var qscale = a.scale * Float32(_LOG2E)

    # Split partials, fp32: acc [B, H, P, D] unnormalised, ml [B, H, P, 2] = (max, sum).
    var nparts = a.num_seqs * H * P if P > 1 else 0
    var part_acc_buf = List[Float32](length=nparts * D, fill=0)
    var part_ml_buf = List[Float32](length=nparts * 2, fill=0)
    var part_acc = Pointer[Float32, MutAnyOrigin](unsafe_from_address=Int(part_acc_buf.unsafe_ptr()))
    var part_ml = Pointer[Float32, MutAnyOrigin](unsafe_from_address=Int(part_ml_buf.unsafe_ptr()))

    # Item i = (sequence b, kv chunk ch, split s): kv heads [ch * KC, (ch + 1) * KC) over the
    # blocks [s * per, (s + 1) * per) of sequence b.
    def item(i: Int) {var out, var q, var kc, var vc, var tables, var lens, var H, var KVH, var G,
                      var S, var SP, var MB, var P, var NCH, var KC, var HI, var qscale,
                      var part_acc, var part_ml}:
        var s = i % P
        var ch = (i // P) % NCH
        var b = i // (P * NCH)
        var L = Int(lens[unsafe_offset=b])
        var nblk = (L + S - 1) // S
        var per = (nblk + P - 1) // P
        var blo = s * per
        var bhi = min(blo + per, nblk)
        var g0 = ch * KC  # first kv head
        var h0 = b * H + g0 * G  # first q row (of q/out viewed as [B * H, D])

        # Per-item fp32 scratch: scaled q [HI, D], acc [HI, D], scores [HI, SP], m [HI], l [HI].
        var scratch = List[Float32](length=HI * (2 * D + SP + 2), fill=0)
        var addr = Int(scratch.unsafe_ptr())
        var qs = Pointer[Float32, MutAnyOrigin](unsafe_from_address=addr)
        var acc = Pointer[Float32, MutAnyOrigin](unsafe_from_address=addr + 4 * HI * D)
        var sc = Pointer[Float32, MutAnyOrigin](unsafe_from_address=addr + 8 * HI * D)
        var mrow = Pointer[Float32, MutAnyOrigin](unsafe_from_address=addr + 4 * HI * (2 * D + SP))
        var lrow = Pointer[Float32, MutAnyOrigin](
            unsafe_from_address=addr + 4 * HI * (2 * D + SP + 1)
        )
        for h in range(HI):
            mrow[unsafe_offset=h] = _NEG_INF
            comptime for c in range(C):
                var qv = q.unsafe_load[width=_W]((h0 + h) * D + c * _W).cast[_F32]()
                qs.unsafe_store(h * D + c * _W, qv * qscale)

        for j in range(blo, bhi):
            var blk = Int(tables[unsafe_offset=b * MB + j])
            var n = min(S, L - j * S)  # valid positions in this block
            # Scores of the whole block, sc[h, t] = (q_h * scale * log2e) . k_t, reading the
            # block's rows [t, g0 .. g0 + KC, :] in memory order (contiguous when KC == KVH).
            # Blocks of a sequence are scattered, which defeats the hardware prefetcher at every
            # block boundary: row t of this block prefetches row t of the next block (K here,
            # V in the P.V pass), one block of work ahead, into L2 (prefetcht1).
            # Measured 1.25x (fp32) / 1.45x (bf16) at B=32 x 1024 on 2 cores; L1 hints were worse.
            var nxt = Int(tables[unsafe_offset=b * MB + j + 1]) if j + 1 < bhi else -1
            for t in range(n):
                var row0 = ((blk * S + t) * KVH + g0) * D
                if nxt >= 0:
                    _prefetch_span(kc, ((nxt * S + t) * KVH + g0) * D, KC * D)
                for gg in range(KC):
                    # One K row as a D-wide vector, widened once and reused by the G heads.
                    var k = kc.unsafe_load[width=D](row0 + gg * D).cast[_F32]()
                    for h in range(gg * G, gg * G + G):
                        var dot = qs.unsafe_load[width=D](h * D) * k
                        sc[unsafe_offset=h * SP + t] = dot.reduce_add()
            # One online-softmax update per head for the whole block.
            for h in range(HI):
                for t in range(n, SP):
                    sc[unsafe_offset=h * SP + t] = _NEG_INF
                var bmax = SIMD[_F32, _W](_NEG_INF)
                for t in range(0, SP, _W):
                    bmax = max(bmax, sc.unsafe_load[width=_W](h * SP + t))
                var m_old = mrow[unsafe_offset=h]
                var m_new = max(m_old, bmax.reduce_max())
                var psum = SIMD[_F32, _W](0)
                for t in range(0, SP, _W):
                    var p = exp2(sc.unsafe_load[width=_W](h * SP + t) - m_new)
                    sc.unsafe_store(h * SP + t, p)
                    psum += p
                var corr = exp2(m_old - m_new)  # 0 on the first block (m_old = -inf)
                lrow[unsafe_offset=h] = lrow[unsafe_offset=h] * corr + psum.reduce_add()
                mrow[unsafe_offset=h] = m_new
                if corr != 1:
                    comptime for c in range(C):
                        var o = h * D + c * _W
                        acc.unsafe_store(o, acc.unsafe_load[width=_W](o) * corr)
            # acc[h] += sum_t p[h, t] * v_t, same memory order as K.
            for t in range(n):
                var row0 = ((blk * S + t) * KVH + g0) * D
                if nxt >= 0:
                    _prefetch_span(vc, ((nxt * S + t) * KVH + g0) * D, KC * D)
                for gg in range(KC):
                    var v = vc.unsafe_load[width=D](row0 + gg * D).cast[_F32]()
                    for h in range(gg * G, gg * G + G):
                        var p = sc[unsafe_offset=h * SP + t]
                        acc.unsafe_store(h * D, acc.unsafe_load[width=D](h * D) + p * v)

        for h in range(HI):
            var l = lrow[unsafe_offset=h]
            if P == 1:
                var inv = 1 / l
                comptime for c in range(C):
                    var o = acc.unsafe_load[width=_W](h * D + c * _W) * inv
                    out.unsafe_store((h0 + h) * D + c * _W, o.cast[dt]())
            else:
                var part = (h0 + h) * P + s  # row of [B * H, P]
                part_ml[unsafe_offset=2 * part] = mrow[unsafe_offset=h]
                part_ml[unsafe_offset=2 * part + 1] = l
                comptime for c in range(C):
                    var o = acc.unsafe_load[width=_W](h * D + c * _W)
                    part_acc.unsafe_store(part * D + c * _W, o)
        _ = len(scratch)  # keep the scratch alive past its last raw-pointer use

    var threads = max(a.num_threads, 1)
    if threads == 1:
        # On the caller's thread: no runtime worker to wake or to leave spinning beside torch's
        # threads; denormals flushed as on the runtime's workers (see prefill_cpu.mojo).
        with FlushDenormals():
            for i in range(a.num_seqs * NCH * P):
                item(i)
    else:
        parallelize(item, a.num_seqs * NCH * P, threads)
    if P == 1:
        return

    # Combine: out[b, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, M = max_s m_s.
    # Empty splits (more splits than blocks) have m = -inf, l = 0, acc = 0 and weigh 0.
    def combine(r: Int) {var out, var part_acc, var part_ml, var P}:
        var M = _NEG_INF
        for s in range(P):
            M = max(M, part_ml[unsafe_offset=2 * (r * P + s)])
        var total = Float32(0)
        for s in range(P):
            var part = r * P + s
            total += exp2(part_ml[unsafe_offset=2 * part] - M) * part_ml[unsafe_offset=2 * part + 1]
        var inv = 1 / total
        comptime for c in range(C):
            var o = SIMD[_F32, _W](0)
            for s in range(P):
                var part = r * P + s
                var w = exp2(part_ml[unsafe_offset=2 * part] - M)
                o += w * part_acc.unsafe_load[width=_W](part * D + c * _W)
            out.unsafe_store(r * D + c * _W, (o * inv).cast[dt]())

    if threads == 1:
        with FlushDenormals():
            for r in range(a.num_seqs * H):
                combine(r)
    else:
        parallelize(combine, a.num_seqs * H, threads)
    _ = len(part_acc_buf)  # keep the partials alive until the combine pass is done
    _ = len(part_ml_buf)
