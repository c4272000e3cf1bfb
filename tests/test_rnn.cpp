// Recurrent layers and cells: PyTorch's parameter names, shapes and initialisation, options and
// input errors, float64 gradients, the directions and layouts against each other, checkpoints,
// DataParallel against one device, and a small training run. (Values against LibTorch: test_libtorch_rnn.)
#include <unistd.h>

#include <filesystem>
#include <map>
#include <set>

#include "test_util.hpp"

using namespace chorus;
using chorus::testing::all_close;
using chorus::testing::gradcheck;
using chorus::testing::throws_with;
using TL = std::vector<Tensor<double>>;
namespace fs = std::filesystem;

namespace {
Tensor<double> r(const Shape& s, std::uint64_t seed, double lo = -1, double hi = 1) {
  Generator g(seed);
  return rand<double>(s, Device::cpu(), lo, hi, g);
}

struct NameShape {
  std::string name;
  Shape shape;
  bool operator==(const NameShape&) const = default;
};
std::ostream& operator<<(std::ostream& os, const NameShape& n) { return os << n.name << " " << n.shape; }

std::vector<NameShape> names_and_shapes(const nn::Module& m) {
  std::vector<NameShape> out;
  for (auto& p : m.named_parameters()) out.push_back({p.name, p.tensor.shape()});
  return out;
}

/// Copies every parameter of `from` into the parameter of the same name in `to`.
void copy_by_name(const nn::Module& from, nn::Module& to) {
  NoGradGuard g;
  for (auto& p : from.named_parameters()) {
    auto t = to.find_tensor(p.name);
    ASSERT_TRUE(t.defined()) << p.name;
    t.as<double>().copy_(p.tensor.as<double>());
  }
}

/// `x` with dimension `dim` reversed.
Tensor<double> flip(const Tensor<double>& x, int dim) {
  std::vector<std::int64_t> idx;
  for (auto i = x.shape()[dim] - 1; i >= 0; --i) idx.push_back(i);
  return x.index_select(dim, from_vector<std::int64_t>(idx));
}

std::vector<Tensor<double>> params_of(const nn::Module& m) {
  std::vector<Tensor<double>> out;
  for (auto& p : m.parameters()) out.push_back(p.as<double>());
  return out;
}

/// Inputs first, then every parameter of `m` (gradcheck perturbs them in place).
TL with_params(TL inputs, const nn::Module& m) {
  for (auto& p : params_of(m)) inputs.push_back(p);
  return inputs;
}

std::vector<Device> cpus(int k) {
  set_cpu_device_count(std::max(cpu_device_count(), k));
  std::vector<Device> d;
  for (int i = 0; i < k; ++i) d.push_back(Device::cpu(i));
  return d;
}
}  // namespace

TEST(RNN, ParameterNamesShapesAndOrderArePyTorchs) {
  nn::LSTM lstm(3, 5, nn::LSTMOptions{.num_layers = 2, .bidirectional = true});
  std::vector<NameShape> want;
  for (std::string l : {"0", "1"})
    for (std::string d : {"", "_reverse"}) {
      const std::int64_t in = l == "0" ? 3 : 10;
      want.push_back({"weight_ih_l" + l + d, Shape{20, in}});
      want.push_back({"weight_hh_l" + l + d, Shape{20, 5}});
      want.push_back({"bias_ih_l" + l + d, Shape{20}});
      want.push_back({"bias_hh_l" + l + d, Shape{20}});
    }
  EXPECT_EQ(names_and_shapes(*lstm), want);
  EXPECT_EQ(lstm->all_weights().size(), want.size());

  nn::GRU gru(3, 5, nn::GRUOptions{.bias = false});
  EXPECT_EQ(names_and_shapes(*gru),
            (std::vector<NameShape>{{"weight_ih_l0", Shape{15, 3}}, {"weight_hh_l0", Shape{15, 5}}}));

  nn::LSTM proj(3, 5, nn::LSTMOptions{.num_layers = 2, .proj_size = 2});
  EXPECT_EQ(names_and_shapes(*proj), (std::vector<NameShape>{{"weight_ih_l0", Shape{20, 3}},
                                                             {"weight_hh_l0", Shape{20, 2}},
                                                             {"bias_ih_l0", Shape{20}},
                                                             {"bias_hh_l0", Shape{20}},
                                                             {"weight_hr_l0", Shape{2, 5}},
                                                             {"weight_ih_l1", Shape{20, 2}},
                                                             {"weight_hh_l1", Shape{20, 2}},
                                                             {"bias_ih_l1", Shape{20}},
                                                             {"bias_hh_l1", Shape{20}},
                                                             {"weight_hr_l1", Shape{2, 5}}}));

  nn::RNN rnn(4, 6, nn::RNNOptions{.nonlinearity = "relu"});
  EXPECT_EQ(names_and_shapes(*rnn), (std::vector<NameShape>{{"weight_ih_l0", Shape{6, 4}},
                                                            {"weight_hh_l0", Shape{6, 6}},
                                                            {"bias_ih_l0", Shape{6}},
                                                            {"bias_hh_l0", Shape{6}}}));
  EXPECT_EQ(rnn->name(), "RNN(4, 6, nonlinearity=relu)");
  EXPECT_EQ(lstm->name(), "LSTM(3, 5, num_layers=2, bidirectional=true)");

  auto cell = [](std::int64_t g) {
    return std::vector<NameShape>{
        {"weight_ih", Shape{g, 3}}, {"weight_hh", Shape{g, 5}}, {"bias_ih", Shape{g}}, {"bias_hh", Shape{g}}};
  };
  EXPECT_EQ(names_and_shapes(*nn::LSTMCell(3, 5)), cell(20));
  EXPECT_EQ(names_and_shapes(*nn::GRUCell(3, 5)), cell(15));
  EXPECT_EQ(names_and_shapes(*nn::RNNCell(3, 5)), cell(5));
  EXPECT_EQ(names_and_shapes(*nn::GRUCell(3, 5, nn::GRUCellOptions{.bias = false})).size(), 2u);
}

