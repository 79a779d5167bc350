"""The tensor-core kernels' index math, replayed in Python/numpy on a machine without a GPU.

kernels/mojo/flash_prefill_gpu.mojo and paged_decode_gpu.mojo have only been compiled here, never
run. These tests model, line for line, what their CTAs, warps and lanes compute from
kernels/geometry.py's launch plan: which output rows each CTA writes, which keys it reads, which
tiles a warp skips or masks, how the ldmatrix/mma fragments assemble Q K^T and P V, and how decode
cuts a sequence into splits and a tile into cp.async copies. A wrong grid, split plan or fragment
formula fails here; the GPU parity grid (test_parity.py, -m gpu) checks the kernels themselves.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from kernels import geometry
from kernels.geometry import FLASH_PREFILL_BLOCK_M, PAGED_DECODE_MIN_SPLIT_KEYS, THREADS

BM = FLASH_PREFILL_BLOCK_M
PAD = 8


def _block_n(head_dim: int) -> int:
    return 32 if head_dim == 256 else 64  # flash_prefill_block_n


# ---- flash_prefill: CTAs, rows, keys ---------------------------------------------------------


def _prefill_cta(x, y, b, grid, cu, starts, num_q_heads, num_kv_heads, block_n):
    """What CTA (x, y, b) of flash_prefill writes and reads, as the kernel computes it:
    ([(token, head)] written, kv_end, [(warp, tile index, 'skip' | 'mask' | 'plain')])."""
    tile = grid[0] - 1 - x
    group = num_q_heads // num_kv_heads
    gh = min(group, BM)
    tm = BM // gh
    chunks = (group + gh - 1) // gh
    kvh, hc0 = y // chunks, (y % chunks) * gh
    seq_lo, n = cu[b], cu[b + 1] - cu[b]
    m0 = tile * tm
    if m0 >= n:
        return [], 0, []
    start = starts[b]
    rows_tok = min(tm, n - m0)
    kv_end = start + m0 + rows_tok
    written = []
    for r in range(BM):
        t, hg = r // gh, hc0 + r % gh
        if t < rows_tok and hg < group:
            written.append((seq_lo + m0 + t, kvh * group + hg))
    decisions = []
    for w in range(4):
        warp_lo = min(start + m0 + (16 * w) // gh, kv_end - 1)
        warp_hi = min(start + m0 + (16 * w + 15) // gh, kv_end - 1)
        for j in range(math.ceil(kv_end / block_n)):
            k0 = j * block_n
            if k0 > warp_hi:
                decisions.append((w, j, "skip"))
            elif k0 + block_n - 1 > warp_lo:
                decisions.append((w, j, "mask"))
            else:
                decisions.append((w, j, "plain"))
    return written, kv_end, decisions


PREFILL_BATCHES = [
    ([1, 7, 16, 17, 100, 513, 0, 7], [0, 3, 16, 5, 0, 0, 9, 513]),
    ([64, 65, 1], [0, 0, 1000]),
]


@pytest.mark.parametrize("heads", [(8, 8), (16, 8), (6, 2), (32, 8), (40, 8), (16, 1), (128, 1)])
@pytest.mark.parametrize("batch", PREFILL_BATCHES, ids=str)
@pytest.mark.parametrize("head_dim", [128, 256])
def test_prefill_ctas_write_every_row_once_and_mask_only_diagonal_tiles(
    heads: tuple[int, int], batch, head_dim: int
) -> None:
    lens, starts = batch
    num_q_heads, num_kv_heads = heads
    block_n = _block_n(head_dim)
    cu = [0, *np.cumsum(lens).tolist()]
    tiling = geometry.prefill_tiling(sum(lens), num_q_heads, num_kv_heads, len(lens))
    assert tiling.grid[1] == num_kv_heads * tiling.head_chunks
    counts = np.zeros((sum(lens), num_q_heads), dtype=np.int64)
    for b in range(len(lens)):
        for y in range(tiling.grid[1]):
            for x in range(tiling.grid[0]):
                written, kv_end, decisions = _prefill_cta(
                    x, y, b, tiling.grid, cu, starts, num_q_heads, num_kv_heads, block_n
                )
                for token, head in written:
                    assert cu[b] <= token < cu[b + 1]
                    counts[token, head] += 1
                    # the keys it needs, 0 .. its position, are all among those the CTA reads
                    assert starts[b] + (token - cu[b]) < kv_end
                    assert head // (num_q_heads // num_kv_heads) == y // tiling.head_chunks
                _check_warp_decisions(
                    decisions, x, y, b, tiling, cu, starts, num_q_heads, num_kv_heads, block_n
                )
    assert (counts == 1).all(), "every (token, head) output row is written exactly once"


def _check_warp_decisions(decisions, x, y, b, tiling, cu, starts, hq, hkv, block_n):
    """A skipped tile holds no key any of the warp's rows may see; an unmasked tile only keys all
    of them see (rows past the sequence are clamped to the last live one, as in the kernel)."""
    gh, tm = tiling.heads_per_cta, tiling.tokens_per_cta
    tile = tiling.grid[0] - 1 - x
    m0, n = tile * tm, cu[b + 1] - cu[b]
    rows_tok = min(tm, n - m0)
    kv_end = starts[b] + m0 + rows_tok
    for w, j, what in decisions:
        limits = [min(starts[b] + m0 + r // gh, kv_end - 1) for r in range(16 * w, 16 * w + 16)]
        keys = range(j * block_n, (j + 1) * block_n)
        if what == "skip":
            assert all(k > lim for k in keys for lim in limits)
        elif what == "plain":
            assert all(k <= lim for k in keys for lim in limits)


# ---- flash_prefill: fragments ----------------------------------------------------------------
# PTX ISA semantics of ldmatrix.x4 (.trans) and mma.m16n8k16 (A row-major, B column-major).


def _ldmatrix_x4(smem: np.ndarray, addr, transpose: bool = False) -> np.ndarray:
    """[32 lanes, 8 values]: lane l's 4 registers (2 halves each). Matrix i's row r starts at the
    address lane 8 i + r gives (addr(lane) -> (row, col) of smem)."""
    out = np.zeros((32, 8), dtype=smem.dtype)
    mats = []
    for i in range(4):
        rows = []
        for r in range(8):
            row, col = addr(8 * i + r)
            rows.append(smem[row, col : col + 8])
        mats.append(np.stack(rows))  # [8 rows][8 cols]
    for lane in range(32):
        g, c = lane // 4, lane % 4
        for i in range(4):
            m = mats[i].T if transpose else mats[i]
            out[lane, 2 * i : 2 * i + 2] = m[g, 2 * c : 2 * c + 2]
    return out


def _mma(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """c [32, 4] += A (16x16 from a [32, 8]) @ B (16x8 from b [32, 4]), per the fragment layout."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(32):
        g, q = lane // 4, lane % 4
        for e in range(2):
            A[g, 2 * q + e] = a[lane, e]
            A[g + 8, 2 * q + e] = a[lane, 2 + e]
            A[g, 2 * q + 8 + e] = a[lane, 4 + e]
            A[g + 8, 2 * q + 8 + e] = a[lane, 6 + e]
            B[2 * q + e, g] = b[lane, e]
            B[2 * q + 8 + e, g] = b[lane, 2 + e]
    C = A @ B
    out = c.copy()
    for lane in range(32):
        g, q = lane // 4, lane % 4
        for e in range(2):
            out[lane, e] += C[g, 2 * q + e]
            out[lane, 2 + e] += C[g + 8, 2 * q + e]
    return out


