// Outer-first contraction on tensor cores with 16-bit operands (bfloat16 or float16, float32
// accumulation): the form PyTorch's matmuls take in those types, and PyTorch's "medium" float32
// matmul precision.
//
// The tile and phases of opm_outer_tc_kernel, with a block covering kT16JSub column tiles:
//   phase 1, per column tile: O[(i,h1), (j,h2)] = sum_s a[s,i,h1] b[s,j,h2]   (M = Ti·H, N = Tj·H, K = S)
//   phase 2: out[(i,j), d] = sum_{h1,h2} O[(i,j),(h1,h2)] W[d, h1·H + h2]      (K = H², per 128 d)
// O is rounded to the 16-bit type as it goes to shared memory (as a 16-bit einsum rounds its
// output), so phase 2 runs on 16-bit operands too.  a and b are stored (s, h)-major, i.e.
// MN-major for phase 1's A and B.  kWgmma (sm_90a): phase 1 on warpgroup MMAs reading the
// swizzled stages directly; otherwise mma.sync m16n8k16 fed by transposing ldmatrix.
// kWgmmaBoth (with kWgmma, where the block's pairs fill whole rounds of kT16RoundRows): phase 2 on
// warpgroup MMAs too, as outᵀ = W·Oᵀ with both operands K-major, O written by phase 1 straight
// into that layout, its k in 8 x 8 blocks of (h1, h2) (o_k_order, for stores without bank
// conflicts), and W read in the same order from OuterArgs::w_blocked; otherwise phase 2 is
// mma.sync m16n8k16 with the K halves split over warps.
//
// Requires H % 8 == 0 and 16-byte aligned a, b and W (and w_blocked).
#pragma once

#include "opm_kernels.cuh"
#include "opm_mma.cuh"

namespace flashopm {

// The tensor-copy forms' groups of tiles: group lin of a launch takes column block col_tile
// (kT16JSub column tiles), row group row_group (the cluster's row tiles) of batch element b, in
// grouped order within each batch element.
__device__ __forceinline__ void tc16_group_tile(int lin, int n_col_blocks, int n_row_groups, int& col_tile,
                                                int& row_group, int& b) {
  const int per_b = n_col_blocks * n_row_groups;
  b = lin / per_b;
  const int rem = lin - b * per_b;
  grouped_tile_of(rem % n_col_blocks, rem / n_col_blocks, n_col_blocks, n_row_groups, col_tile, row_group);
}
// The same for the cluster kernel, by the launch's divisors (OuterArgs::tc16_groups_per_b,
// tc16_group_span): the three divisions above lay ~120 dependent instructions between a tile's
// last mark and the next tile's first (~0.9K cycles of run 359's gap); a whole group of
// kTileGroupRows row groups takes a mask and a shift, the last, shorter group of a batch element
// a division.
__device__ __forceinline__ void tc16_group_tile(const OuterArgs& p, int lin, int n_col_blocks, int n_row_groups,
                                                int& col_tile, int& row_group, int& b) {
  b = int(fast_div(uint32_t(lin), p.tc16_groups_per_b));
  const int rem = lin - b * int(p.tc16_groups_per_b.d);
  const int first = int(fast_div(uint32_t(rem), p.tc16_group_span)) * kTileGroupRows;
  const int within = rem - first * n_col_blocks;
  if (n_row_groups - first >= kTileGroupRows) {
    static_assert(kTileGroupRows == 16, "a whole group's row by a mask and a shift");
    row_group = first + (within & 15);
    col_tile = within >> 4;
  } else {
    const int rows = n_row_groups - first;
    col_tile = within / rows;
    row_group = first + within - col_tile * rows;
  }
}

// The tensor-copy forms' producer, lane 0 of the third warpgroup (see outer_tc16_body): for each group
// of tiles the cluster takes, phase 1's stages of every column tile, then W's chunks of every group
// of d and round, each into its buffer once every block of the cluster has released that buffer's
// last use.  A stage buffer's first stage of a later tile also waits for the tile before to be
// done with what lies over it (its O and W chunks read by every block's products, its sums by
// every block's stores), so that the next tile's first stages load beside the last one's phase 2.
// bars as the body lays them.  This one lane's issue paces phase 1 (the consumers wait for its
// copies, not for their MMAs: run 352), so a stage costs no division and no cluster-id read.
template <int kCluster, bool kWide>
__device__ __forceinline__ void tc16_produce(const OuterArgs& p, const Tc16Maps& maps, char* smem,
                                             const Tc16Layout& L, uint64_t* bars, unsigned rank, int n_col_blocks,
                                             int n_row_groups, int n_groups, int P) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kBGroupsShare = kTcNT / 64 / kCluster, kWRowsShare = kTcDG / kCluster;
  constexpr uint16_t kMask = uint16_t((1u << kCluster) - 1);
  using Sh = Tc16Shape<kWide>;
  constexpr int kStages = Sh::kStages, kW2Stages = Sh::kW2Stages, kStageBytes = Sh::kStageBytes;
  uint64_t* full = bars;
  uint64_t* empty = bars + kStages;
  uint64_t* w_full = bars + 2 * kStages;
  uint64_t* w_empty = w_full + kW2Stages;
  uint64_t* stored = w_empty + kW2Stages;
  // (kWide: after "stored" and the sums' mbarrier, W's local empties, released by this block's
  // phase-2 warpgroups alone; clusters of two with OuterArgs::tc16_w_local, whose chunks this
  // block copies whole into its own shared memory)
  [[maybe_unused]] uint64_t* w_local_empty = stored + 2;
  [[maybe_unused]] const bool w_local = kWide && kCluster == 2 && p.tc16_w_local != 0;
  const int H = p.H;
  const int n_k = (p.S + kT16WgBK - 1) / kT16WgBK, n_q = kT16JSub * n_k, n_kc = H * H / 64;
  auto uses = [&](int sb) { return tc16_stage_uses(n_q, sb, kStages); };
  // whether stage buffer sb lies over any of the bytes [lo, hi)
  auto stage_over = [&](int sb, int lo, int hi) {
    if constexpr (kWide) return tc16_wide_stage_over(sb, L.w, lo, hi);
    const int s_lo = L.stages + sb * kStageBytes;
    return s_lo < hi && s_lo + kStageBytes > lo;
  };
  // what phase 2 reads: the last column tile's O (from L.stages; kWide: O whole, from 0) and W's
  // buffers
  const int phase2_lo = kWide ? 0 : L.stages, phase2_hi = L.w + Sh::kWBuffers * kT16Wg2ChunkBytes;
  const uint32_t stages_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem + L.stages));
  const uint32_t smem_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  // a tile's last round's sums over its O (see outer_tc16_body), stored beside the next tile's
  // MMAs; kWide: its one round's sums in column tile 0's halves of the slices (tc16_wide_red_row),
  // clear of every stage buffer but under W's first slots, and every round arrives on "stored"
  // (stored by the consumers at once, or by the producer warpgroup's other warps beside the next
  // tile's phase 1)
  const bool defer = !kWide && p.tc16_defer != 0;
  const int red_lo = L.w;  // phase 2's other sums from L.w
  const int red_hi = red_lo + Sh::kRound * (kTcDG + 4) * 4;
  // bit sb: the parity of stage buffer sb's fills a tile (uses), so that the k-th fill's wait for
  // the (k-1)-th release takes its parity without a product a stage
  uint32_t uses_odd = 0;
  for (int sb = 0; sb < kStages; ++sb) uses_odd |= uint32_t(uses(sb) & 1) << sb;
  int wq = 0;            // W chunks issued so far, over every tile
  int stored_rounds = 0;  // rounds that arrive on "stored" once stored, so far
  bool last_stored = false;  // whether the round issued last arrives there
  for (int lin = blockIdx.x / kCluster, it = 0; lin < n_groups; lin += gridDim.x / kCluster, ++it) {
    int col_tile, row_group, b;
    tc16_group_tile(p, lin, n_col_blocks, n_row_groups, col_tile, row_group, b);
    const int i0 = (kCluster * row_group + int(rank)) * p.Ti, j0 = col_tile * p.Tj * kT16JSub;
    // stage q = js·n_k + kt: column tile js, s from kt·kT16WgBK (counted, not divided: this one
    // lane's issue is phase 1's critical path)
    const int a_row0 = i0 * H;
    int b_col0 = j0 * H + int(rank) * kBGroupsShare * 64;  // this block's share of the column tile's b
    for (int q = 0, kt = 0; q < n_q; ++q) {
      // this fill is the buffer's use it·uses(buf) + q / kStages (from 0); it waits for the one
      // before's release (every buffer below n_q is filled each tile)
      const int buf = q % kStages;
      if (it > 0 || q >= kStages)
        mbarrier_wait_parity_suspend(empty + buf, ((unsigned(it) & (uses_odd >> buf)) ^ unsigned(q / kStages) ^ 1u) & 1u);
      if (it > 0 && q < kStages) {
        // the buffer's first stage of this tile: the last tile's O and W chunks read (its last
        // chunk released by every block), and where the buffer lies over the sums, those stored
        // (deferred, the last round's sums lie over O of column tile 0, clear of the stages, and
        // those of the rounds before were stored before the last round's chunks were issued)
        if (stage_over(buf, phase2_lo, phase2_hi))
          mbarrier_wait_parity_suspend(w_empty + (wq - 1) % kW2Stages, ((wq - 1) / kW2Stages) & 1);
        if (!kWide && last_stored && stage_over(buf, red_lo, red_hi))
          mbarrier_wait_parity_suspend(stored, (stored_rounds - 1) & 1);
      }
      mbarrier_arrive_expect_tx(full + buf, kStageBytes);
      const int s0 = kt * kT16WgBK;
      const uint32_t st = stages_addr + uint32_t(buf * kStageBytes);
#pragma unroll
      for (int grp = 0; grp < Sh::kMT / 64; ++grp)
        tma_load_3d(kWide ? smem_addr + uint32_t(tc16_wide_stage_a(buf, grp, L.w)) : st + grp * kT16WgGroupBytes, maps.a,
                    a_row0 + grp * 64, s0, b, full + buf);
      bool b_done = false;
      if constexpr (kWide && kBGroupsShare % 2 == 0) {
        // two groups a copy, 8 KB together in one slice (tc16_wide_stage_b)
        if (p.tc16_b_pairs) {
#pragma unroll
          for (int share = 0; share < kBGroupsShare; share += 2) {
            const uint32_t dst = smem_addr + uint32_t(tc16_wide_stage_b(buf, int(rank) * kBGroupsShare + share));
            if constexpr (kCluster == 1) tma_load_4d(dst, maps.b2, 0, s0, (b_col0 >> 6) + share, b, full + buf);
            else tma_load_4d_mc(dst, maps.b2, 0, s0, (b_col0 >> 6) + share, b, full + buf, kMask);
          }
          b_done = true;
        }
      }
      if (!b_done) {
#pragma unroll
        for (int share = 0; share < kBGroupsShare; ++share) {
          const int grp = int(rank) * kBGroupsShare + share;
          const uint32_t dst = kWide ? smem_addr + uint32_t(tc16_wide_stage_b(buf, grp))
                                     : st + Sh::kABytes + grp * kT16WgGroupBytes;
          if constexpr (kCluster == 1) tma_load_3d(dst, maps.b, b_col0 + share * 64, s0, b, full + buf);
          else tma_load_3d_mc(dst, maps.b, b_col0 + share * 64, s0, b, full + buf, kMask);
        }
      }
      if (++kt == n_k) kt = 0, b_col0 += p.Tj * H;
    }
    const int tile_wq = wq;
    // (kWide: one group of d and one round a tile, D <= kTcDG and P = kRound checked at launch)
    for (int dg = 0; dg < (kWide ? 1 : p.D); dg += kTcDG) {
      for (int r0 = 0; r0 < (kWide ? Sh::kRound : P); r0 += Sh::kRound) {
        // the round before's sums (over W's buffers), where it arrives, read by every block
        if (last_stored) mbarrier_wait_parity_suspend(stored, (stored_rounds - 1) & 1);
        last_stored = !defer || dg + kTcDG < p.D || r0 + Sh::kRound < P;
        stored_rounds += last_stored;
        for (int kc = 0; kc < n_kc; ++kc, ++wq) {
          if (kWide && tc16_wide_w_by_third(kc, p.tc16_w_third)) continue;  // (the consumers' third warpgroup's)
          const int buf = wq % kW2Stages, use = wq / kW2Stages;
          // the chunk's buffer (bytes from the shared memory's start; kWide: its slot's first
          // half, A's or B's, the only slots the chunks without a release wait use, contiguous)
          [[maybe_unused]] const int slot = kWide ? tc16_wide_w_slot(kc) : 0;
          const int lo = kWide ? tc16_wide_w_half(slot, 0, L.w) : L.w + buf * kT16Wg2ChunkBytes;
          bool first_use = wq - tile_wq < kW2Stages;
          if constexpr (kWide) {
            // (a chunk a pair of mbarriers: this tile's chunk `after` released, every block's O
            // slices beneath it with it; that release also means every stage of the tile was
            // retired, so only the chunks without one look at the stages; the tile before's sums,
            // over the first slots, were stored before this round began)
            // (w_local: this block's release alone; the other block's next-tile stages, which land
            // over these slots, still wait for the cluster-wide releases)
            const int after = tc16_wide_w_after(kc);
            if (after >= 0) mbarrier_wait_parity_suspend((w_local ? w_local_empty : w_empty) + after, it & 1);
            first_use = after < 0;
          } else {
            if (use > 0) mbarrier_wait_parity_suspend(w_empty + buf, (use - 1) & 1);
          }
          if (first_use) {
            // the buffer's first chunk of this tile: the last use of each stage buffer beneath it,
            // in every block
            const int hi = lo + kT16Wg2ChunkBytes;
            for (int sb = 0; sb < kStages && sb < n_q; ++sb)
              if (stage_over(sb, lo, hi))
                mbarrier_wait_parity_suspend(empty + sb, ((it + 1) * uses(sb) - 1) & 1);
          }
          mbarrier_arrive_expect_tx(w_full + buf, kT16Wg2ChunkBytes);
          if constexpr (kWide) {
            // this block's halves (each block of a cluster of two one, to both), 64 rows of d a
            // copy (the map's box), each into its slot's place
            if (kCluster == 1 || w_local) {
#pragma unroll
              for (int h = 0; h < 2; ++h)
                tma_load_2d(smem_addr + uint32_t(tc16_wide_w_half(slot, h, L.w)), maps.w, kc * 64, dg + 64 * h,
                            w_full + buf);
            } else if (kCluster == 2 || rank < 2) {
              const int h = int(rank);
              tma_load_2d_mc(smem_addr + uint32_t(tc16_wide_w_half(slot, h, L.w)), maps.w, kc * 64, dg + 64 * h,
                             w_full + buf, kMask);
            }
          } else {
            const uint32_t dst = smem_addr + uint32_t(lo + int(rank) * kWRowsShare * 128);
            if constexpr (kCluster == 1) tma_load_2d(dst, maps.w, kc * 64, dg, w_full + buf);
            else tma_load_2d_mc(dst, maps.w, kc * 64, dg + int(rank) * kWRowsShare, w_full + buf, kMask);
          }
        }
      }
    }
  }
