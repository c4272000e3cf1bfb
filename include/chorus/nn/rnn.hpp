#pragma once
// Recurrent layers RNN, LSTM and GRU, as torch.nn's: num_layers, bidirectional, batch_first,
// dropout between layers, an optional initial state, unbatched (2-D) input, LSTM's proj_size.
// Parameters carry PyTorch's names, in PyTorch's order, per layer l and direction:
//   weight_ih_l{l}[_reverse], weight_hh_l{l}[_reverse], bias_ih_l{l}[_reverse],
//   bias_hh_l{l}[_reverse], weight_hr_l{l}[_reverse] (LSTM with proj_size > 0 only)
// so a safetensors checkpoint moves between chorus and PyTorch by name.
//
// Note [recurrent layer GEMMs]
// For each layer and direction the input projection W_ih x + b_ih of the whole sequence is one
// GEMM ([seq*batch, input] x [input, G*hidden]); the recurrence is one GEMM per time step
// (W_hh h + b_hh) plus the gates' elementwise ops. Everything is built from differentiable ops,
// so autograd gives the backward; the time steps and the gates are cut out of the projections
// by one node each (Note [one split node] in rnn_cell.hpp). On the CPU an LSTM layer without a
// projection runs as one node instead (Note [fused LSTM layer] in ops/rnn.hpp).
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../ops/rnn.hpp"
#include "rnn_cell.hpp"

CHORUS_NAMESPACE_BEGIN
namespace nn {

/// RNN's options, braced in PyTorch's order (Note [layer options] in nn/module.hpp).
struct RNNOptions {
  std::int64_t num_layers = 1;        ///< Stacked layers, each reading the previous one's output (default 1).
  std::string nonlinearity = "tanh";  ///< The activation: "tanh" (default) or "relu".
  bool bias = true;                   ///< Adds the biases bias_ih and bias_hh (default true).
  bool batch_first = false;           ///< Input and output (batch, seq, feature); states stay (layers, batch, hidden).
  double dropout = 0.0;               ///< Dropout on every layer's output but the last, while training (default 0).
  bool bidirectional = false;         ///< Adds a reverse direction (D = 2), its output concatenated (default false).
  Device device = Device::cpu();      ///< Where the parameters are created (default CPU).
};

/// LSTM's options, braced in PyTorch's order (Note [layer options] in nn/module.hpp).
struct LSTMOptions {
  std::int64_t num_layers = 1;    ///< Stacked layers, each reading the previous one's output (default 1).
  bool bias = true;               ///< Adds the biases bias_ih and bias_hh (default true).
  bool batch_first = false;       ///< Input and output (batch, seq, feature); states stay (layers, batch, size).
  double dropout = 0.0;           ///< Dropout on every layer's output but the last, while training (default 0).
  bool bidirectional = false;     ///< Adds a reverse direction (D = 2), its output concatenated (default false).
  std::int64_t proj_size = 0;     ///< > 0: h is projected to proj_size by weight_hr (must be < hidden_size); 0: none.
  Device device = Device::cpu();  ///< Where the parameters are created (default CPU).
};

/// GRU's options, braced in PyTorch's order (Note [layer options] in nn/module.hpp).
struct GRUOptions {
  std::int64_t num_layers = 1;    ///< Stacked layers, each reading the previous one's output (default 1).
  bool bias = true;               ///< Adds the biases bias_ih and bias_hh (default true).
  bool batch_first = false;       ///< Input and output (batch, seq, feature); states stay (layers, batch, hidden).
  double dropout = 0.0;           ///< Dropout on every layer's output but the last, while training (default 0).
  bool bidirectional = false;     ///< Adds a reverse direction (D = 2), its output concatenated (default false).
  Device device = Device::cpu();  ///< Where the parameters are created (default CPU).
};

namespace detail {

enum class RNNMode { RNN_TANH, RNN_RELU, LSTM, GRU };

/// What RNN, LSTM and GRU share: the options in one form, the parameters and the loop over
/// layers, directions and time steps (as LibTorch's nn::detail::RNNImplBase).
template <class T>
class RNNImplBase : public Module {
 public:
  struct Config {
    RNNMode mode;
    std::int64_t num_layers;
    bool bias, batch_first;
    double dropout;
    bool bidirectional;
    std::int64_t proj_size;
    Device device;
  };