TEST(RNN, InitialisationIsUniformWithinOneOverSqrtHidden) {
  manual_seed(3);
  nn::LSTMT<double> lstm(7, 16, nn::LSTMOptions{.num_layers = 2, .bidirectional = true, .proj_size = 4});
  nn::GRUCellT<double> cell(7, 16);
  for (const nn::Module* m : {static_cast<const nn::Module*>(lstm.get()), static_cast<const nn::Module*>(cell.get())})
    for (auto& p : m->named_parameters()) {
      auto v = p.tensor.as<double>().to_vector();
      double lo = 1, hi = -1;
      for (double x : v) lo = std::min(lo, x), hi = std::max(hi, x);
      EXPECT_GE(lo, -0.25) << p.name;  // 1 / sqrt(16)
      EXPECT_LE(hi, 0.25) << p.name;
      if (v.size() >= 64) {
        EXPECT_TRUE(lo < -0.2 && hi > 0.2) << p.name << " spans [" << lo << ", " << hi << "]";
      }
    }
}

// A truncated-BPTT loop that writes the next window's state into the buffer this window started
// from, before backward: the gradients would be computed from the new state, so backward
// refuses, for the fused LSTM as for GRU and RNN (PyTorch: "modified by an inplace operation").
TEST(RNN, WritingTheInitialStateBeforeBackwardIsRefused) {
  auto x = r({5, 2, 3}, 1);
  nn::LSTMT<double> lstm(3, 4);
  auto h0 = zeros<double>({1, 2, 4}), c0 = zeros<double>({1, 2, 4});
  {
    auto [y, hc] = lstm->forward(x, {h0, c0});
    c0.copy_(std::get<1>(hc).detach());
    EXPECT_TRUE(throws_with([&] { y.sum().backward(); }, {"modified by an inplace operation", "LSTMLayerBackward"}));
  }
  {
    auto [y, hc] = lstm->forward(x, {h0, c0});
    h0.copy_(std::get<0>(hc).detach());
    EXPECT_TRUE(throws_with([&] { y.sum().backward(); }, {"modified by an inplace operation", "LSTMLayerBackward"}));
  }
  nn::GRUT<double> gru(3, 4);
  auto g0 = zeros<double>({1, 2, 4});
  auto [yg, hg] = gru->forward(x, g0);
  g0.copy_(hg.detach());
  EXPECT_TRUE(throws_with([&] { yg.sum().backward(); }, {"modified by an inplace operation"}));
  // Backward first, then the write: the loop as it should be.
  auto [y, hc] = lstm->forward(x, {h0, c0});
  y.sum().backward();
  h0.copy_(std::get<0>(hc).detach());
  c0.copy_(std::get<1>(hc).detach());
}

// Options in bare braces, as every other layer takes them (nn::Linear(4, 2, {.bias = false})).
TEST(RNN, OptionsTakeBareBraces) {
  nn::GRU gru(4, 6, {.batch_first = true});
  nn::LSTM lstm(4, 6, {.num_layers = 2, .bidirectional = true});
  nn::RNN rnn(4, 6, {.nonlinearity = "relu"});
  nn::GRUCell gru_cell(4, 6, {.bias = false});
  nn::LSTMCellT<double> lstm_cell(4, 6, {.bias = false});
  EXPECT_TRUE(gru->options.batch_first);
  EXPECT_EQ(lstm->options.num_layers, 2);
  EXPECT_EQ(rnn->options.nonlinearity, "relu");
  EXPECT_FALSE(gru_cell->options.bias);
  EXPECT_FALSE(lstm_cell->options.bias);
  auto [y, h] = gru(randn<float>({3, 5, 4}));  // batch first: [B, S, F]
  EXPECT_EQ(y.shape(), (Shape{3, 5, 6}));
  nn::GRU copy = gru;  // a holder: copies share the layer
  EXPECT_EQ(copy.ptr(), gru.ptr());
}

