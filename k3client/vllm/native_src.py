"""The C++ source of ``k3client.vllm.native`` (built there by ``load_inline``): ``rowmm`` and ``experts``.

``rowmm(x, w)``: ``x @ w.T``, float32 ``x [M, K]`` against a row-major bf16 view
``w [N, K]`` (``native``'s docstring has its layout rules and summation order).

``experts(x, views, counts, at, scales, tokens, act, reduced, out)``: one layer's
gated experts of one rank in one call, what ``k3client.runtime.compute.fused``
does per expert with ``native.gated_expert`` and then sums, with no Python between
experts.  Its bits are that path's bits, by construction:

- ``x``: float32 ``[T, K]``, the step's tokens' rows (a row of the step reads
  ``x[tokens[r]]``; an expert's rows are gathered for ``rowmm``); ``views[i]``: expert i's
  ``(gate_up, down)`` or ``(gate, up, down)`` (bf16, rows contiguous, any row
  stride: a TP shard's strided down columns too); ``counts[i]``: its rows, which
  start at row ``at`` of the step's order and follow each other in ``views``' order
  (ascending expert ids); ``scales``: the routing weight of each of the step's rows
  (float32 values); ``tokens``: the token of each of those rows;
- per expert: gate and up by ``rowmm`` into scratch laid out as the per-expert
  path's tensors (one ``[n, 2I]`` for a ``gate_up`` view, its gate half read with
  rows ``2I`` apart, as ``chunk`` gives it; else two contiguous ``[n, I]``), ATen's
  own ``silu_out``/``gelu_out`` on that gate (``act``: 0 silu, 1 gelu, 2 gelu tanh;
  ATen's result depends on the tensor's shape and strides, since a vectorised
  loop's tail is scalar, so they are the per-expert path's), times up, rounded to
  bf16 and back where ``reduced`` (a bf16 engine; round to nearest even, as
  ``Tensor.to``), the down ``rowmm``, each value times its row's weight in float32;
- ``out`` (float32 ``[T, H]``, or None): the weighted rows are added to ``out[token]``
  in the order given (ascending expert, then token order): ``index_add_``'s order
  over zeros; with None a new ``out`` is made, zeros for several tokens, the first
  expert's values for one token (the per-expert path's ``add_`` chain starts there).
  Compiled with ``-ffp-contract=off``, so no product and sum are fused into one
  rounding.  Returns ``out``.
"""

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>
#include <vector>

// bytes of w's rows ahead of the one being read that are prefetched: each row of an arena view (1 KiB
// for a 512-wide expert, half of it in a TP shard's down columns) is too short for the hardware
// prefetcher to ramp up; 8 KiB ahead read a cold shard 1.4-1.7x faster here (bench/README.md)
constexpr int64_t PREFETCH_BYTES = 8192;

// M rows of x against rows [n0, n1) of w: out[m, n] = sum_k x[m, k] * w[n, k].  (Unrolling over
// 2-4 rows of w, for more independent FMA chains at M = 1, measured slower here: not done.)
template <int M>
static void block(const float* x, int64_t ldx, const uint16_t* w, int64_t ldw, float* out, int64_t ldo,
                  int64_t n0, int64_t n1, int64_t K) {
  const int64_t ahead = std::max<int64_t>(1, PREFETCH_BYTES / (2 * K)) * ldw;    // elements
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * ldw;
    const char* pf = reinterpret_cast<const char*>(wr + ahead);     // a hint: never faults, past the end too
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      if ((k & 31) == 0) _mm_prefetch(pf + 2 * k, _MM_HINT_T0);    // one 64-byte line per 32 elements
      // bf16 -> fp32 is a 16-bit shift: exact
      __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k));
      __m512 wf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * ldx + k), wf, acc[m]);
    }
    for (int m = 0; m < M; ++m) out[m * ldo + n] = _mm512_reduce_add_ps(acc[m]);
  }
}

template <int M>
static void rows(const float* x, int64_t ldx, const uint16_t* w, int64_t ldw, float* out, int64_t N, int64_t K) {
  // 64 output rows of w per task: a few KiB of w, enough to amortise a task
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) { block<M>(x, ldx, w, ldw, out, N, n0, n1, K); });
}