#endif
}

// The wide forms' stores of each tile's sums by the producer warpgroup's other three warps (96
// threads, `ts` this thread's index among them; OuterArgs::tc16_store_warps), beside the consumers' next
// tile: tile k's sums in shared memory complete sums_full's phase k (the consumers' arrival), and
// once they are stored every block's "stored" hears of it (this block's consumers wait for it
// before their next O of column tile 0 overlays the sums, every block's producer before W's
// chunks land in the slots over them).  These warps also stage each tile's rows (its pairs' output
// offsets and normalisers, one a thread), the next tile's as soon as this one's are stored: the
// consumers' first warpgroup staged them between its two column tiles, where the pair counts'
// loads from L2 held three of its warps while the other warpgroups went on (runs 356-357).
template <int kCluster>
__device__ __forceinline__ void tc16_store_tiles(const OuterArgs& p, char* smem, const Tc16Layout& L,
                                                 uint64_t* sums_full, uint64_t* stored, unsigned rank,
                                                 int n_col_blocks, int n_row_groups, int n_groups, int ts) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kRound = Tc16Shape<true>::kRound, kStoreThreads = 96;
  static_assert(kStoreThreads == kRound, "a pair's row a store thread");
  int64_t* row_off = reinterpret_cast<int64_t*>(smem + L.rows);
  float* norm_arg = reinterpret_cast<float*>(row_off + kRound);
  // pair ts of group lin's tile in this block (pair js·P1 + il·Tj + jl, as the consumers order them)
  auto stage_rows = [&](int lin) {
    int col_tile, row_group, b;
    tc16_group_tile(p, lin, n_col_blocks, n_row_groups, col_tile, row_group, b);
    const int i0 = (kCluster * row_group + int(rank)) * p.Ti, j0 = col_tile * p.Tj * kT16JSub;
    const int P1 = p.Ti * p.Tj, js = ts / P1, rem = ts - js * P1, il = rem / p.Tj, jl = js * p.Tj + rem - il * p.Tj;
    const float* row_den = p.row_den ? p.row_den + int64_t(b) * p.norm_rows + i0 : nullptr;
    stage_pair_row<true>(p, ts, ts < P1 * kT16JSub && i0 + il < p.Na && j0 + jl < p.N, b, i0, il, j0, jl, p.N, p.D,
                         row_den, row_off, norm_arg);
  };
  float bias[4];
  load_round_bias(p, 0, ts, bias);
  const int stride = gridDim.x / kCluster;
  if (int(blockIdx.x) / kCluster < n_groups) stage_rows(int(blockIdx.x) / kCluster);
  named_barrier(2, kStoreThreads);  // the first tile's rows staged
  int k = 0;
  for (int lin = blockIdx.x / kCluster; lin < n_groups; lin += stride, ++k) {
    mbarrier_wait_parity_suspend(sums_full, unsigned(k & 1));
    store_round16_vec<4, kRound, kT16WideRedRows, kT16WideSlice / 4>(p, reinterpret_cast<const float*>(smem), kTcDG + 4,
                                                                      row_off, norm_arg, 0, ts, kStoreThreads, bias);
    fence_proxy_async_smem();  // the sums read before tensor copies land over them
    named_barrier(2, kStoreThreads);  // (and the rows, before the next tile's overwrite them)
    if (ts < kCluster) mbarrier_arrive_in(stored, unsigned(ts), rank);
    if (lin + stride < n_groups) stage_rows(lin + stride);
    named_barrier(2, kStoreThreads);  // the next tile's rows staged before any thread reads them
  }
#endif
}

