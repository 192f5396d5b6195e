// CUDA compressors, sparse family (issue 27 split of compressors.cu): the
// radix select shared by topk and dgc, dgc's sampled threshold refinement,
// the sparse index check and scatter; topk/dgc encoders and decoder.
#include "compress/cuda/internal.cuh"

namespace bytecomp::compress::cuda::impl {
namespace {

// --- radix select -----------------------------------------------------------------------


// Histogram of digit `pass` of the keys matching the prefix. With EF (first
// pass of topk), p = g + beta r is formed into r on the way.
template <bool EF>
__global__ void k_hist(const float* src, const float* g, float beta, uint64_t n, int pass,
                       const Select* sel, uint32_t* __restrict hist, Gate gate) {
  __shared__ uint32_t h[hd::kRadixMaxBuckets];
  if (gate.closed()) return;
  uint32_t nb = hd::radix_buckets(pass);
  for (uint32_t b = threadIdx.x; b < nb; b += blockDim.x) h[b] = 0;
  __syncthreads();
  uint32_t prefix = sel->prefix;
  float* rw = const_cast<float*>(src);
  for (uint64_t i = gtid(); i < n; i += gstride()) {
    float v = src[i];
    if (EF) {
      v = g[i] + beta * v;
      rw[i] = v;
    }
    uint32_t key = hd::abs_key(v);
    if (hd::radix_prefix_matches(key, prefix, pass)) atomicAdd(&h[hd::radix_digit(key, pass)], 1u);
  }
  __syncthreads();
  for (uint32_t b = threadIdx.x; b < nb; b += blockDim.x)
    if (h[b]) atomicAdd(&hist[b], h[b]);
}

// One block of 1024 threads; thread t tests buckets nb-1-2t and nb-2-2t
// (walking from the top), the winner extends the prefix. Clears the
// histogram for the next use.
__global__ void k_select(uint32_t* hist, int pass, Select* sel, Gate gate) {
  __shared__ uint32_t sh[32];
  if (gate.closed()) return;
  uint32_t nb = hd::radix_buckets(pass);
  uint32_t t = threadIdx.x;
  uint32_t b_hi = nb - 1 - 2 * t, b_lo = nb - 2 - 2 * t;
  bool own = 2 * t + 1 < nb;
  uint32_t c_hi = own ? hist[b_hi] : 0, c_lo = own ? hist[b_lo] : 0;
  // Exclusive scan over 1024 threads of c_hi + c_lo.
  uint32_t v = c_hi + c_lo, x = v;
  unsigned lane = t & 31, warp = t >> 5;
  for (int o = 1; o < 32; o <<= 1) {
    uint32_t y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= static_cast<unsigned>(o)) x += y;
  }
  if (lane == 31) sh[warp] = x;
  __syncthreads();
  if (warp == 0) {
    uint32_t w = sh[lane];
    for (int o = 1; o < 32; o <<= 1) {
      uint32_t y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= static_cast<unsigned>(o)) w += y;
    }
    sh[lane] = w;
  }
  __syncthreads();
  uint32_t above = (warp ? sh[warp - 1] : 0) + x - v;
  uint32_t need = sel->need, prefix = sel->prefix;
  __syncthreads();
  if (own) {
    uint32_t s = hd::radix_shift(pass);
    if (hd::bucket_holds_rank<uint32_t>(above, c_hi, need)) {
      sel->prefix = prefix | (b_hi << s);
      sel->need = need - above;
    } else if (hd::bucket_holds_rank<uint32_t>(above + c_hi, c_lo, need)) {
      sel->prefix = prefix | (b_lo << s);
      sel->need = need - above - c_hi;
    }
    hist[b_hi] = 0;
    hist[b_lo] = 0;
  }
}

// Per tile: keys above the threshold and keys equal to it.
__global__ void k_tile_count(const float* __restrict v, uint64_t n, const Select* sel,
                             uint32_t* __restrict gt, uint32_t* __restrict eq, Gate gate) {
  __shared__ uint32_t sh[32];
  if (gate.closed()) return;
  uint32_t T = sel->prefix;
  uint64_t base = static_cast<uint64_t>(blockIdx.x) * kTile;
  uint32_t a = 0, e = 0;
  for (uint32_t r = 0; r < kRounds; ++r) {
    uint64_t i = base + r * kThreads + threadIdx.x;
    if (i < n) {
      uint32_t key = hd::abs_key(v[i]);
      a += key > T;
      e += key == T;
    }
  }
  uint32_t ta, te;
  block_exclusive(a, sh, &ta);
  block_exclusive(e, sh, &te);
  if (threadIdx.x == 0) gt[blockIdx.x] = ta, eq[blockIdx.x] = te;
}

