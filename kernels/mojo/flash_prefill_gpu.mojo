# Paged causal GQA prefill for NVIDIA sm_90: FlashAttention-2 on tensor cores (mma.sync
# m16n8k16, bf16/fp16 in, fp32 accumulators), compiled ahead of time to PTX. fp32 inputs keep
# prefill_gpu.mojo's CUDA-core kernel.
#
# Semantics (same as prefill_gpu.mojo and mili.engine.attention.TorchAttention.prefill):
#   q, out       [T, H, D]          packed new tokens of B sequences
#   k/v_cache    [N, S, KVH, D]     paged cache; the new tokens are already written there
#   cu_seqlens   [B + 1] int32      sequence i's tokens are rows cu[i] .. cu[i+1]-1 of q
#   start_positions [B] int32       position of sequence i's first new token
#   block_tables [B, max_blocks] int32
# Token j of sequence i sits at position p = start_i + j and attends to positions 0..p of its
# sequence, all read from the cache (position p is k_cache[bt[i, p // S], p % S, kvh, :]).
#
# Launch (kernels/gpu.py): grid (ceil(T / TM), KVH * ceil(G / GH), B), 128 threads (4 warps),
# dynamic shared memory flash_prefill_smem_bytes(D) (46-100 KB: the loader raises the
# function's limit past 48 KB).
#   G = H / KVH, GH = min(G, BM) query heads per CTA, TM = BM // GH new tokens per CTA.
# A CTA's BM rows are TM tokens x GH heads of one kv group, token-major:
#   row r  <->  token m0 + r // GH, head kvh * G + chunk * GH + r % GH
# so each K/V tile it loads serves the whole group (read once per group, not once per head).
# Rows past the sequence or past the group (BM % GH, odd G) compute on zero queries and are
# never written. grid.x runs heaviest-first (x = 0 is the sequence's last token tile); tiles past
# a sequence's length exit at once (T bounds every length, so no host sync is needed).
#
# Tiles (every head_dim):
#   BM = 64 query rows, BN = 64 keys per K/V tile (32 at D = 256); warp w owns rows
#   [16 w, 16 w + 16) as MT = 1 m16 tile (MT = 2 is written but measured nowhere yet: it
#   doubles the O registers). Shared memory, rows padded by 8 elements (16 bytes) so the 8 row
#   addresses of an ldmatrix hit 8 different 16-byte bank groups:
#     Qs [BM][D + 8]            Ks [2][BN][D + 8]   Vs [2][BN][D + 8]   Rb [2][BN] int64
#   Rb holds each key row's element offset in the cache (block table looked up once per row,
#   one tile ahead). K/V tiles are double-buffered: cp.async of tile j + 1 runs while tile j is
#   computed (issued after tile j's Q K^T MMAs, so their tensor-core time covers the copies'
#   address arithmetic).
#
# Fragments (PTX ISA, mma.m16n8k16 .bf16/.f16; lane l, g = l / 4, c = l % 4):
#   A 16x16 (row-major)  a0,a1 (g, 2c..2c+1)  a2,a3 (g+8, 2c..)  a4,a5 (g, 2c+8..)  a6,a7 (g+8, 2c+8..)
#   B 16x8  (k x n)      b0,b1 (k=2c..2c+1, n=g)  b2,b3 (k=2c+8.., n=g)
#   C 16x8  (fp32)       c0,c1 (g, 2c..2c+1)  c2,c3 (g+8, 2c..2c+1)
#   ldmatrix.x4: lanes 8i..8i+7 give the 8 row addresses of matrix i, register i of lane l holds
#   row l/4, elements 2c, 2c+1 of matrix i (.trans: elements (2c, l/4), (2c+1, l/4)).
#   Q  A fragment  (m tile rows R, dims 16kk):      lane l -> Qs[R + l % 16][16 kk + 8 (l / 16)]
#   K  B fragments (keys 16np, dims 16kk), 2 n tiles: lane l -> Ks[16np + l % 8 + 8 (l / 16)]
#                                                                  [16kk + 8 ((l / 8) % 2)]
#      registers 0,1 = n tile 2np (keys 16np..+7), registers 2,3 = n tile 2np + 1
#   V  B fragments (keys 16kk, dims 16dp), .trans:    lane l -> Vs[16kk + l % 8 + 8 ((l / 8) % 2)]
#                                                                  [16dp + 8 (l / 16)]
#      registers 0,1 = dims 16dp..+7, registers 2,3 = dims 16dp+8..+15
#   P  A fragment for keys 16kk..+15 = S n tiles 2kk and 2kk + 1 (c0..c3 each), cast to bf16:
#      exactly a0..a7, so P never leaves registers.
#   A thread's accumulator rows are g and g + 8 of each m tile; a row's values live in the 4
#   lanes of a quad (shuffle xor 1, 2 reduces over them).
#
# Softmax in base 2 on (q . k) * scale * log2(e), the scale applied inside the exponent's FFMA
# (and to the row max); rows keep (m, l) in registers, l as a per-lane partial summed over the
# quad at the end. Causal masking runs only on tiles that reach
# past the warp's first row (the diagonal ones); tiles past a warp's last row are skipped.
#
# Narrow variant (NARROW; entry `flash_prefill_3cta`, kernels/ptx.py): BN = 32 and Q's
# fragments re-read from Qs every tile, so that under its entry's launch bounds (128 threads,
# >= 3 CTAs an SM at D <= 128) ptxas fits it in 168 registers without spills and 3 CTAs fit
# in shared memory (52 KB at D = 128): 12 warps an SM instead of 8, for a kernel ncu found
# latency-bound with 2 warps a scheduler (docs/benchmarks.md, run 6). More tiles of half
# the keys each (twice the barriers and O rescales): benchmarks/attention_gpu.py measures it
# beside the default, which serving keeps until a GPU run says otherwise.