// kBK, kNT: s per stage and phase 1's columns (j, h2) in the mma.sync form (kT16BK and kTcNT;
// kT16BKSmall and kT16NTNarrow on GPUs with less shared memory; kNT >= Tj·H).
// kCluster > 0 (with kWgmmaBoth; full tiles: Ti·H = Tc16Shape<kWide>::kMT, Tj·H = kTcNT): the
// tensor-copy forms.  A warpgroup after the consumers' produces: lane 0 of its first warp issues
// every stage and every W chunk by tensor copies (maps) as soon as the buffer is free, and the
// consumer warps only wait for bytes and multiply.  By setmaxnreg the producer warpgroup keeps
// Tc16Shape's kProducerRegs registers a thread and the consumers take kConsumerRegs, room for
// phase 1's 128 accumulators.
// The block is one of a cluster of kCluster (1, 2 or 4) along rows, the same column tiles: each
// block copies its own a, and its share (1 / kCluster) of every b stage and every W chunk to all
// the cluster's blocks (multicast), so that b and W cross L2 once per cluster.  A stage's "full"
// mbarrier counts this block's producer's arrival and the bytes from every block; its "empty"
// mbarrier one arrival from each consumer warpgroup of each block once that warpgroup has retired
// the stage's products.  W's buffers lie over the stages: each one's first chunk waits for the
// last use of the stages beneath it in every block; phase 2's sums lie over W's buffers: a round's
// chunks wait for every block's previous round to be stored.  The same products in the same order
// as without: the same bits.
template <typename T, bool kWgmma, bool kWgmmaBoth, int kBK, int kNT, int kCluster, bool kWide = false>
__device__ __forceinline__ void outer_tc16_body(const OuterArgs& p, const Tc16Maps* maps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr bool kTma = kCluster > 0;
  static_assert(kTma || !kWide, "three consumer warpgroups in the tensor-copy forms alone");
  using Sh = Tc16Shape<kWide>;
  constexpr int kStages = Sh::kStages, kW2Stages = Sh::kW2Stages, kRound = Sh::kRound, kMT = Sh::kMT;
  constexpr int kABytes = Sh::kABytes, kStageBytes = Sh::kStageBytes, kThreadsC = Sh::kThreads;
  static_assert(kWgmma || !kWgmmaBoth, "phase 2 on wgmma needs phase 1 on wgmma");
  static_assert(kWgmmaBoth || !kTma, "the tensor-copy forms have both phases on wgmma");
  static_assert(kCluster == 0 || kCluster == 1 || kCluster == 2 || kCluster == 4, "clusters of 1, 2 or 4 blocks");
  constexpr int kShare = kTma ? kCluster : 1;
  // each block's share of b's column groups and of W's rows of d, and the multicast to every block
  constexpr int kBGroupsShare = kTcNT / 64 / kShare, kWRowsShare = kTcDG / kShare;
  [[maybe_unused]] constexpr uint16_t kClusterMask = uint16_t((1u << kShare) - 1);
  static_assert(kBK == kT16BK || (kBK == kT16BKSmall && !kWgmma), "half stages for the mma.sync form alone");
  static_assert(kNT == kTcNT || (kNT == kT16NTNarrow && !kWgmma), "a narrower phase 1 for the mma.sync form alone");
  extern __shared__ float4 smem_f4[];
  char* smem = reinterpret_cast<char*>(smem_f4);
  if constexpr (kWgmmaBoth)  // the swizzle follows address bits 4-9: every tile from a 1 KB boundary
    smem = align_smem_1k(smem);
  const Tc16Layout L = tc16_layout(p.H, p.Ti, p.Tj,
                                   kTma         ? tc16_tma_form(kCluster, kWide)
                                   : kWgmmaBoth ? kT16WgmmaBoth
                                   : kWgmma     ? kT16WgmmaPhase1
                                                : tc16_mma_sync_form(kBK, kNT));
  T* Os = reinterpret_cast<T*>(smem);                  // [P][ldo]
  T* stages = reinterpret_cast<T*>(smem + L.stages);   // mma.sync: [kT16Stages][BK][LdA + LdB]
  T* Wst = reinterpret_cast<T*>(smem + L.w);           // [kT16WStages][DG][LdW]
  int64_t* row_off = reinterpret_cast<int64_t*>(smem + L.rows);            // [kRound]
  float* norm_arg = reinterpret_cast<float*>(row_off + kRound);     // [kRound]
  const int H = p.H, N = p.N, S = p.S, D = p.D, Ti = p.Ti, Tj = p.Tj;
  const int P1 = Ti * Tj;          // pairs of one column tile
  const int P = P1 * kT16JSub;     // pairs of the block, column tile by column tile
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;   // accumulator coordinates (PTX: groupID, threadID_in_group)
  const int lq = lane >> 3, lr = lane & 7;  // ldmatrix: the matrix and the row this lane addresses
  const int64_t NH = int64_t(N) * H, NaH = int64_t(p.Na) * H;
  const T* a_g = static_cast<const T*>(p.a);
  const T* b_g = static_cast<const T*>(p.b);
  const T* w_g = static_cast<const T*>(p.w_out);
  // kTma: this block's rank in its cluster, and the launch's groups of tiles (a column block, the
  // cluster's kCluster row tiles, a batch element), which each cluster takes in turn
  [[maybe_unused]] unsigned rank = 0;
  [[maybe_unused]] int n_col_blocks = 0, n_row_groups = 0, n_groups = 0;
  // The output's stores: 16 bytes a thread (store_round16_vec) where the output is 16-bit, D a
  // multiple of 8 and out 16-byte aligned, unless FLASHOPM_TC16_WIDE_STORES=0 (OuterArgs::tc16_wide).
  const bool wide_stores = p.tc16_wide && p.out_kind != kMaskFloat && (D & 7) == 0 && !p.accumulate &&
                           (reinterpret_cast<uintptr_t>(p.out) & 15) == 0;
  // kWide: each tile's sums stored by the producer warpgroup's other warps (tc16_store_tiles)
  // where the output takes store_round16_vec's stores (FLASHOPM_TC16_STORE_WARPS=0: by the consumers,
  // at once)
  [[maybe_unused]] const bool store_warps = kWide && p.tc16_store_warps != 0 && wide_stores && D <= kTcDG;
  // kTma: full[kStages], empty[..], W's full[kW2Stages], empty[..], round stored, (kWide) sums in
  [[maybe_unused]] uint64_t* bars = nullptr;
  if constexpr (kTma) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    rank = cluster_rank();
    const Tc16GroupCounts counts = tc16_group_counts(N, p.Na, Ti, Tj, kShare);
    n_col_blocks = counts.col_blocks;
    n_row_groups = counts.row_groups;
    n_groups = n_col_blocks * n_row_groups * p.B;
    bars = reinterpret_cast<uint64_t*>(smem + L.rows + kRound * 12);
    if (tid == 0) {
      for (int i = 0; i < kStages; ++i) {
        mbarrier_init(bars + i, 1);                                 // the producer's arrival with the bytes
        mbarrier_init(bars + kStages + i, Sh::kWgs * kShare);  // each consumer warpgroup's release
      }
      for (int i = 0; i < kW2Stages; ++i) {
        mbarrier_init(bars + 2 * kStages + i, 1);
        mbarrier_init(bars + 2 * kStages + kW2Stages + i, 2 * kShare);  // phase 2's two warpgroups'
      }
      mbarrier_init(bars + 2 * kStages + 2 * kW2Stages, kShare);  // each block's round stored
      if constexpr (kWide) {
        mbarrier_init(bars + 2 * kStages + 2 * kW2Stages + 1, 1);  // the consumers' sums in
        for (int i = 0; i < kW2Stages; ++i)  // W's local empties: this block's phase-2 warpgroups'
          mbarrier_init(bars + 2 * kStages + 2 * kW2Stages + 2 + i, 2);
      }
    }
    cluster_barrier();  // every block's mbarriers set up before any copies to another
    if (warp >= kThreadsC / 32) {
      warpgroup_regs_dec<Sh::kProducerRegs>();
      if (warp == kThreadsC / 32) {
        if (lane == 0)
          tc16_produce<kCluster, kWide>(p, *maps, smem, L, bars, rank, n_col_blocks, n_row_groups, n_groups, P);
      } else if constexpr (kWide) {
        if (store_warps)
          tc16_store_tiles<kCluster>(p, smem, L, bars + 2 * kStages + 2 * kW2Stages + 1,
                                     bars + 2 * kStages + 2 * kW2Stages, rank, n_col_blocks, n_row_groups, n_groups,
                                     tid - kThreadsC - 32);
      }
      __syncwarp();
      cluster_barrier();  // (the consumers' last)
      return;
    }
    warpgroup_regs_inc<Sh::kConsumerRegs>();
#endif
  }
  // kTma (consumers): a stage or W chunk retired by this warpgroup, released to every block that
  // refills it (lane r of the warpgroup's first warp arrives on block r's mbarrier)
  [[maybe_unused]] auto release = [&](uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if ((warp & 3) == 0 && lane < kShare) mbarrier_arrive_in(bar, unsigned(lane), rank);
#endif
  };
  // a barrier of the eight consumer warps (the producer warpgroup does not take part in kTma)
  auto consumers_sync = [&]() {
    if constexpr (kTma) named_barrier(1, kThreadsC);
    else __syncthreads();
  };
  // kTma: W's chunks in one sequence over every tile, group of d and round (wq), buffer wq %
  // kW2Stages, issued by the producer warp (kWide: 16 a tile, one pair of mbarriers each, so
  // chunk kc's and the tile's parity; w_base unused)
  [[maybe_unused]] int w_base = 0;
  // FLASHOPM_TC16_TRACE (timing aid): the first thread of each consumer warpgroup records its
  // Tc16Mark points; the count stays in a register, so a mark costs two clock reads and stores.
  long long* trace_rec = nullptr;
  int trace_n = 0;
  if (p.wv.trace != nullptr && (tid & 127) == 0 && tid < kThreadsC) {
    const int64_t lin_block = blockIdx.x + int64_t(gridDim.x) * (blockIdx.y + int64_t(gridDim.y) * blockIdx.z);
    trace_rec = p.wv.trace + (lin_block * Sh::kWgs + (tid >> 7)) * int64_t(p.wv.trace_cap) * 3;
  }
  auto mark = [&](int m, int payload) {
    if (trace_rec != nullptr && trace_n + 1 < p.wv.trace_cap) {
      unsigned long long gt;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt));
      long long* const e = trace_rec + 3 * (trace_n + 1);
      e[0] = m | (int64_t(payload) << 8);
      e[1] = static_cast<long long>(gt);
      e[2] = clock64();
      trace_rec[0] = ++trace_n;
    }
  };
  // kTma: a tile's last round of phase 2 leaves its sums at the start of shared memory (over its O
  // of column tile 0, clear of every stage and W buffer) and its output rows are stored beside the
  // next tile's first MMAs, half a round after each of its first two stages, rather than with the
  // tensor cores idle; dg of that round.  row_off and norm_arg keep the round's rows until the
  // next tile's phase 2 stages its own.
  constexpr int kRedLd = kTcDG + 4;
  [[maybe_unused]] bool stores_pending = false;
  [[maybe_unused]] int pending_dg = 0;
  // a round's bias for this thread's d (load_round_bias8, or load_round_bias in the first four)
  auto load_bias = [&](int dg, float (&bias)[8]) {
    if (wide_stores) load_round_bias8(p, dg, tid, bias);
    else load_round_bias(p, dg, tid, reinterpret_cast<float(&)[4]>(bias));
  };
  auto store_rows = [&](auto rows_c, const float* red, const int64_t* rows, const float* args, int dg,
                        const float (&bias)[8]) {
    constexpr int kRows = decltype(rows_c)::value;
    // (kWide: the sums in pieces, tc16_wide_red_row)
    constexpr int kPieceRows = kWide ? kT16WideRedRows : kRows, kPieceStride = kWide ? kT16WideSlice / 4 : 0;
    if (wide_stores)
      store_round16_vec<8, kRows, kPieceRows, kPieceStride>(p, red, kRedLd, rows, args, dg, tid, kThreadsC, bias);
    else
      store_round<kRows, true, kPieceRows, kPieceStride>(p, red, kRedLd, rows, args, dg, tid, kThreadsC,
                                                         reinterpret_cast<const float(&)[4]>(bias));
  };
  [[maybe_unused]] float pending_bias[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  [[maybe_unused]] auto store_pending_half = [&](int half) {
    constexpr int kHalf = kRound / 2;
    store_rows(std::integral_constant<int, kHalf>{}, reinterpret_cast<const float*>(smem) + half * kHalf * kRedLd,
               row_off + half * kHalf, norm_arg + half * kHalf, pending_dg, pending_bias);
  };

  // kWgmma: phase 1's stages as the block's threads copy them (the forms without tensor copies).
  // This thread's 16-byte pieces: column chunk c = tid % 8 of rows s = tid / 8 + 32r, in A's two
  // and B's four column groups; a warp writes four whole 128-byte rows (no bank conflicts).
  const int pc = tid & 7, pk = tid >> 3;
  constexpr int kRowParts = kT16WgBK / 32;  // rows of s per stage, 32 per pass of the block
  char* wg_stages = smem + L.stages;  // rounded up to 1 KB: the swizzle follows address bits 4-9
  if constexpr (!kWgmmaBoth)
    wg_stages = align_smem_1k(wg_stages);
  // The shared address of this thread's pieces in stage 0 (in stage k: + k stages), and which of
  // its column groups hold valid columns: bits 0-1 a's groups, bits 2-5 b's (of the tile being
  // issued).  A mask in one register rather than flags the compiler recomputed per stage.
  [[maybe_unused]] const uint32_t piece_dst0 = static_cast<uint32_t>(__cvta_generic_to_shared(wg_stages)) +
                                               (pk >> 3) * 1024 + (pk & 7) * 128 + ((pc ^ (pk & 7)) << 4);
  uint32_t col_ok = 0;
  constexpr int kBBit = kMT / 64;
  // One stage sequence over a tile's column tiles in turn, so that the next column tile's first
  // stages load while this one's last ones are multiplied and its O is stored.  That needs column
  // tile 0's O clear of the stages; later ones' O overlays them, so only the last may drain the ring.
  static_assert(kT16JSub == 2, "only the last column tile's O may overlay the stages");
  // Running sources (row s = s_row of this thread's first piece, chunk pc of group 0) of the next
  // stage to issue, from column tile issue_js of the tile at (issue_a, issue_b, issue_j0): one
  // pointer step per stage rather than each piece's offset from scratch (at 32 s per stage that
  // arithmetic made the loop issue-bound).
  const T* a_src = nullptr;
  const T* b_src = nullptr;
  const T* issue_a = nullptr;
  int s_row = 0, issue_js = 0, issue_buf = 0, issue_b = 0, issue_j0 = 0;
  auto start_tile = [&](int js) {
    const int jt0 = issue_j0 + js * Tj;
    const int b_lim = min(Tj * H, (N - jt0) * H);  // <= 0 for a column tile past N
    col_ok &= (1u << kBBit) - 1;
#pragma unroll
    for (int grp = 0; grp < kTcNT / 64; ++grp) col_ok |= uint32_t(grp * 64 + pc * 8 < b_lim) << (kBBit + grp);
    a_src = issue_a + int64_t(pk) * NaH + pc * 8;
    b_src = b_g + int64_t(issue_b) * S * NH + int64_t(jt0) * H + int64_t(pk) * NH + pc * 8;
    s_row = pk;
  };
  // The next stage of the sequence into the next buffer of the ring; nothing once every column
  // tile's stages are issued (the caller still commits a group, empty, to keep the wait counts).
  auto issue_stage = [&]() {
    if (issue_js < kT16JSub) {
      const uint32_t st = piece_dst0 + uint32_t(issue_buf * kStageBytes);
#pragma unroll
      for (int r = 0; r < kRowParts; ++r) {
        const uint32_t ok_bits = s_row + 32 * r < S ? col_ok : 0u;
#pragma unroll
        for (int grp = 0; grp < kMT / 64; ++grp) {
          const bool ok = (ok_bits >> grp) & 1u;
          cp_async16z_shared(st + r * 4096 + grp * kT16WgGroupBytes,
                             ok ? a_src + int64_t(32 * r) * NaH + grp * 64 : a_g, ok);
        }
#pragma unroll
        for (int grp = 0; grp < kTcNT / 64; ++grp) {
          const bool ok = (ok_bits >> (kBBit + grp)) & 1u;
          cp_async16z_shared(st + r * 4096 + kABytes + grp * kT16WgGroupBytes,
                             ok ? b_src + int64_t(32 * r) * NH + grp * 64 : b_g, ok);
        }
      }
      a_src += int64_t(kT16WgBK) * NaH;
      b_src += int64_t(kT16WgBK) * NH;
      s_row += kT16WgBK;
      if (s_row - pk >= S && ++issue_js < kT16JSub) start_tile(issue_js);  // that was the tile's last stage
    }
    issue_buf = issue_buf + 1 == kStages ? 0 : issue_buf + 1;
  };
  // The tile at row i0 (local to the row block), column j0 of batch element b: its stage sequence
  // from ring buffer 0, and its first kT16WgAhead stages issued, a commit group each.
  [[maybe_unused]] auto begin_stages = [&](int i0, int j0, int b) {
    const int a_lim = min(Ti * H, (p.Na - i0) * H);  // valid columns of the tile (multiples of 8)
    col_ok = 0;
#pragma unroll
    for (int grp = 0; grp < kMT / 64; ++grp) col_ok |= uint32_t(grp * 64 + pc * 8 < a_lim) << grp;
    issue_a = a_g + int64_t(b) * S * NaH + int64_t(i0) * H;
    issue_b = b;
    issue_j0 = j0;
    issue_js = 0;
    issue_buf = 0;
    start_tile(0);
#pragma unroll
    for (int st = 0; st < kT16WgAhead; ++st) {
      issue_stage();
      cp_async_commit();
    }
  };
  // The forms without tensor copies, resident (OuterArgs::tc16_resident): whether this tile's
  // first stages were issued by the block's tile before (beside its epilogue), and the next
  // tile's coordinates (next_b < 0: none).
  [[maybe_unused]] bool stages_ahead = false;
  [[maybe_unused]] int next_col = 0, next_row = 0, next_b = -1;

  // One tile: column block col_tile, row tile row_tile of batch element b, the block's tile_it-th
  // (kTma: the stage ring starts at buffer 0 with each tile).
  auto tile = [&](const int col_tile, const int row_tile, const int b, const int tile_it) {
  const int i0 = row_tile * Ti, j0 = col_tile * Tj * kT16JSub;  // i0 local to this row block
  // this tile's row denominators (kNormRow): row i0 + il at row_den[il]
  const float* row_den = p.row_den ? p.row_den + int64_t(b) * p.norm_rows + i0 : nullptr;
  if (trace_rec != nullptr) {
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    mark(kT16MarkTile, tile_it | int(smid << 24));
  }

  // Output rows and normaliser arguments of the round of pairs r0 .. r0 + kRound (pair
  // js·P1 + il·Tj + jl), for store_round.  The wgmma forms stage their first round's after phase
  // 1's column tile 0, later rounds' at their start; the others at each round's start once its
  // first W chunks are on their way: the denominators' or pair counts' loads (from L2 or memory)
  // then pass beside the products instead of before the epilogue (run 334: ~1.3K cycles a tile
  // at phase 2's first barrier when staged at its start).
  auto stage_round_rows = [&](int r0) {
    if (tid < kRound) {
      const int pr = r0 + tid;
      const int js = pr / P1, rem = pr - js * P1;
      const int il = rem / Tj, jl = js * Tj + rem - il * Tj;
      stage_pair_row<true>(p, tid, pr < P && i0 + il < p.Na && j0 + jl < N, b, i0, il, j0, jl, N, D, row_den, row_off,
                     norm_arg);
    }
  };
  // ---------------- phase 1 ----------------
  const int a_lim = min(Ti * H, (p.Na - i0) * H);  // valid columns of the tile (multiples of 8)
  const T* a_base = a_g + int64_t(b) * S * NaH + int64_t(i0) * H;
  if constexpr (kWgmma) {
    // Two warpgroups, each 64 rows (i, h1) x all 256 columns (j, h2), one wgmma.m64n256k16 per 16
    // s.  Stages hold a and b as they are in memory, (s, h)-major, i.e. MN-major operands: per
    // 64-wide group of m (or n), kT16WgBK rows of s of 128 bytes, swizzled (see wgmma_desc).
    const int n_k = (S + kT16WgBK - 1) / kT16WgBK;
    const int wg = warp >> 2, wl = warp & 3;
    int read_buf = 0;
    // kTma: the parity each stage buffer's next use waits for, a bit per buffer: this tile's first
    // uses follow from each buffer's uses in the tiles before, and a bit flips as its use is read.
    // Kept as bits rather than formed from the stage's index at each wait: with that arithmetic
    // between a warpgroup MMA's issue and its wait, ptxas serialised every one of the kernel's
    // MMAs (C7515: a wait after each, no group left in flight).
    [[maybe_unused]] uint32_t read_parity = 0;
    if constexpr (kTma) {
#pragma unroll
      for (int sb = 0; sb < kStages; ++sb)
        read_parity |= uint32_t((tile_it * tc16_stage_uses(kT16JSub * n_k, sb, kStages)) & 1) << sb;
    }
    if constexpr (!kTma) {
      // (the tile before on this block may have issued them, beside its epilogue)
      if (!stages_ahead) begin_stages(i0, j0, b);
      stages_ahead = false;
    }
    // Stage 0's descriptors; another stage's or k step's differ in the start address alone, whose
    // field (address / 16, 14 bits) holds every shared address without carrying into the next.
    // (kWide: each stage's boxes where tc16_wide_stage_a / _b put them, from the shared memory's
    // start)
    const uint64_t desc_a0 =
        wgmma_desc(kWide ? smem : wg_stages + wg * kT16WgGroupBytes, kT16WgGroupBytes, 1024);
    const uint64_t desc_b0 = wgmma_desc(kWide ? smem : wg_stages + kABytes, kT16WgGroupBytes, 1024);
    for (int js = 0; js < kT16JSub; ++js) {
      float acc[128];
#pragma unroll
      for (int e = 0; e < 128; ++e) acc[e] = 0.f;
      for (int kt = 0; kt < n_k; ++kt) {
        if constexpr (kTma) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
          // the stage's bytes, from every block
          mbarrier_wait_parity_suspend(bars + read_buf, (read_parity >> read_buf) & 1u);
          read_parity ^= 1u << read_buf;
#endif
        } else {
          cp_async_wait<kT16WgAhead - 1>();
          fence_proxy_async_smem();  // this thread's copies, visible to the tensor cores' reads
          __syncthreads();
          // The stage refilled now was last read by the group two stages back, which every
          // warpgroup retired before the barrier (one group stays in flight).
          issue_stage();
          cp_async_commit();
        }
        uint64_t stage_off = uint64_t(read_buf * (kStageBytes >> 4)), b_stage_off = stage_off;
        if constexpr (kWide) {
          stage_off = uint64_t(tc16_wide_stage_a(read_buf, wg, L.w) >> 4);
          b_stage_off = uint64_t(tc16_wide_stage_b(read_buf, 0) >> 4);
        }
        [[maybe_unused]] const int prev_buf = read_buf == 0 ? kStages - 1 : read_buf - 1;
        read_buf = read_buf + 1 == kStages ? 0 : read_buf + 1;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kT16WgBK / 16; ++kk) {
          if constexpr (kWide) {  // (512 threads: 128 registers at entry, see wgmma_m64n128k16)
#pragma unroll
            for (int h = 0; h < 2; ++h)
              wgmma_m64n128k16<T>(acc + 64 * h, desc_a0 + stage_off + kk * (2048 >> 4),
                                  desc_b0 + b_stage_off + kk * (2048 >> 4) + h * (kT16WideSlice >> 4));
          } else {
            wgmma_m64n256k16<T>(acc, desc_a0 + stage_off + kk * (2048 >> 4), desc_b0 + stage_off + kk * (2048 >> 4));
          }
        }
        wgmma_commit();
        if constexpr (kTma && !kWide)
          if (stores_pending && js == 0 && kt < 2) store_pending_half(kt);  // beside this stage's MMAs
        wgmma_wait<1>();
        // kTma: the previous stage's products retired by this warpgroup (this tile's; the last
        // tile's last stage is released below)
        if constexpr (kTma)
          if (kt > 0) release(bars + kStages + prev_buf);
      }
      wgmma_wait<0>();
      mark(js == 0 ? kT16MarkP1Done0 : kT16MarkP1Done1, 0);
      if constexpr (kTma && !kWide) {
        if (stores_pending && js == 0) {
          if (n_k == 1) store_pending_half(1);
          stores_pending = false;
          consumers_sync();  // the last tile's sums read by every thread: O of column tile 0 overlays them
        }
      }
      // kWide, the sums stored by the producer warpgroup's other warps: the tile before's, which
      // lie under O of column tile 0 and read the rows, stored by every block
      if constexpr (kWide)
        if (store_warps && js == 0 && tile_it > 0)
          mbarrier_wait_parity_suspend(bars + 2 * kStages + 2 * kW2Stages, unsigned((tile_it - 1) & 1));
      // the first round's rows (the block's tile before has stored its rows by now; kWide with
      // the store warps: staged by them)
      if constexpr (kWgmmaBoth)
        if (js == 0 && !(kWide && store_warps)) stage_round_rows(0);
      if constexpr (kTma) release(bars + kStages + (js * n_k + n_k - 1) % kStages);
      if (js + 1 == kT16JSub) {
        // (kTma: every stage's bytes from every block have arrived: nothing more is copied here)
        if constexpr (!kTma) cp_async_wait_all();
        consumers_sync();  // every warp done with the stages: the last tile's O overlays them
        mark(kT16MarkO1Sync, 0);
      }

      // O as [pair][h1·H + h2], pair = js·P1 + il·Tj + jl, rounded to T.  Column 8j + 2(lane%4)
      // of the accumulator lies in column tile jl = j / (H/8) (H is a multiple of 8).
      const int hb = H >> 3;
      if constexpr (kWgmmaBoth) {
        // phase 2's B operand: K-major, pair groups of 8 rows H²·16 bytes apart, k in the order
        // o_k_order gives (8 x 8 blocks of (h1, h2), one 64-wide swizzle group each), so that the
        // 32 lanes of a store (8 rows h1 by lane / 4, 4 pairs of h2 by lane % 4) fill one 128-byte
        // row: no bank conflicts (in the order h1·H + h2 eight lanes shared each bank).  For
        // H = 8·kHB (kHB = 1, 2, 4) and full column tiles the offsets fold to constants but for
        // one base per row half (the general form's division and offset arithmetic per store took
        // as many instructions as phase 1's loop): a tile's pair rows start at multiples of 8, so
        // a pair's row within its group of 8 is jl % 8.
        // Pair group by pair group (kSbo apart), then the chunks of 64 k 1 KB apart; the wide
        // forms' in slices of two chunks (tc16_wide_o, see Tc16Shape).
        auto store_o_folded = [&](auto hb_const) {
          constexpr int kHB = decltype(hb_const)::value, kH = 8 * kHB, kTj = 32 / kHB;
          constexpr uint32_t kSbo = 16u * kH * kH;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int m = wg * 64 + wl * 16 + g + 8 * half;
            const int il = m / kH, h1 = m % kH;
            if (il < Ti) {
              const uint32_t base = uint32_t((js * P1 + il * kTj) >> 3) * kSbo + uint32_t(h1 >> 3) * (kHB * 1024u) + 4u * t;
#pragma unroll
              for (int j = 0; j < 32; ++j) {
                const int jl = j / kHB, q = j % kHB;  // column tile jl, h2 = 8q + 2t (+1)
                const uint32_t off = base + uint32_t(q) * 1024u + uint32_t(jl >> 3) * kSbo + uint32_t(jl & 7) * 128u +
                                     (uint32_t((h1 & 7) ^ (jl & 7)) << 4);
                *reinterpret_cast<uint32_t*>(smem + off) = pack_16bit<T>(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
              }
            }
          }
        };
        // The same stores by stmatrix (OuterArgs::tc16_stmatrix, the tensor-copy forms): a matrix is 8 rows h1 (lane / 4)
        // of one pair's 16-byte piece of 8 h2, each row one piece of that pair's swizzled 128-byte
        // row; lane 8i + r addresses row r of matrix i, the column tile j = 4c + i.  A quarter of
        // the store instructions, each piece whole (the 4-byte stores were 1.3-way conflicted in
        // run 338's Nsight).
        auto store_o_stmatrix = [&](auto hb_const) {
          constexpr int kHB = decltype(hb_const)::value, kH = 8 * kHB, kTj = 32 / kHB;
          constexpr uint32_t kSbo = 16u * kH * kH;
          const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
          const int r = lane & 7, mi = lane >> 3;
          // (the wide forms' tiles are whole, hidden 32: Ti·H = kMT and Tj = kTj, checked at launch,
          // so that their row test and pair offsets fold to constants rather than live through
          // phase 1)
          static_assert(!kWide || kHB == 4, "the wide forms at hidden 32 alone");
          const int ti = kWide ? kMT / kH : Ti, p1 = kWide ? (kMT / kH) * kTj : P1;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int m0 = wg * 64 + wl * 16 + 8 * half;  // the matrices' first row: 8 rows of one il
            const int il = m0 / kH, h1 = m0 % kH + r;
            if (il < ti) {
              const uint32_t base =
                  smem_base + uint32_t((js * p1 + il * kTj) >> 3) * kSbo + uint32_t(h1 >> 3) * (kHB * 1024u);
#pragma unroll
              for (int c = 0; c < 8; ++c) {
                const int j = 4 * c + mi, jl = j / kHB, q = j % kHB;  // this lane's matrix
                uint32_t addr = base + uint32_t(q) * 1024u + uint32_t(jl >> 3) * kSbo + uint32_t(jl & 7) * 128u +
                                (uint32_t(r ^ (jl & 7)) << 4);
                if constexpr (kWide)  // (O in slices: tc16_wide_o)
                  addr = smem_base +
                         uint32_t(tc16_wide_o(((js * p1 + il * kTj) >> 3) + (jl >> 3), (h1 >> 3) * kHB + q)) +
                         uint32_t(jl & 7) * 128u + (uint32_t(r ^ (jl & 7)) << 4);
                stmatrix_x4(addr, pack_16bit<T>(acc[16 * c + 2 * half], acc[16 * c + 2 * half + 1]),
                            pack_16bit<T>(acc[16 * c + 4 + 2 * half], acc[16 * c + 5 + 2 * half]),
                            pack_16bit<T>(acc[16 * c + 8 + 2 * half], acc[16 * c + 9 + 2 * half]),
                            pack_16bit<T>(acc[16 * c + 12 + 2 * half], acc[16 * c + 13 + 2 * half]));
              }
            }
          }
        };
        // (the tensor-copy forms alone: in the form without, at 255 registers, it spilled.  The
        // wide forms, hidden 32 alone (hb 4, Tj 8), always take it: only store_o_stmatrix lays O
        // out in their slices; the other stores below are the two-warpgroup layouts.)
        const bool stm = kWide || (kTma && p.tc16_stmatrix != 0);
        if constexpr (kWide) {
          store_o_stmatrix(std::integral_constant<int, 4>{});  // (hidden 32 and Tj 8, checked at launch)
        } else if (hb == 4 && Tj == 8) {
          if (stm) store_o_stmatrix(std::integral_constant<int, 4>{});
          else store_o_folded(std::integral_constant<int, 4>{});
        } else if (hb == 2 && Tj == 16) {
          if (stm) store_o_stmatrix(std::integral_constant<int, 2>{});
          else store_o_folded(std::integral_constant<int, 2>{});
        } else if (hb == 1 && Tj == 32) {
          if (stm) store_o_stmatrix(std::integral_constant<int, 1>{});
          else store_o_folded(std::integral_constant<int, 1>{});
        } else {
          const uint32_t o_sbo = uint32_t(H) * H * 16;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int m = wg * 64 + wl * 16 + g + 8 * half;
            const int il = m / H;
            if (il < Ti) {
              const int h1 = m - il * H;
              const int pair_row = js * P1 + il * Tj;
#pragma unroll
              for (int j = 0; j < 32; ++j) {
                const int jl = j / hb;
                if (jl < Tj)
                  *reinterpret_cast<uint32_t*>(
                      smem + kmajor_sw128_offset(pair_row + jl, o_k_order(h1, 8 * (j - jl * hb) + 2 * t, hb), o_sbo)) =
                      pack_16bit<T>(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
              }
            }
          }
        }
        mark(js == 0 ? kT16MarkO0 : kT16MarkO1, 0);
        continue;
      }
      T* Ot = Os + js * P1 * L.ldo;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int m = wg * 64 + wl * 16 + g + 8 * half;
        const int il = m / H;
        if (il < Ti) {
          T* orow_w = Ot + il * Tj * L.ldo + (m - il * H) * H + 2 * t;
#pragma unroll
          for (int j = 0; j < 32; ++j) {
            const int jl = j / hb;
            if (jl < Tj)
              *reinterpret_cast<uint32_t*>(orow_w + jl * L.ldo + 8 * (j - jl * hb)) =
                  pack_16bit<T>(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
          }
        }
      }
    }
  } else {
  // warps 2 (m) x 4 (n), 64 x kNT / 4 each, mma.sync fed by ldmatrix
  const int wm = warp & 1, wn = warp >> 1;
  constexpr int kLdB = tc16_ld_b(kNT);
  constexpr int kWarpN = kNT / 4, kNTiles = kWarpN / 8;
  constexpr int kStageElems = tc16_stage_elems(kBK, kNT);
  const int n_k = (S + kBK - 1) / kBK;
  // Lane offsets of the transposed fragment loads: A's matrices are (k 0-7 | 8-15) x (m 0-7 | 8-15)
  // in the order a0..a3 of the MMA; B's are (k 0-7, n 0-7), (k 8-15, n 0-7), then n 8-15.
  const int a_off = ((lq >> 1) * 8 + lr) * kT16LdA + wm * 64 + (lq & 1) * 8;
  const int b_off = ((lq & 1) * 8 + lr) * kLdB + wn * kWarpN + (lq >> 1) * 8;

  // This thread's 16-byte pieces of a stage: A rows k = tid/16 + 16u at column m, B rows
  // k = tid/32 + 8u at column n.  Sources advance by a stage's rows per stage issued; a piece past
  // S, past the tile's valid columns, or of a stage past the last is zero-filled (and not read).
  constexpr int kAPieces = kBK * kMT / 8 / kThreadsC, kBPieces = kBK * kNT / 8 / kThreadsC;
  constexpr int kARowStep = kThreadsC / (kMT / 8), kBRowStep = kThreadsC / (kNT / 8);
  const int a_k = tid / (kMT / 8), a_m = (tid % (kMT / 8)) * 8;
  const int b_k = tid / (kNT / 8), b_n = (tid % (kNT / 8)) * 8;
  const bool a_col_ok = a_m < a_lim;
  const int a_dst = a_k * kT16LdA + a_m, b_dst = kBK * kT16LdA + b_k * kLdB + b_n;

  for (int js = 0; js < kT16JSub; ++js) {
    const int jt0 = j0 + js * Tj;
    const bool b_col_ok = b_n < min(Tj * H, (N - jt0) * H);  // false for a column tile past N
    const T* a_src = a_base + int64_t(a_k) * NaH + a_m;
    const T* b_src = b_g + int64_t(b) * S * NH + int64_t(jt0) * H + int64_t(b_k) * NH + b_n;
    int s_next = 0;  // first s of the next stage to issue
    auto issue_stage = [&](int buf) {
      T* st = stages + buf * kStageElems;
#pragma unroll
      for (int u = 0; u < kAPieces; ++u) {
        const bool ok = a_col_ok && s_next + a_k + u * kARowStep < S;
        cp_async16z(st + a_dst + u * kARowStep * kT16LdA, ok ? a_src + int64_t(u * kARowStep) * NaH : a_g, ok);
      }
#pragma unroll
      for (int u = 0; u < kBPieces; ++u) {
        const bool ok = b_col_ok && s_next + b_k + u * kBRowStep < S;
        cp_async16z(st + b_dst + u * kBRowStep * kLdB, ok ? b_src + int64_t(u * kBRowStep) * NH : b_g, ok);
      }
      s_next += kBK;
      a_src += int64_t(kBK) * NaH;
      b_src += int64_t(kBK) * NH;
    };

#pragma unroll
    for (int st = 0; st < kT16Stages - 1; ++st) {
      issue_stage(st);
      cp_async_commit();
    }

    float acc[4][kNTiles][4];
    zero_tiles(acc);

    for (int kt = 0; kt < n_k; ++kt) {
      cp_async_wait<kT16Stages - 2>();
      __syncthreads();
      issue_stage((kt + kT16Stages - 1) % kT16Stages);
      cp_async_commit();
      const T* As = stages + (kt % kT16Stages) * kStageElems;
      const T* Bs = As + kBK * kT16LdA;
#pragma unroll
      for (int kk = 0; kk < kBK; kk += 16) {
        uint32_t af[4][4], bf[kNTiles / 2][4];
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) ldmatrix_x4_trans(af[mt], As + kk * kT16LdA + a_off + mt * 16);
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) ldmatrix_x4_trans(bf[np], Bs + kk * kLdB + b_off + np * 16);
        mma_16bit_tiles<T>(acc, af, bf);
      }
    }
    cp_async_wait_all();
    __syncthreads();  // every warp done with the stages: this tile's O may overwrite them

    // O as [pair][h1·H + h2], pair = js·P1 + il·Tj + jl, rounded to T.
    T* Ot = Os + js * P1 * L.ldo;
    int col_off[kNTiles];  // -1: a column past the tile
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      const int n = wn * kWarpN + nt * 8 + 2 * t;
      const int jl = n / H;
      col_off[nt] = jl < Tj ? jl * L.ldo + n - jl * H : -1;
    }
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int m = wm * 64 + mt * 16 + g + 8 * half;
        const int il = m / H;
        const bool row_ok = il < Ti;
        T* orow_w = Ot + il * Tj * L.ldo + (m - il * H) * H;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
          if (row_ok && col_off[nt] >= 0)
            *reinterpret_cast<uint32_t*>(orow_w + col_off[nt]) =
                pack_16bit<T>(acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1]);
      }
  }
  }

  const int K2 = H * H;
  if constexpr (kWgmmaBoth) {
    // ---------------- phase 2 on wgmma: out[(i,j), d]ᵀ = W · Oᵀ, warpgroup wg taking d 64wg .. 64wg+63
    // of each group of kTcDG, a round of 64 pairs at a time, W in chunks of 64 k (A, K-major) and
    // O as written above (B, K-major).
    const int n_kc = K2 / 64;
    const int wg = warp >> 2, wl = warp & 3;
    const T* w_blk = static_cast<const T*>(p.w_blocked);
    const uint32_t o_sbo = uint32_t(K2) * 16;
    char* w_st = smem + L.w;
    // This thread's pieces of a chunk: rows d = tid/8 + 32u, 16-byte piece tid % 8 of the row.
    const int wc = tid & 7, wr = tid >> 3;
    const uint32_t w_dst = kmajor_sw128_offset(wr, wc * 8, 1024);  // rows wr + 32u: + 4 KB each
    [[maybe_unused]] uint64_t* w_full = bars + 2 * kStages;
    [[maybe_unused]] uint64_t* w_empty = w_full + kW2Stages;
    // kWide (OuterArgs::tc16_w_third): the third warpgroup's part in phase 2, W's chunks 2 and 3
    // (mode 2: and 5 and 6) of round dg, loaded from L2 into registers (2 and 3 at once, 5 and 6
    // each once the chunk before it in those registers is stored), each stored into its slot (in
    // the map's 128-byte swizzle) as soon as this block's first two warpgroups have retired the
    // chunk that held that slot (tc16_wide_third_barrier), and announced on its full mbarrier:
    // the producer's copy would wait for every block's release and then for L2.
    [[maybe_unused]] auto third_wg_w_chunks = [&](int dg) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      const int q = tid & 127, piece = q & 7, row0 = q >> 3;  // 16-byte piece `piece` of rows row0 + 16u
      uint4 v[2][8];
      const T* src = w_blk + int64_t(min(dg + row0, D - 1)) * K2 + piece * 8;
      const int valid_rows = D - dg - row0;  // row row0 + 16u lies below D where 16u < valid_rows
      auto load = [&](uint4 (&dst)[8], int kc) {
#pragma unroll
        for (int u = 0; u < 8; ++u)
          dst[u] = ld_global_cg16z(src + (16 * u < valid_rows ? 16 * u * K2 : 0) + kc * 64,
                                   16 * u < valid_rows);  // (zeros past D, as the map's copy fills them)
      };
      auto store = [&](const uint4 (&val)[8], int kc) {
        const int slot = tc16_wide_w_slot(kc);
        named_barrier(tc16_wide_third_barrier(kc), kThreadsC);  // the slot's chunk before retired here
        fence_proxy_async_smem();
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const int row = row0 + 16 * u;  // of the chunk's 128 rows of d: half row / 64
          *reinterpret_cast<uint4*>(smem + tc16_wide_w_half(slot, row >> 6, L.w) +
                                    kmajor_sw128_offset(row & 63, piece * 8, 1024)) = val[u];
        }
        fence_proxy_async_smem();  // visible to the tensor cores
        named_barrier(5, 128);     // every piece stored before the chunk is announced
        if (q == 0) mbarrier_arrive_local(w_full + kc);  // (kWide: chunk kc's own pair)
      };
      load(v[0], 2);
      load(v[1], 3);
      store(v[0], 2);
      const bool more = p.tc16_w_third > 1;
      if (more) load(v[0], 5);
      store(v[1], 3);
      if (more) {
        load(v[1], 6);
        store(v[0], 5);
        store(v[1], 6);
      }