// One block: eq_before[t] = equal keys in earlier tiles; picks per tile =
// gt + the equal keys still needed; off[t] = picks before tile t.
__global__ void k_tile_scan(const uint32_t* gt, const uint32_t* eq, uint32_t tiles, Select* sel,
                            uint32_t* off, uint32_t* eq_before, Gate gate) {
  __shared__ uint32_t sh[32];
  if (gate.closed()) return;
  uint32_t need = sel->need;
  uint32_t carry_eq = 0, carry_off = 0;
  for (uint32_t b = 0; b < tiles; b += kThreads) {
    uint32_t t = b + threadIdx.x;
    uint32_t e = t < tiles ? eq[t] : 0, tot_e;
    uint32_t eb = carry_eq + block_exclusive(e, sh, &tot_e);
    uint32_t take = 0;
    if (t < tiles) {
      uint32_t room = need == kAll ? e : (need > eb ? need - eb : 0);
      take = gt[t] + (e < room ? e : room);
      eq_before[t] = eb;
    }
    uint32_t tot_o;
    uint32_t o = carry_off + block_exclusive(take, sh, &tot_o);
    if (t < tiles) off[t] = o;
    carry_eq += tot_e;
    carry_off += tot_o;
  }
  if (threadIdx.x == 0) sel->total = carry_off;
}

// Writes the picks of each tile in index order: indices at out_idx, values
// at out_idx + total (the sparse payload), clearing them in z1/z2.
__global__ void k_tile_write(const float* v, uint64_t n, const Select* sel, const uint32_t* off,
                             const uint32_t* eq_before, uint32_t* out_idx, float* z1, float* z2) {
  __shared__ uint32_t sh[32];
  uint32_t T = sel->prefix, need = sel->need, total = sel->total;
  float* out_val = reinterpret_cast<float*>(out_idx + total);
  uint64_t base = static_cast<uint64_t>(blockIdx.x) * kTile;
  uint32_t pos = off[blockIdx.x], eqs = eq_before[blockIdx.x];
  for (uint32_t r = 0; r < kRounds; ++r) {
    uint64_t i = base + r * kThreads + threadIdx.x;
    uint32_t key = 0;
    float x = 0;
    if (i < n) {
      x = v[i];
      key = hd::abs_key(x);
    }
    bool is_eq = i < n && key == T, is_gt = i < n && key > T;
    uint32_t eq_tot;
    uint32_t eq_rank = eqs + block_exclusive(is_eq ? 1u : 0u, sh, &eq_tot);
    bool pick = is_gt || (is_eq && (need == kAll || eq_rank < need));
    uint32_t pick_tot;
    uint32_t p = pos + block_exclusive(pick ? 1u : 0u, sh, &pick_tot);
    if (pick) {
      out_idx[p] = static_cast<uint32_t>(i);
      out_val[p] = x;
      if (z1 != nullptr) z1[i] = 0.0f;
      if (z2 != nullptr) z2[i] = 0.0f;
    }
    pos += pick_tot;
    eqs += eq_tot;
  }
}

__global__ void k_select_init(Select* sel, uint32_t need) {
  if (threadIdx.x == 0) *sel = {0, need, 0, 0};
}

// --- dgc ----------------------------------------------------------------------------------

__global__ void k_dgc_update(const float* __restrict g, float* __restrict u, float* __restrict v,
                             float m, uint64_t n, uint64_t stride, float* __restrict sample) {
  for (uint64_t i = gtid(); i < n; i += gstride()) {
    float ui = m * u[i] + g[i];
    u[i] = ui;
    float vi = v[i] + ui;
    v[i] = vi;
    if (i % stride == 0) sample[i / stride] = fabsf(vi);
  }
}


__global__ void k_dgc_init(DgcCtl* c, Select* ss, double rank, uint64_t s) {
  if (threadIdx.x != 0) return;
  c->phase = kRefine;
  c->thr = 0.0f;
  c->rank = rank;
  double r = fmin(fmax(ceil(rank), 1.0), static_cast<double>(s));
  *ss = {0, static_cast<uint32_t>(r), 0, 0};
}

// After a sample select: the threshold (the first, or the lower of the new
// sample rank and half the old one), then count.
__global__ void k_dgc_threshold(DgcCtl* c, const Select* ss, Select* sv, bool first) {
  if (threadIdx.x != 0 || c->phase != kRefine) return;
  float next = hd::u2f(ss->prefix);
  c->thr = first ? next : (next < c->thr ? next : c->thr * 0.5f);
  *sv = {hd::abs_key(c->thr), kAll, 0, 0};
  c->phase = kCount;
}