def _c_to_matrix(frags: list[np.ndarray]) -> np.ndarray:
    """C fragments of consecutive n tiles -> the [16, 8 * len] matrix."""
    m = np.zeros((16, 8 * len(frags)))
    for nt, c in enumerate(frags):
        for lane in range(32):
            g, q = lane // 4, lane % 4
            for e in range(2):
                m[g, 8 * nt + 2 * q + e] = c[lane, e]
                m[g + 8, 8 * nt + 2 * q + e] = c[lane, 2 + e]
    return m


@pytest.mark.parametrize("head_dim", [64, 128])
def test_fragment_formulas_compute_q_kt_and_p_v(head_dim: int) -> None:
    """The kernel's ldmatrix lane addresses and register slices (header of flash_prefill_gpu.mojo)
    give S = Q K^T for a warp's 16 rows and O = P V with P taken straight from S's registers."""
    rng = np.random.default_rng(head_dim)
    bn, ld, w = 64, head_dim + PAD, 2  # warp 2: rows 32 .. 47
    qs = rng.standard_normal((BM, ld))
    ks = rng.standard_normal((bn, ld))
    vs = rng.standard_normal((bn, ld))
    nt_count = bn // 8

    s = [np.zeros((32, 4)) for _ in range(nt_count)]
    for kk in range(head_dim // 16):
        qa = _ldmatrix_x4(qs, lambda x: (16 * w + x % 16, 16 * kk + 8 * (x // 16)))  # noqa: B023
        for np_ in range(nt_count // 2):
            kb = _ldmatrix_x4(
                ks,
                lambda x: (16 * np_ + x % 8 + 8 * (x // 16), 16 * kk + 8 * ((x // 8) % 2)),  # noqa: B023
            )
            for half in range(2):
                s[2 * np_ + half] = _mma(s[2 * np_ + half], qa, kb[:, 4 * half : 4 * half + 4])
    q_rows = qs[16 * w : 16 * w + 16, :head_dim]
    np.testing.assert_allclose(_c_to_matrix(s), q_rows @ ks[:, :head_dim].T, rtol=1e-10)

    o = [np.zeros((32, 4)) for _ in range(head_dim // 8)]
    for kk in range(bn // 16):
        pa = np.concatenate([s[2 * kk], s[2 * kk + 1]], axis=1)  # s.slice[8, (2 kk) * 4]
        for dp in range(head_dim // 16):
            vb = _ldmatrix_x4(
                vs,
                lambda x: (16 * kk + x % 8 + 8 * ((x // 8) % 2), 16 * dp + 8 * (x // 16)),  # noqa: B023
                transpose=True,
            )
            for half in range(2):
                o[2 * dp + half] = _mma(o[2 * dp + half], pa, vb[:, 4 * half : 4 * half + 4])
    p = _c_to_matrix(s)
    np.testing.assert_allclose(_c_to_matrix(o), p @ vs[:, :head_dim], rtol=1e-10)


def test_fragment_model_catches_a_wrong_address() -> None:
    """The model is strict: the K address without the (l / 8) % 2 column term is wrong."""
    rng = np.random.default_rng(0)
    qs, ks = rng.standard_normal((16, 24)), rng.standard_normal((16, 24))
    qa = _ldmatrix_x4(qs, lambda x: (x % 16, 8 * (x // 16)))
    kb = _ldmatrix_x4(ks, lambda x: (x % 8 + 8 * (x // 16), 0))
    s = _mma(np.zeros((32, 4)), qa, kb[:, :4])
    assert not np.allclose(_c_to_matrix([s]), qs[:, :16] @ ks[:8, :16].T)


# ---- paged_decode ----------------------------------------------------------------------------


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 7, 8, 16, 64])
def test_decode_ctas_cover_every_query_head_once(group: int) -> None:
    num_kv_heads = 3
    gc = geometry.decode_group_size(group)
    assert gc >= min(group, 8) and gc in (1, 2, 4, 8)
    chunks = math.ceil(group / gc)
    seen = []
    for y in range(num_kv_heads * chunks):
        kvh, r0 = y // chunks, (y % chunks) * gc
        rows = min(gc, group - r0)
        assert rows > 0
        seen += [kvh * group + r0 + h for h in range(rows)]
    assert sorted(seen) == list(range(num_kv_heads * group))


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("seq_len", [1, 15, 16, 17, 64, 100, 513, 4096, 8192 + 5])
def test_decode_splits_cut_a_sequence_into_disjoint_block_ranges(
    seq_len: int, num_splits: int, block_size: int
) -> None:
    ranges = [
        geometry.decode_split_blocks(seq_len, block_size, num_splits, s) for s in range(num_splits)
    ]
    covered = [blk for r in ranges for blk in r]
    assert covered == list(range(math.ceil(seq_len / block_size)))  # in order, each once
    assert len(ranges[0]) > 0  # split 0 always has work: with one split it writes `out`
    live = [r for r in ranges if len(r)]
    for r in live[:-1]:  # a split reads at least MIN_SPLIT_KEYS keys, the last one excepted
        assert len(r) * block_size >= PAGED_DECODE_MIN_SPLIT_KEYS
    # The kernel's live count (its last live split merges): exactly the splits with work, first.
    assert ranges[: geometry.decode_live_splits(seq_len, block_size, num_splits)] == live


@pytest.mark.parametrize("num_splits", [1, 2, 64])
def test_a_sequence_of_no_keys_has_one_split_that_writes_zeros(num_splits: int) -> None:
    assert geometry.decode_live_splits(0, 16, num_splits) == 1
    assert len(geometry.decode_split_blocks(0, 16, num_splits, 0)) == 0


def test_decode_plan_depends_on_shapes_only() -> None:
    """Same shapes, same plan (CUDA graphs replay it); more CTAs than two per SM: no split."""
    plan = geometry.decode_splits(1, 8, 32, 4096, num_sms=132)
    assert plan == geometry.decode_splits(1, 8, 32, 4096, num_sms=132) > 1
    assert geometry.decode_splits(64, 8, 32, 4096, num_sms=132) == 1
    assert geometry.decode_splits(1, 8, 32, 256, num_sms=132) == 256 // PAGED_DECODE_MIN_SPLIT_KEYS
    assert geometry.decode_splits(1, 1, 1, 10**6, num_sms=132) == geometry.MAX_DECODE_SPLITS


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_tile_copies_cover_the_tile_once(head_dim: int, group: int) -> None:
    """Thread t copies 16-byte chunk t % CPR of rows t / CPR + NG i (i < COPIES) of a TK-key
    tile; the row groups' key slices [grp KPG, grp KPG + KPG) partition the same tile."""
    row_lanes = head_dim // 8  # BDX == CPR
    ng = THREADS // row_lanes
    kpg = 1 if group == 8 else 4
    tk = ng * kpg
    copies = tk * row_lanes // THREADS
    hits = np.zeros((tk, row_lanes), dtype=np.int64)
    for t in range(THREADS):
        for i in range(copies):
            hits[t // row_lanes + ng * i, t % row_lanes] += 1
    assert (hits == 1).all()
    keys = sorted(k for grp in range(ng) for k in range(grp * kpg, grp * kpg + kpg))
    assert keys == list(range(tk))
    # the score butterfly (shuffle xor BDX/2 .. 1) stays inside a row group's lanes
    for lane in range(32):
        for lvl in range(int(math.log2(row_lanes))):
            other = lane ^ (row_lanes >> (lvl + 1))
            assert other // row_lanes == lane // row_lanes


@pytest.mark.parametrize("block_size", [1, 5, 7, 16, 31, 32, 33, 64, 100])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_tile_rows_are_followed_without_a_division(group: int, block_size: int) -> None:
    """paged_decode's copies find each row's block without dividing in the tile loop: a
    thread's row i of tile p (key p TK + r, r = c_row + NG i) is in ids[bidx[i]] at offset
    boff[i], set by one divmod per window and moved TK keys on per tile (TK // S blocks, TK % S
    keys, one carry). Replayed here over 300 tiles against divmod, for every thread's rows."""
    head_dim = 128
    row_lanes = head_dim // 8
    ng = THREADS // row_lanes
    tk = ng * (1 if group == 8 else 4)
    copies = tk * row_lanes // THREADS
    step_blocks, step_keys = divmod(tk, block_size)
    for c_row in range(ng):
        rows = [c_row + ng * i for i in range(copies)]
        state = [divmod(r, block_size) for r in rows]  # (bidx, boff) of tile 0
        for p in range(300):
            assert state == [divmod(p * tk + r, block_size) for r in rows], (c_row, p)
            moved = []
            for bidx, boff in state:
                bidx, boff = bidx + step_blocks, boff + step_keys
                if boff >= block_size:
                    bidx, boff = bidx + 1, boff - block_size
                moved.append((bidx, boff))
            state = moved