static void check_w(const torch::Tensor& w, int64_t K) {
  TORCH_CHECK(w.dim() == 2, "rowmm: x and w must be 2-D");
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16, "rowmm: w must be bfloat16");
  TORCH_CHECK(w.stride(1) == 1, "rowmm: rows of x and w must be contiguous");
  TORCH_CHECK(w.size(1) == K && K % 16 == 0, "rowmm: w must be [N, K] with K a multiple of 16");
}

// out [M, N] (rows N apart) = x [M, K] (rows ldx apart) @ w.T; w checked by the caller
static void mm(const float* x, int64_t ldx, int64_t M, const torch::Tensor& w, float* out) {
  const int64_t K = w.size(1), N = w.size(0);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const float* xp = x + m0 * ldx;
    float* op = out + m0 * N;
    switch (std::min<int64_t>(8, M - m0)) {
      case 1: rows<1>(xp, ldx, wp, w.stride(0), op, N, K); break;
      case 2: rows<2>(xp, ldx, wp, w.stride(0), op, N, K); break;
      case 3: rows<3>(xp, ldx, wp, w.stride(0), op, N, K); break;
      case 4: rows<4>(xp, ldx, wp, w.stride(0), op, N, K); break;
      case 5: rows<5>(xp, ldx, wp, w.stride(0), op, N, K); break;
      case 6: rows<6>(xp, ldx, wp, w.stride(0), op, N, K); break;
      case 7: rows<7>(xp, ldx, wp, w.stride(0), op, N, K); break;
      default: rows<8>(xp, ldx, wp, w.stride(0), op, N, K); break;
    }
  }
}

torch::Tensor rowmm(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "rowmm: x and w must be 2-D");
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "rowmm: x must be float32");
  TORCH_CHECK(x.stride(1) == 1, "rowmm: rows of x and w must be contiguous");
  check_w(w, x.size(1));
  auto out = torch::empty({x.size(0), w.size(0)}, x.options());
  mm(x.data_ptr<float>(), x.stride(0), x.size(0), w, out.data_ptr<float>());
  return out;
}

// h = act(g) into h, by ATen's own op: its bits depend on g's shape and strides (a vectorised loop's
// scalar tail), so g is what the per-expert path hands torch's act_fn
static void act_into(const torch::Tensor& g, const torch::Tensor& h, int64_t act) {
  if (act == 0) at::silu_out(const_cast<torch::Tensor&>(h), g);
  else at::gelu_out(const_cast<torch::Tensor&>(h), g, act == 1 ? "none" : "tanh");
}