// The CPU library's decision after a collect (sparse.cc, Dgc::select).
__global__ void k_dgc_decide(DgcCtl* c, Select* ss, Select* sv, uint32_t attempt, uint32_t refine,
                             uint64_t k, uint64_t s) {
  if (threadIdx.x != 0 || c->phase != kCount) return;
  uint64_t got = sv->total;
  if (got * 10 > k * 13) {
    c->phase = kTrim;
    *sv = {0, static_cast<uint32_t>(k), 0, 0};
  } else if (got * 10 >= k * 7 || attempt >= refine || c->thr <= 0.0f) {
    c->phase = kTakeAll;
  } else {
    c->rank *= static_cast<double>(k) / static_cast<double>(got > 1 ? got : 1);
    double r = fmin(fmax(ceil(c->rank), 1.0), static_cast<double>(s));
    *ss = {0, static_cast<uint32_t>(r), 0, 0};
    c->phase = kRefine;
  }
}

// --- sparse decode ---------------------------------------------------------------------------

// Checks the index list of a sparse buffer of `size` bytes before anything
// is decoded: *bad gets the lowest failing position (or stays ~0). Reads only
// inside the buffer whatever its header says; the host rejects bad headers.
__global__ void k_check_sparse(const uint8_t* buf, uint64_t size, unsigned long long* bad) {
  if (size < 40) return;
  uint32_t plen = *reinterpret_cast<const uint32_t*>(buf + 8);
  uint64_t count = *reinterpret_cast<const uint64_t*>(buf + 16);
  uint64_t k = *reinterpret_cast<const uint64_t*>(buf + 32);
  if (plen != 8 || k > (size - 40) / 8 || 40 + 8 * k != size) return;
  const uint32_t* idx = reinterpret_cast<const uint32_t*>(buf + 40);
  for (uint64_t j = gtid(); j < k; j += gstride())
    if (idx[j] >= count || (j > 0 && idx[j] <= idx[j - 1])) atomicMin(bad, static_cast<unsigned long long>(j));
}

__global__ void k_sparse_scatter(const uint32_t* __restrict idx, const float* __restrict val,
                                 uint64_t k, float* __restrict out) {
  for (uint64_t j = gtid(); j < k; j += gstride()) out[idx[j]] += val[j];
}

}  // namespace

void launch_check_sparse(const std::byte* in, size_t size, unsigned long long* bad, cudaStream_t s) {
  k_check_sparse<<<grid_for(size / 8, 4096), kThreads, 0, s>>>(reinterpret_cast<const uint8_t*>(in), size,
                                                             bad);
  ck_launch("index check");
}

// --- codecs ---------------------------------------------------------------------

// Three histogram passes and selects over v[0, n) for sel's need; the
// first pass forms p = g + beta r into v when g is given.
void CudaCompressor::radix(const float* v, const float* g, uint64_t n, CudaState& st, Select* sel, Gate gate,
                           cudaStream_t s) const {
  for (int pass = 0; pass < hd::kRadixPasses; ++pass) {
    if (pass == 0 && g != nullptr)
      k_hist<true><<<grid_for(n, 2048), kThreads, 0, s>>>(v, g, beta_, n, pass, sel, st.hist.as<uint32_t>(), gate);
    else
      k_hist<false><<<grid_for(n, 2048), kThreads, 0, s>>>(v, g, beta_, n, pass, sel, st.hist.as<uint32_t>(), gate);
    ck_launch("radix histogram");
    k_select<<<1, 1024, 0, s>>>(st.hist.as<uint32_t>(), pass, sel, gate);
    ck_launch("radix select");
  }
}

void CudaCompressor::tile_counts(const float* v, uint64_t n, CudaState& st, Select* sel, Gate gate, cudaStream_t s) const {
  uint32_t t = static_cast<uint32_t>(tiles(n));
  uint32_t* tl = st.tiles.as<uint32_t>();
  k_tile_count<<<t, kThreads, 0, s>>>(v, n, sel, tl, tl + t, gate);
  ck_launch("tile count");
  k_tile_scan<<<1, kThreads, 0, s>>>(tl, tl + t, t, sel, tl + 2 * t, tl + 3 * t, gate);
  ck_launch("tile scan");
}

void CudaCompressor::tile_write(const float* v, uint64_t n, CudaState& st, Select* sel, std::byte* out, float* z1,
                                float* z2, cudaStream_t s) const {
  uint32_t t = static_cast<uint32_t>(tiles(n));
  uint32_t* tl = st.tiles.as<uint32_t>();
  k_tile_write<<<t, kThreads, 0, s>>>(v, n, sel, tl + 2 * t, tl + 3 * t,
                                      reinterpret_cast<uint32_t*>(out + kHeaderBytes + 8), z1, z2);
  ck_launch("tile write");
}