TEST(RNN, OutputAndStateShapes) {
  const std::int64_t S = 5, B = 3, F = 4, H = 6;
  for (std::int64_t layers : {1, 2})
    for (bool bidir : {false, true})
      for (bool bf : {false, true}) {
        SCOPED_TRACE(std::to_string(layers) + " layers, bidirectional " + std::to_string(bidir) + ", batch_first " +
                     std::to_string(bf));
        const std::int64_t D = bidir ? 2 : 1;
        auto x = randn<float>(bf ? Shape{B, S, F} : Shape{S, B, F});
        const Shape out_shape = bf ? Shape{B, S, D * H} : Shape{S, B, D * H}, state{layers * D, B, H};
        nn::LSTM lstm(F, H, nn::LSTMOptions{.num_layers = layers, .batch_first = bf, .bidirectional = bidir});
        auto [y, hc] = lstm(x);
        auto [h, c] = hc;
        EXPECT_EQ(y.shape(), out_shape);
        EXPECT_EQ(h.shape(), state);
        EXPECT_EQ(c.shape(), state);
        nn::GRU gru(F, H, nn::GRUOptions{.num_layers = layers, .batch_first = bf, .bidirectional = bidir});
        auto [yg, hg] = gru(x, zeros<float>(state));
        EXPECT_EQ(yg.shape(), out_shape);
        EXPECT_EQ(hg.shape(), state);
        nn::RNN rnn(F, H, nn::RNNOptions{.num_layers = layers, .batch_first = bf, .bidirectional = bidir});
        auto [yr, hr] = rnn(x);
        EXPECT_EQ(yr.shape(), out_shape);
        EXPECT_EQ(hr.shape(), state);
        // Unbatched (seq, feature): batch_first does not apply.
        auto [yu, hu] = rnn(randn<float>({S, F}), zeros<float>({layers * D, H}));
        EXPECT_EQ(yu.shape(), (Shape{S, D * H}));
        EXPECT_EQ(hu.shape(), (Shape{layers * D, H}));
        // With a projection, h and the output have proj_size features, c keeps hidden_size.
        nn::LSTM proj(F, H,
                      nn::LSTMOptions{.num_layers = layers, .batch_first = bf, .bidirectional = bidir, .proj_size = 2});
        auto [yp, hcp] = proj->forward(x, {zeros<float>({layers * D, B, 2}), zeros<float>(state)});
        EXPECT_EQ(yp.shape(), bf ? (Shape{B, S, D * 2}) : (Shape{S, B, D * 2}));
        EXPECT_EQ(std::get<0>(hcp).shape(), (Shape{layers * D, B, 2}));
        EXPECT_EQ(std::get<1>(hcp).shape(), state);
      }
  // An empty batch gives empty outputs, as in PyTorch.
  auto [y0, s0] = nn::LSTM(F, H, nn::LSTMOptions{.num_layers = 2, .bidirectional = true})(randn<float>({S, 0, F}));
  EXPECT_EQ(y0.shape(), (Shape{S, 0, 2 * H}));
  EXPECT_EQ(std::get<1>(s0).shape(), (Shape{4, 0, H}));
  auto [h, c] = nn::LSTMCell(4, 6)(randn<float>({3, 4}));
  EXPECT_EQ(h.shape(), (Shape{3, 6}));
  EXPECT_EQ(c.shape(), (Shape{3, 6}));
  EXPECT_EQ(nn::GRUCell(4, 6)(randn<float>({4})).shape(), (Shape{6}));
  EXPECT_EQ(nn::RNNCell(4, 6)(randn<float>({4}), zeros<float>({6})).shape(), (Shape{6}));
}

