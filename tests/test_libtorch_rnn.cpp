// chorus's recurrent layers and cells against LibTorch's (Debian libtorch-dev): LibTorch's
// parameters are copied into chorus by name (which also proves the names: LibTorch's C++
// named_parameters() uses PyTorch's), then outputs, final states and every gradient (input,
// initial states, each parameter) agree to 1e-10 in float64. Skips where LibTorch was not found.
#include <functional>

#include "libtorch_util.hpp"


using namespace chorus;
using chorus::testing::all_close;

#if CHORUS_HAVE_LIBTORCH
namespace {
using chorus::testing::from_torch;
using chorus::testing::sizes_of;
using chorus::testing::to_torch;
constexpr double kTol = 1e-10;


/// LibTorch modules made while alive hold float64 parameters.
struct TorchDouble {
  TorchDouble() { torch::set_default_dtype(caffe2::TypeMeta::Make<double>()); }
  ~TorchDouble() { torch::set_default_dtype(caffe2::TypeMeta::Make<float>()); }
};

/// Copies each LibTorch parameter into chorus's parameter of the same name; both modules must
/// name the same parameters in the same order.
void copy_from_torch(const torch::nn::Module& tm, nn::Module& cm) {
  std::vector<std::string> torch_names, chorus_names;
  NoGradGuard g;
  for (const auto& p : tm.named_parameters()) {
    torch_names.push_back(p.key());
    auto t = cm.find_tensor(p.key());
    ASSERT_TRUE(t.defined()) << "chorus has no parameter '" << p.key() << "'";
    auto value = from_torch(p.value());
    ASSERT_EQ(t.shape(), value.shape()) << p.key();
    t.as<double>().copy_(value);
  }
  for (const auto& p : cm.named_parameters()) chorus_names.push_back(p.name);
  ASSERT_EQ(chorus_names, torch_names);
}

using CRun = std::function<std::vector<Tensor<double>>(const std::vector<Tensor<double>>&)>;
using TRun = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

/// Runs both modules on the same inputs (after copying LibTorch's parameters into chorus):
/// every output, then the gradients of the inputs and of every parameter under a random
/// weighting of all outputs.
void same_as_torch(const std::string& what, torch::nn::Module& tm, nn::Module& cm, const TRun& run_torch,
                   const CRun& run_chorus, const std::vector<Tensor<double>>& inputs) {
  SCOPED_TRACE(what);
  copy_from_torch(tm, cm);
  if (::testing::Test::HasFatalFailure()) return;
  std::vector<Tensor<double>> ci;
  std::vector<torch::Tensor> ti;
  for (const auto& x : inputs) {
    ci.push_back(x.detach().requires_grad_(true));
    ti.push_back(to_torch(x).requires_grad_(true));
  }
  auto yc = run_chorus(ci);
  auto yt = run_torch(ti);
  ASSERT_EQ(yc.size(), yt.size());
  Generator gen(17);
  Tensor<double> lc;
  torch::Tensor lt;
  for (std::size_t i = 0; i < yc.size(); ++i) {
    ASSERT_TRUE(all_close(yc[i], from_torch(yt[i]), kTol, kTol)) << "output " << i;
    auto w = randn<double>(yc[i].shape(), Device::cpu(), 0, 1, gen);
    auto c_term = (yc[i] * w).sum();
    auto t_term = (yt[i] * to_torch(w)).sum();
    lc = i == 0 ? c_term : lc + c_term;
    lt = i == 0 ? t_term : lt + t_term;
  }
  lc.backward();
  lt.backward();
  for (std::size_t i = 0; i < ci.size(); ++i) {
    ASSERT_TRUE(ci[i].grad().defined()) << "input " << i;
    EXPECT_TRUE(all_close(ci[i].grad(), from_torch(ti[i].grad()), kTol, kTol)) << "gradient of input " << i;
  }
  auto tp = tm.named_parameters();
  for (const auto& p : cm.named_parameters()) {
    auto g = p.tensor.as<double>().grad();
    ASSERT_TRUE(g.defined()) << p.name;
    EXPECT_TRUE(all_close(g, from_torch(tp[p.name].grad()), kTol, kTol)) << "gradient of " << p.name;
  }
}

Tensor<double> rnd(const Shape& s, std::uint64_t seed) {
  Generator g(seed);
  return rand<double>(s, Device::cpu(), -1, 1, g);
}

enum class Kind { LSTM, GRU, RNN_TANH, RNN_RELU };
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::LSTM: return "LSTM";
    case Kind::GRU: return "GRU";
    case Kind::RNN_TANH: return "RNN tanh";
    case Kind::RNN_RELU: return "RNN relu";
  }
  return "?";
}