torch::Tensor experts(const torch::Tensor& x, const std::vector<std::vector<torch::Tensor>>& views,
                      const std::vector<int64_t>& counts, int64_t at, const std::vector<double>& scales,
                      const std::vector<int64_t>& tokens, int64_t act, bool reduced,
                      c10::optional<torch::Tensor> out_) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1,
              "experts: x must be float32 [rows, K] with contiguous rows");
  TORCH_CHECK(views.size() == counts.size(), "experts: one count per expert");
  TORCH_CHECK(scales.size() == tokens.size(), "experts: one scale and one token per row");
  TORCH_CHECK(act >= 0 && act <= 2, "experts: act must be 0 (silu), 1 (gelu) or 2 (gelu tanh)");
  const int64_t K = x.size(1), T = x.size(0);
  int64_t total = 0, maxn = 0, maxi = 0;
  for (size_t i = 0; i < views.size(); ++i) {
    const auto& v = views[i];
    TORCH_CHECK(v.size() == 2 || v.size() == 3, "experts: an expert's views are (gate_up, down) or (gate, up, down)");
    TORCH_CHECK(counts[i] >= 1, "experts: an expert with no rows");
    for (size_t j = 0; j + 1 < v.size(); ++j) check_w(v[j], K);
    const int64_t I = v.size() == 2 ? v[0].size(0) / 2 : v[0].size(0);
    TORCH_CHECK(v.size() == 2 ? v[0].size(0) == 2 * I : v[1].size(0) == I,
                "experts: gate and up must have the same rows");
    check_w(v.back(), I);
    TORCH_CHECK(v.back().size(0) == views[0].back().size(0),
                "experts: every expert's down projection must have H rows");
    total += counts[i];
    maxn = std::max(maxn, counts[i]);
    maxi = std::max(maxi, I);
  }
  TORCH_CHECK(at >= 0 && at + total <= (int64_t)scales.size(), "experts: rows outside the step's");
  for (auto t : tokens) TORCH_CHECK(t >= 0 && t < T, "experts: a row's token is outside x");
  if (views.empty()) return out_.has_value() ? *out_ : torch::Tensor();
  const int64_t H = views[0].back().size(0);
  torch::Tensor out;
  bool assign = false;                      // one token and no out yet: the first expert's values start it
  if (out_.has_value()) {
    out = *out_;
    TORCH_CHECK(out.scalar_type() == torch::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(1) == H,
                "experts: out must be contiguous float32 [tokens, H]");
  } else if (T == 1) {
    out = torch::empty({1, H}, x.options());
    assign = true;
  } else {
    out = torch::zeros({T, H}, x.options());
  }
  TORCH_CHECK(out.size(0) == T, "experts: out must have x's tokens");
  float* op = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  // scratch for the largest expert of the call: gate and up side by side ([n, 2I], as a gate_up view
  // gives them), the activation h ([n, I]), the down projection ([n, H]), gathered rows of x
  auto gu = torch::empty({maxn, 2 * maxi}, x.options());
  auto hb = torch::empty({maxn * maxi}, x.options());
  std::vector<float> d(maxn * H), rowsbuf;
  int64_t r = at;
  for (size_t i = 0; i < views.size(); ++i) {
    const auto& v = views[i];
    const int64_t n = counts[i];
    const int64_t I = v.size() == 2 ? v[0].size(0) / 2 : v[0].size(0);
    const float* xe = xp + tokens[r] * x.stride(0);
    int64_t ldx = x.stride(0);
    if (n > 1) {                             // rowmm reads rows ldx apart: its tokens' rows, packed
      rowsbuf.resize(n * K);
      for (int64_t j = 0; j < n; ++j)
        std::memcpy(rowsbuf.data() + j * K, xp + tokens[r + j] * x.stride(0), K * sizeof(float));
      xe = rowsbuf.data();
      ldx = K;
    }
    float* g = gu.data_ptr<float>();
    float* u;
    int64_t ldu;
    torch::Tensor gate;                     // the tensor the per-expert path's act_fn reads
    if (v.size() == 2) {                    // rowmm(x, gate_up).chunk(2): [n, I] with rows 2I apart
      mm(xe, ldx, n, v[0], g);
      gate = torch::from_blob(g, {n, I}, {2 * I, 1}, x.options());
      u = g + I;
      ldu = 2 * I;
    } else {                                // rowmm(x, gate), rowmm(x, up): contiguous [n, I] each
      u = g + n * I;
      mm(xe, ldx, n, v[0], g);
      mm(xe, ldx, n, v[1], u);
      gate = torch::from_blob(g, {n, I}, x.options());
      ldu = I;
    }
    float* h = hb.data_ptr<float>();
    act_into(gate, torch::from_blob(h, {n, I}, x.options()), act);
    for (int64_t j = 0; j < n; ++j) {       // act(gate).mul_(up), then (reduced) .to(bf16).float()
      float* hr = h + j * I;
      const float* ur = u + j * ldu;
      for (int64_t c = 0; c < I; ++c) hr[c] = hr[c] * ur[c];
      if (reduced)
        for (int64_t c = 0; c < I; ++c) hr[c] = static_cast<float>(c10::BFloat16(hr[c]));
    }
    mm(h, I, n, v.back(), d.data());
    for (int64_t j = 0; j < n; ++j, ++r) {
      const float s = (float)scales[r];
      float* o = op + tokens[r] * H;
      const float* dr = d.data() + j * H;
      if (assign) {
        for (int64_t c = 0; c < H; ++c) o[c] = dr[c] * s;
      } else {
        for (int64_t c = 0; c < H; ++c) { const float w = dr[c] * s; o[c] = o[c] + w; }
      }
    }
    assign = false;
  }
  return out;
}
"""
