#pragma once
// Recurrent cells (RNNCell, LSTMCell, GRUCell) and the single time steps they share with the
// recurrent layers of rnn.hpp. Parameter names, shapes, gate order and initialisation are
// PyTorch's, so a checkpoint moves both ways:
//   weight_ih [G*hidden, input], weight_hh [G*hidden, hidden], bias_ih [G*hidden], bias_hh [G*hidden]
// with G = 1 (RNN), 4 (LSTM: gates i, f, g, o) or 3 (GRU: gates r, z, n), every one drawn from
// U(-1/sqrt(hidden), 1/sqrt(hidden)).
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "../ops/ops.hpp"
#include "init.hpp"
#include "module.hpp"

CHORUS_NAMESPACE_BEGIN
namespace nn {
namespace detail {

// Note [one split node]
// A time step reads its slice of the whole sequence's input projection, and each gate reads
// its slice of the gates. Tensor::select/narrow (and split/chunk, built on narrow) record one
// node per slice whose backward writes that slice's gradient into a zero tensor of the whole
// input's shape: over a sequence of S steps that is S tensors of the full projection's size,
// allocated, zeroed and summed by the engine -- quadratic in S. split_views records one node
// for all the pieces; its backward copies the pieces' gradients into one tensor of the input's
// shape (PyTorch's SplitBackward/UnbindBackward). It belongs in ops/ (split, chunk and an unbind
// could all use it); it lives here so that the recurrent layers need no operator from another
// branch.
template <class T>
class SplitViewsBackward final : public autograd::Node<T> {
 public:
  SplitViewsBackward(Shape in_shape, int dim, std::vector<std::int64_t> sizes, bool squeezed)
      : in_(in_shape), dim_(dim), sizes_(std::move(sizes)), squeezed_(squeezed) {}
  std::string name() const override { return squeezed_ ? "UnbindBackward" : "SplitBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    // The engine hands every output's gradient (zeros where none arrived), contiguous.
    auto out = Tensor<T>::empty(in_, g[0].device());
    const auto& st = out.strides();
    std::int64_t start = 0;
    for (std::size_t i = 0; i < sizes_.size(); ++i) {
      Shape piece = in_;
      piece[dim_] = sizes_[i];
      auto dst = ops::detail::make_view(out, piece, st, start * st[dim_]);
      backend::copy(dst, squeezed_ ? ops::detail::view_as_shape(g[i], piece) : g[i]);
      start += sizes_[i];
    }
    return {out};
  }