struct Case {
  Kind kind;
  std::int64_t layers = 2;
  bool bidirectional = false, batch_first = false, with_state = false, bias = true;
  std::int64_t proj_size = 0;
  bool unbatched = false;
  double dropout = 0;  // only with eval
  bool eval = false;
  std::string str() const {
    return std::string(kind_name(kind)) + " layers=" + std::to_string(layers) +
           " bidirectional=" + std::to_string(bidirectional) + " batch_first=" + std::to_string(batch_first) +
           " state=" + std::to_string(with_state) + " bias=" + std::to_string(bias) +
           " proj_size=" + std::to_string(proj_size) + (unbatched ? " unbatched" : "") +
           (eval ? " eval, dropout=" + std::to_string(dropout) : "");
  }
};

/// One layer configuration in chorus and in LibTorch. Unbatched input is compared with
/// LibTorch's batch of one (PyTorch defines unbatched input as exactly that).
void check_layer(const Case& c) {
  TorchDouble dtype;
  const std::int64_t S = 5, B = c.unbatched ? 1 : 3, F = 4, H = 6, D = c.bidirectional ? 2 : 1;
  const std::int64_t Hout = c.proj_size > 0 ? c.proj_size : H;
  const bool lstm = c.kind == Kind::LSTM;
  std::vector<Tensor<double>> inputs{c.unbatched ? rnd({S, F}, 1)
                                                 : rnd(c.batch_first ? Shape{B, S, F} : Shape{S, B, F}, 1)};
  if (c.with_state) {
    inputs.push_back(c.unbatched ? rnd({c.layers * D, Hout}, 2) : rnd({c.layers * D, B, Hout}, 2));
    if (lstm) inputs.push_back(c.unbatched ? rnd({c.layers * D, H}, 3) : rnd({c.layers * D, B, H}, 3));
  }
  // Torch sees unbatched input as a batch of one.
  auto batch_torch = [&](const std::vector<torch::Tensor>& x) {
    std::vector<torch::Tensor> out = x;
    if (!c.unbatched) return out;
    out[0] = out[0].unsqueeze(c.batch_first ? 0 : 1);
    for (std::size_t i = 1; i < out.size(); ++i) out[i] = out[i].unsqueeze(1);
    return out;
  };
  auto unbatch_torch = [&](torch::Tensor y, torch::Tensor h, torch::Tensor cn) {
    std::vector<torch::Tensor> out{y, h};
    if (cn.defined()) out.push_back(cn);
    if (c.unbatched) {
      out[0] = out[0].squeeze(c.batch_first ? 0 : 1);
      for (std::size_t i = 1; i < out.size(); ++i) out[i] = out[i].squeeze(1);
    }
    return out;
  };
  std::shared_ptr<torch::nn::Module> tm;
  std::shared_ptr<nn::Module> cm;
  TRun run_torch;
  CRun run_chorus;
  if (lstm) {
    torch::nn::LSTM t(torch::nn::LSTMOptions(F, H)
                          .num_layers(c.layers)
                          .bias(c.bias)
                          .batch_first(c.batch_first)
                          .dropout(c.dropout)
                          .bidirectional(c.bidirectional)
                          .proj_size(c.proj_size));
    nn::LSTMT<double> m(F, H,
                        nn::LSTMOptions{.num_layers = c.layers,
                                        .bias = c.bias,
                                        .batch_first = c.batch_first,
                                        .dropout = c.dropout,
                                        .bidirectional = c.bidirectional,
                                        .proj_size = c.proj_size});
    tm = t.ptr();
    cm = m.ptr();
    run_torch = [=](const std::vector<torch::Tensor>& x0) mutable {
      auto x = batch_torch(x0);
      auto [y, hc] = x.size() > 1 ? t->forward(x[0], std::make_tuple(x[1], x[2])) : t->forward(x[0]);
      return unbatch_torch(y, std::get<0>(hc), std::get<1>(hc));
    };
    run_chorus = [=](const std::vector<Tensor<double>>& x) {
      auto [y, hc] = x.size() > 1 ? m->forward(x[0], {x[1], x[2]}) : m->forward(x[0]);
      return std::vector<Tensor<double>>{y, std::get<0>(hc), std::get<1>(hc)};
    };
  } else if (c.kind == Kind::GRU) {
    torch::nn::GRU t(torch::nn::GRUOptions(F, H)
                         .num_layers(c.layers)
                         .bias(c.bias)
                         .batch_first(c.batch_first)
                         .dropout(c.dropout)
                         .bidirectional(c.bidirectional));
    nn::GRUT<double> m(F, H,
                       nn::GRUOptions{.num_layers = c.layers,
                                      .bias = c.bias,
                                      .batch_first = c.batch_first,
                                      .dropout = c.dropout,
                                      .bidirectional = c.bidirectional});
    tm = t.ptr();
    cm = m.ptr();
    run_torch = [=](const std::vector<torch::Tensor>& x0) mutable {
      auto x = batch_torch(x0);
      auto [y, h] = x.size() > 1 ? t->forward(x[0], x[1]) : t->forward(x[0]);
      return unbatch_torch(y, h, {});
    };
    run_chorus = [=](const std::vector<Tensor<double>>& x) {
      auto [y, h] = x.size() > 1 ? m->forward(x[0], x[1]) : m->forward(x[0]);
      return std::vector<Tensor<double>>{y, h};
    };
  } else {
    const bool relu = c.kind == Kind::RNN_RELU;
    torch::nn::RNNOptions o(F, H);
    o.num_layers(c.layers).bias(c.bias).batch_first(c.batch_first).dropout(c.dropout).bidirectional(c.bidirectional);
    if (relu) o.nonlinearity(torch::kReLU);
    torch::nn::RNN t(o);
    nn::RNNT<double> m(F, H,
                       nn::RNNOptions{.num_layers = c.layers,
                                      .nonlinearity = relu ? "relu" : "tanh",
                                      .bias = c.bias,
                                      .batch_first = c.batch_first,
                                      .dropout = c.dropout,
                                      .bidirectional = c.bidirectional});
    tm = t.ptr();
    cm = m.ptr();
    run_torch = [=](const std::vector<torch::Tensor>& x0) mutable {
      auto x = batch_torch(x0);
      auto [y, h] = x.size() > 1 ? t->forward(x[0], x[1]) : t->forward(x[0]);
      return unbatch_torch(y, h, {});
    };
    run_chorus = [=](const std::vector<Tensor<double>>& x) {
      auto [y, h] = x.size() > 1 ? m->forward(x[0], x[1]) : m->forward(x[0]);
      return std::vector<Tensor<double>>{y, h};
    };
  }
  if (c.eval) {
    tm->eval();
    cm->eval();
  }
  same_as_torch(c.str(), *tm, *cm, run_torch, run_chorus, inputs);
}
}  // namespace