  std::int64_t input_size, hidden_size;

  /// Every parameter in PyTorch's order (LibTorch's all_weights()).
  std::vector<Tensor<T>> all_weights() const {
    std::vector<Tensor<T>> out;
    for (const auto& w : weights_)
      for (const auto* t : {&w.w_ih, &w.w_hh, &w.b_ih, &w.b_hh, &w.w_hr})
        if (t->defined()) out.push_back(*t);
    return out;
  }
  void reset_parameters() { reset_recurrent_parameters(all_weights(), hidden_size); }

  int num_directions() const { return config_.bidirectional ? 2 : 1; }
  /// The size of h: proj_size when the LSTM projects, else hidden_size.
  std::int64_t output_size() const { return config_.proj_size > 0 ? config_.proj_size : hidden_size; }

 protected:
  RNNImplBase(const char* kind, std::int64_t input_size, std::int64_t hidden_size, Config config)
      : input_size(input_size), hidden_size(hidden_size), config_(config), kind_(kind) {
    CHORUS_CHECK(input_size > 0, kind, ": input_size must be positive, got ", input_size);
    CHORUS_CHECK(hidden_size > 0, kind, ": hidden_size must be positive, got ", hidden_size);
    CHORUS_CHECK(config.num_layers > 0, kind, ": num_layers must be positive, got ", config.num_layers);
    CHORUS_CHECK(config.dropout >= 0.0 && config.dropout <= 1.0, kind, ": dropout must be in [0, 1], got ",
                 config.dropout);
    CHORUS_CHECK(config.proj_size >= 0, kind, ": proj_size must be non-negative, got ", config.proj_size);
    CHORUS_CHECK(config.proj_size < hidden_size, kind, ": proj_size (", config.proj_size,
                 ") must be smaller than hidden_size (", hidden_size, ")");
    const std::int64_t gates = config.mode == RNNMode::LSTM ? 4 : config.mode == RNNMode::GRU ? 3 : 1;
    const std::int64_t g = gates * hidden_size;  // rows of weight_ih / weight_hh: the gates stacked
    const auto out = output_size();
    const Device dev = config.device;
    for (std::int64_t l = 0; l < config.num_layers; ++l) {
      for (int d = 0; d < num_directions(); ++d) {
        const std::string sfx = "_l" + std::to_string(l) + (d ? "_reverse" : "");
        const std::int64_t in = l == 0 ? input_size : out * num_directions();
        Weights w;
        w.w_ih = register_parameter("weight_ih" + sfx, Tensor<T>::empty(Shape{g, in}, dev));
        w.w_hh = register_parameter("weight_hh" + sfx, Tensor<T>::empty(Shape{g, out}, dev));
        if (config.bias) {
          w.b_ih = register_parameter("bias_ih" + sfx, Tensor<T>::empty(Shape{g}, dev));
          w.b_hh = register_parameter("bias_hh" + sfx, Tensor<T>::empty(Shape{g}, dev));
        }
        if (config.proj_size > 0)
          w.w_hr = register_parameter("weight_hr" + sfx, Tensor<T>::empty(Shape{config.proj_size, hidden_size}, dev));
        weights_.push_back(std::move(w));
      }
    }
    reset_parameters();
  }

  struct Result {
    Tensor<T> output, h_n, c_n;  // c_n: LSTM only
  };