#endif
    };
    // kWide: this warpgroup's products of the tile's 16 chunks of W (H = 32) into acc2, the chunk
    // loop unrolled.  Each chunk's slot, its MMAs' descriptors and the third warpgroup's barriers
    // are then constants from a few bases, its buffer chunk kc's own and its parity the tile's
    // (every tile takes the 16 chunks); the rolled loop spent ~110 instructions a chunk on them,
    // most waiting on the one before, against the chunk's 384 MMA cycles (run 355's samples).
    // (The parity from tile_it: a running count of chunks, spilled, was reloaded from L2 before
    // chunk 0, ~580 cycles a tile in run 359's w0_wait.)
    [[maybe_unused]] auto wide_w_chunks = [&](float* acc2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      if constexpr (kWide) {
        constexpr int kChunks = kW2Stages, kHalf = kT16Wg2ChunkBytes / 2;
        const unsigned parity = unsigned(tile_it) & 1u;
        // this warpgroup's half of slots A-B (from L.w), S0-S3 (from 0) and H01-H23 (a slice each)
        const uint64_t w_desc_ab = wgmma_desc(smem + L.w + wg * kHalf, 16, 1024);
        const uint64_t w_desc_s = wgmma_desc(smem + wg * kHalf, 16, 1024);
        const uint64_t w_desc_h = wgmma_desc(smem + wg * kT16WideSlice + kT16Wg2ChunkBytes, 16, 1024);
        const uint64_t o_desc = wgmma_desc(smem, 16, 2048);
#pragma unroll
        for (int kc = 0; kc < kChunks; ++kc) {
          const long long t0 = trace_rec != nullptr ? clock64() : 0;
          mbarrier_wait_parity_suspend(w_full + kc, parity);
          if (trace_rec != nullptr) mark(kT16MarkWChunk, kc | int(min(clock64() - t0, 0x7fffffll) << 8));
          if (kc == 0) mark(kT16MarkW0, 0);
          const int slot = tc16_wide_w_slot(kc);
          const uint64_t w_desc = slot < 2   ? w_desc_ab + uint64_t((slot * kT16Wg2ChunkBytes) >> 4)
                                  : slot < 6 ? w_desc_s + uint64_t(((slot - 2) * kT16WideSlice) >> 4)
                                             : w_desc_h + uint64_t((2 * (slot - 6) * kT16WideSlice) >> 4);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < 4; ++kk)
            wgmma_m64n96k16_kmajor<T>(acc2, w_desc + uint64_t(kk * (32 >> 4)),
                                      o_desc + uint64_t((tc16_wide_o(0, kc) + kk * 32) >> 4));
          wgmma_commit();
          wgmma_wait<1>();
          if (kc > 0) release(w_empty + kc - 1);  // retired by this warpgroup
          // (the chunks that a later chunk's copy waits for: tc16_wide_w_after's 0-7)
          if (kCluster == 2 && p.tc16_w_local != 0 && kc > 0 && kc - 1 < 8 && (warp & 3) == 0 && lane == 0)
            mbarrier_arrive_local(w_full + 2 * kW2Stages + 2 + kc - 1);
          // (this block's chunk kc - 1 retired: to the third warpgroup where it stores the
          // chunk that follows it in its slot)
          if (p.tc16_w_third > 0 && (kc == 1 || kc == 2))
            named_barrier_arrive(tc16_wide_third_barrier(kc + 1), kThreadsC);
          if (p.tc16_w_third > 1 && (kc == 3 || kc == 4))
            named_barrier_arrive(tc16_wide_third_barrier(kc + 2), kThreadsC);
        }
        // (retired here, inside the branch of the warpgroups that issue them: ptxas serialises
        // every MMA where products still in flight meet the other warpgroup's path)
        wgmma_wait<0>();
      }