TEST(LibTorchRNN, TwoLayersEveryLayoutWithAndWithoutState) {
  for (Kind k : {Kind::LSTM, Kind::GRU, Kind::RNN_TANH, Kind::RNN_RELU})
    for (bool bidir : {false, true})
      for (bool bf : {false, true})
        for (bool state : {false, true})
          check_layer({.kind = k, .bidirectional = bidir, .batch_first = bf, .with_state = state});
}

TEST(LibTorchRNN, WithoutBiasThreeLayersAndUnbatched) {
  for (Kind k : {Kind::LSTM, Kind::GRU, Kind::RNN_TANH, Kind::RNN_RELU}) {
    check_layer({.kind = k, .bidirectional = true, .with_state = true, .bias = false});
    check_layer({.kind = k, .layers = 3, .bidirectional = true, .batch_first = true});
    for (bool state : {false, true})
      for (bool bf : {false, true})  // batch_first does not apply to unbatched input
        check_layer({.kind = k, .bidirectional = true, .batch_first = bf, .with_state = state, .unbatched = true});
  }
}

TEST(LibTorchRNN, LSTMWithProjection) {
  for (bool bidir : {false, true})
    for (bool bf : {false, true})
      for (bool state : {false, true})
        check_layer(
            {.kind = Kind::LSTM, .bidirectional = bidir, .batch_first = bf, .with_state = state, .proj_size = 3});
  check_layer({.kind = Kind::LSTM, .bidirectional = true, .with_state = true, .proj_size = 2, .unbatched = true});
}

