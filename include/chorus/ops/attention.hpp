#pragma once
// Scaled dot-product attention, as torch.nn.functional.scaled_dot_product_attention (PyTorch
// 2.x semantics), and the attention core that nn::MultiheadAttention shares with it. Built from
// differentiable operators: two batched GEMMs (matmul, one strided-batched GEMM each on a GPU)
// around the softmax kernel, the masks applied by where/masked_fill/add on the device. Nothing
// reads a tensor on the host, so a GPU's queue keeps running; autograd, the CUDA backend and a
// 16-bit instantiation come with the operators.
#include <cmath>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "elementwise.hpp"
#include "factory.hpp"
#include "index.hpp"
#include "linalg.hpp"
#include "minmax.hpp"
#include "reduce.hpp"
#include "shape.hpp"
#include "view.hpp"

CHORUS_NAMESPACE_BEGIN

/// An attention mask for scores of scalar type T: none, boolean (a Tensor<mask_t>, Note [masks
/// are int64]) or additive (a Tensor<T> added to the scores: 0 keeps a position, -inf removes
/// it). What a nonzero boolean element means is the caller's, as in PyTorch:
/// scaled_dot_product_attention reads it as PyTorch reads True there (takes part), while
/// nn::MultiheadAttention and the Transformer layers read it as their PyTorch counterparts do
/// (is masked out). Converts implicitly from either tensor type, from `{}` and std::nullopt.
template <class T>
class AttentionMask {
  static_assert(is_floating_v<T>, "AttentionMask<T>: T is the scores' floating-point type");

 public:
  AttentionMask() = default;
  /// No mask.
  AttentionMask(std::nullopt_t) {}                                // NOLINT
  /// A boolean mask (nonzero = true).
  AttentionMask(Tensor<mask_t> mask) : bool_(std::move(mask)) {}  // NOLINT
  /// An additive mask, added to the scores.
  AttentionMask(Tensor<T> mask) : float_(std::move(mask)) {}      // NOLINT
  /// Internal: refuses a tensor of any other scalar type at compile time, with a message.
  template <class U>
    requires(!std::is_same_v<U, T> && !std::is_same_v<U, mask_t>)
  AttentionMask(const Tensor<U>&) {  // NOLINT
    static_assert(sizeof(U) == 0,
                  "an attention mask is a boolean Tensor<std::int64_t> (nonzero = true; Note [masks are int64]) or an "
                  "additive float mask of the query's scalar type (Tensor<T>, added to the scores): convert a float "
                  "mask of another type with .to<T>()");
  }

  /// Whether there is a mask (boolean or additive).
  bool defined() const { return bool_.defined() || float_.defined(); }
  /// True for a boolean (int64) mask.
  bool is_bool() const { return bool_.defined(); }
  /// The boolean mask (an undefined tensor unless is_bool()).
  const Tensor<mask_t>& bool_mask() const { return bool_; }
  /// The additive mask (an undefined tensor for a boolean mask or none).
  const Tensor<T>& float_mask() const { return float_; }
  /// The mask's shape.
  const Shape& shape() const { return is_bool() ? bool_.shape() : float_.shape(); }
  /// The mask's device.
  Device device() const { return is_bool() ? bool_.device() : float_.device(); }
  /// The mask's number of dimensions.
  int dim() const { return shape().size(); }
  /// "a boolean (int64) mask of shape [2, 5]" / "a float mask of shape [2, 5]", for errors.
  std::string describe() const {
    std::ostringstream os;
    os << (is_bool() ? "a boolean (int64) mask" : "a float mask") << " of shape " << shape();
    return os.str();
  }
  /// The same mask with another shape of as many elements (a view where it can be one).
  AttentionMask reshape(const Shape& s) const {
    return is_bool() ? AttentionMask(bool_.reshape(s)) : AttentionMask(float_.reshape(s));
  }

 private:
  Tensor<mask_t> bool_;
  Tensor<T> float_;
};

namespace ops::detail {

/// One mask applied to the scores [..., L, S] before the softmax.
template <class T>
struct ScoreMask {
  enum Kind { Attend, Ignore, Add };  // boolean, nonzero = take part / nonzero = masked out; additive
  Kind kind;
  std::string name;  // for errors: "attn_mask", "key_padding_mask", ...
  Tensor<mask_t> bools;
  Tensor<T> values;