from std.math import exp2, inf
from std.sys import size_of
from max.gpu import thread_idx, block_idx, grid_dim, barrier, lane_id
from max.gpu.compute.mma import mma, ld_matrix
from max.gpu.memory import (
    AddressSpace,
    async_copy,
    async_copy_commit_group,
    async_copy_wait_group,
    external_memory,
)
from max.gpu.primitives import warp
from grid_order_gpu import grid_order_start

comptime FLASH_PREFILL_THREADS = 128
comptime NUM_WARPS = 4
comptime PAD = 8  # elements of padding per shared-memory row (16 bytes)


def flash_prefill_m_tiles(head_dim: Int) -> Int:
    """MT: 16-row mma tiles per warp."""
    return 1


def flash_prefill_block_m(head_dim: Int) -> Int:
    """BM: query rows (token x head) per CTA."""
    return NUM_WARPS * 16 * flash_prefill_m_tiles(head_dim)


def flash_prefill_block_n(head_dim: Int, narrow: Bool = False) -> Int:
    """BN: keys per K/V tile (32 at D = 256: 64 keys' scores next to 128 O registers spill;
    32 everywhere in the narrow variant)."""
    return 32 if head_dim == 256 or narrow else 64


def flash_prefill_smem_bytes(head_dim: Int, narrow: Bool = False) -> Int:
    """Dynamic shared memory of one CTA (2-byte dtypes): Qs, 2 x Ks, 2 x Vs, 2 x Rb."""
    var bm = flash_prefill_block_m(head_dim)
    var bn = flash_prefill_block_n(head_dim, narrow)
    return (bm + 4 * bn) * (head_dim + PAD) * 2 + 2 * bn * 8