TEST(RNN, OptionsAreCheckedAtConstruction) {
  EXPECT_TRUE(throws_with([] { nn::LSTM(4, 0); }, {"LSTM", "hidden_size must be positive, got 0"}));
  EXPECT_TRUE(throws_with([] { nn::GRU(4, -3); }, {"GRU", "hidden_size", "-3"}));
  EXPECT_TRUE(throws_with([] { nn::RNN(0, 3); }, {"RNN", "input_size must be positive"}));
  EXPECT_TRUE(throws_with([] { nn::LSTM(4, 3, nn::LSTMOptions{.num_layers = 0}); }, {"num_layers must be positive"}));
  EXPECT_TRUE(
      throws_with([] { nn::GRU(4, 3, nn::GRUOptions{.dropout = -0.1}); }, {"GRU", "dropout must be in [0, 1]"}));
  EXPECT_TRUE(
      throws_with([] { nn::LSTM(4, 3, nn::LSTMOptions{.dropout = 1.5}); }, {"dropout must be in [0, 1], got 1.5"}));
  EXPECT_TRUE(throws_with([] { nn::LSTM(4, 3, nn::LSTMOptions{.proj_size = 3}); },
                          {"proj_size (3) must be smaller than hidden_size (3)"}));
  EXPECT_TRUE(
      throws_with([] { nn::LSTM(4, 3, nn::LSTMOptions{.proj_size = -1}); }, {"proj_size must be non-negative"}));
  EXPECT_TRUE(throws_with([] { nn::RNN(4, 3, nn::RNNOptions{.nonlinearity = "sigmoid"}); },
                          {"RNN", "unknown nonlinearity 'sigmoid'", "\"tanh\" or \"relu\""}));
  EXPECT_TRUE(throws_with([] { nn::RNNCell(4, 3, nn::RNNCellOptions{.nonlinearity = "gelu"}); },
                          {"RNNCell", "unknown nonlinearity"}));
  EXPECT_TRUE(throws_with([] { nn::LSTMCell(4, 0); }, {"LSTMCell", "hidden_size must be positive"}));
  EXPECT_TRUE(throws_with([] { nn::GRUCell(-1, 2); }, {"GRUCell", "input_size must be positive"}));
}

TEST(RNN, BadInputsNameWhatWasExpected) {
  nn::LSTM lstm(4, 3, nn::LSTMOptions{.num_layers = 2, .bidirectional = true});
  EXPECT_TRUE(
      throws_with([&] { lstm(randn<float>({4})); },
                  {"LSTM: expected input of shape (seq_len, batch, input_size) or unbatched", "got shape [4]"}));
  EXPECT_TRUE(throws_with([&] { lstm(randn<float>({2, 3, 4, 4})); }, {"got shape [2, 3, 4, 4]"}));
  EXPECT_TRUE(throws_with([&] { lstm(randn<float>({5, 2, 7})); }, {"has 7 features, expected input_size=4"}));
  EXPECT_TRUE(throws_with([&] { lstm(randn<float>({0, 2, 4})); }, {"at least one step"}));
  auto x = randn<float>({5, 2, 4});
  EXPECT_TRUE(throws_with(
      [&] {
        lstm->forward(x, {zeros<float>({2, 2, 3}), zeros<float>({4, 2, 3})});
      },
      {"expected h0 of shape [4, 2, 3] (num_layers * num_directions, batch, hidden_size)", "got [2, 2, 3]"}));
  EXPECT_TRUE(throws_with(
      [&] {
        lstm->forward(x, {zeros<float>({4, 2, 3}), zeros<float>({4, 1, 3})});
      },
      {"expected c0 of shape [4, 2, 3]", "got [4, 1, 3]"}));
  EXPECT_TRUE(throws_with([&] { lstm->forward(x, {zeros<float>({4, 2, 3}), Tensor<float>()}); }, {"both h0 and c0"}));
  // Unbatched input takes unbatched states.
  EXPECT_TRUE(throws_with(
      [&] {
        lstm->forward(randn<float>({5, 4}), {zeros<float>({4, 1, 3}), zeros<float>({4, 1, 3})});
      },
      {"expected h0 of shape [4, 3] (num_layers * num_directions, hidden_size)"}));
  nn::LSTM proj(4, 3, nn::LSTMOptions{.proj_size = 2});
  EXPECT_TRUE(throws_with(
      [&] {
        proj->forward(x, {zeros<float>({1, 2, 3}), zeros<float>({1, 2, 3})});
      },
      {"expected h0 of shape [1, 2, 2]", "proj_size)"}));
  nn::GRU gru(4, 3, nn::GRUOptions{.batch_first = true});
  EXPECT_TRUE(throws_with([&] { gru(randn<float>({4})); }, {"GRU", "(batch, seq_len, input_size)"}));
  EXPECT_TRUE(throws_with([&] { gru(x, zeros<float>({1, 5, 3, 1})); }, {"GRU: expected h0 of shape [1, 5, 3]"}));
  set_cpu_device_count(std::max(cpu_device_count(), 2));
  EXPECT_TRUE(throws_with([&] { gru(x.to(Device::cpu(1))); }, {"input is on cpu:1 but the parameters are on cpu:0"}));
  nn::LSTMCell cell(4, 3);
  EXPECT_TRUE(throws_with([&] { cell(randn<float>({2, 5})); }, {"LSTMCell", "has 5 features, expected input_size=4"}));
  EXPECT_TRUE(throws_with(
      [&] {
        cell->forward(randn<float>({2, 4}), {zeros<float>({3, 3}), zeros<float>({2, 3})});
      },
      {"LSTMCell: expected h of shape [2, 3] (batch, hidden_size), got [3, 3]"}));
  EXPECT_TRUE(throws_with(
      [&] {
        nn::GRUCell(4, 3)(randn<float>({4}), zeros<float>({1, 3}));
      },
      {"expected hx of shape [3] (hidden_size) for unbatched input"}));
  EXPECT_TRUE(throws_with([&] { nn::RNNCell(4, 3)(randn<float>({1, 2, 4})); }, {"RNNCell", "got shape [1, 2, 4]"}));
}

