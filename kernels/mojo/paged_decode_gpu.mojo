# Paged GQA decode attention for NVIDIA sm_90, FlashInfer-style; compiled ahead of time to PTX.
# bf16/fp16 only (fp32 keeps decode_gpu.mojo's kernel).
#
# Semantics (same as decode_gpu.mojo and mili.engine.attention.TorchAttention.decode):
#   q, out       [B, H, D]          one query per sequence
#   k/v_cache    [N, S, KVH, D]     paged cache
#   block_tables [B, max_blocks] int32, seq_lens [B] int32
# Sequence b's query attends to positions 0 .. seq_lens[b] - 1; q head h reads kv head
# h // (H // KVH).
#
# Launch (kernels/gpu.py): grid (num_splits, KVH * ceil(G / GC), B), 128 threads, dynamic shared
# memory paged_decode_smem_bytes(D) (50 KB: the loader raises the function's limit).
# G = H / KVH; GC (a compile-time parameter, 1/2/4/8) is the number of query heads of one kv
# group a CTA serves: every K/V byte a CTA reads serves GC heads (G <= 8: the whole group, so
# K/V is read once). Heads r0 + GC .. of a group with G > GC go to the next grid.y; a group with
# G < GC (odd ratios) leaves GC - G head slots idle (computed on zero queries, never written).
#
# Split-KV plan (stable under CUDA graphs): the host fixes num_splits from shapes only (batch,
# heads, block-table width). The kernel cuts sequence b's nb = ceil(L / S) blocks into chunks of
#   per = max(ceil(nb / num_splits), ceil(MIN_SPLIT_KEYS / S)) blocks;
# split s takes blocks [s * per, min(nb, (s + 1) * per)), so the sequence has
#   live = max(1, ceil(nb / per)) splits
# (read on the device: a short context takes one split whatever the plan). Splits s >= live
# exit at once. With live == 1 the CTA writes `out` directly. Else each live split writes its
# normalised fp32 output and log2-sum-exp to part_o [B, H, num_splits, D] / part_lse
# [B, H, num_splits], then counts itself in counters[b, grid.y] (int32, zero between launches);
# the split that counts last merges the live parts into `out` and sets the counter back to 0.
# No second kernel: at batch 1 the combine's launch cost more than the splits saved.
#
# Inside a CTA (D = 128 shown; BDX = D / 8 lanes per row, NG = 128 / BDX row groups):
#
#   thread t:  tx = t % 16 owns dims [8 tx, 8 tx + 8) of a row (one 16-byte vector)
#              grp = t / 16 (0..7) is a row group: the 16 lanes of one half-warp
#   registers: q[GC][8] (fp32, pre-scaled by scale * log2 e), o[GC][8], m[GC], l[GC]
#   tile:      TK = NG * KPG = 32 keys (KPG = 4; 1 for GC = 8, with a 12-deep ring instead of 3);
#              group grp takes keys [grp * KPG, grp * KPG + KPG)
#
#   smem:  ring  [STAGES][2 (K, V)][TK][D] dtype    cp.async destination, STAGES-deep
#          ids   [IDS_WINDOW] int32                 block ids of the current window
#          (after the last tile the ring is reused for the cross-group merge, fp32)
#
# Score of key j against head h: each lane dots its 8 dims, then a butterfly over the group's
# BDX lanes (shuffle xor BDX/2 .. 1) leaves the full sum in every lane, so all lanes of a group
# run the same online softmax and each updates its own 8 output dims. Groups keep separate
# (m, l, o) and are merged once at the end.
#
# Copies: a tile is TK rows x (D / 8) 16-byte chunks of K and as many of V: 4 + 4 cp.async per
# thread (thread t copies chunk t % CPR of rows t / CPR + NG * i, i < 4). Row key k lives at
#   k_cache[ids[(k - window_key0) / S], k % S, kvh, :]
# with the window's block ids staged in shared memory once per IDS_WINDOW blocks (one window
# covers 8192 keys at S = 16, i.e. every split of a 8k context). A thread follows its rows'
# (id index, offset in block) from tile to tile: no division in the tile loop. Rows past the
# split's end are zero-filled (cp.async src-size 0), so masked keys meet finite V rows.