 private:
  Shape in_;
  int dim_;
  std::vector<std::int64_t> sizes_;
  bool squeezed_;
};

/// Views of `x` split along `dim` into pieces of `sizes` (which add up to its size there), with
/// that dimension removed when `squeeze` (all sizes 1: torch.unbind). One node records them all
/// (Note [one split node]).
template <class T>
std::vector<Tensor<T>> split_views(const Tensor<T>& x, int dim, const std::vector<std::int64_t>& sizes,
                                   bool squeeze = false) {
  std::vector<Tensor<T>> out;
  out.reserve(sizes.size());
  std::int64_t start = 0;
  for (auto n : sizes) {
    Shape s = x.shape();
    Strides st = x.strides();
    const auto offset = x.storage_offset() + start * st[dim];
    if (squeeze) {
      s.erase(dim);
      st.erase(dim);
    } else {
      s[dim] = n;
    }
    out.push_back(ops::detail::make_view(x, s, st, offset));
    start += n;
  }
  CHORUS_CHECK(start == x.shape()[dim], "split_views: sizes add up to ", start, ", expected ", x.shape()[dim]);
  if (autograd::needs_grad(x)) {
    auto node = autograd::make_node<SplitViewsBackward<T>, T>({&x}, x.shape(), dim, sizes, squeeze);
    auto base = std::shared_ptr<autograd::Node<T>>(node);
    for (auto& piece : out) autograd::set_history(piece, base);
  }
  return out;
}

/// torch.unbind(x, dim) with one node (Note [one split node]).
template <class T>
std::vector<Tensor<T>> unbind(const Tensor<T>& x, int dim) {
  return split_views(x, dim, std::vector<std::int64_t>(static_cast<std::size_t>(x.shape()[dim]), 1), true);
}

/// `n` equal pieces of x's last dimension (the gates), with one node.
template <class T>
std::vector<Tensor<T>> gate_chunks(const Tensor<T>& x, int n) {
  return split_views(x, x.dim() - 1, std::vector<std::int64_t>(static_cast<std::size_t>(n), x.shape().back() / n));
}

// The time steps. `gi` is the input projection W_ih x + b_ih of this step (computed for a whole
// sequence at once by the layers), `h`/`c` the state; the recurrent product is one GEMM, the
// gates ~10 elementwise operations.

/// Elman RNN: h' = act(gi + W_hh h + b_hh), act = tanh or relu.
template <class T>
Tensor<T> rnn_step(const Tensor<T>& gi, const Tensor<T>& h, const Tensor<T>& w_hh, const Tensor<T>& b_hh, bool relu) {
  auto pre = gi + linear(h, w_hh, b_hh);
  return relu ? chorus::relu(pre) : chorus::tanh(pre);
}

/// LSTM with PyTorch's gate order i, f, g, o: c' = f*c + i*g, h' = o*tanh(c'), then h' = W_hr h'
/// when there is a projection (proj_size > 0).
template <class T>
std::tuple<Tensor<T>, Tensor<T>> lstm_step(const Tensor<T>& gi, const Tensor<T>& h, const Tensor<T>& c,
                                           const Tensor<T>& w_hh, const Tensor<T>& b_hh, const Tensor<T>& w_hr) {
  auto g = gate_chunks(gi + linear(h, w_hh, b_hh), 4);
  auto c_next = sigmoid(g[1]) * c + sigmoid(g[0]) * chorus::tanh(g[2]);
  auto h_next = sigmoid(g[3]) * chorus::tanh(c_next);
  if (w_hr.defined()) h_next = linear(h_next, w_hr);
  return {h_next, c_next};
}

/// GRU with PyTorch's gates r, z, n: n = tanh(W_in x + b_in + r*(W_hn h + b_hn)),
/// h' = (1 - z)*n + z*h, computed as n + z*(h - n).
template <class T>
Tensor<T> gru_step(const Tensor<T>& gi, const Tensor<T>& h, const Tensor<T>& w_hh, const Tensor<T>& b_hh) {
  auto i = gate_chunks(gi, 3);
  auto hh = gate_chunks(linear(h, w_hh, b_hh), 3);
  auto r = sigmoid(i[0] + hh[0]);
  auto z = sigmoid(i[1] + hh[1]);
  auto n = chorus::tanh(i[2] + r * hh[2]);
  return n + z * (h - n);
}

inline bool parse_nonlinearity(const std::string& what, const std::string& nonlinearity) {
  CHORUS_CHECK(nonlinearity == "tanh" || nonlinearity == "relu", what, ": unknown nonlinearity '", nonlinearity,
               "' (expected \"tanh\" or \"relu\")");
  return nonlinearity == "relu";
}

/// U(-1/sqrt(hidden), 1/sqrt(hidden)) for every parameter, as PyTorch's RNNBase and RNNCellBase.
template <class T>
void reset_recurrent_parameters(const std::vector<Tensor<T>>& params, std::int64_t hidden_size) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(hidden_size));
  for (auto p : params)
    if (p.defined()) init::uniform_(p, -bound, bound);
}

/// The parameters and checks the three cells share (as LibTorch's RNNCellImplBase).
template <class T>
class RNNCellImplBase : public Module {
 public:
  std::int64_t input_size, hidden_size;
  bool bias;
  Tensor<T> weight_ih, weight_hh, bias_ih, bias_hh;

  void reset_parameters() { reset_recurrent_parameters<T>({weight_ih, weight_hh, bias_ih, bias_hh}, hidden_size); }

 protected:
  RNNCellImplBase(const char* kind, std::int64_t input_size, std::int64_t hidden_size, bool bias, int gates,
                  Device device)
      : input_size(input_size), hidden_size(hidden_size), bias(bias), kind_(kind) {
    CHORUS_CHECK(input_size > 0, kind, ": input_size must be positive, got ", input_size);
    CHORUS_CHECK(hidden_size > 0, kind, ": hidden_size must be positive, got ", hidden_size);
    const std::int64_t g = gates * hidden_size;
    register_parameter("weight_ih", &RNNCellImplBase::weight_ih, Tensor<T>::empty(Shape{g, input_size}, device));
    register_parameter("weight_hh", &RNNCellImplBase::weight_hh, Tensor<T>::empty(Shape{g, hidden_size}, device));
    if (bias) {
      register_parameter("bias_ih", &RNNCellImplBase::bias_ih, Tensor<T>::empty(Shape{g}, device));
      register_parameter("bias_hh", &RNNCellImplBase::bias_hh, Tensor<T>::empty(Shape{g}, device));
    }
    reset_parameters();
  }

  /// Checks input [batch, input_size] or unbatched [input_size]; returns it 2-D.
  Tensor<T> batched_input(const Tensor<T>& input) const {
    ops::detail::check_defined(kind_, input);
    CHORUS_CHECK(input.dim() == 1 || input.dim() == 2, kind_, ": expected input of shape (batch, input_size) or ",
                 "unbatched (input_size), got shape ", input.shape());
    CHORUS_CHECK(input.shape().back() == input_size, kind_, ": input of shape ", input.shape(), " has ",
                 input.shape().back(), " features, expected input_size=", input_size);
    CHORUS_CHECK(input.device() == weight_ih.device(), kind_, ": input is on ", input.device(),
                 " but the parameters are on ", weight_ih.device());
    return input.dim() == 1 ? input.unsqueeze(0) : input;
  }