TEST(RNNGradcheck, LSTMTwoLayersBidirectionalWithState) {
  nn::LSTMT<double> lstm(3, 3, nn::LSTMOptions{.num_layers = 2, .bidirectional = true});
  EXPECT_TRUE(gradcheck(
      [&](const TL& x) {
        auto [y, hc] = lstm->forward(x[0], {x[1], x[2]});
        return cat(std::vector<Tensor<double>>{y.flatten(), std::get<0>(hc).flatten(), std::get<1>(hc).flatten()});
      },
      with_params({r({4, 2, 3}, 1), r({4, 2, 3}, 2), r({4, 2, 3}, 3)}, *lstm)));
}

TEST(RNNGradcheck, LSTMProjectionBatchFirst) {
  nn::LSTMT<double> lstm(3, 4, nn::LSTMOptions{.batch_first = true, .proj_size = 2});
  EXPECT_TRUE(gradcheck(
      [&](const TL& x) {
        auto [y, hc] = lstm->forward(x[0], {x[1], x[2]});
        return cat(std::vector<Tensor<double>>{y.flatten(), std::get<0>(hc).flatten(), std::get<1>(hc).flatten()});
      },
      with_params({r({2, 4, 3}, 4), r({1, 2, 2}, 5), r({1, 2, 4}, 6)}, *lstm)));
}

TEST(RNNGradcheck, GRUAndRNNBidirectionalBatchFirst) {
  nn::GRUT<double> gru(3, 3, nn::GRUOptions{.num_layers = 2, .batch_first = true, .bidirectional = true});
  EXPECT_TRUE(gradcheck(
      [&](const TL& x) {
        auto [y, h] = gru(x[0], x[1]);
        return cat(std::vector<Tensor<double>>{y.flatten(), h.flatten()});
      },
      with_params({r({2, 4, 3}, 7), r({4, 2, 3}, 8)}, *gru)));
  for (const char* act : {"tanh", "relu"}) {
    nn::RNNT<double> rnn(3, 4, nn::RNNOptions{.num_layers = 2, .nonlinearity = act, .bidirectional = true});
    EXPECT_TRUE(gradcheck(
        [&](const TL& x) {
          auto [y, h] = rnn(x[0], x[1]);
          return cat(std::vector<Tensor<double>>{y.flatten(), h.flatten()});
        },
        with_params({r({3, 2, 3}, 9), r({4, 2, 4}, 10)}, *rnn)))
        << act;
  }
}

TEST(RNNGradcheck, UnbatchedWithoutBias) {
  nn::GRUT<double> gru(3, 4, nn::GRUOptions{.bias = false, .bidirectional = true});
  EXPECT_TRUE(gradcheck([&](const TL& x) { return std::get<0>(gru(x[0])); }, with_params({r({5, 3}, 11)}, *gru)));
}

TEST(RNNGradcheck, Cells) {
  nn::LSTMCellT<double> lstm(3, 4);
  EXPECT_TRUE(gradcheck(
      [&](const TL& x) {
        auto [h, c] = lstm->forward(x[0], {x[1], x[2]});
        return cat(std::vector<Tensor<double>>{h, c}, 1);
      },
      with_params({r({2, 3}, 1), r({2, 4}, 2), r({2, 4}, 3)}, *lstm)));
  nn::GRUCellT<double> gru(3, 4);
  EXPECT_TRUE(gradcheck([&](const TL& x) { return gru(x[0], x[1]); }, with_params({r({2, 3}, 4), r({2, 4}, 5)}, *gru)));
  nn::RNNCellT<double> rnn(3, 4, nn::RNNCellOptions{.nonlinearity = "relu"});
  EXPECT_TRUE(gradcheck([&](const TL& x) { return rnn(x[0], x[1]); }, with_params({r({3}, 6), r({4}, 7)}, *rnn)));
}

namespace {
/// How many nodes of each name the graph behind `t` holds.
std::map<std::string, int> node_counts(const Tensor<double>& t) {
  std::map<std::string, int> counts;
  std::set<const autograd::NodeBase*> seen;
  std::vector<std::shared_ptr<autograd::NodeBase>> todo{t.grad_fn()};
  while (!todo.empty()) {
    auto n = todo.back();
    todo.pop_back();
    if (!n || !seen.insert(n.get()).second) continue;
    ++counts[n->name()];
    for (const auto& e : n->next_edges()) todo.push_back(e.fn);
  }
  return counts;
}
}  // namespace