  /// Runs the layers over `input` from the state (h0, c0); undefined states start at zero.
  Result run(const Tensor<T>& input, const Tensor<T>& h0, const Tensor<T>& c0) const {
    const bool lstm = config_.mode == RNNMode::LSTM;
    ops::detail::check_defined(kind_, input);
    const char* layout = config_.batch_first ? "(batch, seq_len, input_size)" : "(seq_len, batch, input_size)";
    CHORUS_CHECK(input.dim() == 3 || input.dim() == 2, kind_, ": expected input of shape ", layout,
                 " or unbatched (seq_len, input_size), got shape ", input.shape());
    CHORUS_CHECK(input.shape().back() == input_size, kind_, ": input of shape ", input.shape(), " has ",
                 input.shape().back(), " features, expected input_size=", input_size);
    const Device dev = weights_[0].w_ih.device();
    CHORUS_CHECK(input.device() == dev, kind_, ": input is on ", input.device(), " but the parameters are on ", dev);
    const bool batched = input.dim() == 3;
    // Time-major [seq, batch, feature] inside.
    Tensor<T> x = !batched ? input.unsqueeze(1) : config_.batch_first ? input.transpose(0, 1) : input;
    const std::int64_t seq = x.shape()[0], batch = x.shape()[1];
    CHORUS_CHECK(seq > 0, kind_, ": expected a sequence of at least one step, got input of shape ", input.shape());
    const std::int64_t layers_dirs = config_.num_layers * num_directions();
    auto states = [&](const Tensor<T>& s, const char* name, std::int64_t size, const char* size_name) {
      if (!s.defined()) return std::vector<Tensor<T>>();
      const Shape want = batched ? Shape{layers_dirs, batch, size} : Shape{layers_dirs, size};
      CHORUS_CHECK(s.shape() == want, kind_, ": expected ", name, " of shape ", want,
                   batched ? " (num_layers * num_directions, batch, " : " (num_layers * num_directions, ", size_name,
                   ") for input of shape ", input.shape(), ", got ", s.shape());
      CHORUS_CHECK(s.device() == dev, kind_, ": ", name, " is on ", s.device(), " but the parameters are on ", dev);
      return nn::detail::unbind(batched ? s : s.unsqueeze(1), 0);  // qualified: no ADL onto a future chorus::unbind
    };
    const auto h_size = output_size();
    auto hs = states(h0, "h0", h_size, config_.proj_size > 0 ? "proj_size)" : "hidden_size)");
    auto cs = lstm ? states(c0, "c0", hidden_size, "hidden_size)") : std::vector<Tensor<T>>();
    const bool relu = config_.mode == RNNMode::RNN_RELU;

    std::vector<Tensor<T>> h_n, c_n;
    for (std::int64_t l = 0; l < config_.num_layers; ++l) {
      std::vector<Tensor<T>> dir_out;
      for (int d = 0; d < num_directions(); ++d) {
        const auto idx = static_cast<std::size_t>(l * num_directions() + d);
        const Weights& w = weights_[idx];
        auto proj = linear(x, w.w_ih, w.b_ih);  // Note [recurrent layer GEMMs]
        Tensor<T> h = hs.empty() ? zeros<T>(Shape{batch, h_size}, dev) : hs[idx];
        Tensor<T> c;
        if (lstm) c = cs.empty() ? zeros<T>(Shape{batch, hidden_size}, dev) : cs[idx];
        if (lstm && !w.w_hr.defined() && dev.is_cpu()) {  // one node for the layer (Note [fused LSTM layer])
          auto [o, hn, cn] = ops::lstm_layer(proj, w.w_hh, w.b_hh, h, c, d == 1);
          dir_out.push_back(o);
          h_n.push_back(hn);
          c_n.push_back(cn);
          continue;
        }
        auto steps = nn::detail::unbind(proj, 0);
        std::vector<Tensor<T>> out(static_cast<std::size_t>(seq));
        for (std::int64_t k = 0; k < seq; ++k) {
          const auto t = static_cast<std::size_t>(d == 0 ? k : seq - 1 - k);
          switch (config_.mode) {
            case RNNMode::LSTM: std::tie(h, c) = lstm_step(steps[t], h, c, w.w_hh, w.b_hh, w.w_hr); break;
            case RNNMode::GRU: h = gru_step(steps[t], h, w.w_hh, w.b_hh); break;
            default: h = rnn_step(steps[t], h, w.w_hh, w.b_hh, relu); break;
          }
          out[t] = h;
        }
        dir_out.push_back(stack(out, 0));
        h_n.push_back(h);
        if (lstm) c_n.push_back(c);
      }
      x = dir_out.size() == 1 ? dir_out[0] : cat(dir_out, 2);
      if (config_.dropout > 0 && is_training() && l + 1 < config_.num_layers)
        x = chorus::dropout(x, config_.dropout, true);
    }
    Result r{x, stack(h_n, 0), lstm ? stack(c_n, 0) : Tensor<T>()};
    if (!batched) {
      r.output = r.output.squeeze(1);
      r.h_n = r.h_n.squeeze(1);
      if (lstm) r.c_n = r.c_n.squeeze(1);
    } else if (config_.batch_first) {
      r.output = r.output.transpose(0, 1);
    }
    return r;
  }