  /// `mask` read with PyTorch's convention for `name`: a boolean mask's nonzero elements take
  /// part (`nonzero_attends`, SDPA) or are masked out (MultiheadAttention); a float one is added.
  static ScoreMask from(const AttentionMask<T>& mask, std::string name, bool nonzero_attends) {
    if (mask.is_bool()) return {nonzero_attends ? Attend : Ignore, std::move(name), mask.bool_mask(), {}};
    return {Add, std::move(name), {}, mask.float_mask()};
  }
  const Shape& shape() const { return kind == Add ? values.shape() : bools.shape(); }
};

/// True when `from` broadcasts to `to` without growing it.
inline bool broadcasts_to(const Shape& from, const Shape& to) {
  if (from.size() > to.size()) return false;
  for (int i = 1; i <= from.size(); ++i) {
    const auto f = from[from.size() - i], t = to[to.size() - i];
    if (f != t && f != 1) return false;
  }
  return true;
}

/// softmax(q kᵀ · scale + masks) v with q [..., L, E], k [..., S, E], v [..., S, Ev] (batch
/// dimensions broadcast, as torch.matmul): (output [..., L, Ev], the attention weights
/// [..., L, S] after dropout). `op` names the caller in errors.
///
/// Note [fully masked rows]
/// A query row whose every score is -inf (all its keys masked) has no softmax: plain softmax
/// gives 0/0 = NaN, and the NaN reaches every gradient that touches the row. PyTorch 2.5 and
/// later give such rows zero attention in scaled_dot_product_attention (at::_safe_softmax, for
/// every backend: the output row is 0, its gradients are 0); its nn.MultiheadAttention still
/// gives NaN when need_weights=True (an explicit softmax) and 0 otherwise (through SDPA), and the
/// Transformer layers call it with need_weights=False, so they get 0. chorus gives 0 everywhere,
/// weights included: one rule, and the one PyTorch moved to. The rows are found on the device
/// by the softmax kernel itself (its `zero_dead` mode: a row whose maximum is -inf is written as
/// zeros), never on the host, and without extra passes over the scores. No NaN exists for the
/// softmax's backward to multiply by 0 (0·NaN is NaN): its gradient y·(g - Σ g·y) is exactly 0
/// on such a row. Without any mask the mode is off (a row is then all -inf only if the inputs
/// hold infinities, and gives NaN, as torch.softmax).
template <class T>
std::pair<Tensor<T>, Tensor<T>> attend(const char* op, const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v,
                                       const std::vector<ScoreMask<T>>& masks, double dropout_p, double scale) {
  constexpr double inf = std::numeric_limits<double>::infinity();
  // Scaling q (L·E elements) costs less than scaling the scores (L·S), and keeps them small in 16 bits.
  auto scores = matmul(mul(q, scale), k.transpose(-2, -1));  // [..., L, S]
  for (const auto& m : masks) {
    CHORUS_CHECK(m.bools.defined() || m.values.defined(), op, ": ", m.name, " is an undefined tensor");
    const Device md = m.kind == ScoreMask<T>::Add ? m.values.device() : m.bools.device();
    CHORUS_CHECK(md == q.device(), op, ": ", m.name, " is on ", md, ", the query on ", q.device(),
                 " (move it with .to(device))");
    CHORUS_CHECK(broadcasts_to(m.shape(), scores.shape()), op, ": ", m.name, " (",
                 m.kind == ScoreMask<T>::Add ? "a float mask" : "a boolean (int64) mask", ") of shape ", m.shape(),
                 " cannot be broadcast to the attention scores' shape ", scores.shape(), " ([..., L, S])");
    switch (m.kind) {
      case ScoreMask<T>::Add:
        scores = add(scores, m.values);
        break;
      case ScoreMask<T>::Ignore:
        scores = masked_fill(scores, m.bools, -inf);
        break;
      case ScoreMask<T>::Attend:
        scores = where(m.bools, scores, -inf);
        break;
    }
  }
  // Note [fully masked rows]: with a mask, rows of -inf get zeros.
  Tensor<T> attn = softmax_impl(scores, -1, false, !masks.empty());
  if (dropout_p > 0.0) attn = dropout(attn, dropout_p, true);
  return {matmul(attn, v), attn};
}

/// A view of x [..., n·m] (unit stride in its last dimension) as [..., n, m], recorded.
template <class T>
Tensor<T> unflatten_last(const Tensor<T>& x, std::int64_t n, std::int64_t m) {
  const int d = x.dim();
  CHORUS_CHECK(d >= 1 && x.shape()[d - 1] == n * m && (x.strides()[d - 1] == 1 || x.numel() == 0),
               "unflatten_last: cannot view shape ", x.shape(), " as [..., ", n, ", ", m, "]");
  Shape s = x.shape();
  Strides st = x.strides();
  s[d - 1] = n;
  st[d - 1] = m;
  s.push_back(m);
  st.push_back(1);
  auto out = make_view(x, s, st, x.storage_offset());
  if (autograd::needs_grad(x)) {
    auto node = autograd::make_node<ReshapeBackward<T>, T>({&x}, x.shape());
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

}  // namespace ops::detail

/// softmax(query keyᵀ · scale + mask) value, as torch.nn.functional.scaled_dot_product_attention
/// (PyTorch 2.x): query [..., L, E], key [..., S, E], value [..., S, Ev] → [..., L, Ev], the
/// batch dimensions broadcast. `attn_mask` broadcasts to [..., L, S]: boolean (int64, nonzero =
/// takes part, as PyTorch's True) or additive (a float mask). `dropout_p` drops attention weights
/// whenever it is positive (as in PyTorch, there is no training flag: pass 0 in evaluation).
/// `is_causal`: query i attends keys j <= i (top-left aligned when L != S); an explicit
/// attn_mask with it is an error. `scale` defaults to 1/sqrt(E). A query whose keys are all
/// masked gets zeros (Note [fully masked rows]).
template <class T>
Tensor<T> scaled_dot_product_attention(const Tensor<T>& query, const Tensor<T>& key, const Tensor<T>& value,
                                       const std::type_identity_t<AttentionMask<T>>& attn_mask = {},
                                       double dropout_p = 0.0, bool is_causal = false,
                                       std::optional<double> scale = std::nullopt) {
  static_assert(is_floating_v<T>, "scaled_dot_product_attention needs floating-point tensors");
  constexpr const char* op = "scaled_dot_product_attention";
  ops::detail::check_defined(op, query, "query");
  ops::detail::check_defined(op, key, "key");
  ops::detail::check_defined(op, value, "value");
  ops::detail::check_same_device(op, query, key);
  ops::detail::check_same_device(op, query, value);
  CHORUS_CHECK(
      query.dim() >= 2 && key.dim() >= 2 && value.dim() >= 2, op,
      ": query, key and value need at least 2 dimensions ([..., L, E], [..., S, E], [..., S, Ev]), got shapes ",
      query.shape(), ", ", key.shape(), " and ", value.shape());
  const int qd = query.dim(), kd = key.dim(), vd = value.dim();
  const std::int64_t L = query.shape()[qd - 2], E = query.shape()[qd - 1], S = key.shape()[kd - 2];
  CHORUS_CHECK(key.shape()[kd - 1] == E, op,
               ": query and key need the same embedding size E (their last dimension), got query of shape ",
               query.shape(), " and key of shape ", key.shape());
  CHORUS_CHECK(value.shape()[vd - 2] == S, op,
               ": key and value need the same sequence length S (dimension -2), got key of shape ", key.shape(),
               " and value of shape ", value.shape());
  auto batch = [](const Shape& s) { return Shape(std::span<const std::int64_t>(s.begin(), s.end() - 2)); };
  (void)broadcast_shapes(broadcast_shapes(batch(query.shape()), batch(key.shape()), op), batch(value.shape()), op);
  CHORUS_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0, op, ": dropout_p must be in [0, 1], got ", dropout_p);
  CHORUS_CHECK(!(is_causal && attn_mask.defined()), op, ": an explicit attn_mask (", attn_mask.describe(),
               ") must not be given with is_causal = true (is_causal makes the mask)");
  std::vector<ops::detail::ScoreMask<T>> masks;
  if (attn_mask.defined()) masks.push_back(ops::detail::ScoreMask<T>::from(attn_mask, "attn_mask", true));
  if (is_causal)
    masks.push_back(
        {ops::detail::ScoreMask<T>::Attend, "the causal mask", tril(ones<mask_t>({L, S}, query.device())), {}});
  const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(E)));
  return ops::detail::attend(op, query, key, value, masks, dropout_p, s).first;
}

namespace nn::functional {
using chorus::scaled_dot_product_attention;
}  // namespace nn::functional

CHORUS_NAMESPACE_END
