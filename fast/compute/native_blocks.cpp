// The lean Llama block loop of a flat forward, in C++ (fast/compute/native.py builds it once per machine),
// and the element-wise kernels both block loops share.
//
// The loop calls the same operators, in the same order and on the same operands, as the Python path:
// fast/compute/lean_llama.py's LeanBlock.forward with these kernels, the SlotCache's update
// (fast/compute/slot_cache.py), fast/compute/attention.py's flat_attention and plain_attention, and
// fast/compute/kernels.py's choice of product. So its output is bitwise the Python path's
// (tests/test_native_blocks.py): what it saves is the Python interpreter around some 30 operators a
// layer. Decisions that depend on the forward (the row plan of each product, the flat attention's parts,
// where new K/V go) are made in Python once per forward and passed in.
//
// The element-wise kernels (RMS norm, rotation, SiLU product) each replace 3-8 of torch's operators and
// their temporaries by one pass over the rows. Each computes every row on its own, in an order that does
// not depend on how many rows there are, so a row's result is the same in a decoding step and in a
// verify (row invariance, I8), and whichever thread computes it: rows are shared among torch's threads
// in runs of at least torch's grain of element-wise work (at::internal::GRAIN_SIZE elements), so a
// decoding step's few rows stay on one thread and a prefill's hundreds use them all.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>

using at::Tensor;

namespace {

// ---- element-wise kernels -------------------------------------------------------------------------

// exp(x) in float: Cephes' expf (range reduction by n ln 2 in two parts, a degree-6 polynomial), written
// without branches or library calls so that loops over it vectorize; within 2 ulp of std::exp on
// [-87, 88]; 0 below, and x clamped at 88.
inline float exp_float(float x) {
  const float clamped = std::min(std::max(x, -87.0f), 88.0f);
  const float t = clamped * 1.44269504088896341f;
  const float n = std::floor(t + 0.5f);
  float r = clamped - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.0f ? 0.0f : y * scale;
}
inline double exp_of(double x) { return std::exp(x); }  // float64: the library's, correctly rounded or nearly
inline float exp_of(float x) { return exp_float(x); }

template <typename T> struct Acc { using type = float; };   // what a T row computes in
template <> struct Acc<double> { using type = double; };

// f(first, last) over [0, rows) in runs of at least GRAIN_SIZE elements (`width` a row), on torch's threads.
template <typename F> void over_rows(int64_t rows, int64_t width, const F& f) {
  at::parallel_for(0, rows, std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, width)), f);
}

constexpr int LANES = 16;  // partial sums kept side by side: a fixed order, whatever the row count

// x [.., width] -> x * rsqrt(mean(x^2) + eps) * weight, each row alone (torch.rms_norm up to rounding).
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  const Tensor input = x.contiguous();
  const Tensor w = weight.to(x.scalar_type()).contiguous();
  Tensor out = at::empty_like(input);
  const int64_t width = input.size(-1), rows = width ? input.numel() / width : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "rms_norm", [&] {
    using A = typename Acc<scalar_t>::type;
    const scalar_t* in = input.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    over_rows(rows, width, [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) {
        const scalar_t* a = in + r * width;
        A part[LANES] = {};  // part[j]: the squares of a[d] for d % LANES == j, in order of d
        int64_t d = 0;
        for (; d + LANES <= width; d += LANES)
          for (int j = 0; j < LANES; ++j) part[j] += A(a[d + j]) * A(a[d + j]);
        for (int j = 0; d + j < width; ++j) part[j] += A(a[d + j]) * A(a[d + j]);
        for (int half = LANES / 2; half >= 1; half /= 2)
          for (int j = 0; j < half; ++j) part[j] += part[j + half];
        const A inverse = A(1) / std::sqrt(part[0] / A(width) + A(eps));
        for (d = 0; d < width; ++d) o[r * width + d] = scalar_t(A(a[d]) * inverse * A(wp[d]));
      }
    });
  });
  return out;
}

