# CPU prefill attention for `mili_attention.prefill`: causal grouped-query FlashAttention over
# packed prompts, every key/value read from the paged cache (the caller already wrote the new
# tokens' K/V there).
#
#   q, out           [T, H, D]          T packed new tokens of all sequences
#   k_cache, v_cache [N, S, KVH, D]     position p of sequence i lives in block
#                                       block_tables[i, p // S], slot p % S
#   cu_seqlens [B + 1], start_positions [B], block_tables [B, max_blocks]   int32
#
# Design (fp32 accumulation; bf16/fp16 are widened on load and rounded on store):
# - A work item is (sequence, kv head, query tile): TQ consecutive new tokens x the g = H / KVH q
#   heads sharing that kv head, i.e. up to _BM "rows" (row = token * g + head-in-group). Each K/V
#   tile is therefore gathered from the cache once for all g heads.
# - Queries are packed once per item, transposed and pre-scaled: Qt [D, rows] fp32. Per key tile
#   of _BC positions, K and V rows are gathered into Ks/Vs [_BC, D] fp32 (plain vector copies).
# - S^T = K Q^T: broadcast k[c, d] x SIMD vectors of rows, RC keys x NR row vectors of
#   accumulators in registers. Keeping scores key-major (St [_BC, rows]) makes the online softmax
#   purely vertical (running max/sum per row are SIMD vectors; no horizontal reductions).
# - O += P V: broadcast p[r, c] x SIMD vectors of V rows, _RO rows x _DO vectors in registers.
# - Q is pre-scaled by the softmax scale; only tiles crossing the diagonal are masked, keys past
#   the tile's last query position are never visited. std.math.exp, not exp2: on this toolchain
#   fp32 exp2 is only ~1.4e-5 relative (exp ~1.4e-7), too coarse for the 1e-5 fp32 parity bar.
# - Items are assigned up front to num_threads workers (heaviest first, to the least-loaded
#   worker), so causal imbalance does not idle a core; each worker allocates scratch once.
# Measured (2 cores, H=16, KVH=8, D=128): ~6x torch SDPA for fp32 and bf16 at T=512 and 2048.
from std.sys import simd_width_of
from std.math import exp, iota
from std.collections import Array
from std.python import PythonObject
from std.utils.numerics import FlushDenormals
from max.algorithm import parallelize

comptime _F32 = DType.float32
comptime _W = simd_width_of[_F32]()  # fp32 lanes per vector (16 with AVX-512)
comptime _BM = 64  # target rows (tokens x heads of one kv group) per work item
comptime _BC = 48  # keys per tile (a multiple of every _scores key block: 8, 6, 4, 3)
comptime _RO = 4  # rows per P V register block
comptime _DO = 4  # D vectors per P V register block: _RO x _DO accumulators


@fieldwise_init
struct _Args(ImplicitlyCopyable, Movable):
    """Everything a worker needs: raw addresses (Python ints) and the problem's dims."""

    var out: Int
    var q: Int
    var k: Int
    var v: Int
    var cu: Int
    var starts: Int
    var tables: Int
    var items: Int  # [n_items, 5] Int: seq, tok0, ntok, kvh, owner
    var n_items: Int
    var H: Int
    var KVH: Int
    var S: Int
    var max_blocks: Int
    var scale: Float32  # softmax scale, folded into Q


def _ptr[dt: DType](addr: Int) -> Pointer[Scalar[dt], MutAnyOrigin]:
    return Pointer[Scalar[dt], MutAnyOrigin](unsafe_from_address=addr)