#endif
    };
    // (kWide: one group of d and one round a tile, D <= kTcDG and P = kRound checked at launch)
    for (int dg = 0; dg < (kWide ? 1 : D); dg += kTcDG) {
      bool d_ok[kTcDG / 32];
#pragma unroll
      for (int u = 0; u < kTcDG / 32; ++u) d_ok[u] = dg + wr + 32 * u < D;
      for (int r0 = 0; r0 < (kWide ? kRound : P); r0 += kRound) {
        // running source: row dg + wr of W (k in O's order) at the next chunk to issue
        const T* w_src = w_blk + int64_t(dg + wr) * K2 + wc * 8;
        // Chunk kc of W, nothing past the last (the caller still commits a group, empty).
        auto issue_w = [&](int kc) {
          if (kc < n_kc) {
            char* st = w_st + (kc % kW2Stages) * kT16Wg2ChunkBytes + w_dst;
#pragma unroll
            for (int u = 0; u < kTcDG / 32; ++u)
              cp_async16z(st + u * 4096, d_ok[u] ? w_src + int64_t(32 * u) * K2 : w_blk, d_ok[u]);
            w_src += 64;
          }
        };
        if constexpr (kTma) {
          fence_proxy_async_smem();  // O, visible to the tensor cores
          consumers_sync();          // O written / the previous round's rows consumed
        } else {
          __syncthreads();  // O written / the previous round's partial sums consumed
#pragma unroll
          for (int kc = 0; kc < kW2Stages - 2; ++kc) {
            issue_w(kc);
            cp_async_commit();
          }
        }
        mark(kT16MarkRound, r0);
        if (dg > 0 || r0 > 0) stage_round_rows(r0);  // (the first round's staged in phase 1)
        // (kWide: loaded where its stores are, after phase 2: a value loaded here and kept
        // through phase 2 goes to local memory, and the spill's store waits for the load)
        float round_bias[8];
        if constexpr (!kWide) load_bias(dg, round_bias);
        const char* o_round = smem + (r0 >> 3) * o_sbo;
        // The tile's last round's sums over O of column tile 0, clear of the stages: kTma, stored
        // beside the next tile's first MMAs (see stores_pending); resident without tensor copies,
        // stored while the next tile's first stages load (see stages_ahead).
        // (kWide: the one round of the tile, D <= kTcDG and P = kRound checked at launch)
        const bool tile_last_round = kWide || (dg + kTcDG >= D && r0 + kRound >= P);
        // (kWide: always, its one round's sums fit nowhere but over O)
        const bool last_round = kTma && (kWide || p.tc16_defer) && tile_last_round;
        const bool next_ahead = !kTma && tile_last_round && next_b >= 0 && L.stages >= kRound * kRedLd * 4;
        float* red = reinterpret_cast<float*>(last_round || next_ahead ? smem : w_st);  // [64 pairs][kTcDG + 4]
        // The round's products and sums into red.
        {
          // rows d, columns the round's pairs (kWide: 96, one m64n96k16; the third warpgroup has no d)
          constexpr int kAcc2 = kRound / 2;
          const bool p2_wg = wg < 2;
          if (kWide && !p2_wg && p.tc16_w_third) third_wg_w_chunks(dg);  // (before the accumulators, which it does not hold)
          float acc2[kAcc2];
#pragma unroll
          for (int e = 0; e < kAcc2; ++e) acc2[e] = 0.f;
          if constexpr (kWide) {
            if (p2_wg) wide_w_chunks(acc2);
          } else if (p2_wg)
          for (int kc = 0; kc < n_kc; ++kc) {
            int buf = kc % kW2Stages;
            if constexpr (kTma) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
              const int wq = w_base + kc;
              buf = wq % kW2Stages;
              const long long t0 = trace_rec != nullptr ? clock64() : 0;
              mbarrier_wait_parity_suspend(w_full + buf, (wq / kW2Stages) & 1);
              if (trace_rec != nullptr) mark(kT16MarkWChunk, kc | int(min(clock64() - t0, 0x7fffffll) << 8));
#endif
            } else {
              cp_async_wait<kW2Stages - 3>();
              fence_proxy_async_smem();  // this thread's copies (and O), visible to the tensor cores
              __syncthreads();
              // The stage refilled now was last read by the group of chunk kc - 2, which every
              // warpgroup retired before the barrier (one group stays in flight).
              issue_w(kc + kW2Stages - 2);
              cp_async_commit();
            }
            if (kc == 0) mark(kT16MarkW0, 0);
            const char* st = w_st + buf * kT16Wg2ChunkBytes;
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
              wgmma_m64n64k16_kmajor<T>(acc2, wgmma_desc(st + wg * 64 * 128 + kk * 32, 16, 1024),
                                        wgmma_desc(o_round + kc * 1024 + kk * 32, 16, o_sbo));
            wgmma_commit();
            wgmma_wait<1>();
            if constexpr (kTma)  // the previous chunk's products retired by this warpgroup
              if (kc > 0) release(w_empty + (w_base + kc - 1) % kW2Stages);
          }
          wgmma_wait<0>();
          mark(kT16MarkP2Done, 0);
          if constexpr (kTma) {
            if constexpr (kWide) {
              if (p2_wg) release(w_empty + kW2Stages - 1);
            } else {
              if (p2_wg) release(w_empty + (w_base + n_kc - 1) % kW2Stages);
              w_base += n_kc;
            }
            // every W read done: the stage area takes the sums (the next round's chunks wait for
            // every block's round to be stored)
            consumers_sync();
          } else {
            cp_async_wait_all();
            __syncthreads();  // every W read done: the stage area takes the sums
            // the next tile's first stages, into buffers under O of column tile 1 and W, now read
            if (next_ahead) {
              begin_stages(next_row * Ti, next_col * Tj * kT16JSub, next_b);
              stages_ahead = true;
            }
          }
          // acc2: rows d = 64wg + 16wl + g (+8), columns (pairs) 8j + 2t (+1)
          if (p2_wg)
#pragma unroll
          for (int j = 0; j < kRound / 8; ++j)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int d = wg * 64 + wl * 16 + g + 8 * half, pr = 8 * j + 2 * t;
              red[(kWide ? tc16_wide_red_row(pr) : pr * kRedLd) + d] = acc2[4 * j + 2 * half];
              red[(kWide ? tc16_wide_red_row(pr + 1) : (pr + 1) * kRedLd) + d] = acc2[4 * j + 2 * half + 1];
            }
        }
        consumers_sync();
        mark(kT16MarkSums, 0);
        if (last_round) {
          if constexpr (kWide) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
            if (store_warps) {
              // stored by the producer warpgroup's other warps beside the next tile's phase 1
              // (the 128 accumulators leave the consumers no registers to hold the round's bias
              // and addresses into it)
              if (tid == 0) mbarrier_arrive_local(bars + 2 * kStages + 2 * kW2Stages + 1);
            } else {
              // stored now, beside the next tile's first stages loading (its sums lie clear of
              // the stages); every thread done with the sums and rows before the next tile's
              // rows and O overlay them, and every block's producer told (W's first slots lie
              // over the sums)
              load_bias(dg, round_bias);
              store_rows(std::integral_constant<int, kRound>{}, red, row_off, norm_arg, dg, round_bias);
              fence_proxy_async_smem();
              consumers_sync();
              if (tid < kShare) mbarrier_arrive_in(bars + 2 * kStages + 2 * kW2Stages, unsigned(tid), rank);
            }
#endif
          } else {
            stores_pending = true;
            pending_dg = dg;
#pragma unroll
            for (int e = 0; e < 8; ++e) pending_bias[e] = round_bias[e];
          }
          mark(kT16MarkStored, 0);
          continue;
        }
        store_rows(std::integral_constant<int, kRound>{}, red, row_off, norm_arg, dg, round_bias);
        mark(kT16MarkStored, 0);
        if constexpr (kTma) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
          // the sums read: this block's round stored, to every block's producer (the next
          // round's chunks and the next tile's stages land over the sums)
          fence_proxy_async_smem();
          consumers_sync();
          if (tid < kShare) mbarrier_arrive_in(bars + 2 * kStages + 2 * kW2Stages, unsigned(tid), rank);