TEST(RNN, TimeStepsAndGatesAreCutOutByOneNodeEach) {
  // Note [one split node]: a node per slice (select/narrow) would make backward quadratic in
  // the sequence length.
  const std::int64_t S = 7;
  nn::GRUT<double> gru(3, 4, nn::GRUOptions{.num_layers = 2, .bidirectional = true});
  auto h0 = r({4, 2, 4}, 2).requires_grad_(true);
  auto [y, h] = gru->forward(r({S, 2, 3}, 1), h0);
  auto counts = node_counts(y + 0.0 * h.sum());
  EXPECT_EQ(counts["UnbindBackward"], 4 + 1);   // each layer's projection per direction, h0
  EXPECT_EQ(counts["SplitBackward"], 4 * S * 2);  // the gates of every step, input and recurrent side
  EXPECT_EQ(counts["SelectBackward"] + counts["NarrowBackward"], 0);
  EXPECT_EQ(counts["LinearBackward"], 4 * (S + 1));  // one projection and one GEMM per step
}

TEST(RNN, AnLSTMLayerIsOneNodePerDirectionOnTheCpu) {
  // Note [fused LSTM layer]: the projection of the whole sequence, then one node for the steps.
  const std::int64_t S = 7;
  nn::LSTMT<double> lstm(3, 4, nn::LSTMOptions{.num_layers = 2, .bidirectional = true});
  auto h0 = r({4, 2, 4}, 2).requires_grad_(true), c0 = r({4, 2, 4}, 3).requires_grad_(true);
  auto [y, hc] = lstm->forward(r({S, 2, 3}, 1), {h0, c0});
  auto counts = node_counts(y + 0.0 * std::get<0>(hc).sum() + 0.0 * std::get<1>(hc).sum());
  EXPECT_EQ(counts["LSTMLayerBackward"], 4);
  EXPECT_EQ(counts["UnbindBackward"], 2);  // h0, c0
  EXPECT_EQ(counts["SplitBackward"] + counts["SelectBackward"] + counts["NarrowBackward"], 0);
  EXPECT_EQ(counts["LinearBackward"], 4);  // the projections
}

TEST(RNN, BatchFirstIsTheTransposedLayout) {
  manual_seed(5);
  nn::LSTMT<double> tm(3, 4, nn::LSTMOptions{.num_layers = 2, .bidirectional = true});
  nn::LSTMT<double> bf(3, 4, nn::LSTMOptions{.num_layers = 2, .batch_first = true, .bidirectional = true});
  copy_by_name(*tm, *bf);
  auto x = r({6, 2, 3}, 1);
  auto [y1, s1] = tm(x);
  auto [y2, s2] = bf(x.transpose(0, 1));
  EXPECT_TRUE(all_close(y2.transpose(0, 1).contiguous(), y1, 1e-14, 1e-14));
  EXPECT_TRUE(all_close(std::get<0>(s2), std::get<0>(s1), 1e-14, 1e-14));
  EXPECT_TRUE(all_close(std::get<1>(s2), std::get<1>(s1), 1e-14, 1e-14));
}

TEST(RNN, TheReverseDirectionReadsTheSequenceBackwards) {
  // A bidirectional layer's second half is a forward layer (with the _reverse weights) over the
  // reversed sequence, reversed; its h_n is that layer's last state.
  nn::GRUT<double> bi(3, 4, nn::GRUOptions{.bidirectional = true});
  nn::GRUT<double> fwd(3, 4), bwd(3, 4);
  for (auto& p : bi->named_parameters()) {
    auto name = p.name;
    const bool rev = name.ends_with("_reverse");
    if (rev) name.resize(name.size() - 8);
    NoGradGuard g;
    (rev ? bwd : fwd)->find_tensor(name).as<double>().copy_(p.tensor.as<double>());
  }
  auto x = r({5, 2, 3}, 2);
  auto h0 = r({2, 2, 4}, 3);
  auto [y, h] = bi(x, h0);
  auto [yf, hf] = fwd(x, h0.narrow(0, 0, 1));
  auto [yb, hb] = bwd(flip(x, 0), h0.narrow(0, 1, 1));
  EXPECT_TRUE(all_close(y.narrow(2, 0, 4).contiguous(), yf, 1e-14, 1e-14));
  EXPECT_TRUE(all_close(y.narrow(2, 4, 4).contiguous(), flip(yb, 0), 1e-14, 1e-14));
  EXPECT_TRUE(all_close(h, cat(std::vector<Tensor<double>>{hf, hb}, 0), 1e-14, 1e-14));
}