def _aligned(mut buf: List[Float32]) -> Pointer[Float32, MutAnyOrigin]:
    """64-byte aligned view into a buffer allocated with 16 spare floats."""
    var a = Int(buf.unsafe_ptr())
    return _ptr[_F32]((a + 63) // 64 * 64)


comptime _P = Pointer[Float32, MutAnyOrigin]


def _scores[D: Int, NR: Int, RC: Int](qt: _P, ks: _P, st: _P, ld: Int, r0: Int, nk: Int):
    """St[c, r0:] = Ks[c, :] . Qt[:, r0:] for keys c < nk: NR row vectors x RC keys in registers.

    Qt [D, ld] holds the tile's pre-scaled queries transposed, Ks [_BC, D] the keys, St [_BC, ld]
    the scores transposed (one row per key), so the softmax below needs no horizontal reductions.
    The last group may compute up to RC - 1 scores past nk (inside _BC, never read).
    """
    for c0 in range(0, nk, RC):
        var acc = Array[SIMD[_F32, _W], RC * NR](fill=SIMD[_F32, _W](0))
        for d in range(D):
            var qv = Array[SIMD[_F32, _W], NR](fill=SIMD[_F32, _W](0))
            comptime for v in range(NR):
                qv[v] = qt.unsafe_load[width=_W](d * ld + r0 + v * _W)
            comptime for c in range(RC):
                var kb = SIMD[_F32, _W](ks[unsafe_offset=(c0 + c) * D + d])
                comptime for v in range(NR):
                    acc[c * NR + v] = qv[v].fma(kb, acc[c * NR + v])
        comptime for c in range(RC):
            comptime for v in range(NR):
                st.unsafe_store((c0 + c) * ld + r0 + v * _W, acc[c * NR + v])


def _worker[dt: DType, D: Int](w: Int, a: _Args):
    """Process every work item owned by worker `w` (scratch allocated once, reused per item)."""
    var g = a.H // a.KVH
    var tq = max(1, _BM // g)
    var ld = (tq * g + _W - 1) // _W * _W  # rows of scratch, a multiple of the vector width
    var qb = List[Float32](length=D * ld + 16, fill=0)  # Qt [D, ld]
    var ob = List[Float32](length=ld * D + 16, fill=0)  # O  [ld, D] running output
    var kb = List[Float32](length=_BC * D + 16, fill=0)  # Ks [_BC, D]
    var vb = List[Float32](length=_BC * D + 16, fill=0)  # Vs [_BC, D]
    var sb = List[Float32](length=_BC * ld + 16, fill=0)  # St [_BC, ld] scores, then P^T
    var mb = List[Float32](length=ld + 16, fill=0)  # running max per row
    var lb = List[Float32](length=ld + 16, fill=0)  # running sum of exp per row
    var alb = List[Float32](length=ld + 16, fill=0)  # this tile's rescale factor per row
    var posb = List[Int32](length=ld, fill=0)  # absolute position of each row's token
    var qt = _aligned(qb)
    var os = _aligned(ob)
    var ks = _aligned(kb)
    var vs = _aligned(vb)
    var st = _aligned(sb)
    var m = _aligned(mb)
    var l = _aligned(lb)
    var al = _aligned(alb)
    var qpos = posb.unsafe_ptr()

    var qp = _ptr[dt](a.q)
    var outp = _ptr[dt](a.out)
    var kc = _ptr[dt](a.k)
    var vc = _ptr[dt](a.v)
    var cu = _ptr[DType.int32](a.cu)
    var stp = _ptr[DType.int32](a.starts)
    var bt = _ptr[DType.int32](a.tables)
    var items = _ptr[DType.int](a.items)
    var neg_inf = SIMD[_F32, _W](FloatLiteral.negative_infinity)

    for it in range(a.n_items):
        if Int(items[unsafe_offset=it * 5 + 4]) != w:
            continue
        var seq = Int(items[unsafe_offset=it * 5])
        var tok0 = Int(items[unsafe_offset=it * 5 + 1])
        var ntok = Int(items[unsafe_offset=it * 5 + 2])
        var kvh = Int(items[unsafe_offset=it * 5 + 3])
        var row0 = Int(cu[unsafe_offset=seq]) + tok0  # first q/out row of this tile
        var qmin = Int(stp[unsafe_offset=seq]) + tok0  # position of the tile's first token
        var kmax = qmin + ntok - 1  # position of its last token = last key needed
        var rows = ntok * g
        var nr = (rows + _W - 1) // _W  # row vectors
        var rows_pad = nr * _W

        # Qt (pre-scaled, fp32, transposed); padding rows are zero and reuse the last position.
        for r in range(rows_pad):
            var rr = min(r, rows - 1)
            qpos[unsafe_offset=r] = Int32(qmin + rr // g)
            var src = ((row0 + rr // g) * a.H + kvh * g + rr % g) * D
            comptime for d in range(0, D, _W):
                var x = qp.unsafe_load[width=_W](src + d).cast[_F32]() * a.scale
                if r >= rows:
                    x = 0
                comptime for e in range(_W):
                    qt[unsafe_offset=(d + e) * ld + r] = x[e]
                os.unsafe_store(r * D + d, SIMD[_F32, _W](0))
        for v in range(nr):
            m.unsafe_store(v * _W, neg_inf)
            l.unsafe_store(v * _W, SIMD[_F32, _W](0))

        var k0 = 0
        while k0 <= kmax:
            var nk = min(_BC, kmax + 1 - k0)
            # Gather this tile's keys/values from the paged cache as fp32 rows.
            for c in range(nk):
                var pos = k0 + c
                var blk = Int(bt[unsafe_offset=seq * a.max_blocks + pos // a.S])
                var src = ((blk * a.S + pos % a.S) * a.KVH + kvh) * D
                comptime for d in range(0, D, _W):
                    ks.unsafe_store(c * D + d, kc.unsafe_load[width=_W](src + d).cast[_F32]())
                    vs.unsafe_store(c * D + d, vc.unsafe_load[width=_W](src + d).cast[_F32]())

            # Row vectors in groups of at most _BM / _W (more only when g > _BM).
            for v0 in range(0, nr, _BM // _W):
                comptime for n in range(1, _BM // _W + 1):
                    if min(nr - v0, _BM // _W) == n:
                        # Up to 24 accumulators (of 32 zmm), keys per block dividing _BC.
                        _scores[D, n, min(8, 24 // n)](qt, ks, st, ld, v0 * _W, nk)

            # Online softmax, vectorised over rows (St is key-major). Only tiles crossing the
            # diagonal mask; exp(-inf) = 0 makes alpha 0 on the first tile.
            var masked = k0 + nk - 1 > qmin
            for v in range(nr):
                var mold = m.unsafe_load[width=_W](v * _W)
                var mx = mold
                var qv = qpos.unsafe_load[width=_W](v * _W)
                for c in range(nk):
                    var s = st.unsafe_load[width=_W](c * ld + v * _W)
                    if masked:
                        s = qv.lt(Int32(k0 + c)).select(neg_inf, s)
                        st.unsafe_store(c * ld + v * _W, s)
                    mx = max(mx, s)
                var alpha = exp(mold - mx)
                var sum = SIMD[_F32, _W](0)
                for c in range(nk):
                    var p = exp(st.unsafe_load[width=_W](c * ld + v * _W) - mx)
                    sum += p
                    st.unsafe_store(c * ld + v * _W, p)
                m.unsafe_store(v * _W, mx)
                l.unsafe_store(v * _W, l.unsafe_load[width=_W](v * _W) * alpha + sum)
                al.unsafe_store(v * _W, alpha)

            # O = O * alpha + P V: _RO rows x _DO vectors of D in registers, p broadcast.
            for rb in range(0, rows_pad, _RO):
                comptime for dv in range(0, D, _DO * _W):
                    var acc = Array[SIMD[_F32, _W], _RO * _DO](fill=SIMD[_F32, _W](0))
                    comptime for r in range(_RO):
                        var ar = al[unsafe_offset=rb + r]
                        comptime for v in range(_DO):
                            var o = os.unsafe_load[width=_W]((rb + r) * D + dv + v * _W)
                            acc[r * _DO + v] = o * ar
                    for c in range(nk):
                        var vv = Array[SIMD[_F32, _W], _DO](fill=SIMD[_F32, _W](0))
                        comptime for v in range(_DO):
                            vv[v] = vs.unsafe_load[width=_W](c * D + dv + v * _W)
                        comptime for r in range(_RO):
                            var pv = SIMD[_F32, _W](st[unsafe_offset=c * ld + rb + r])
                            comptime for v in range(_DO):
                                acc[r * _DO + v] = vv[v].fma(pv, acc[r * _DO + v])
                    comptime for r in range(_RO):
                        comptime for v in range(_DO):
                            os.unsafe_store((rb + r) * D + dv + v * _W, acc[r * _DO + v])
            k0 += _BC

        # out = O / l, rounded to the output dtype.
        for r in range(rows):
            var inv = 1 / l[unsafe_offset=r]
            var dst = ((row0 + r // g) * a.H + kvh * g + r % g) * D
            comptime for d in range(0, D, _W):
                var o = os.unsafe_load[width=_W](r * D + d) * inv
                outp.unsafe_store(dst + d, o.cast[dt]())
    _ = qb^
    _ = ob^
    _ = kb^
    _ = vb^
    _ = sb^
    _ = mb^
    _ = lb^
    _ = alb^
    _ = posb^


def _run[dt: DType, D: Int](a: _Args, nthreads: Int):
    var n = nthreads
    if n > a.n_items:
        n = a.n_items
    if n <= 1:
        # On the caller's thread: no runtime worker to wake or to leave spinning beside
        # torch's threads. Denormals flushed as on the runtime's workers: online softmax's
        # exp() of far-below-max scores makes many, and gradual underflow slows this loop
        # several times (docs/benchmarks.md, "Measurements behind choices in the code").
        with FlushDenormals():
            _worker[dt, D](0, a)
        return

    def work(w: Int) {var a}:
        _worker[dt, D](w, a)

    parallelize(work, n, n)


def _run_d[dt: DType](D: Int, a: _Args, nthreads: Int) raises:
    if D == 64:
        _run[dt, 64](a, nthreads)
    elif D == 128:
        _run[dt, 128](a, nthreads)
    elif D == 256:
        _run[dt, 256](a, nthreads)
    else:
        raise Error("prefill_cpu: unsupported head_dim ", D)


def prefill_cpu(ptrs: PythonObject, dims: PythonObject, scale: PythonObject) raises -> PythonObject:
    var code = Int(py=dims[0])
    var B = Int(py=dims[1])
    var H = Int(py=dims[3])
    var KVH = Int(py=dims[4])
    var D = Int(py=dims[5])
    var S = Int(py=dims[7])
    var max_blocks = Int(py=dims[8])
    var nthreads = max(1, Int(py=dims[9]))
    if KVH <= 0 or H % KVH != 0 or S <= 0:
        raise Error("prefill_cpu: bad head counts or block size")
    var g = H // KVH
    var tq = max(1, _BM // g)
    var cu = _ptr[DType.int32](Int(py=ptrs[4]))
    var starts = _ptr[DType.int32](Int(py=ptrs[5]))

    # Work items, heaviest (latest query tiles: most keys) first, each given to the worker with
    # the least work so far. Cost ~ rows x keys visited.
    var items = List[Int]()
    var load = List[Int](length=nthreads, fill=0)
    for seq in range(B):
        var lo = Int(cu[unsafe_offset=seq])
        var n = Int(cu[unsafe_offset=seq + 1]) - lo
        var start = Int(starts[unsafe_offset=seq])
        var ntiles = (n + tq - 1) // tq
        for t in range(ntiles - 1, -1, -1):
            var tok0 = t * tq
            var ntok = min(tq, n - tok0)
            var cost = ntok * g * ((start + tok0 + ntok + _BC - 1) // _BC)
            for kvh in range(KVH):
                var best = 0
                for w in range(1, nthreads):
                    if load[w] < load[best]:
                        best = w
                load[best] += cost
                items.append(seq)
                items.append(tok0)
                items.append(ntok)
                items.append(kvh)
                items.append(best)
    var n_items = len(items) // 5
    if n_items == 0:
        return PythonObject(None)
    var a = _Args(
        Int(py=ptrs[0]),
        Int(py=ptrs[1]),
        Int(py=ptrs[2]),
        Int(py=ptrs[3]),
        Int(py=ptrs[4]),
        Int(py=ptrs[5]),
        Int(py=ptrs[6]),
        Int(items.unsafe_ptr()),
        n_items,
        H,
        KVH,
        S,
        max_blocks,
        Float32(Float64(py=scale)),
    )
    if code == 0:
        _run_d[DType.float32](D, a, nthreads)
    elif code == 1:
        _run_d[DType.bfloat16](D, a, nthreads)
    elif code == 2:
        _run_d[DType.float16](D, a, nthreads)
    else:
        raise Error("prefill_cpu: unknown dtype code ", code)
    _ = items^
    return PythonObject(None)