from std.atomic import Atomic, Ordering
from std.math import exp2, log2, inf
from std.sys import size_of
from max.gpu import thread_idx, block_idx, barrier
from max.gpu.intrinsics import threadfence
from max.gpu.memory import (
    AddressSpace,
    async_copy,
    async_copy_commit_group,
    async_copy_wait_group,
    external_memory,
)
from max.gpu.primitives import warp
from grid_order_gpu import grid_order_start

comptime PAGED_DECODE_THREADS = 128
comptime RING_KEYS_PER_GROUP = 12  # STAGES x KPG: the ring's size in keys per row group
comptime IDS_WINDOW = 512  # block ids staged in shared memory at a time
comptime MIN_SPLIT_KEYS = 64  # a split reads at least this many keys (host plan: the same)


def paged_decode_keys_per_group(group: Int) -> Int:
    """KPG: keys per row group per tile. GC = 8 takes 1 (4 and, for fp16, 2 spill: 8 x KPG scores
    next to 64 query and 64 output registers exceed 255), with a deeper ring (12 stages) so it
    holds as many keys."""
    return 1 if group == 8 else 4


def paged_decode_stages(group: Int) -> Int:
    """STAGES: tiles in the cp.async ring (STAGES - 1 in flight while one is computed)."""
    return RING_KEYS_PER_GROUP // paged_decode_keys_per_group(group)


def paged_decode_row_lanes(head_dim: Int) -> Int:
    """BDX: lanes that share one row, each with 8 elements (16 bytes of bf16/fp16)."""
    return head_dim // 8


def paged_decode_keys_per_tile(head_dim: Int, group: Int) -> Int:
    """TK: keys of one cp.async stage (NG row groups x KPG keys)."""
    var ng = PAGED_DECODE_THREADS // paged_decode_row_lanes(head_dim)
    return ng * paged_decode_keys_per_group(group)


