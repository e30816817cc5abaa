// The cast-transpose tile machinery, written once: tile shapes, the tile load into registers, the
// row-major and transposed FP8 stores through a shared tile, and the amax / scale_inv epilogue.
//
// A tile is kRows x 64 elements of a (rows, cols) row-major tensor, handled by one 256-thread
// block. Thread tid owns the N consecutive columns col(tid) = (tid % kThreadsPerRow) * N and the
// rows row(tid, l) = l * kRowGroups + tid / kThreadsPerRow, l < kLoads.
//   Vector shape (rows and cols multiples of 16, 16-byte-aligned pointers): 128 x 64 tiles and
//   N = 16 / sizeof(T), one 16-byte load per (thread, l). The FP8 bytes go into a swizzled
//   128 x 64 shared tile; its transpose is 64 rows of 128 bytes, and thread (j = tid / 4,
//   quarter = tid % 4) writes input rows quarter * 32 .. + 31 of tile column j with two 16-byte
//   stores, so every warp writes whole 128-byte lines of out_t.
//   Scalar shape (any other tensor): 64 x 64 tiles, N = 1, a 64 x 65 shared tile (the padding
//   column keeps the column reads free of bank conflicts) and byte stores.
#pragma once

#include <initializer_list>
#include <type_traits>

#include "fp8_util.cuh"
#include "vec.cuh"

namespace graphfp8::cuda {

constexpr int kTileThreads = 256;
constexpr int kTileCols = 64;
// One block per tile (the block scheduler overlaps tiles better than a persistent loop did:
// notes/PERF.md, v4), at most this many per SM and launch: ~2^30 elements on an H200.
constexpr int kTileBlocksPerSm = 1024;

template <typename T, bool kVec>
struct TileShape {
  static constexpr int kRows = kVec ? 128 : 64;
  static constexpr int kCols = kTileCols;
  static constexpr int N = kVec ? Vec<T>::N : 1;  // elements per load
  static constexpr int kThreadsPerRow = kCols / N;
  static constexpr int kRowGroups = kTileThreads / kThreadsPerRow;
  static constexpr int kLoads = kRows / kRowGroups;
  using Frag = std::conditional_t<kVec, uint4, T>;  // what one load brings