  /// Kind(input, hidden, option=value, ...) with the options that differ from the defaults.
  std::string describe() const {
    std::string s = std::string(kind_) + "(" + std::to_string(input_size) + ", " + std::to_string(hidden_size);
    if (config_.proj_size > 0) s += ", proj_size=" + std::to_string(config_.proj_size);
    if (config_.num_layers != 1) s += ", num_layers=" + std::to_string(config_.num_layers);
    if (config_.mode == RNNMode::RNN_RELU) s += ", nonlinearity=relu";
    if (!config_.bias) s += ", bias=false";
    if (config_.batch_first) s += ", batch_first=true";
    if (config_.dropout > 0) s += ", dropout=" + std::to_string(config_.dropout);
    if (config_.bidirectional) s += ", bidirectional=true";
    return s + ")";
  }

  Config config_;
  const char* kind_;

 private:
  struct Weights {
    Tensor<T> w_ih, w_hh, b_ih, b_hh, w_hr;
  };
  std::vector<Weights> weights_;  // [layer * num_directions + direction]
};

}  // namespace detail

/// Elman RNN, as torch.nn.RNN: forward returns (output, h_n) with output
/// (seq, batch, D*hidden) -- (batch, seq, D*hidden) when batch_first -- and h_n
/// (num_layers*D, batch, hidden), D = 2 when bidirectional.
template <class T = float>
class RNNImpl : public detail::RNNImplBase<T> {
 public:
  /// `input_size` features in, `hidden_size` features of state (both positive); every parameter drawn
  /// from U(-1/sqrt(hidden_size), 1/sqrt(hidden_size)).
  RNNImpl(std::int64_t input_size, std::int64_t hidden_size, RNNOptions options = {})
      : detail::RNNImplBase<T>("RNN", input_size, hidden_size,
                               {detail::parse_nonlinearity("RNN", options.nonlinearity) ? detail::RNNMode::RNN_RELU
                                                                                        : detail::RNNMode::RNN_TANH,
                                options.num_layers, options.bias, options.batch_first, options.dropout,
                                options.bidirectional, 0, options.device}),
        options(options) {}

  /// (output, h_n) from a zero initial state.
  std::tuple<Tensor<T>, Tensor<T>> forward(const Tensor<T>& input) const { return forward(input, Tensor<T>()); }
  /// (output, h_n) from h0 of shape (num_layers*D, batch, hidden) (undefined: zeros).
  std::tuple<Tensor<T>, Tensor<T>> forward(const Tensor<T>& input, const Tensor<T>& h0) const {
    auto r = this->run(input, h0, Tensor<T>());
    return {r.output, r.h_n};
  }
  std::string name() const override { return this->describe(); }

  RNNOptions options;  ///< The options it was built with.
};
/// Holder (Note [layer options] in nn/module.hpp): `RNNT<T>(in, hidden, {.batch_first = true})`
/// takes the options in bare braces, as nn::Linear does.
template <class T = float>
class RNNT : public ModuleHolder<RNNImpl<T>> {
 public:
  using ModuleHolder<RNNImpl<T>>::ModuleHolder;
  /// Constructs the implementation: RNNImpl(input_size, hidden_size, options).
  explicit RNNT(std::int64_t input_size, std::int64_t hidden_size, RNNOptions options = {})
      : ModuleHolder<RNNImpl<T>>(std::make_shared<RNNImpl<T>>(input_size, hidden_size, options)) {}
};
using RNN = RNNT<float>;  ///< RNNT over float tensors.

/// LSTM, as torch.nn.LSTM: forward returns (output, (h_n, c_n)), h_n (num_layers*D, batch,
/// H_out) and c_n (num_layers*D, batch, hidden), H_out = proj_size if > 0, else hidden.
template <class T = float>
class LSTMImpl : public detail::RNNImplBase<T> {
 public:
  /// `input_size` features in, `hidden_size` features of state (both positive); every parameter drawn
  /// from U(-1/sqrt(hidden_size), 1/sqrt(hidden_size)).
  LSTMImpl(std::int64_t input_size, std::int64_t hidden_size, LSTMOptions options = {})
      : detail::RNNImplBase<T>("LSTM", input_size, hidden_size,
                               {detail::RNNMode::LSTM, options.num_layers, options.bias, options.batch_first,
                                options.dropout, options.bidirectional, options.proj_size, options.device}),
        options(options) {}