TEST(RNN, OneStepOfALayerIsItsCell) {
  auto x = r({1, 3, 5}, 1);
  auto h0 = r({1, 3, 4}, 2), c0 = r({1, 3, 4}, 3);
  nn::LSTMT<double> lstm(5, 4);
  nn::LSTMCellT<double> lcell(5, 4);
  nn::GRUT<double> gru(5, 4);
  nn::GRUCellT<double> gcell(5, 4);
  nn::RNNT<double> rnn(5, 4, nn::RNNOptions{.nonlinearity = "relu"});
  nn::RNNCellT<double> rcell(5, 4, nn::RNNCellOptions{.nonlinearity = "relu"});
  auto strip = [](const nn::Module& layer, nn::Module& cell) {  // weight_ih_l0 -> weight_ih
    NoGradGuard g;
    for (auto& p : layer.named_parameters())
      cell.find_tensor(p.name.substr(0, p.name.size() - 3)).as<double>().copy_(p.tensor.as<double>());
  };
  strip(*lstm, *lcell);
  strip(*gru, *gcell);
  strip(*rnn, *rcell);
  auto [y, hc] = lstm->forward(x, {h0, c0});
  auto [h, c] = lcell->forward(x.select(0, 0), {h0.select(0, 0), c0.select(0, 0)});
  EXPECT_TRUE(all_close(y.select(0, 0), h, 1e-14, 1e-14));
  EXPECT_TRUE(all_close(std::get<1>(hc).select(0, 0), c, 1e-14, 1e-14));
  EXPECT_TRUE(all_close(std::get<0>(gru(x, h0)).select(0, 0), gcell(x.select(0, 0), h0.select(0, 0)), 1e-14, 1e-14));
  EXPECT_TRUE(all_close(std::get<0>(rnn(x)).select(0, 0), rcell(x.select(0, 0)), 1e-14, 1e-14));
}

TEST(RNN, DropoutBetweenLayersOnlyWhileTraining) {
  manual_seed(9);
  nn::LSTMT<double> drop(3, 4, nn::LSTMOptions{.num_layers = 2, .dropout = 0.5});
  nn::LSTMT<double> plain(3, 4, nn::LSTMOptions{.num_layers = 2});
  copy_by_name(*drop, *plain);
  auto x = r({5, 2, 3}, 1);
  auto reference = std::get<0>(plain(x));
  EXPECT_FALSE(all_close(std::get<0>(drop(x)), reference, 1e-6)) << "dropout has no effect while training";
  drop->eval();
  EXPECT_TRUE(all_close(std::get<0>(drop(x)), reference, 1e-15));
  // No dropout after the last layer: one layer with dropout is the plain layer, also in training.
  nn::GRUT<double> one(3, 4, nn::GRUOptions{.dropout = 0.9});
  nn::GRUT<double> one_plain(3, 4);
  copy_by_name(*one, *one_plain);
  EXPECT_TRUE(all_close(std::get<0>(one(x)), std::get<0>(one_plain(x)), 1e-15));
}

TEST(RNN, CheckpointsKeepPyTorchsNames) {
  const fs::path path = fs::temp_directory_path() / ("chorus_test_rnn_" + std::to_string(::getpid()) + ".safetensors");
  manual_seed(1);
  nn::LSTMT<double> a(3, 4, nn::LSTMOptions{.num_layers = 2, .bidirectional = true, .proj_size = 2});
  save(a, path.string());
  auto file = io::read(path.string());
  std::vector<std::string> in_file, names;
  for (auto& [name, rec] : file.tensors) in_file.push_back(name);
  for (auto& p : a->named_parameters()) names.push_back(p.name);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(in_file, names);
  manual_seed(2);
  nn::LSTMT<double> b(3, 4, nn::LSTMOptions{.num_layers = 2, .bidirectional = true, .proj_size = 2});
  auto x = r({3, 2, 3}, 5);
  EXPECT_FALSE(all_close(std::get<0>(b(x)), std::get<0>(a(x)), 1e-6));
  load(b, path.string());
  fs::remove(path);
  auto pa = a->named_parameters(), pb = b->named_parameters();
  for (std::size_t i = 0; i < pa.size(); ++i)
    EXPECT_EQ(pa[i].tensor.as<double>().to_vector(), pb[i].tensor.as<double>().to_vector()) << pa[i].name;
  EXPECT_TRUE(all_close(std::get<0>(b(x)), std::get<0>(a(x)), 0));
  // A checkpoint of another configuration is refused by name.
  nn::LSTMT<double> c(3, 4, nn::LSTMOptions{.num_layers = 2});
  save(a, path.string());
  EXPECT_THROW(load(c, path.string()), Error);
  fs::remove(path);
}

TEST(RNN, CloneIsADeepCopy) {
  nn::LSTMT<double> a(3, 4, nn::LSTMOptions{.num_layers = 2, .bidirectional = true});
  auto b = nn::clone(a, Device::cpu());
  auto x = r({3, 2, 3}, 5);
  EXPECT_TRUE(all_close(std::get<0>(b(x)), std::get<0>(a(x)), 0));
  {
    NoGradGuard g;
    b->all_weights()[0].fill_(0.5);
  }
  EXPECT_NE(a->all_weights()[0].to_vector()[0], 0.5);
  EXPECT_EQ(b->named_parameters()[0].tensor.as<double>().to_vector()[0], 0.5)
      << "all_weights() and the registry differ";
}