  /// Checks a state against (batch, size) -- (size) for unbatched input -- and returns it 2-D,
  /// or zeros when it is undefined.
  Tensor<T> state(const Tensor<T>& input, const Tensor<T>& x2, const Tensor<T>& s, const char* name) const {
    if (!s.defined()) return zeros<T>(Shape{x2.shape()[0], hidden_size}, x2.device());
    const Shape want = input.dim() == 1 ? Shape{hidden_size} : Shape{x2.shape()[0], hidden_size};
    CHORUS_CHECK(s.shape() == want, kind_, ": expected ", name, " of shape ", want,
                 input.dim() == 1 ? " (hidden_size) for unbatched input" : " (batch, hidden_size)", ", got ",
                 s.shape());
    CHORUS_CHECK(s.device() == x2.device(), kind_, ": ", name, " is on ", s.device(), " but the input is on ",
                 x2.device());
    return input.dim() == 1 ? s.unsqueeze(0) : s;
  }

  /// The cell's repr: Kind(input, hidden[, bias=false]).
  std::string describe(const std::string& extra = "") const {
    return std::string(kind_) + "(" + std::to_string(input_size) + ", " + std::to_string(hidden_size) +
           (bias ? "" : ", bias=false") + extra + ")";
  }

  const char* kind_;
};
}  // namespace detail

/// RNNCell's options, braced in PyTorch's order (Note [layer options] in nn/module.hpp).
struct RNNCellOptions {
  bool bias = true;                   ///< Adds the biases bias_ih and bias_hh (default true).
  std::string nonlinearity = "tanh";  ///< The activation: "tanh" (default) or "relu".
  Device device = Device::cpu();      ///< Where the parameters are created (default CPU).
};

/// An Elman RNN cell, h' = act(W_ih x + b_ih + W_hh h + b_hh), as torch.nn.RNNCell.
template <class T = float>
class RNNCellImpl : public detail::RNNCellImplBase<T> {
 public:
  /// `input_size` features in, `hidden_size` features of state (both positive); every parameter drawn
  /// from U(-1/sqrt(hidden_size), 1/sqrt(hidden_size)).
  RNNCellImpl(std::int64_t input_size, std::int64_t hidden_size, RNNCellOptions options = {})
      : detail::RNNCellImplBase<T>("RNNCell", input_size, hidden_size, options.bias, 1, options.device),
        options(options),
        relu_(detail::parse_nonlinearity("RNNCell", options.nonlinearity)) {}

  /// h' for input [batch, input_size] (or [input_size]) and h [batch, hidden] (zeros when omitted).
  Tensor<T> forward(const Tensor<T>& input, const Tensor<T>& hx = {}) const {
    auto x = this->batched_input(input);
    auto h = this->state(input, x, hx, "hx");
    auto out = detail::rnn_step(linear(x, this->weight_ih, this->bias_ih), h, this->weight_hh, this->bias_hh, relu_);
    return input.dim() == 1 ? out.squeeze(0) : out;
  }
  std::string name() const override { return this->describe(relu_ ? ", nonlinearity=relu" : ""); }

  RNNCellOptions options;  ///< The options it was built with.

 private:
  bool relu_;
};
/// Holder (Note [layer options] in nn/module.hpp): `RNNCellT<T>(in, hidden, {.bias = false})`
/// takes the options in bare braces, as nn::Linear does.
template <class T = float>
class RNNCellT : public ModuleHolder<RNNCellImpl<T>> {
 public:
  using ModuleHolder<RNNCellImpl<T>>::ModuleHolder;
  /// Constructs the implementation: RNNCellImpl(input_size, hidden_size, options).
  explicit RNNCellT(std::int64_t input_size, std::int64_t hidden_size, RNNCellOptions options = {})
      : ModuleHolder<RNNCellImpl<T>>(std::make_shared<RNNCellImpl<T>>(input_size, hidden_size, options)) {}
};
using RNNCell = RNNCellT<float>;  ///< RNNCellT over float tensors.

/// LSTMCell's options, braced in PyTorch's order (Note [layer options] in nn/module.hpp).
struct LSTMCellOptions {
  bool bias = true;               ///< Adds the biases bias_ih and bias_hh (default true).
  Device device = Device::cpu();  ///< Where the parameters are created (default CPU).
};