// x [B, Q, heads, D] (rows of D contiguous), cos and signed_sin [B, Q, 1, D]: x * cos + x.roll(D / 2) *
// signed_sin (transformers' rotary embedding: see lean_llama.rotate), contiguous.
Tensor rotate(const Tensor& x, const Tensor& cos, const Tensor& signed_sin) {
  const Tensor input = x.stride(-1) == 1 ? x : x.contiguous();
  const int64_t batch = input.size(0), queries = input.size(1), heads = input.size(2), dim = input.size(3);
  const int64_t half = dim / 2;
  // [B, Q, 1, D] rows of angles, one per (b, q), as broadcasting would read them: no copy where they
  // already are
  const auto angles = [&](const Tensor& t) {
    return t.to(x.scalar_type()).expand({batch, queries, 1, dim}).contiguous();
  };
  const Tensor c = angles(cos), s = angles(signed_sin);
  Tensor out = at::empty({batch, queries, heads, dim}, input.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "rotate", [&] {
    using A = typename Acc<scalar_t>::type;
    const scalar_t* in = input.data_ptr<scalar_t>();
    const scalar_t* cp = c.data_ptr<scalar_t>();
    const scalar_t* sp = s.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    over_rows(batch * queries, heads * dim, [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; ++i) {
        const int64_t b = i / queries, q = i % queries, angle = i * dim;
        for (int64_t h = 0; h < heads; ++h) {
          const scalar_t* a = in + b * input.stride(0) + q * input.stride(1) + h * input.stride(2);
          scalar_t* y = o + ((b * queries + q) * heads + h) * dim;
          for (int64_t d = 0; d < dim; ++d) {
            const A rolled = A(a[d < half ? d + half : d - half]);
            y[d] = scalar_t(A(scalar_t(A(a[d]) * A(cp[angle + d]))) + A(scalar_t(rolled * A(sp[angle + d]))));
          }
        }
      }
    });
  });
  return out;
}

// gate_up [.., 2 I] (gate, then up) -> silu(gate) * up [.., I], silu(g) = g / (1 + exp(-g)).
Tensor silu_mul(const Tensor& gate_up) {
  const Tensor input = gate_up.contiguous();
  const int64_t width = input.size(-1) / 2, rows = width ? input.numel() / (2 * width) : 0;
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = width;
  Tensor out = at::empty(shape, input.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "silu_mul", [&] {
    using A = typename Acc<scalar_t>::type;
    const scalar_t* in = input.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    over_rows(rows, 2 * width, [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) {
        const scalar_t* g = in + r * 2 * width;
        const scalar_t* u = g + width;
        for (int64_t d = 0; d < width; ++d) {
          const A gate = A(g[d]);
          o[r * width + d] = scalar_t(gate / (A(1) + exp_of(-gate)) * A(u[d]));
        }
      }
    });
  });
  return out;
}

// out [rows, N], the product of x [.., K] flattened to rows, in x's leading shape: [.., N].
Tensor leading_shape(const Tensor& out, const Tensor& x) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(out.size(-1));
  return out.view(shape);
}

// One linear layer: torch's product on `weight` (plan 0), or oneDNN's on its prepacked copy with the
// rows padded to `plan` (fast.compute.row_plan.product).
Tensor product(const Tensor& x, const Tensor& weight, const Tensor& packed, int64_t plan) {
  if (plan == 0)  // at::linear's own path for an input of 2+ dimensions and no bias, one call
    return leading_shape(at::mm(x.reshape({-1, x.size(-1)}), weight.t()), x);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, c10::string_view,
                                     c10::List<std::optional<c10::Scalar>>, std::optional<c10::string_view>)>();
  const c10::List<std::optional<c10::Scalar>> no_scalars;
  const int64_t rows = x.size(-1) ? x.numel() / x.size(-1) : 0;
  if (plan == rows) return op.call(x, packed, std::nullopt, "none", no_scalars, "");
  Tensor flat = x.reshape({rows, x.size(-1)});
  flat = at::cat({flat, flat.narrow(0, 0, 1).expand({plan - rows, -1})});  // copies of row 0, dropped below
  return leading_shape(op.call(flat, packed, std::nullopt, "none", no_scalars, "").narrow(0, 0, rows), x);
}