TEST(RNN, ToMovesEveryWeight) {
  set_cpu_device_count(std::max(cpu_device_count(), 2));
  nn::GRUT<double> a(3, 4, nn::GRUOptions{.num_layers = 2, .bidirectional = true});
  auto x = r({3, 2, 3}, 5);
  auto [y, h] = a(x);
  a->to(Device::cpu(1));
  for (const auto& w : a->all_weights()) EXPECT_EQ(w.device(), Device::cpu(1));
  auto [y1, h1] = a(x.to(Device::cpu(1)));
  EXPECT_EQ(y1.device(), Device::cpu(1));
  EXPECT_TRUE(all_close(y1.to(Device::cpu()), y, 0));
  EXPECT_TRUE(all_close(h1.to(Device::cpu()), h, 0));
}

namespace {
/// A sequence model: a batch-first LSTM and a linear head on every step.
struct Tagger : nn::Module {
  nn::LSTMT<double> lstm;
  nn::LinearT<double> head;
  Tagger()
      : lstm(register_module(
            "lstm",
            nn::LSTMT<double>(3, 5, nn::LSTMOptions{.num_layers = 2, .batch_first = true, .bidirectional = true}))),
        head(register_module("head", nn::LinearT<double>(10, 2))) {}
  Tensor<double> forward(const Tensor<double>& x) { return head(std::get<0>(lstm(x))); }
};
}  // namespace

TEST(RNN, DataParallelGivesTheSingleDeviceGradients) {
  manual_seed(4);
  Tagger reference;
  auto x = r({7, 6, 3}, 1);
  auto w = r({7, 6, 2}, 2);
  auto xr = x.detach().requires_grad_(true);
  auto ref_out = reference.forward(xr);
  (ref_out * w).sum().backward();
  const auto inline_default = parallel::inline_work_default();
  for (bool threaded : {true, false})
    for (int k : {1, 2, 3}) {
      SCOPED_TRACE(std::to_string(k) + (threaded ? " devices, threaded" : " devices, inline"));
      // Threaded: every replica on its device's worker; inline: replicas after one another on this
      // thread when the step is small (Note [inline small steps]).
      parallel::set_inline_work_default(threaded ? 0 : std::int64_t{1} << 40);
      DataParallel<Tagger> dp(nn::clone(reference, Device::cpu(0)), cpus(k));
      parallel::set_inline_work_default(inline_default);
      auto xd = x.detach().requires_grad_(true);
      auto out = dp(xd);
      EXPECT_TRUE(all_close(out, ref_out, 1e-10, 1e-10));
      (out * w).sum().backward();
      EXPECT_TRUE(all_close(xd.grad(), xr.grad(), 1e-10, 1e-10)) << "input gradient";
      auto pa = reference.named_parameters(), pb = dp.module().named_parameters();
      ASSERT_EQ(pa.size(), pb.size());
      for (std::size_t i = 0; i < pa.size(); ++i) {
        auto gb = pb[i].tensor.as<double>().grad();
        ASSERT_TRUE(gb.defined()) << pb[i].name;
        EXPECT_TRUE(all_close(gb, pa[i].tensor.as<double>().grad(), 1e-10, 1e-10)) << "gradient of " << pa[i].name;
      }
    }
}

TEST(RNN, TrainingLearnsToRecallAnEarlierStep) {
  // y_t = x_{t-2}: the layer has to carry two steps of memory.
  for (int model = 0; model < 2; ++model) {
    SCOPED_TRACE(model == 0 ? "LSTM" : "GRU");
    manual_seed(7);
    nn::LSTM lstm(1, 12, nn::LSTMOptions{.batch_first = true});
    nn::GRU gru(1, 12, nn::GRUOptions{.batch_first = true});
    nn::Linear head(12, 1);
    std::vector<AnyTensor> params = model == 0 ? lstm->parameters() : gru->parameters();
    for (auto& p : head->parameters()) params.push_back(p);
    optim::Adam opt(params, {.lr = 0.03});
    Generator gen(11);
    auto batch_loss = [&] {
      auto x = rand<float>({16, 10, 1}, Device::cpu(), -1, 1, gen);
      auto y = cat(std::vector<Tensor<float>>{zeros<float>({16, 2, 1}), x.narrow(1, 0, 8)}, 1);
      auto h = model == 0 ? std::get<0>(lstm(x)) : std::get<0>(gru(x));
      return nn::functional::mse_loss(head(h), y);
    };
    double first = 0, last = 0;
    for (int step = 0; step < 150; ++step) {
      auto loss = batch_loss();
      if (step < 5) first += loss.item() / 5;
      if (step >= 145) last += loss.item() / 5;
      opt.zero_grad();
      loss.backward();
      opt.step();
    }
    EXPECT_LT(last, 0.2 * first) << "loss " << first << " -> " << last;
  }
}