  using State = std::tuple<Tensor<T>, Tensor<T>>;  ///< A state (h, c).
  /// (output, (h_n, c_n)) from a zero initial state.
  std::tuple<Tensor<T>, State> forward(const Tensor<T>& input) const { return forward(input, State{}); }
  /// (output, (h_n, c_n)) from (h0, c0); both undefined means zeros.
  std::tuple<Tensor<T>, State> forward(const Tensor<T>& input, const State& hx) const {
    const auto& [h0, c0] = hx;
    CHORUS_CHECK(h0.defined() == c0.defined(), "LSTM: give both h0 and c0 of the initial state, or neither");
    auto r = this->run(input, h0, c0);
    return {r.output, State{r.h_n, r.c_n}};
  }
  std::string name() const override { return this->describe(); }

  LSTMOptions options;  ///< The options it was built with.
};
/// Holder (Note [layer options] in nn/module.hpp): `LSTMT<T>(in, hidden, {.batch_first = true})`
/// takes the options in bare braces, as nn::Linear does.
template <class T = float>
class LSTMT : public ModuleHolder<LSTMImpl<T>> {
 public:
  using ModuleHolder<LSTMImpl<T>>::ModuleHolder;
  /// Constructs the implementation: LSTMImpl(input_size, hidden_size, options).
  explicit LSTMT(std::int64_t input_size, std::int64_t hidden_size, LSTMOptions options = {})
      : ModuleHolder<LSTMImpl<T>>(std::make_shared<LSTMImpl<T>>(input_size, hidden_size, options)) {}
};
using LSTM = LSTMT<float>;  ///< LSTMT over float tensors.

/// GRU, as torch.nn.GRU: forward returns (output, h_n), shaped as RNN's.
template <class T = float>
class GRUImpl : public detail::RNNImplBase<T> {
 public:
  /// `input_size` features in, `hidden_size` features of state (both positive); every parameter drawn
  /// from U(-1/sqrt(hidden_size), 1/sqrt(hidden_size)).
  GRUImpl(std::int64_t input_size, std::int64_t hidden_size, GRUOptions options = {})
      : detail::RNNImplBase<T>("GRU", input_size, hidden_size,
                               {detail::RNNMode::GRU, options.num_layers, options.bias, options.batch_first,
                                options.dropout, options.bidirectional, 0, options.device}),
        options(options) {}

  /// (output, h_n) from a zero initial state.
  std::tuple<Tensor<T>, Tensor<T>> forward(const Tensor<T>& input) const { return forward(input, Tensor<T>()); }
  /// (output, h_n) from h0 of shape (num_layers*D, batch, hidden) (undefined: zeros).
  std::tuple<Tensor<T>, Tensor<T>> forward(const Tensor<T>& input, const Tensor<T>& h0) const {
    auto r = this->run(input, h0, Tensor<T>());
    return {r.output, r.h_n};
  }
  std::string name() const override { return this->describe(); }

  GRUOptions options;  ///< The options it was built with.
};
/// Holder (Note [layer options] in nn/module.hpp): `GRUT<T>(in, hidden, {.batch_first = true})`
/// takes the options in bare braces, as nn::Linear does.
template <class T = float>
class GRUT : public ModuleHolder<GRUImpl<T>> {
 public:
  using ModuleHolder<GRUImpl<T>>::ModuleHolder;
  /// Constructs the implementation: GRUImpl(input_size, hidden_size, options).
  explicit GRUT(std::int64_t input_size, std::int64_t hidden_size, GRUOptions options = {})
      : ModuleHolder<GRUImpl<T>>(std::make_shared<GRUImpl<T>>(input_size, hidden_size, options)) {}
};
using GRU = GRUT<float>;  ///< GRUT over float tensors.

}  // namespace nn
CHORUS_NAMESPACE_END
