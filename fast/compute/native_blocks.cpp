// The lean Llama block loop of a flat forward, in C++ (fast/compute/native.py builds it once per machine).
//
// It calls the same ATen operators, in the same order and on the same operands, as the Python path:
// fast/compute/lean_llama.py's LeanBlock.forward, the SlotCache's update (fast/compute/slot_cache.py),
// fast/compute/attention.py's flat_attention and plain_attention, and fast/compute/kernels.py's choice
// of product. So its output is bitwise the Python path's (tests/test_native_blocks.py): what it saves
// is the Python interpreter around some 40 operators a layer. Decisions that depend on the forward
// (the row plan of each product, the flat attention's parts, where new K/V go) are made in Python
// once per forward and passed in.
#include <torch/extension.h>

using at::Tensor;

namespace {

// One linear layer: torch's product on `weight` (plan 0), or oneDNN's on its prepacked copy with the
// rows padded to `plan` (fast.compute.row_plan.product).
Tensor product(const Tensor& x, const Tensor& weight, const Tensor& packed, int64_t plan) {
  if (plan == 0) return at::linear(x, weight);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, c10::string_view,
                                     c10::List<std::optional<c10::Scalar>>, std::optional<c10::string_view>)>();
  const c10::List<std::optional<c10::Scalar>> no_scalars;
  const int64_t rows = x.size(-1) ? x.numel() / x.size(-1) : 0;
  if (plan == rows) return op.call(x, packed, std::nullopt, "none", no_scalars, "");
  Tensor flat = x.reshape({rows, x.size(-1)});
  flat = at::cat({flat, flat.narrow(0, 0, 1).expand({plan - rows, -1})});  // copies of row 0, dropped below
  Tensor out = op.call(flat, packed, std::nullopt, "none", no_scalars, "");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(out.size(-1));
  return out.narrow(0, 0, rows).reshape(shape);
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

// rotate: x * cos + x.roll(D / 2) * signed_sin (transformers' rotary embedding, bitwise).
Tensor rotate(const Tensor& x, const Tensor& cos, const Tensor& signed_sin) {
  return x * cos + x.roll({x.size(-1) / 2}, {-1}) * signed_sin;
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
  const int64_t batch = hidden.size(0), queries = hidden.size(1), width = hidden.size(2);
  const int64_t rotated = heads + kv_heads;
  for (size_t l = 0; l < keys.size(); ++l) {
    const Tensor* w = &weights[4 * l];
    const Tensor* p = &packed[4 * l];
    Tensor x = at::rms_norm(hidden, {width}, norms[2 * l], eps);
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
    x = at::rms_norm(hidden, {width}, norms[2 * l + 1], eps);
    std::vector<Tensor> gate_up = product(x, w[2], p[2], plans[2]).chunk(2, -1);
    hidden = hidden + product(at::silu(gate_up[0]) * gate_up[1], w[3], p[3], plans[3]);
  }
  return hidden;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("flat_blocks", &flat_blocks, "every block of a lean Llama flat forward");
}