  __device__ static int col() { return (threadIdx.x % kThreadsPerRow) * N; }
  __device__ static int group() { return threadIdx.x / kThreadsPerRow; }
  __device__ static int row(int l) { return l * kRowGroups + group(); }
};

// Whether the vector shape applies: both dims multiples of 16 and every given pointer 16-byte
// aligned (nullptr: an operand the kernel does not have).
inline bool vec_tiles_ok(int64_t rows, int64_t cols, const void* p0, const void* p1,
                         const void* p2 = nullptr, const void* p3 = nullptr) {
  if (rows % 16 != 0 || cols % 16 != 0) return false;
  for (const void* p : {p0, p1, p2, p3}) {
    if (p != nullptr && !aligned16(p)) return false;
  }
  return true;
}

// Where a tile lies. Tiles are numbered row of tiles by row of tiles.
struct TilePos {
  int64_t r0, c0;  // first row and column
  int64_t tile_r;  // its row of tiles
};

template <typename S>
struct TileGrid {
  int64_t rows, cols, tiles_c, num_tiles;
  __host__ __device__ TileGrid(int64_t r, int64_t c)
      : rows(r),
        cols(c),
        tiles_c(ceil_div(c, S::kCols)),
        num_tiles(ceil_div(r, S::kRows) * tiles_c) {}
  __device__ TilePos at(int64_t t) const {
    const int64_t tile_r = t / tiles_c;
    return {tile_r * S::kRows, (t % tiles_c) * S::kCols, tile_r};
  }
  __device__ bool in(int64_t r, int64_t c) const { return r < rows && c < cols; }
};

// Launches launch_chunk(blocks, first_tile) for consecutive chunks of the tiles, one block per
// tile and at most grid_size(num_tiles, kTileBlocksPerSm) blocks per launch (one launch for every
// realistic tensor). The kernels take the index of their first tile instead of looping over
// tiles: a loop cost the fused kernels 15-18 registers per thread and an occupancy step.
template <typename LaunchChunk>
inline Status launch_tiles(int64_t num_tiles, const char* kernel, LaunchChunk&& launch_chunk) {
  const int grid = grid_size(num_tiles, kTileBlocksPerSm);
  for (int64_t first = 0; first < num_tiles; first += grid) {
    const int64_t left = num_tiles - first;
    launch_chunk(static_cast<int>(left < grid ? left : grid), first);
    const Status st = check_launch(kernel);
    if (!st.ok()) return st;
  }
  return Status{};
}

// Issues every load of the thread's part of the tile before any is used: more bytes in flight.
template <typename S, typename T>
__device__ __forceinline__ void load_tile(const T* __restrict__ x, const TileGrid<S>& g,
                                          const TilePos& t, typename S::Frag (&raw)[S::kLoads]) {
  const int64_t gc = t.c0 + S::col();
#pragma unroll
  for (int l = 0; l < S::kLoads; ++l) {
    const int64_t gr = t.r0 + S::row(l);
    if (g.in(gr, gc)) {
      const T* p = x + gr * g.cols + gc;
      if constexpr (S::N == 1) {
        raw[l] = *p;
      } else {
        raw[l] = __ldg(reinterpret_cast<const uint4*>(p));
      }
    }
  }
}

// The N elements of one load as floats.
template <typename S, typename T>
__device__ __forceinline__ void frag_to_floats(const typename S::Frag& raw, float (&f)[S::N]) {
  if constexpr (S::N == 1) {
    f[0] = to_float(raw);
  } else if constexpr (sizeof(T) == 4) {
    unpack(raw, f);
  } else {
    unpack<T>(raw, f);
  }
}

// The N bytes of one load of an FP8 tensor.
template <typename S>
__device__ __forceinline__ void frag_to_bytes(const typename S::Frag& raw, uint8_t (&b)[S::N]) {
  if constexpr (S::N == 1) {
    b[0] = raw;
  } else {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < S::N; ++k) b[k] = static_cast<uint8_t>(w[k / 4] >> (8 * (k % 4)));
  }
}

// The FP8 bytes of one tile in shared memory (layouts above).
template <bool kVec>
struct SharedTile;

template <>
struct SharedTile<true> {
  __align__(16) uint8_t b[128][kTileCols];
  // Unit u (16 bytes) of row r is stored at u ^ ((r / 32) & 3): the four 32-row quarters read in
  // the transposed phase fall in different banks.
  __device__ static int swizzle(int r, int byte) {
    return ((((byte >> 4) ^ (r >> 5)) & 3) << 4) | (byte & 15);
  }
  __device__ uint8_t* at(int r, int c) { return &b[r][swizzle(r, c)]; }
};

template <>
struct SharedTile<false> {
  uint8_t b[64][kTileCols + 1];
  __device__ uint8_t* at(int r, int c) { return &b[r][c]; }
};

// Stores the N bytes that the thread converted for row r of the tile into the shared tile.
template <typename S, bool kVec>
__device__ __forceinline__ void stage(SharedTile<kVec>& tile, int r, const uint8_t (&q)[S::N]) {
  store_bytes<S::N>(tile.at(r, S::col()), q);
}

