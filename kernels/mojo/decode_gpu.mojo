# Paged GQA decode attention for NVIDIA GPUs (sm_90), compiled ahead of time to PTX.
#
# Semantics (same as decode_cpu.mojo and mili.engine.attention.TorchAttention.decode):
#   q, out       [B, H, D]          one query per sequence
#   k/v_cache    [N, S, KVH, D]     paged cache
#   block_tables [B, max_blocks] int32, seq_lens [B] int32
# Sequence b's query attends to positions 0 .. seq_lens[b] - 1; q head h reads kv head
# h // (H // KVH).
#
# decode_kernel: grid (num_splits, KVH * ceil(G / GM), B), block 128 threads, where
# G = H / KVH. A CTA handles up to GM = 8 query heads of one kv-head group (all of them for the
# usual ratios), so each K/V row is read from memory once for the whole group. With
# num_splits > 1 the sequence is cut into num_splits chunks (flash-decoding): each CTA writes
# its chunk's normalised output and log2-sum-exp to fp32 scratch and decode_combine_kernel
# merges them; with num_splits == 1 the CTA writes the final output directly.
#
# Inside a CTA the 4 warps take interleaved 32-key tiles of the chunk and keep separate online
# softmax states, merged through shared memory at the end. In a tile lane j owns key j for the
# scores (K row read straight from global memory with 16-byte loads; the scaled queries are
# broadcast from shared memory) and output dims [lane * DPL, lane * DPL + DPL) for P @ V (the
# warp reads each V row with one coalesced load).

from std.math import exp2, log2, inf
from std.memory import stack_allocation
from std.sys import size_of
from max.gpu import thread_idx, block_idx, barrier, lane_id, syncwarp
from max.gpu.memory import AddressSpace
from max.gpu.primitives import warp
from grid_order_gpu import grid_order_start

comptime DECODE_THREADS = 128
comptime NUM_WARPS = 4
comptime GM = 8  # query heads per CTA (grid.y = KVH * ceil(G / GM))