@always_inline
def flash_prefill_kernel[
    dtype: DType, D: Int, NARROW: Bool = False
](
    out_ptr: Pointer[Scalar[dtype], MutAnyOrigin],
    q: Pointer[Scalar[dtype], MutAnyOrigin],
    k_cache: Pointer[Scalar[dtype], MutAnyOrigin],
    v_cache: Pointer[Scalar[dtype], MutAnyOrigin],
    cu_seqlens: Pointer[Int32, MutAnyOrigin],
    start_positions: Pointer[Int32, MutAnyOrigin],
    block_tables: Pointer[Int32, MutAnyOrigin],
    num_q_heads: Int32,
    num_kv_heads: Int32,
    block_size: Int32,
    max_blocks: Int32,
    scale_log2: Float32,
):
    grid_order_start()  # grid_order_gpu.mojo: nothing is read before it
    comptime assert size_of[dtype]() == 2, "bf16/fp16 only (fp32: prefill_gpu.mojo)"
    comptime assert D == 64 or D == 128 or D == 256, "head_dim 64, 128 or 256"
    comptime MT = flash_prefill_m_tiles(D)
    comptime BM = flash_prefill_block_m(D)
    comptime BN = flash_prefill_block_n(D, NARROW)
    comptime WM = 16 * MT  # rows per warp
    comptime LD = D + PAD  # shared-memory row stride (elements)
    comptime NT = BN // 8  # S n tiles (8 keys each)
    comptime DT = D // 8  # O n tiles (8 dims each)
    comptime VEC = 8  # elements per 16-byte copy
    comptime CPR = D // VEC  # 16-byte chunks per row
    comptime RPP = FLASH_PREFILL_THREADS // CPR  # rows one pass of copies covers
    comptime Q_COPIES = BM // RPP
    comptime KV_COPIES = BN // RPP
    comptime NEG_INF = -inf[DType.float32]()
    comptime assert BN % RPP == 0 and BM % RPP == 0, "copy passes must cover whole tiles"

    var tile = Int(grid_dim.x) - 1 - Int(block_idx.x)  # heaviest (last) token tiles first
    var y = Int(block_idx.y)
    var b = Int(block_idx.z)
    var tid = Int(thread_idx.x)
    var w = tid // 32
    var lane = Int(lane_id())
    var qg = lane // 4  # accumulator row within an m tile (and + 8)
    var qc = lane % 4  # accumulator column pair

    var H = Int(num_q_heads)
    var KVH = Int(num_kv_heads)
    var S = Int(block_size)
    var G = H // KVH
    var GH = min(G, BM)  # query heads per CTA
    var TM = BM // GH  # tokens per CTA
    var chunks = (G + GH - 1) // GH
    var kvh = y // chunks
    var hc0 = (y % chunks) * GH  # first head of this CTA within the group

    var seq_lo = Int(cu_seqlens[unsafe_offset=b])
    var n = Int(cu_seqlens[unsafe_offset=b + 1]) - seq_lo
    var m0 = tile * TM
    if m0 >= n:
        return  # CTA-uniform: past this sequence's new tokens
    var start = Int(start_positions[unsafe_offset=b])
    var rows_tok = min(TM, n - m0)  # live tokens of this CTA
    var kv_end = start + m0 + rows_tok  # keys [0, kv_end) cover every row of the CTA
    var n_tiles = (kv_end + BN - 1) // BN
    var bt_row = b * Int(max_blocks)

    var smem = external_memory[
        Scalar[dtype], address_space=AddressSpace.SHARED, alignment=16
    ]()
    var qs = smem
    var ks0 = smem.unsafe_offset(BM * LD)  # Ks[stage] = ks0 + stage * 2 * BN * LD
    var rb = smem.unsafe_offset((BM + 4 * BN) * LD).unsafe_bitcast[Int64]()  # [2][BN]
    var qgl = q.unsafe_address_space_cast[AddressSpace.GLOBAL]()
    var kg = k_cache.unsafe_address_space_cast[AddressSpace.GLOBAL]()
    var vg = v_cache.unsafe_address_space_cast[AddressSpace.GLOBAL]()

    # Cache offsets of the first two tiles' key rows (-1: past kv_end, zero-filled).
    if tid < BN:
        comptime for st in range(2):
            var kp = st * BN + tid
            var base = Int64(-1)
            if kp < kv_end:
                var blk = Int(block_tables[unsafe_offset=bt_row + kp // S])
                base = Int64(((blk * S + kp % S) * KVH + kvh) * D)
            rb[unsafe_offset=st * BN + tid] = base
    barrier()

    # Q tile (cp.async, zero-filled rows past the sequence or the group), then K/V tile 0: one
    # commit group.
    var c_col = (tid % CPR) * VEC
    var c_row = tid // CPR
    comptime for i in range(Q_COPIES):
        var r = c_row + RPP * i
        var t = r // GH
        var hg = hc0 + r % GH
        var valid = t < rows_tok and hg < G
        var src = ((seq_lo + m0 + t) * H + kvh * G + hg) * D + c_col if valid else 0
        async_copy[16, fill=Scalar[dtype](0)](
            qgl.unsafe_offset(src),
            qs.unsafe_offset(r * LD + c_col),
            src_size=Int32(16) if valid else Int32(0),
        )
    _issue_kv[dtype, D, BN, KV_COPIES, RPP](ks0, rb, kg, vg, c_row, c_col)
    async_copy_commit_group()

    # Per-row state. Thread rows: (mt, half) -> warp row WM w + 16 mt + qg + 8 half.
    var m_i = SIMD[DType.float32, 2 * MT](NEG_INF)
    var l_i = SIMD[DType.float32, 2 * MT](0)  # this lane's partial sums
    var o_acc = SIMD[DType.float32, MT * DT * 4](0)  # [mt][dt][c0..c3]
    var limit = SIMD[DType.int32, 2 * MT](0)  # last key each row may see
    comptime for mt in range(MT):
        comptime for half in range(2):
            var r = WM * w + 16 * mt + qg + 8 * half
            limit[mt * 2 + half] = Int32(min(start + m0 + r // GH, kv_end - 1))
    var warp_lo = min(start + m0 + (WM * w) // GH, kv_end - 1)  # the warp's first row's limit
    var warp_hi = min(start + m0 + (WM * w + WM - 1) // GH, kv_end - 1)  # and its last row's

    # With one m tile per warp and D <= 128, Q's A fragments fit in registers for the whole loop
    # (D / 16 x 4 registers); else they are re-read from Qs each tile (ldmatrix, cheap) so the
    # registers hold O instead (D = 256 with Q in registers spills: ptxas -v, manifest).
    comptime Q_IN_REGS = MT == 1 and D <= 128 and not NARROW
    var q_frag = SIMD[dtype, (D // 16) * MT * 8 if Q_IN_REGS else 8](0)
    comptime if Q_IN_REGS:
        async_copy_wait_group(0)
        barrier()
        comptime for kk in range(D // 16):
            q_frag = q_frag.insert[offset=kk * MT * 8](_q_fragments[dtype, D, MT](qs, w, lane, kk))

    for j in range(n_tiles):
        async_copy_wait_group(0)  # tile j (and Q) landed for this thread's copies
        barrier()  # ... and everyone's; tile j - 1 is computed, its buffers are free
        var k0 = j * BN
        var ks = ks0.unsafe_offset((j % 2) * 2 * BN * LD)
        var vs = ks.unsafe_offset(BN * LD)
        # Tile j + 2's key row `tid` (threads tid < BN): its block id is loaded here and used
        # only once this warp's Q K^T MMAs are issued, so the load's latency hides behind them.
        var kp = (j + 2) * BN + tid
        var has_row = tid < BN and kp < kv_end
        var blk_idx = Int(UInt32(kp) // UInt32(S))  # 32-bit: no 64-bit division call
        var blk = Int(block_tables[unsafe_offset=bt_row + blk_idx]) if has_row else 0
        var computes = k0 <= warp_hi  # warp-uniform: else every key is after every row

        # S = Q K^T: s[(mt * NT + nt) * 4 + i] = C fragment i of m tile mt, n tile nt.
        var s = SIMD[DType.float32, MT * NT * 4](0)
        if computes:
            comptime for kk in range(D // 16):
                var qa: SIMD[dtype, MT * 8]
                comptime if Q_IN_REGS:
                    qa = q_frag.slice[MT * 8, offset=kk * MT * 8]()
                else:
                    qa = _q_fragments[dtype, D, MT](qs, w, lane, kk)
                comptime for np in range(NT // 2):
                    var krow = 16 * np + lane % 8 + 8 * (lane // 16)
                    var kb = ld_matrix[8](ks.unsafe_offset(krow * LD + 16 * kk + 8 * ((lane // 8) % 2)))
                    comptime for mt in range(MT):
                        comptime for half in range(2):
                            comptime off = (mt * NT + 2 * np + half) * 4
                            var c = s.slice[4, offset=off]()
                            mma(c, qa.slice[8, offset=mt * 8](), kb.slice[4, offset=4 * half](), c)
                            s = s.insert[offset=off](c)

        # Tile j + 1's copies, issued once this warp's MMAs are (the address arithmetic of a
        # copy is a dependent chain per row: here it runs while the tensor cores work), then
        # tile j + 2's row offsets into slot j % 2 (last read when tile j was issued, before
        # this iteration's barrier); both read after the next barrier.
        if j + 1 < n_tiles:
            _issue_kv[dtype, D, BN, KV_COPIES, RPP](
                ks0.unsafe_offset(((j + 1) % 2) * 2 * BN * LD),
                rb.unsafe_offset(((j + 1) % 2) * BN),
                kg,
                vg,
                c_row,
                c_col,
            )
        async_copy_commit_group()
        if tid < BN:
            var base = Int64(-1)
            if has_row:
                base = Int64(((blk * S + kp - blk_idx * S) * KVH + kvh) * D)
            rb[unsafe_offset=(j % 2) * BN + tid] = base
        if not computes:
            continue

        # Causal mask on diagonal tiles only (warp-uniform branch: every key of an earlier
        # tile is visible to every row of the warp). C element (mt, nt, i) is row (mt, i / 2),
        # key k0 + 8 nt + 2 qc + i % 2; keys >= kv_end (zero-filled) are past every limit.
        if k0 + BN - 1 > warp_lo:
            comptime for mt in range(MT):
                comptime for nt in range(NT):
                    comptime for i in range(4):
                        comptime idx = (mt * NT + nt) * 4 + i
                        var key = Int32(k0 + 8 * nt + 2 * qc + i % 2)
                        if key > limit[mt * 2 + i // 2]:
                            s[idx] = NEG_INF

        # Online softmax: rows (mt, half) over their 2 NT values per lane, then the quad.
        comptime for mt in range(MT):
            comptime for half in range(2):
                var mx = NEG_INF
                comptime for nt in range(NT):
                    comptime for e in range(2):
                        mx = max(mx, s[(mt * NT + nt) * 4 + 2 * half + e])
                mx = max(mx, warp.shuffle_xor(mx, UInt32(1)))
                mx = max(mx, warp.shuffle_xor(mx, UInt32(2)))
                comptime ri = mt * 2 + half
                var m_new = max(m_i[ri], mx * scale_log2)  # s unscaled, m in log2 units
                # Tile 0 holds key 0, visible to every row, so m is finite from the first tile
                # on; the guard keeps a hypothetical all-masked row at exp2(-inf) = 0, not NaN.
                var m_use = m_new if m_new != NEG_INF else Float32(0)
                var alpha = exp2(m_i[ri] - m_use)
                var psum = Float32(0)
                comptime for nt in range(NT):
                    comptime for e in range(2):
                        comptime idx = (mt * NT + nt) * 4 + 2 * half + e
                        var p = exp2(s[idx].fma(scale_log2, -m_use))  # one FFMA
                        s[idx] = p
                        psum += p
                l_i[ri] = l_i[ri] * alpha + psum
                m_i[ri] = m_new
                comptime for dt in range(DT):
                    comptime for e in range(2):
                        comptime oi = (mt * DT + dt) * 4 + 2 * half + e
                        o_acc[oi] = o_acc[oi] * alpha

        # O += P V: P's A fragments come straight from s (see the header).
        comptime for kk in range(BN // 16):
            var pa = SIMD[dtype, MT * 8](0)
            comptime for mt in range(MT):
                pa = pa.insert[offset=mt * 8](
                    s.slice[8, offset=(mt * NT + 2 * kk) * 4]().cast[dtype]()
                )
            comptime for dp in range(DT // 2):
                var vrow = 16 * kk + lane % 8 + 8 * ((lane // 8) % 2)
                var vb = ld_matrix[8, transpose=True](
                    vs.unsafe_offset(vrow * LD + 16 * dp + 8 * (lane // 16))
                )
                comptime for mt in range(MT):
                    comptime for half in range(2):
                        comptime off = (mt * DT + 2 * dp + half) * 4
                        var c = o_acc.slice[4, offset=off]()
                        mma(c, pa.slice[8, offset=mt * 8](), vb.slice[4, offset=4 * half](), c)
                        o_acc = o_acc.insert[offset=off](c)

    # out = O / l for the live rows.
    comptime for mt in range(MT):
        comptime for half in range(2):
            comptime ri = mt * 2 + half
            var l_row = l_i[ri]
            l_row += warp.shuffle_xor(l_row, UInt32(1))
            l_row += warp.shuffle_xor(l_row, UInt32(2))
            var r = WM * w + 16 * mt + qg + 8 * half
            var t = r // GH
            var hg = hc0 + r % GH
            if t < rows_tok and hg < G:
                var inv = Float32(1) / l_row
                var base = ((seq_lo + m0 + t) * H + kvh * G + hg) * D + 2 * qc
                comptime for dt in range(DT):
                    comptime oi = (mt * DT + dt) * 4 + 2 * half
                    var v = o_acc.slice[2, offset=oi]() * inv
                    out_ptr.unsafe_store[alignment=4](base + 8 * dt, v.cast[dtype]())


@always_inline
def _q_fragments[
    dtype: DType, D: Int, MT: Int
](
    qs: Pointer[Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    w: Int,
    lane: Int,
    kk: Int,
) -> SIMD[dtype, MT * 8]:
    """A fragments of warp w's MT m tiles for dims [16 kk, 16 kk + 16) (ldmatrix.x4 each)."""
    comptime LD = D + PAD
    var qa = SIMD[dtype, MT * 8](0)
    comptime for mt in range(MT):
        var qrow = 16 * MT * w + 16 * mt + lane % 16
        qa = qa.insert[offset=mt * 8](
            ld_matrix[8](qs.unsafe_offset(qrow * LD + 16 * kk + 8 * (lane // 16)))
        )
    return qa


@always_inline
def _issue_kv[
    dtype: DType, D: Int, BN: Int, KV_COPIES: Int, RPP: Int
](
    ks: Pointer[Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    rb: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    kg: Pointer[Scalar[dtype], MutAnyOrigin, address_space=AddressSpace.GLOBAL],
    vg: Pointer[Scalar[dtype], MutAnyOrigin, address_space=AddressSpace.GLOBAL],
    c_row: Int,
    c_col: Int,
):
    """cp.async one K/V tile: ks -> Ks stage, ks + BN * LD -> Vs stage; row r's cache offset is
    rb[r] (-1: zero-fill)."""
    comptime LD = D + PAD
    var vs = ks.unsafe_offset(BN * LD)
    comptime for i in range(KV_COPIES):
        var r = c_row + RPP * i
        var base = Int(rb[unsafe_offset=r])
        var valid = base >= 0
        var src = base + c_col if valid else 0
        var n = Int32(16) if valid else Int32(0)
        async_copy[16, fill=Scalar[dtype](0)](
            kg.unsafe_offset(src), ks.unsafe_offset(r * LD + c_col), src_size=n
        )
        async_copy[16, fill=Scalar[dtype](0)](
            vg.unsafe_offset(src), vs.unsafe_offset(r * LD + c_col), src_size=n
        )