/// An LSTM cell (gates i, f, g, o), as torch.nn.LSTMCell: forward returns (h', c').
template <class T = float>
class LSTMCellImpl : public detail::RNNCellImplBase<T> {
 public:
  /// `input_size` features in, `hidden_size` features of state (both positive); every parameter drawn
  /// from U(-1/sqrt(hidden_size), 1/sqrt(hidden_size)).
  LSTMCellImpl(std::int64_t input_size, std::int64_t hidden_size, LSTMCellOptions options = {})
      : detail::RNNCellImplBase<T>("LSTMCell", input_size, hidden_size, options.bias, 4, options.device),
        options(options) {}

  /// (h', c') from zero state.
  std::tuple<Tensor<T>, Tensor<T>> forward(const Tensor<T>& input) const { return forward(input, {}); }
  /// (h', c') from state (h, c), each [batch, hidden] (or [hidden] for unbatched input).
  std::tuple<Tensor<T>, Tensor<T>> forward(const Tensor<T>& input, const std::tuple<Tensor<T>, Tensor<T>>& hx) const {
    const auto& [h0, c0] = hx;
    CHORUS_CHECK(h0.defined() == c0.defined(), "LSTMCell: give both h and c of the state, or neither");
    auto x = this->batched_input(input);
    auto h = this->state(input, x, h0, "h");
    auto c = this->state(input, x, c0, "c");
    auto [h1, c1] =
        detail::lstm_step(linear(x, this->weight_ih, this->bias_ih), h, c, this->weight_hh, this->bias_hh, Tensor<T>());
    if (input.dim() == 1) return {h1.squeeze(0), c1.squeeze(0)};
    return {h1, c1};
  }
  std::string name() const override { return this->describe(); }

  LSTMCellOptions options;  ///< The options it was built with.
};
/// Holder (Note [layer options] in nn/module.hpp): `LSTMCellT<T>(in, hidden, {.bias = false})`
/// takes the options in bare braces, as nn::Linear does.
template <class T = float>
class LSTMCellT : public ModuleHolder<LSTMCellImpl<T>> {
 public:
  using ModuleHolder<LSTMCellImpl<T>>::ModuleHolder;
  /// Constructs the implementation: LSTMCellImpl(input_size, hidden_size, options).
  explicit LSTMCellT(std::int64_t input_size, std::int64_t hidden_size, LSTMCellOptions options = {})
      : ModuleHolder<LSTMCellImpl<T>>(std::make_shared<LSTMCellImpl<T>>(input_size, hidden_size, options)) {}
};
using LSTMCell = LSTMCellT<float>;  ///< LSTMCellT over float tensors.

/// GRUCell's options, braced in PyTorch's order (Note [layer options] in nn/module.hpp).
struct GRUCellOptions {
  bool bias = true;               ///< Adds the biases bias_ih and bias_hh (default true).
  Device device = Device::cpu();  ///< Where the parameters are created (default CPU).
};

/// A GRU cell (gates r, z, n with PyTorch's n = tanh(W_in x + b_in + r*(W_hn h + b_hn))).
template <class T = float>
class GRUCellImpl : public detail::RNNCellImplBase<T> {
 public:
  /// `input_size` features in, `hidden_size` features of state (both positive); every parameter drawn
  /// from U(-1/sqrt(hidden_size), 1/sqrt(hidden_size)).
  GRUCellImpl(std::int64_t input_size, std::int64_t hidden_size, GRUCellOptions options = {})
      : detail::RNNCellImplBase<T>("GRUCell", input_size, hidden_size, options.bias, 3, options.device),
        options(options) {}

  /// h' for input [batch, input_size] (or [input_size]) and h [batch, hidden] (zeros when omitted).
  Tensor<T> forward(const Tensor<T>& input, const Tensor<T>& hx = {}) const {
    auto x = this->batched_input(input);
    auto h = this->state(input, x, hx, "hx");
    auto out = detail::gru_step(linear(x, this->weight_ih, this->bias_ih), h, this->weight_hh, this->bias_hh);
    return input.dim() == 1 ? out.squeeze(0) : out;
  }
  std::string name() const override { return this->describe(); }

  GRUCellOptions options;  ///< The options it was built with.
};
/// Holder (Note [layer options] in nn/module.hpp): `GRUCellT<T>(in, hidden, {.bias = false})`
/// takes the options in bare braces, as nn::Linear does.
template <class T = float>
class GRUCellT : public ModuleHolder<GRUCellImpl<T>> {
 public:
  using ModuleHolder<GRUCellImpl<T>>::ModuleHolder;
  /// Constructs the implementation: GRUCellImpl(input_size, hidden_size, options).
  explicit GRUCellT(std::int64_t input_size, std::int64_t hidden_size, GRUCellOptions options = {})
      : ModuleHolder<GRUCellImpl<T>>(std::make_shared<GRUCellImpl<T>>(input_size, hidden_size, options)) {}
};
using GRUCell = GRUCellT<float>;  ///< GRUCellT over float tensors.

}  // namespace nn
CHORUS_NAMESPACE_END