// Writes the shared tile (after a barrier) transposed into out_t (cols, rows).
template <typename S, bool kVec>
__device__ __forceinline__ void store_transposed(SharedTile<kVec>& tile,
                                                 uint8_t* __restrict__ out_t, const TileGrid<S>& g,
                                                 const TilePos& t) {
  if constexpr (kVec) {
    static_assert(S::kRows == 128, "the vector store covers 128 rows: 4 quarters of 32");
    const int j = threadIdx.x / 4;
    const int quarter = threadIdx.x % 4;
    const int64_t gj = t.c0 + j;
    if (gj >= g.cols) return;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i0 = quarter * 32 + half * 16;
      const int64_t gi = t.r0 + i0;
      if (gi < g.rows) {  // rows % 16 == 0: all 16 rows are in range
        uint8_t b[16];
#pragma unroll
        for (int k = 0; k < 16; ++k) b[k] = *tile.at(i0 + k, j);
        store_bytes<16>(out_t + gj * g.rows + gi, b);
      }
    }
  } else {
    for (int e = threadIdx.x; e < S::kRows * S::kCols; e += kTileThreads) {
      const int j = e / S::kRows;
      const int i = e % S::kRows;
      const int64_t gj = t.c0 + j;
      const int64_t gi = t.r0 + i;
      if (gj < g.cols && gi < g.rows) out_t[gj * g.rows + gi] = *tile.at(i, j);
    }
  }
}

// store_transposed for vector tiles with 4-byte shared reads (kernel switch PAIRED_QUANTIZE):
// thread (j4 = tid / 16, rg = tid % 16) reads tile rows 8 rg .. 8 rg + 7 of columns 4 j4 ..
// 4 j4 + 3 as eight words, transposes them in registers (two 4x4 byte transposes, 8 byte
// permutes each) and writes 8 bytes to each of the 4 rows of out_t: per warp, two whole 128-byte
// lines per store. The bytes land where store_transposed puts them (the same tile, the same
// out_t), with ~1 instruction per byte instead of ~3 (one LDS.U8 per byte and its packing).
template <typename S>
__device__ __forceinline__ void store_transposed_words(SharedTile<true>& tile,
                                                       uint8_t* __restrict__ out_t,
                                                       const TileGrid<S>& g, const TilePos& t) {
  static_assert(S::kRows == 128, "16 groups of 8 rows");
  const int j4 = threadIdx.x / 16;
  const int rg = threadIdx.x % 16;
  const int64_t gi = t.r0 + rg * 8;
  if (gi >= g.rows || t.c0 + j4 * 4 >= g.cols) return;  // rows, cols % 16 == 0: all or nothing
  uint32_t w[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) w[k] = *reinterpret_cast<const uint32_t*>(tile.at(rg * 8 + k, j4 * 4));
  uint32_t col[4][2];  // col[c][h]: column 4 j4 + c, rows 4 h .. 4 h + 3 of the eight
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t* v = w + 4 * h;
    const uint32_t a = __byte_perm(v[0], v[1], 0x5140), b = __byte_perm(v[0], v[1], 0x7362);
    const uint32_t c = __byte_perm(v[2], v[3], 0x5140), d = __byte_perm(v[2], v[3], 0x7362);
    col[0][h] = __byte_perm(a, c, 0x5410);
    col[1][h] = __byte_perm(a, c, 0x7632);
    col[2][h] = __byte_perm(b, d, 0x5410);
    col[3][h] = __byte_perm(b, d, 0x7632);
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    *reinterpret_cast<uint2*>(out_t + (t.c0 + j4 * 4 + c) * g.rows + gi) =
        make_uint2(col[c][0], col[c][1]);
  }
}

// Every kernel that casts with a scale ends here: folds the block's amax into *amax (one atomic
// per block) and block 0 writes scale_inv = 1 / scale. Every thread of the block must call it.
__device__ __forceinline__ void amax_epilogue(float amax, float* amax_out, float* scale_inv,
                                              float scale) {
  block_amax_atomic(amax, amax_out);
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = 1.0f / scale;
}

// The epilogue of a current-scaling cast (current_scale.cuh): its own amax goes nowhere.
template <bool kCurrent>
__device__ __forceinline__ void cast_epilogue(float amax, float* amax_out, float* scale_inv,
                                              float scale) {
  if constexpr (kCurrent) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = 1.0f / scale;
  } else {
    amax_epilogue(amax, amax_out, scale_inv, scale);
  }
}

}  // namespace graphfp8::cuda