#endif
        }
      }
    }
    return;
  }

  // ---------------- phase 2: warps 4 (32 d each) x 2 (halves of each k chunk), 64 pairs ----------------
  const int n_kc = K2 / kT16KC;
  const int dw = warp & 3, kh = warp >> 2;

  // This thread's pieces of a W chunk: rows d = dg + tid/8 + 32u, columns k = kc0 + (tid%8)·8.
  constexpr int kWPieces = kTcDG * kT16KC / 8 / kThreadsC, kWRowStep = kThreadsC / (kT16KC / 8);
  const int w_d = tid / (kT16KC / 8), w_k = (tid % (kT16KC / 8)) * 8;
  const T* w_src = nullptr;
  int w_next = 0;  // next chunk to issue
  auto issue_w = [&](int buf, int dg) {
    T* Ws = Wst + buf * kTcDG * kT16LdW + w_d * kT16LdW + w_k;
#pragma unroll
    for (int u = 0; u < kWPieces; ++u) {
      const bool ok = w_next < n_kc && dg + w_d + u * kWRowStep < D;
      cp_async16z(Ws + u * kWRowStep * kT16LdW, ok ? w_src + int64_t(u * kWRowStep) * K2 : w_g, ok);
    }
    ++w_next;
    w_src += kT16KC;
  };
  // W's matrices: (d 0-7, k 0-7), (d 0-7, k 8-15), then d 8-15: b0, b1 of two n tiles.
  const int w_off = (dw * 32 + (lq >> 1) * 8 + lr) * kT16LdW + (lq & 1) * 8;

  for (int dg = 0; dg < D; dg += kTcDG) {
    for (int r0 = 0; r0 < P; r0 += kRound) {
      float acc2[4][4][4];
      zero_tiles(acc2);
      // O's matrices: (pairs 0-7, k 0-7), (pairs 8-15, k 0-7), then k 8-15: a0..a3.  Pairs past
      // P read row P-1: computed, never stored.
      const T* orow[4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
        orow[mt] = Os + min(r0 + mt * 16 + (lq & 1) * 8 + lr, P - 1) * L.ldo + (lq >> 1) * 8;

      __syncthreads();  // O written / previous round's W and partial sums consumed
      w_src = w_g + int64_t(dg + w_d) * K2 + w_k;
      w_next = 0;
#pragma unroll
      for (int st = 0; st < kT16WStages - 1; ++st) {
        issue_w(st, dg);
        cp_async_commit();
      }
      stage_round_rows(r0);
      for (int kc = 0; kc < n_kc; ++kc) {
        cp_async_wait<kT16WStages - 2>();
        __syncthreads();
        issue_w((kc + kT16WStages - 1) % kT16WStages, dg);
        cp_async_commit();
        const T* Ws = Wst + (kc % kT16WStages) * kTcDG * kT16LdW + w_off;
#pragma unroll
        for (int ks = 0; ks < kT16KC / 32; ++ks) {
          const int kl = (kT16KC / 32 * kh + ks) * 16;  // k within the chunk
          uint32_t af[4][4], bw[2][4];
#pragma unroll
          for (int mt = 0; mt < 4; ++mt) ldmatrix_x4(af[mt], orow[mt] + kc * kT16KC + kl);
#pragma unroll
          for (int np = 0; np < 2; ++np) ldmatrix_x4(bw[np], Ws + np * 16 * kT16LdW + kl);
          mma_16bit_tiles<T>(acc2, af, bw);
        }
      }
      cp_async_wait_all();
      __syncthreads();  // all W reads done: the stage area takes the partial sums
      // The two k halves' sums meet in shared memory, next to each pair's output row.
      float* red = reinterpret_cast<float*>(Wst);  // [64 pairs][kTcDG + 4]
      constexpr int kRedLd = kTcDG + 4;
      sum_k_halves<4>(red, kRedLd, acc2, kh, dw * 32, g, t);
      store_round<kRound, true>(p, red, kRedLd, row_off, norm_arg, dg, tid, kThreadsC);
    }
  }
  };  // tile

  if constexpr (kTma) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    for (int lin = blockIdx.x / kShare, it = 0; lin < n_groups; lin += gridDim.x / kShare, ++it) {
      int col_tile, row_group, b;
      tc16_group_tile(p, lin, n_col_blocks, n_row_groups, col_tile, row_group, b);
      tile(col_tile, kShare * row_group + int(rank), b, it);
    }
    if constexpr (!kWide) {
      if (stores_pending) {
        store_pending_half(0);
        store_pending_half(1);
      }
    }
    cluster_barrier();  // the peers' last arrivals on this block's mbarriers made before it exits