TEST(LibTorchRNN, DropoutIsOffInEval) {
  for (Kind k : {Kind::LSTM, Kind::GRU, Kind::RNN_TANH})
    check_layer({.kind = k, .bidirectional = true, .with_state = true, .dropout = 0.4, .eval = true});
}

TEST(LibTorchRNN, Cells) {
  TorchDouble dtype;
  const std::int64_t B = 3, F = 4, H = 5;
  for (bool bias : {true, false})
    for (bool state : {false, true}) {
      const std::string how = std::string(bias ? "bias" : "no bias") + (state ? ", with state" : ", zero state");
      {
        torch::nn::LSTMCell t(torch::nn::LSTMCellOptions(F, H).bias(bias));
        nn::LSTMCellT<double> m(F, H, nn::LSTMCellOptions{.bias = bias});
        std::vector<Tensor<double>> in{rnd({B, F}, 4)};
        if (state) in.insert(in.end(), {rnd({B, H}, 5), rnd({B, H}, 6)});
        same_as_torch(
            "LSTMCell " + how, *t, *m,
            [&](const std::vector<torch::Tensor>& x) {
              auto [h, c] = x.size() > 1 ? t->forward(x[0], std::make_tuple(x[1], x[2])) : t->forward(x[0]);
              return std::vector<torch::Tensor>{h, c};
            },
            [&](const std::vector<Tensor<double>>& x) {
              auto [h, c] = x.size() > 1 ? m->forward(x[0], {x[1], x[2]}) : m->forward(x[0]);
              return std::vector<Tensor<double>>{h, c};
            },
            in);
      }
      {
        torch::nn::GRUCell t(torch::nn::GRUCellOptions(F, H).bias(bias));
        nn::GRUCellT<double> m(F, H, nn::GRUCellOptions{.bias = bias});
        std::vector<Tensor<double>> in{rnd({B, F}, 7)};
        if (state) in.push_back(rnd({B, H}, 8));
        same_as_torch(
            "GRUCell " + how, *t, *m,
            [&](const std::vector<torch::Tensor>& x) {
              return std::vector<torch::Tensor>{x.size() > 1 ? t->forward(x[0], x[1]) : t->forward(x[0])};
            },
            [&](const std::vector<Tensor<double>>& x) {
              return std::vector<Tensor<double>>{x.size() > 1 ? m->forward(x[0], x[1]) : m->forward(x[0])};
            },
            in);
      }
      for (bool relu : {false, true}) {
        torch::nn::RNNCellOptions o(F, H);
        o.bias(bias);
        if (relu) o.nonlinearity(torch::kReLU);
        torch::nn::RNNCell t(o);
        nn::RNNCellT<double> m(F, H, nn::RNNCellOptions{.bias = bias, .nonlinearity = relu ? "relu" : "tanh"});
        std::vector<Tensor<double>> in{rnd({B, F}, 9)};
        if (state) in.push_back(rnd({B, H}, 10));
        same_as_torch(
            std::string("RNNCell ") + (relu ? "relu " : "tanh ") + how, *t, *m,
            [&](const std::vector<torch::Tensor>& x) {
              return std::vector<torch::Tensor>{x.size() > 1 ? t->forward(x[0], x[1]) : t->forward(x[0])};
            },
            [&](const std::vector<Tensor<double>>& x) {
              return std::vector<Tensor<double>>{x.size() > 1 ? m->forward(x[0], x[1]) : m->forward(x[0])};
            },
            in);
      }
    }
}
#else
TEST(LibTorchRNN, LayersAndCells) { GTEST_SKIP() << CHORUS_LIBTORCH_SKIP; }
#endif