// plain_attention: softmax(q k^T * scaling + mask) v for q [B, H, Q, D], k/v [B, Hkv, S, D], mask
// [B, 1, Q, S]; or SDPA's kernel where the plan measured it faster (sdpa).
Tensor plain_attention(Tensor q, const Tensor& k, const Tensor& v, const Tensor& mask, double scaling, bool sdpa) {
  const auto out_dtype = q.scalar_type();
  if (sdpa) {
    Tensor out = at::scaled_dot_product_attention(q.to(k.scalar_type()), k, v, mask.to(k.scalar_type()), 0.0,
                                                  false, scaling, q.size(1) != k.size(1));
    return out.to(out_dtype);
  }
  if (k.scalar_type() != q.scalar_type()) q = q.to(k.scalar_type());
  const int64_t batch = q.size(0), heads = q.size(1), queries = q.size(2), dim = q.size(3);
  const int64_t kv_heads = k.size(1), slots = k.size(2), group = heads / kv_heads;
  Tensor scores = at::bmm(q.reshape({batch * kv_heads, group * queries, dim}),
                          k.reshape({batch * kv_heads, slots, dim}).transpose(1, 2));  // [B Hkv, G Q, S]
  if (scores.scalar_type() == at::kHalf || scores.scalar_type() == at::kBFloat16) scores = scores.to(at::kFloat);
  scores.mul_(scaling);
  scores.view({batch, kv_heads, group, queries, slots}).add_(mask.unsqueeze(2));
  Tensor probs = scores.softmax(-1);
  if (probs.scalar_type() != v.scalar_type()) probs = probs.to(v.scalar_type());
  Tensor out = at::bmm(probs, v.reshape({batch * kv_heads, slots, v.size(-1)})).view({batch, heads, queries, v.size(-1)});
  return out.scalar_type() == out_dtype ? out : out.to(out_dtype);
}

// The rows of one FlatPart: a run [row_start, row_stop) (a view) or the rows in row_index (a copy).
struct Part {
  int64_t row_start, row_stop, length, run_start, run_stop;  // run_start < 0: queries gathered by `tokens`
  Tensor row_index, tokens, mask, cells, targets;

  Tensor rows_of(const Tensor& cache) const {
    if (row_start >= 0) return cache.slice(0, row_start, row_stop).slice(2, 0, length);
    return cache.slice(2, 0, length).index_select(0, row_index);
  }
};

// flat_attention: query [1, H, T, D] holds every row's queries end to end; returns [1, T, H, D].
Tensor flat_attention(const Tensor& query, const Tensor& keys, const Tensor& values, const std::vector<Part>& parts,
                      double scaling, bool sdpa) {
  const int64_t heads = query.size(1), tokens = query.size(2), dim = values.size(-1);
  const Tensor flat_q = query.select(0, 0);  // [H, T, D]
  Tensor out;
  for (const Part& part : parts) {
    const int64_t n = part.mask.size(0), width = part.mask.size(2);
    Tensor picked = part.run_start >= 0 ? flat_q.slice(1, part.run_start, part.run_stop)
                                        : flat_q.index_select(1, part.tokens);
    Tensor q = picked.view({heads, n, width, query.size(-1)}).transpose(0, 1);
    Tensor o = plain_attention(q, part.rows_of(keys), part.rows_of(values), part.mask, scaling, sdpa);
    o = o.transpose(1, 2).reshape({n * width, heads, dim});  // [n Qmax, H, D]
    if (parts.size() == 1 && part.run_start >= 0) return o.unsqueeze(0);
    if (!out.defined()) out = o.new_empty({1, tokens, heads, dim});
    if (part.run_start >= 0)
      out.select(0, 0).slice(0, part.run_start, part.run_stop).copy_(o);
    else
      out.select(0, 0).index_copy_(0, part.targets, o.index_select(0, part.cells));
  }
  return out;
}

}  // namespace