#endif
  } else if constexpr (kWgmmaBoth) {
    // a row of blocks taking tiles in turn (one block a tile where the launch has as many), each
    // tile's first stages issued beside the epilogue of the block's tile before
    const int n_col_blocks = (N + Tj * kT16JSub - 1) / (Tj * kT16JSub), n_row_tiles = (p.Na + Ti - 1) / Ti;
    const int n_tiles = n_col_blocks * n_row_tiles * p.B;
    int lin = blockIdx.x, col_tile = 0, row_tile = 0, b = 0;
    if (lin < n_tiles) tc16_group_tile(lin, n_col_blocks, n_row_tiles, col_tile, row_tile, b);
    for (int it = 0; lin < n_tiles; ++it) {
      const int nxt = lin + int(gridDim.x);
      next_b = -1;
      if (nxt < n_tiles) tc16_group_tile(nxt, n_col_blocks, n_row_tiles, next_col, next_row, next_b);
      tile(col_tile, row_tile, b, it);
      lin = nxt;
      col_tile = next_col;
      row_tile = next_row;
      b = next_b;
    }
  } else {
    int col_tile, row_tile;
    grouped_tile(col_tile, row_tile);
    tile(col_tile, row_tile, int(blockIdx.z), 0);
  }
#else
  target_lacks_instructions();
#endif
}

template <typename T, bool kWgmma, bool kWgmmaBoth, int kBK = kT16BK, int kNT = kTcNT>
__global__ void __launch_bounds__(kTcThreads, 1) opm_outer_tc16_kernel(const OuterArgs p) {
  outer_tc16_body<T, kWgmma, kWgmmaBoth, kBK, kNT, 0>(p, nullptr);
}

// The tensor-copy forms (kT16WgmmaTma, kT16WgmmaPair, kT16WgmmaQuad; kWide: kT16WgmmaTmaWide,
// kT16WgmmaPairWide): two (kWide: three) consumer warpgroups and a producer warpgroup, launched as a
// row of clusters of kCluster blocks.
template <typename T, int kCluster, bool kWide = false>
__global__ void __launch_bounds__(Tc16Shape<kWide>::kTmaThreads, 1) opm_outer_tc16_cluster_kernel(
    const OuterArgs p, const __grid_constant__ Tc16Maps maps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  outer_tc16_body<T, true, true, kT16BK, kTcNT, kCluster, kWide>(p, &maps);
#else
  target_lacks_instructions();
#endif
}

}  // namespace flashopm