size_t CudaCompressor::encode_topk(const float* x, size_t n, std::byte* out, CudaState& st, cudaStream_t s) const {
  uint64_t k = hd::sparse_k(n, ratio_);
  if (n) {
    auto* sel = st.sel.as<Select>();
    const float* v = ef_ ? st.r.as<float>() : x;
    k_select_init<<<1, 32, 0, s>>>(sel, static_cast<uint32_t>(k));
    ck_launch("select init");
    radix(v, ef_ ? x : nullptr, n, st, sel, Gate{nullptr, 0}, s);
    tile_counts(v, n, st, sel, Gate{nullptr, 0}, s);
    tile_write(v, n, st, sel, out, ef_ ? st.r.as<float>() : nullptr, nullptr, s);
  }
  HeaderArgs h = header_args(algo_, n, 8, 8 * k);
  hd::put_le(h.params, k, 8);
  launch_header(out, h, s);
  return kHeaderBytes + 8 + 8 * k;
}

size_t CudaCompressor::encode_dgc(const float* g, size_t n, std::byte* out, CudaState& st, const CompressContext& ctx,
                                  cudaStream_t s) const {
  uint64_t k = hd::sparse_k(n, hd::dgc_ratio_at(ratio_, warmup_, ctx.iteration));
  if (n == 0) {
    HeaderArgs h = header_args(algo_, 0, 8, 0);
    launch_header(out, h, s);
    return kHeaderBytes + 8;
  }
  float* u = st.u.as<float>();
  float* v = st.v.as<float>();
  float* sample = st.sample.as<float>();
  uint64_t ns = (n + stride_ - 1) / stride_;
  auto* ctl = st.ctl.as<DgcCtl>();
  auto* ss = st.sel_sample.as<Select>();
  auto* sv = st.sel.as<Select>();
  const uint32_t* phase = &ctl->phase;
  k_dgc_update<<<grid_for(n), kThreads, 0, s>>>(g, u, v, momentum_, n, stride_, sample);
  ck_launch("dgc update");
  double rank = static_cast<double>(ns) * static_cast<double>(k) / static_cast<double>(n);
  k_dgc_init<<<1, 32, 0, s>>>(ctl, ss, rank, ns);
  ck_launch("dgc init");
  for (uint32_t attempt = 0; attempt <= refine_; ++attempt) {
    radix(sample, nullptr, ns, st, ss, Gate{phase, kRefine}, s);
    k_dgc_threshold<<<1, 32, 0, s>>>(ctl, ss, sv, attempt == 0);
    ck_launch("dgc threshold");
    tile_counts(v, n, st, sv, Gate{phase, kCount}, s);
    k_dgc_decide<<<1, 32, 0, s>>>(ctl, ss, sv, attempt, refine_, k, ns);
    ck_launch("dgc decide");
  }
  radix(v, nullptr, n, st, sv, Gate{phase, kTrim}, s);
  tile_counts(v, n, st, sv, Gate{phase, kTrim}, s);
  tile_write(v, n, st, sv, out, v, u, s);
  HeaderArgs h = header_args(algo_, n, 8, 0);
  h.k_dev = &sv->total;
  launch_header(out, h, s);
  // The one host read of the call: how many were picked.
  auto* host = st.count_host->as<Select>();
  ck(cudaMemcpyAsync(host, sv, sizeof(Select), cudaMemcpyDeviceToHost, s), "dgc count");
  ck(cudaStreamSynchronize(s), "dgc count");
  return kHeaderBytes + 8 + 8 * static_cast<uint64_t>(host->total);
}

void CudaCompressor::decode_sparse(const detail::Parsed& p, const std::byte* payload,
                                   unsigned long long bad, float* out, bool add, cudaStream_t s) const {
  uint64_t n = p.count;
  const char* a = detail::algo_name(algo_);
  expect_params(p, 8);
  uint64_t k = param<uint64_t>(p, 0);
  if (k > n) malformed(std::string(a) + " sends " + std::to_string(k) + " elements of " + std::to_string(n));
  expect_payload(p, 8 * k, "k = " + std::to_string(k));
  if (bad != ~0ull)
    malformed(std::string(a) + " index #" + std::to_string(bad) +
              " is out of range or not above the previous index");
  if (!n) return;
  if (!add) ck(cudaMemsetAsync(out, 0, n * sizeof(float), s), "sparse decode");
  if (k) {
    auto* idx = reinterpret_cast<const uint32_t*>(payload);
    k_sparse_scatter<<<grid_for(k), kThreads, 0, s>>>(idx, reinterpret_cast<const float*>(idx + k), k, out);
    ck_launch("sparse scatter");
  }
}

}  // namespace bytecomp::compress::cuda::impl