// Every block of a flat forward. Per layer l: norms[2l], norms[2l + 1] (attention and MLP norm
// weights); weights[4l + j] and packed[4l + j] for j = q/k/v, output, gate/up, down, with plans[j]
// the row plan of product j (the same in every layer: one shape class per j); keys[l], values[l]
// the layer's cache buffers, written at rows `write` of their [-1, D] views, read as rows [0, rows)
// and slots [0, kv_len). Parts: the flat attention's parts, field by field.
Tensor flat_blocks(Tensor hidden, const Tensor& cos, const Tensor& signed_sin, const std::vector<Tensor>& norms,
                   const std::vector<Tensor>& weights, const std::vector<Tensor>& packed, std::vector<int64_t> plans,
                   const std::vector<Tensor>& keys, const std::vector<Tensor>& values, const Tensor& write,
                   int64_t rows, int64_t kv_len, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
                   double scaling, bool sdpa, std::vector<int64_t> part_ints, std::vector<Tensor> part_tensors) {
  std::vector<Part> parts;
  for (size_t i = 0; i < part_ints.size() / 5; ++i) {
    const int64_t* a = &part_ints[5 * i];
    const Tensor* t = &part_tensors[5 * i];
    parts.push_back(Part{a[0], a[1], a[2], a[3], a[4], t[0], t[1], t[2], t[3], t[4]});
  }
  const int64_t batch = hidden.size(0), queries = hidden.size(1);
  const int64_t rotated = heads + kv_heads;
  for (size_t l = 0; l < keys.size(); ++l) {
    const Tensor* w = &weights[4 * l];
    const Tensor* p = &packed[4 * l];
    Tensor x = rms_norm(hidden, norms[2 * l], eps);
    Tensor qkv = product(x, w[0], p[0], plans[0]).view({batch, queries, -1, head_dim});  // [B, Q, H + 2 Hkv, D]
    Tensor qk = rotate(qkv.slice(2, 0, rotated), cos, signed_sin);
    Tensor q = qk.slice(2, 0, heads).transpose(1, 2);
    Tensor k = qk.slice(2, heads).transpose(1, 2);
    Tensor v = qkv.slice(2, rotated).transpose(1, 2);
    keys[l].view({-1, keys[l].size(-1)}).index_copy_(0, write, k.reshape({-1, k.size(-1)}).to(keys[l].scalar_type()));
    values[l].view({-1, values[l].size(-1)})
        .index_copy_(0, write, v.reshape({-1, v.size(-1)}).to(values[l].scalar_type()));
    const Tensor key = keys[l].slice(0, 0, rows).slice(2, 0, kv_len);
    const Tensor value = values[l].slice(0, 0, rows).slice(2, 0, kv_len);
    if (key.scalar_type() != q.scalar_type()) q = q.to(key.scalar_type());
    Tensor out = flat_attention(q, key, value, parts, scaling, sdpa).to(hidden.scalar_type());  // [1, T, H, D]
    hidden = hidden + product(out.reshape({batch, queries, -1}), w[1], p[1], plans[1]);
    x = rms_norm(hidden, norms[2 * l + 1], eps);
    hidden = hidden + product(silu_mul(product(x, w[2], p[2], plans[2])), w[3], p[3], plans[3]);
  }
  return hidden;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("flat_blocks", &flat_blocks, "every block of a lean Llama flat forward");
  m.def("rms_norm", &rms_norm, "x * rsqrt(mean(x^2) + eps) * weight, row by row");
  m.def("rotate", &rotate, "x * cos + x.roll(D / 2) * signed_sin, contiguous");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate/up product");
}