def decode_kernel[
    dtype: DType, D: Int
](
    out_ptr: Pointer[Scalar[dtype], MutAnyOrigin],
    part_o: Pointer[Float32, MutAnyOrigin],
    part_lse: Pointer[Float32, MutAnyOrigin],
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
    comptime assert D % 64 == 0, "head_dim must be a multiple of 64"
    comptime VEC = 16 // size_of[dtype]()  # elements per 16-byte global load
    comptime CPR = D // VEC  # 16-byte chunks per row
    comptime DPL = D // 32  # output dims per lane (contiguous)
    comptime NEG_INF = -inf[DType.float32]()

    var split = Int(block_idx.x)
    var y = Int(block_idx.y)
    var b = Int(block_idx.z)
    var tid = Int(thread_idx.x)
    var w = tid // 32
    var lane = Int(lane_id())

    var H = Int(num_q_heads)
    var KVH = Int(num_kv_heads)
    var S = Int(block_size)
    var ns = Int(num_splits)
    var G = H // KVH
    var chunks = (G + GM - 1) // GM
    var kvh = y // chunks
    var r0 = (y % chunks) * GM
    var rows = min(GM, G - r0)
    var head0 = kvh * G + r0  # first query head of this CTA
    var bt_row = b * Int(max_blocks)

    var L = Int(seq_lens[unsafe_offset=b])
    var per = (L + ns - 1) // ns
    per = ((per + 31) // 32) * 32
    var k_lo = split * per
    var k_hi = min(L, k_lo + per)  # keys [k_lo, k_hi); may be empty for trailing splits

    var Qs = stack_allocation[GM * D, Float32, address_space=AddressSpace.SHARED, alignment=16]()
    # Per warp: probabilities [32 keys][GM rows] and the cache offset of each key's row.
    var Ps = stack_allocation[
        NUM_WARPS * 32 * GM, Float32, address_space=AddressSpace.SHARED, alignment=16
    ]()
    var Rb = stack_allocation[NUM_WARPS * 32, Int64, address_space=AddressSpace.SHARED, alignment=16]()
    # Cross-warp merge: per warp and row the max, the sum and the unnormalised output.
    var Ms = stack_allocation[NUM_WARPS * GM, Float32, address_space=AddressSpace.SHARED, alignment=16]()
    var Ls = stack_allocation[NUM_WARPS * GM, Float32, address_space=AddressSpace.SHARED, alignment=16]()
    var Os = stack_allocation[
        NUM_WARPS * GM * D, Float32, address_space=AddressSpace.SHARED, alignment=16
    ]()

    for idx in range(tid, GM * CPR, DECODE_THREADS):
        var r = idx // CPR
        var c = idx % CPR
        var v = SIMD[DType.float32, VEC](0)
        if r < rows:
            var off = (b * H + head0 + r) * D + c * VEC
            v = q.unsafe_load[width=VEC, alignment=16](off).cast[DType.float32]() * scale_log2
        comptime for e in range(0, VEC, 4):
            Qs.unsafe_store[alignment=16](r * D + c * VEC + e, v.slice[4, offset=e]())
    barrier()

    var m_i = SIMD[DType.float32, GM](NEG_INF)
    var l_i = SIMD[DType.float32, GM](0)
    var acc = SIMD[DType.float32, GM * DPL](0)
    var pw = Ps + w * 32 * GM
    var rw = Rb + w * 32

    for t0 in range(k_lo + w * 32, k_hi, NUM_WARPS * 32):  # warp-uniform trip count
        var kp = t0 + lane
        var valid = kp < k_hi
        var kc = min(kp, k_hi - 1)  # lanes past the chunk read a valid row, then mask it
        var blk = Int(block_tables[unsafe_offset=bt_row + kc // S])
        var base = ((blk * S + kc % S) * KVH + kvh) * D

        # Scores of key kp against every query row of the CTA.
        var s4 = SIMD[DType.float32, GM * 4](0)
        comptime for c in range(CPR):
            var kv = k_cache.unsafe_load[width=VEC, alignment=16](base + c * VEC).cast[
                DType.float32
            ]()
            comptime for r in range(GM):
                if r < rows:
                    comptime for e in range(0, VEC, 4):
                        var qv = Qs.unsafe_load[width=4, alignment=16](r * D + c * VEC + e)
                        s4 = s4.insert[offset=r * 4](
                            qv.fma(kv.slice[4, offset=e](), s4.slice[4, offset=r * 4]())
                        )

        syncwarp()  # the previous tile's reads of pw / rw are done
        rw[unsafe_offset=lane] = Int64(base)
        var p_row = SIMD[DType.float32, GM](0)
        comptime for r in range(GM):
            if r < rows:
                var s = s4.slice[4, offset=r * 4]().reduce_add()
                if not valid:
                    s = NEG_INF
                # Lane 0's key (t0 < k_hi) is valid, so m_new is finite.
                var m_new = max(m_i[r], warp.max(s))
                var m_use = m_new if m_new != NEG_INF else Float32(0)
                var p = exp2(s - m_use) if valid else Float32(0)
                var alpha = exp2(m_i[r] - m_use)
                l_i[r] = l_i[r] * alpha + warp.sum(p)
                m_i[r] = m_new
                p_row[r] = p
                comptime for e in range(DPL):
                    acc[r * DPL + e] = acc[r * DPL + e] * alpha
        comptime for r in range(0, GM, 4):
            pw.unsafe_store[alignment=16](lane * GM + r, p_row.slice[4, offset=r]())
        syncwarp()  # pw / rw written by every lane

        # acc[r, lane dims] += sum_j p[j, r] * V[key j, lane dims]
        var n_keys = min(32, k_hi - t0)
        for j in range(n_keys):
            var vb = Int(rw[unsafe_offset=j])
            var vv = v_cache.unsafe_load[width=DPL, alignment = DPL * size_of[dtype]()](
                vb + lane * DPL
            ).cast[DType.float32]()
            comptime for r in range(GM):
                if r < rows:
                    var p = pw[unsafe_offset=j * GM + r]
                    comptime for e in range(DPL):
                        acc[r * DPL + e] = p.fma(vv[e], acc[r * DPL + e])

    # Merge the 4 warps' states.
    comptime for r in range(GM):
        if lane == 0:
            Ms[unsafe_offset=w * GM + r] = m_i[r]
            Ls[unsafe_offset=w * GM + r] = l_i[r]
        comptime for e in range(DPL):
            Os[unsafe_offset=(w * GM + r) * D + lane * DPL + e] = acc[r * DPL + e]
    barrier()

    for idx in range(tid, rows * D, DECODE_THREADS):
        var r = idx // D
        var d = idx % D
        var m_all = NEG_INF
        comptime for ww in range(NUM_WARPS):
            m_all = max(m_all, Ms[unsafe_offset=ww * GM + r])
        var l_all = Float32(0)
        var o_all = Float32(0)
        if m_all != NEG_INF:
            comptime for ww in range(NUM_WARPS):
                var f = exp2(Ms[unsafe_offset=ww * GM + r] - m_all)
                l_all += Ls[unsafe_offset=ww * GM + r] * f
                o_all += Os[unsafe_offset=(ww * GM + r) * D + d] * f
        var o = o_all / l_all if l_all > 0 else Float32(0)
        var row = b * H + head0 + r  # (sequence, query head)
        if ns == 1:
            out_ptr[unsafe_offset=row * D + d] = o.cast[dtype]()
        else:
            part_o[unsafe_offset=(row * ns + split) * D + d] = o
            if d == 0:
                var lse = m_all + log2(l_all) if l_all > 0 else NEG_INF
                part_lse[unsafe_offset=row * ns + split] = lse


def decode_combine_kernel[
    dtype: DType, D: Int
](
    out_ptr: Pointer[Scalar[dtype], MutAnyOrigin],
    part_o: Pointer[Float32, MutAnyOrigin],
    part_lse: Pointer[Float32, MutAnyOrigin],
    num_splits: Int32,
):
    """Grid (B * H), block D threads: out[row, d] = sum_s w_s o_s[d] / sum_s w_s, w_s = 2^lse_s."""
    grid_order_start()  # grid_order_gpu.mojo: nothing is read before it
    comptime NEG_INF = -inf[DType.float32]()
    var row = Int(block_idx.x)
    var d = Int(thread_idx.x)
    var ns = Int(num_splits)
    var m_all = NEG_INF
    for s in range(ns):
        m_all = max(m_all, part_lse[unsafe_offset=row * ns + s])
    var num = Float32(0)
    var den = Float32(0)
    if m_all != NEG_INF:
        for s in range(ns):
            var lse = part_lse[unsafe_offset=row * ns + s]
            if lse != NEG_INF:
                var f = exp2(lse - m_all)
                den += f
                num += part_o[unsafe_offset=(row * ns + s) * D + d] * f
    var o = num / den if den > 0 else Float32(0)
    out_ptr[unsafe_offset=row * D + d] = o.cast[dtype]()