def paged_decode_smem_bytes(head_dim: Int) -> Int:
    """Dynamic shared memory of one CTA (any GC: STAGES x KPG is fixed): the K/V ring (2-byte
    dtypes) and the id window."""
    var ring_keys = (PAGED_DECODE_THREADS // paged_decode_row_lanes(head_dim)) * RING_KEYS_PER_GROUP
    return 2 * ring_keys * head_dim * 2 + IDS_WINDOW * 4


@always_inline
def paged_decode_kernel[
    dtype: DType, D: Int, GC: Int
](
    out_ptr: Pointer[Scalar[dtype], MutAnyOrigin],
    part_o: Pointer[Float32, MutAnyOrigin],
    part_lse: Pointer[Float32, MutAnyOrigin],
    counters: Pointer[Int32, MutAnyOrigin],
    q: Pointer[Scalar[dtype], MutAnyOrigin],
    k_cache: Pointer[Scalar[dtype], MutAnyOrigin],
    v_cache: Pointer[Scalar[dtype], MutAnyOrigin],
    block_tables: Pointer[Int32, MutAnyOrigin],
    seq_lens: Pointer[Int32, MutAnyOrigin],
    num_q_heads: Int32,
    num_kv_heads: Int32,
    block_size: Int32,
    max_blocks: Int32,
    num_splits: Int32,
    scale_log2: Float32,
):
    grid_order_start()  # grid_order_gpu.mojo: nothing is read before it
    comptime assert size_of[dtype]() == 2, "bf16/fp16 only (fp32: decode_gpu.mojo)"
    comptime assert D == 64 or D == 128 or D == 256, "head_dim 64, 128 or 256"
    comptime assert GC == 1 or GC == 2 or GC == 4 or GC == 8, "GC in 1, 2, 4, 8"
    comptime VEC = 8  # elements per lane and row: one 16-byte vector
    comptime BDX = paged_decode_row_lanes(D)
    comptime NG = PAGED_DECODE_THREADS // BDX  # row groups
    comptime KPG = paged_decode_keys_per_group(GC)
    comptime STAGES = paged_decode_stages(GC)
    comptime TK = paged_decode_keys_per_tile(D, GC)
    comptime CPR = D // VEC  # 16-byte chunks per row (== BDX)
    comptime COPIES = TK * CPR // PAGED_DECODE_THREADS  # cp.async per thread per tile, K or V
    comptime TILE = TK * D  # elements of one K (or V) tile
    comptime LOG2_BDX = 3 if BDX == 8 else (4 if BDX == 16 else 5)
    comptime NEG_INF = -inf[DType.float32]()
    comptime assert COPIES * PAGED_DECODE_THREADS == TK * CPR, "copies must split evenly"
    # The merge area (per group and head: m, l and D outputs, fp32) must fit in the ring.
    comptime assert NG * GC * (D + 2) * 4 <= STAGES * 2 * TILE * 2, "merge area exceeds ring"

    var split = Int(block_idx.x)
    var y = Int(block_idx.y)
    var b = Int(block_idx.z)
    var tid = Int(thread_idx.x)
    var tx = tid % BDX
    var grp = tid // BDX

    var H = Int(num_q_heads)
    var KVH = Int(num_kv_heads)
    var S = Int(block_size)
    var ns = Int(num_splits)
    var G = H // KVH
    var chunks = (G + GC - 1) // GC
    var kvh = y // chunks
    var r0 = (y % chunks) * GC
    var rows = min(GC, G - r0)  # live head slots of this CTA
    var head0 = kvh * G + r0  # first query head of this CTA
    var row0 = b * H + head0  # (sequence, head) row of out / part_o

    # This split's blocks (see the plan above).
    var L = Int(seq_lens[unsafe_offset=b])
    var nb = (L + S - 1) // S
    var per = max((nb + ns - 1) // ns, (MIN_SPLIT_KEYS + S - 1) // S)
    var live = max(1, (nb + per - 1) // per)
    if split >= live:
        return  # surplus split of a short sequence: nothing to read, nothing to merge
    var b_lo = split * per
    var b_hi = min(nb, b_lo + per)  # empty only for L == 0: the one split writes zeros
    var k_hi = min(L, b_hi * S)

    var smem = external_memory[
        Scalar[dtype], address_space=AddressSpace.SHARED, alignment=16
    ]()
    var ids = smem.unsafe_offset(STAGES * 2 * TILE).unsafe_bitcast[Int32]()
    var kg = k_cache.unsafe_address_space_cast[AddressSpace.GLOBAL]()
    var vg = v_cache.unsafe_address_space_cast[AddressSpace.GLOBAL]()

    # Queries in registers: q_reg[h * VEC + e] = q[b, head0 + h, tx * VEC + e] * scale * log2(e).
    var q_reg = SIMD[DType.float32, GC * VEC](0)
    comptime for h in range(GC):
        if h < rows:
            var v = q.unsafe_load[width=VEC, alignment=16]((row0 + h) * D + tx * VEC)
            q_reg = q_reg.insert[offset=h * VEC](v.cast[DType.float32]() * scale_log2)

    var m_i = SIMD[DType.float32, GC](NEG_INF)
    var l_i = SIMD[DType.float32, GC](0)
    var o_acc = SIMD[DType.float32, GC * VEC](0)

    # Chunk copied by this thread: column chunk tid % CPR of rows tid / CPR + NG * i.
    var c_col = (tid % CPR) * VEC
    var c_row = tid // CPR
    # Where this thread's rows sit, kept from tile to tile without a division in the loop: row
    # i of the next tile to issue is key key0 + p * TK + c_row + NG * i, in ids[bidx[i]] at
    # offset boff[i]; each tile moves it TK keys on (TK // S blocks and TK % S keys). Source
    # element of a row: ids[..] * S * KVH * D + boff * KVH * D + kvh * D + c_col.
    var step_blocks = Int32(TK // S)
    var step_keys = Int32(TK % S)
    var blk_stride = S * KVH * D
    var row_stride = Int32(KVH * D)
    var head_off = kvh * D + c_col

    for w_lo in range(b_lo, b_hi, IDS_WINDOW):
        var w_hi = min(b_hi, w_lo + IDS_WINDOW)
        var key0 = w_lo * S  # first key of the window
        var key_end = min(k_hi, w_hi * S)
        barrier()  # every copy of the previous window was issued (its ids are dead)
        for i in range(tid, w_hi - w_lo, PAGED_DECODE_THREADS):
            ids[unsafe_offset=i] = block_tables[unsafe_offset=b * Int(max_blocks) + w_lo + i]
        barrier()
        var ntiles = (key_end - key0 + TK - 1) // TK
        var bidx = SIMD[DType.int32, COPIES](0)  # tile 0's rows (the window's first key)
        var boff = SIMD[DType.int32, COPIES](0)
        comptime for i in range(COPIES):
            bidx[i] = Int32((c_row + NG * i) // S)
            boff[i] = Int32((c_row + NG * i) % S)

        # A commit group per tile (empty past the last) keeps "tile t landed" at
        # wait_group(STAGES - 2) for every t.
        comptime for p in range(STAGES - 1):
            _issue_tile[dtype, D, NG, TK, COPIES, STAGES](
                smem, ids, kg, vg, p, ntiles, key_end - key0, c_row, c_col, bidx, boff,
                step_blocks, step_keys, Int32(S), blk_stride, row_stride, head_off,
            )

        for t in range(ntiles):
            async_copy_wait_group(Int32(STAGES - 2))  # this thread's copies of tile t landed
            barrier()  # ... everyone's; and tile t - 1 is computed, so its stage is free
            _issue_tile[dtype, D, NG, TK, COPIES, STAGES](
                smem, ids, kg, vg, t + STAGES - 1, ntiles, key_end - key0, c_row, c_col, bidx,
                boff, step_blocks, step_keys, Int32(S), blk_stride, row_stride, head_off,
            )

            var ks = smem.unsafe_offset((t % STAGES) * 2 * TILE)
            var vs = ks.unsafe_offset(TILE)
            var kbase = key0 + t * TK + grp * KPG  # this group's first key

            # s[j * GC + h]: score of key kbase + j against head h (this lane's 8 dims, then
            # the group's butterfly).
            var s = SIMD[DType.float32, KPG * GC](0)
            comptime for j in range(KPG):
                var kv = ks.unsafe_load[width=VEC, alignment=16](
                    (grp * KPG + j) * D + tx * VEC
                ).cast[DType.float32]()
                comptime for h in range(GC):
                    s[j * GC + h] = (q_reg.slice[VEC, offset=h * VEC]() * kv).reduce_add()
            comptime for lvl in range(LOG2_BDX):
                comptime for i in range(KPG * GC):
                    s[i] += warp.shuffle_xor(s[i], UInt32(BDX >> (lvl + 1)))
            comptime for j in range(KPG):
                if kbase + j >= key_end:
                    comptime for h in range(GC):
                        s[j * GC + h] = NEG_INF

            # Online softmax per head over the group's KPG keys.
            comptime for h in range(GC):
                var mx = s[h]
                comptime for j in range(1, KPG):
                    mx = max(mx, s[j * GC + h])
                var m_new = max(m_i[h], mx)
                # A group whose keys are all past the end keeps m = -inf: use 0 so every
                # exponent is exp2(-inf) = 0 and nothing becomes NaN.
                var m_use = m_new if m_new != NEG_INF else Float32(0)
                var alpha = exp2(m_i[h] - m_use)
                var psum = Float32(0)
                comptime for j in range(KPG):
                    var p = exp2(s[j * GC + h] - m_use)
                    s[j * GC + h] = p
                    psum += p
                l_i[h] = l_i[h] * alpha + psum
                m_i[h] = m_new
                o_acc = o_acc.insert[offset=h * VEC](o_acc.slice[VEC, offset=h * VEC]() * alpha)

            # o[h] += p[j, h] * V[key j, this lane's dims]
            comptime for j in range(KPG):
                var vv = vs.unsafe_load[width=VEC, alignment=16](
                    (grp * KPG + j) * D + tx * VEC
                ).cast[DType.float32]()
                comptime for h in range(GC):
                    var pj = SIMD[DType.float32, VEC](s[j * GC + h])
                    o_acc = o_acc.insert[offset=h * VEC](
                        vv.fma(pj, o_acc.slice[VEC, offset=h * VEC]())
                    )

    # Merge the NG groups' states through shared memory (the ring is free: every copy was
    # waited for and the barrier below orders the last tile's reads before the writes).
    barrier()
    var mo = smem.unsafe_bitcast[Float32]()  # [NG][GC][D] outputs
    var mm = mo.unsafe_offset(NG * GC * D)  # [NG][GC] maxima
    var ml = mm.unsafe_offset(NG * GC)  # [NG][GC] sums
    comptime for h in range(GC):
        comptime for e in range(0, VEC, 4):
            mo.unsafe_store[alignment=16](
                (grp * GC + h) * D + tx * VEC + e, o_acc.slice[4, offset=h * VEC + e]()
            )
        if tx == 0:
            mm[unsafe_offset=grp * GC + h] = m_i[h]
            ml[unsafe_offset=grp * GC + h] = l_i[h]
    barrier()

    # Thread t finishes 4 consecutive dims of one head: (h, d) = divmod(4 t', D) over t'.
    for idx in range(tid, rows * (D // 4), PAGED_DECODE_THREADS):
        var h = idx // (D // 4)
        var d = (idx % (D // 4)) * 4
        var m_all = NEG_INF
        comptime for g in range(NG):
            m_all = max(m_all, mm[unsafe_offset=g * GC + h])
        var l_all = Float32(0)
        var o_all = SIMD[DType.float32, 4](0)
        if m_all != NEG_INF:
            comptime for g in range(NG):
                var f = exp2(mm[unsafe_offset=g * GC + h] - m_all)
                l_all += ml[unsafe_offset=g * GC + h] * f
                o_all += mo.unsafe_load[width=4, alignment=16]((g * GC + h) * D + d) * f
        var o = o_all / l_all if l_all > 0 else SIMD[DType.float32, 4](0)
        var row = row0 + h
        if live == 1:
            out_ptr.unsafe_store[alignment=8](row * D + d, o.cast[dtype]())
        else:
            part_o.unsafe_store[alignment=16]((row * ns + split) * D + d, o)
            if d == 0:
                var lse = m_all + log2(l_all) if l_all > 0 else NEG_INF
                part_lse[unsafe_offset=row * ns + split] = lse
    if live == 1:
        return

    # Count this split in; the last of the live splits to arrive merges them. The fence makes
    # this thread's part writes visible device-wide before thread 0's count (release); the
    # count's acquire, the barrier and the fence after it order the last CTA's reads after
    # every other split's writes.
    threadfence()
    barrier()
    var counter = b * (KVH * chunks) + y
    if tid == 0:
        var prev = Atomic[Int32, scope="device"].fetch_add[ordering=Ordering.ACQUIRE_RELEASE](
            counters.unsafe_offset(counter), Int32(1)
        )
        var last = Int(prev) == live - 1
        if last:
            counters[unsafe_offset=counter] = 0  # every live split has counted: ready to reuse
        ids[unsafe_offset=0] = Int32(1) if last else Int32(0)
    barrier()
    if ids[unsafe_offset=0] == 0:
        return
    threadfence()
    _merge_splits[dtype, D](out_ptr, part_o, part_lse, row0, rows, ns, live, tid)


@always_inline
def _merge_splits[
    dtype: DType, D: Int
](
    out_ptr: Pointer[Scalar[dtype], MutAnyOrigin],
    part_o: Pointer[Float32, MutAnyOrigin],
    part_lse: Pointer[Float32, MutAnyOrigin],
    row0: Int,
    rows: Int,
    ns: Int,
    live: Int,
    tid: Int,
):
    """out[row] = sum_s 2^lse_s o_s / sum_s 2^lse_s over the live splits s < live of rows
    row0 .. row0 + rows - 1; thread t takes 4 consecutive dims of one row at a time. The parts
    were written by other CTAs: volatile loads read them from L2, never a stale L1 line."""
    comptime NEG_INF = -inf[DType.float32]()
    for idx in range(tid, rows * (D // 4), PAGED_DECODE_THREADS):
        var row = row0 + idx // (D // 4)
        var d = (idx % (D // 4)) * 4
        var m_all = NEG_INF
        for s in range(live):
            m_all = max(m_all, part_lse.unsafe_load[volatile=True](row * ns + s))
        var den = Float32(0)
        var num = SIMD[DType.float32, 4](0)
        if m_all != NEG_INF:
            for s in range(live):
                var lse = part_lse.unsafe_load[volatile=True](row * ns + s)
                if lse != NEG_INF:
                    var f = exp2(lse - m_all)
                    den += f
                    num += (
                        part_o.unsafe_load[width=4, alignment=16, volatile=True](
                            (row * ns + s) * D + d
                        )
                        * f
                    )
        var o = num / den if den > 0 else SIMD[DType.float32, 4](0)
        out_ptr.unsafe_store[alignment=8](row * D + d, o.cast[dtype]())


@always_inline
def _issue_tile[
    dtype: DType, D: Int, NG: Int, TK: Int, COPIES: Int, STAGES: Int
](
    smem: Pointer[Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    ids: Pointer[Int32, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    kg: Pointer[Scalar[dtype], MutAnyOrigin, address_space=AddressSpace.GLOBAL],
    vg: Pointer[Scalar[dtype], MutAnyOrigin, address_space=AddressSpace.GLOBAL],
    p: Int,
    ntiles: Int,
    num_keys: Int,
    c_row: Int,
    c_col: Int,
    mut bidx: SIMD[DType.int32, COPIES],
    mut boff: SIMD[DType.int32, COPIES],
    step_blocks: Int32,
    step_keys: Int32,
    S: Int32,
    blk_stride: Int,
    row_stride: Int32,
    head_off: Int,
):
    """cp.async tile p of the window (its keys p * TK .. of num_keys) into ring stage
    p % STAGES, then commit a group (an empty one when p is past the window's last tile).
    bidx/boff hold tile p's rows on entry and tile p + 1's on return (see the kernel)."""
    comptime TILE = TK * D
    if p < ntiles:
        var ks = smem.unsafe_offset((p % STAGES) * 2 * TILE)
        var vs = ks.unsafe_offset(TILE)
        comptime for i in range(COPIES):
            var r = c_row + NG * i
            var valid = p * TK + r < num_keys
            # ids[0] for rows past the end: any mapped block; the copy reads 0 bytes of it.
            var blk = Int(ids[unsafe_offset=Int(bidx[i]) if valid else 0])
            var src = blk * blk_stride + Int(boff[i] * row_stride) + head_off
            var n = Int32(16) if valid else Int32(0)
            async_copy[16, fill=Scalar[dtype](0)](
                kg.unsafe_offset(src), ks.unsafe_offset(r * D + c_col), src_size=n
            )
            async_copy[16, fill=Scalar[dtype](0)](
                vg.unsafe_offset(src), vs.unsafe_offset(r * D + c_col), src_size=n
            )
    comptime for i in range(COPIES):
        var off = boff[i] + step_keys
        var blk = bidx[i] + step_blocks
        if off >= S:
            off -= S
            blk += 1
        boff[i] = off
        bidx[i] = blk
    async_copy_commit_group()
