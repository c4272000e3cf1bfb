// DataParallel for sequence models and any model (issue 18, items 4 and 5): per-argument scatter
// dims and per-output gather dims (Note [scatter and gather dims]), tensors nested in tuples,
// vectors, maps and optionals (Note [nested arguments]), per-replica scalar losses, the
// functional API (Note [functional data parallelism]), a module built elsewhere moved by to(),
// and a capsule network with dynamic routing. Everything in float64 on virtual CPU devices,
// against the single-device run to 1e-10.
#include <atomic>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "capsule_net.hpp"
#include "data_parallel_util.hpp"

using namespace chorus;
using chorus::testing::all_close;
using chorus::testing::cpus;
using chorus::testing::throws_with;

namespace {
constexpr double kTol = 1e-10;

Tensor<double> r(const Shape& shape, std::uint64_t seed) {
  Generator gen(seed);
  return randn<double>(shape, Device::cpu(0), 0.0, 1.0, gen);
}

/// Runs `body(threaded)` with DataParallels built to run their replicas on the workers
/// (threaded) or, for small steps, one after another on the caller (Note [inline small steps]).
template <class F>
void both_schedules(F&& body) {
  const auto saved = parallel::inline_work_default();
  for (bool threaded : {true, false}) {
    SCOPED_TRACE(threaded ? "threaded" : "inline");
    parallel::set_inline_work_default(threaded ? 0 : std::int64_t{1} << 40);
    body();
    parallel::set_inline_work_default(saved);
  }
}

void expect_param_grads(const nn::Module& reference, const nn::Module& dp, const std::string& what) {
  auto pa = reference.named_parameters(), pb = dp.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (std::size_t i = 0; i < pa.size(); ++i) {
    auto ga = pa[i].tensor.as<double>().grad(), gb = pb[i].tensor.as<double>().grad();
    ASSERT_TRUE(ga.defined() && gb.defined()) << what << ": " << pa[i].name;
    EXPECT_TRUE(all_close(gb, ga, kTol, kTol)) << what << ": gradient of " << pa[i].name;
  }
}
}  // namespace

// ---------------------------------------------------------------- LSTM: (h0, c0) split along dim 1

TEST(DataParallelSeq, LstmStateSplitAlongDim1GivesTheSingleDeviceRun) {
  using LSTM = nn::LSTMT<double>;
  using State = std::tuple<Tensor<double>, Tensor<double>>;
  for (bool batch_first : {true, false}) {
    SCOPED_TRACE(batch_first ? "batch_first" : "time-major");
    manual_seed(3);
    LSTM reference(4, 5, nn::LSTMOptions{.num_layers = 2, .batch_first = batch_first});
    const std::int64_t batch = 7, seq = 6;
    const Shape in_shape = batch_first ? Shape{batch, seq, 4} : Shape{seq, batch, 4};
    auto x = r(in_shape, 1), h0 = r({2, batch, 5}, 2), c0 = r({2, batch, 5}, 3);
    auto w_out = r(batch_first ? Shape{batch, seq, 5} : Shape{seq, batch, 5}, 4), w_h = r({2, batch, 5}, 5),
         w_c = r({2, batch, 5}, 6);
    auto leaves = [&] {
      return std::make_tuple(x.detach().requires_grad_(true), h0.detach().requires_grad_(true),
                             c0.detach().requires_grad_(true));
    };
    auto [xr, hr, cr] = leaves();
    auto [ref_out, ref_state] = reference(xr, State{hr, cr});
    auto loss = [&](const Tensor<double>& out, const State& s) {
      return sum(out * w_out) + sum(std::get<0>(s) * w_h) + sum(std::get<1>(s) * w_c);
    };
    loss(ref_out, ref_state).backward();
    both_schedules([&] {
      for (int k : {1, 2, 3}) {
        SCOPED_TRACE(std::to_string(k) + " devices");
        // Say it once: the input splits along its batch dim, both states along 1; the outputs join likewise.
        auto options = batch_first ? DataParallelOptions{.devices = cpus(k), .scatter_dims = {0, 1}, .gather_dims = {0, 1}}
                                   : DataParallelOptions{.devices = cpus(k), .dim = 1};
        DataParallel<LSTM> dp(nn::clone(reference, Device::cpu(0)), options);
        auto [xd, hd, cd] = leaves();
        auto [out, state] = dp(xd, State{hd, cd});
        EXPECT_TRUE(all_close(out, ref_out, kTol, kTol)) << "output";
        EXPECT_TRUE(all_close(std::get<0>(state), std::get<0>(ref_state), kTol, kTol)) << "h_n";
        EXPECT_TRUE(all_close(std::get<1>(state), std::get<1>(ref_state), kTol, kTol)) << "c_n";
        loss(out, state).backward();
        EXPECT_TRUE(all_close(xd.grad(), xr.grad(), kTol, kTol)) << "input gradient";
        EXPECT_TRUE(all_close(hd.grad(), hr.grad(), kTol, kTol)) << "h0 gradient";
        EXPECT_TRUE(all_close(cd.grad(), cr.grad(), kTol, kTol)) << "c0 gradient";
        expect_param_grads(*reference, dp.module(), "LSTM");
        // Replicated recurrent weights are contiguous, in one block per replica, with no
        // flatten_parameters() call (PyTorch warns and wants one).
        for (std::size_t rep = 0; rep < dp.devices().size(); ++rep) {
          const auto weights = dp.replica(rep).all_weights();
          for (const auto& w : weights) {
            EXPECT_TRUE(w.is_contiguous()) << "replica " << rep;
            EXPECT_EQ(chorus::testing::block_of(w), chorus::testing::block_of(weights[0])) << "replica " << rep;
          }
        }
      }
    });
  }
}

// ---------------------------------------------------------------- nested arguments and outputs

namespace {
using Vec = std::vector<Tensor<double>>;
using Map = std::map<std::string, Tensor<double>>;
/// Takes tensors in every container DataParallel sees into, and returns some of each.
struct Nested : nn::Module {
  nn::LinearT<double> fc;
  Nested() : fc(register_module("fc", nn::LinearT<double>(3, 2))) {}
  template <class... A>
  auto operator()(A&&... a) {
    return forward(std::forward<A>(a)...);
  }
  std::tuple<Tensor<double>, std::pair<Vec, Map>, std::optional<Tensor<double>>, std::string, Tensor<double>> forward(
      const std::tuple<Tensor<double>, double>& a, const Vec& vs, const Map& m, const std::optional<Tensor<double>>& o,
      const std::string& tag) {
    const auto& [x, scale] = a;
    auto y = fc(x) * scale;
    EXPECT_FALSE(vs[1].defined());  // an undefined tensor reaches every replica undefined
    Vec outs{fc(vs[0]), Tensor<double>()};
    Map mo{{"sum", y + fc(m.at("z"))}, {"loss", sum(y * y)}};
    std::optional<Tensor<double>> oo;
    if (o) oo = *o * 2.0;
    return {y, {outs, mo}, oo, tag + "!", vs[2].transpose(0, 1)};
  }
};
}  // namespace

TEST(DataParallelSeq, TensorsInsideTuplesVectorsMapsAndOptionalsAreScatteredAndGathered) {
  manual_seed(5);
  Nested reference;
  auto x = r({5, 3}, 1), v0 = r({5, 3}, 2), v2 = r({5, 4}, 3), z = r({5, 3}, 4), o = r({5, 2}, 5);
  auto leaves = [&] {
    return std::vector<Tensor<double>>{x.detach().requires_grad_(true), v0.detach().requires_grad_(true),
                                       v2.detach().requires_grad_(true), z.detach().requires_grad_(true),
                                       o.detach().requires_grad_(true)};
  };
  auto call = [](auto& model, const std::vector<Tensor<double>>& l, bool with_optional) {
    return model(std::make_tuple(l[0], 0.5), Vec{l[1], Tensor<double>(), l[2]}, Map{{"z", l[3]}},
                 with_optional ? std::optional<Tensor<double>>(l[4]) : std::nullopt, std::string("tag"));
  };
  auto total = [](const auto& result) {
    const auto& [y, vm, oo, tag, t] = result;
    auto s = sum(y * y) + sum(vm.first[0]) + sum(t * t) + sum(vm.second.at("sum")) + sum(vm.second.at("loss"));
    return oo ? s + sum(*oo * *oo) : s;
  };
  for (bool with_optional : {true, false}) {
    SCOPED_TRACE(with_optional ? "optional set" : "optional empty");
    auto ref_leaves = leaves();
    auto ref = call(reference, ref_leaves, with_optional);
    reference.zero_grad();
    total(ref).backward();
    for (int k : {1, 2, 3}) {
      SCOPED_TRACE(std::to_string(k) + " devices");
      // The last output is [4, rows]: it joins along its last dim (gather_dims per output).
      // The vector's tensors split along -2 (their dim 0), the undefined one passing through.
      DataParallel<Nested> dp(nn::clone(reference, Device::cpu(0)),
                              {.devices = cpus(k), .scatter_dims = {0, -2}, .gather_dims = {0, 0, 0, 0, -1}});
      auto l = leaves();
      auto out = call(dp, l, with_optional);
      const auto& [y, vm, oo, tag, t] = out;
      EXPECT_EQ(tag, "tag!");
      EXPECT_TRUE(all_close(y, std::get<0>(ref), kTol, kTol));
      EXPECT_TRUE(all_close(t, std::get<4>(ref), kTol, kTol));
      ASSERT_EQ(vm.first.size(), 2u);
      EXPECT_TRUE(all_close(vm.first[0], std::get<1>(ref).first[0], kTol, kTol));
      EXPECT_FALSE(vm.first[1].defined());  // undefined in every replica: undefined
      EXPECT_TRUE(all_close(vm.second.at("sum"), std::get<1>(ref).second.at("sum"), kTol, kTol));
      // A per-replica scalar: one value per replica (k > 1), which sum to the single-device value.
      const auto& losses = vm.second.at("loss");
      EXPECT_EQ(losses.dim(), k == 1 ? 0 : 1);
      EXPECT_NEAR(sum(losses).item(), std::get<1>(ref).second.at("loss").item(), 1e-10);
      ASSERT_EQ(oo.has_value(), with_optional);
      if (oo) {
        EXPECT_TRUE(all_close(*oo, *std::get<2>(ref), kTol, kTol));
      }
      total(out).backward();
      for (std::size_t i = 0; i < l.size(); ++i)
        if (with_optional || i != 4) {
          EXPECT_TRUE(all_close(l[i].grad(), ref_leaves[i].grad(), kTol, kTol)) << "leaf " << i;
        }
      expect_param_grads(reference, dp.module(), "Nested");
    }
  }
}

TEST(DataParallelSeq, NestedArgumentsGiveTheSingleDeviceGradients) {
  // Gradients of tensors inside containers flow back through the scatter (k = 1, 2, 3).
  struct Sum : nn::Module {
    nn::LinearT<double> fc;
    Sum() : fc(register_module("fc", nn::LinearT<double>(3, 2))) {}
    Tensor<double> forward(const std::pair<Tensor<double>, Vec>& p, const Map& m) {
      return fc(p.first) + fc(p.second[0]) * m.at("w");
    }
  };
  manual_seed(8);
  Sum reference;
  auto a = r({7, 3}, 1), b = r({7, 3}, 2), w = r({7, 2}, 3), g = r({7, 2}, 4);
  auto la = a.detach().requires_grad_(true), lb = b.detach().requires_grad_(true), lw = w.detach().requires_grad_(true);
  auto ref = reference.forward({la, Vec{lb}}, Map{{"w", lw}});
  sum(ref * g).backward();
  both_schedules([&] {
    for (int k : {1, 2, 3}) {
      SCOPED_TRACE(std::to_string(k) + " devices");
      DataParallel<Sum> dp(nn::clone(reference, Device::cpu(0)), cpus(k));
      auto da = a.detach().requires_grad_(true), db = b.detach().requires_grad_(true),
           dw = w.detach().requires_grad_(true);
      auto out = dp(std::make_pair(da, Vec{db}), Map{{"w", dw}});
      EXPECT_TRUE(all_close(out, ref, kTol, kTol));
      sum(out * g).backward();
      EXPECT_TRUE(all_close(da.grad(), la.grad(), kTol, kTol));
      EXPECT_TRUE(all_close(db.grad(), lb.grad(), kTol, kTol));
      EXPECT_TRUE(all_close(dw.grad(), lw.grad(), kTol, kTol));
      expect_param_grads(reference, dp.module(), "Sum");
    }
  });
}

// ---------------------------------------------------------------- per-replica scalar loss

TEST(DataParallelSeq, APerReplicaScalarLossIsGatheredIntoOneValuePerReplica) {
  struct WithLoss : nn::Module {
    nn::LinearT<double> fc;
    WithLoss() : fc(register_module("fc", nn::LinearT<double>(4, 3))) {}
    Tensor<double> forward(const Tensor<double>& x, const Tensor<double>& y) {
      return nn::functional::mse_loss(fc(x), y, Reduction::Sum);
    }
  };
  manual_seed(9);
  WithLoss reference;
  auto x = r({10, 4}, 1), y = r({10, 3}, 2);
  auto ref = reference.forward(x, y);
  ref.backward();
  both_schedules([&] {
    for (int k : {1, 2, 3}) {
      SCOPED_TRACE(std::to_string(k) + " devices");
      DataParallel<WithLoss> dp(nn::clone(reference, Device::cpu(0)), cpus(k));
      auto losses = dp(x, y);
      // As PyTorch: one device returns the module's 0-dim loss; k devices a vector of k losses.
      EXPECT_EQ(losses.shape(), k == 1 ? Shape{} : Shape{k});
      const auto plan = parallel::plan_chunks(10, static_cast<std::size_t>(k));
      for (std::size_t i = 0; i < plan.used() && k > 1; ++i) {
        NoGradGuard ng;
        auto part = reference.forward(x.narrow(0, plan.offsets[i], plan.sizes[i]), y.narrow(0, plan.offsets[i], plan.sizes[i]));
        EXPECT_NEAR(losses.to_vector()[i], part.item(), 1e-10) << "replica " << i;
      }
      sum(losses).backward();
      expect_param_grads(reference, dp.module(), "loss");
    }
  });
}

// ---------------------------------------------------------------- the functional API

TEST(DataParallelSeq, TheFunctionalPiecesAreTorchNnParallels) {
  auto devs = cpus(3);
  manual_seed(10);
  nn::LinearT<double> reference(4, 3);
  auto x = r({8, 4}, 1), g = r({8, 3}, 2);
  auto ref = reference(x);
  sum(ref * g).backward();
  // scatter: torch.chunk pieces on their devices (8 on 3: 3, 3, 2); nested tensors split, values copied.
  auto pieces = parallel::scatter(std::make_tuple(x, 7, Vec{x}), devs);
  ASSERT_EQ(pieces.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(std::get<0>(pieces[i]).device(), devs[i]);
    EXPECT_EQ(std::get<0>(pieces[i]).shape(), (Shape{i < 2 ? 3 : 2, 4}));
    EXPECT_EQ(std::get<1>(pieces[i]), 7);
    EXPECT_TRUE(all_close(std::get<2>(pieces[i])[0].to(Device::cpu(0)), std::get<0>(pieces[i]).to(Device::cpu(0)), 0));
  }
  auto two = parallel::scatter(r({2, 4}, 3), devs);
  EXPECT_EQ(two.size(), 2u);  // fewer chunks than devices
  {
    auto module = nn::clone(reference, Device::cpu(0));
    auto three = parallel::replicate(module, devs);
    EXPECT_TRUE(throws_with([&] { parallel::parallel_apply(three, two); }, {"2 inputs for 3 replicas"}));
  }
  EXPECT_EQ(parallel::scatter(std::string("no tensor"), devs), std::vector<std::string>(3, "no tensor"));
  auto by_dims = parallel::scatter(std::make_pair(x, r({2, 8}, 4)), devs, std::vector<std::int64_t>{0, 1});
  EXPECT_EQ(by_dims[2].second.shape(), (Shape{2, 2}));
  // replicate + scatter + parallel_apply + gather, step by step, as PyTorch's data_parallel.
  for (int k : {1, 2, 3}) {
    SCOPED_TRACE(std::to_string(k) + " devices");
    auto module = nn::clone(reference, Device::cpu(0));
    const std::vector<Device> used(devs.begin(), devs.begin() + k);
    auto xd = x.detach().requires_grad_(true);
    auto replicas = parallel::replicate(module, used);
    ASSERT_EQ(replicas.size(), static_cast<std::size_t>(k));
    EXPECT_EQ(&*replicas[0], &*module);  // replica 0 is the module itself
    for (std::size_t i = 0; i < replicas.size(); ++i) EXPECT_EQ(replicas[i]->weight.device(), used[i]);
    auto inputs = parallel::scatter(xd, used);
    auto outputs = parallel::parallel_apply(replicas, inputs);
    for (std::size_t i = 0; i < outputs.size(); ++i) EXPECT_EQ(outputs[i].device(), used[i]);
    auto out = parallel::gather(outputs, Device::cpu(0));
    EXPECT_TRUE(all_close(out, ref, kTol, kTol));
    sum(out * g).backward();
    ASSERT_TRUE(xd.grad().defined()) << "the scatter is differentiable";
    EXPECT_TRUE(all_close(xd.grad(), matmul(g, reference->weight.detach()), kTol, kTol));
    expect_param_grads(*reference, *module, "replicate");
    // data_parallel: one call, with PyTorch's positional form and with options.
    auto fresh = nn::clone(reference, Device::cpu(0));
    auto y = parallel::data_parallel(fresh, x, used);
    EXPECT_TRUE(all_close(y, ref, kTol, kTol));
    sum(y * g).backward();
    expect_param_grads(*reference, *fresh, "data_parallel");
    EXPECT_EQ(parallel::data_parallel(fresh, x, {.devices = used, .output_device = used.back()}).device(), used.back());
  }
  // gather of nested outputs: tensors joined, scalars stacked, equal values kept.
  std::vector<std::tuple<Tensor<double>, Tensor<double>, int>> outs{
      {r({2, 3}, 5), scalar_tensor<double>(1.0), 4}, {r({1, 3}, 6).to(devs[1]), scalar_tensor<double>(2.0, devs[1]), 4}};
  auto [joined, stacked, same] = parallel::gather(outs, devs[2]);
  EXPECT_EQ(joined.shape(), (Shape{3, 3}));
  EXPECT_EQ(joined.device(), devs[2]);
  EXPECT_EQ(stacked.to_vector(), (std::vector<double>{1.0, 2.0}));
  EXPECT_EQ(same, 4);
  std::get<2>(outs[1]) = 5;
  EXPECT_TRUE(throws_with([&] { parallel::gather(outs, devs[0]); }, {"output[2]", "differs between replica 0 and replica 1"}));
}

TEST(DataParallelSeq, DataParallelTakesAnLstmsTupleOfArguments) {
  // data_parallel(module, (x, (h0, c0)), ...) with the LSTM's dims, as the DataParallel test above.
  manual_seed(11);
  nn::LSTMT<double> reference(3, 4, nn::LSTMOptions{.batch_first = true});
  auto x = r({5, 2, 3}, 1), h0 = r({1, 5, 4}, 2), c0 = r({1, 5, 4}, 3);
  auto [ref_out, ref_state] = reference(x, std::make_tuple(h0, c0));
  auto [out, state] = parallel::data_parallel(reference, std::make_tuple(x, std::make_tuple(h0, c0)),
                                              {.devices = cpus(3), .scatter_dims = {0, 1}, .gather_dims = {0, 1}});
  EXPECT_TRUE(all_close(out, ref_out, kTol, kTol));
  EXPECT_TRUE(all_close(std::get<1>(state), std::get<1>(ref_state), kTol, kTol));
}

// ---------------------------------------------------------------- DataParallel(module elsewhere).to(devices[0])

TEST(DataParallelSeq, AModuleBuiltElsewhereIsMovedByTo) {
  auto devs = cpus(3);
  manual_seed(12);
  chorus::testing::Net<double> reference;
  auto x = r({6, 6}, 1);
  auto ref = reference.forward(x);
  auto elsewhere = nn::clone(reference, devs[2]);
  DataParallel<chorus::testing::Net<double>> dp(std::move(elsewhere), {devs[0], devs[1]});  // as PyTorch: no error yet
  EXPECT_TRUE(throws_with([&] { dp(x); }, {"fc1.weight", "is on cpu:2", "primary device is cpu:0"}));
  EXPECT_TRUE(throws_with([&] { (void)dp.replica(1); }, {"no replicas yet", "to(cpu:0)"}));
  dp.to(devs[0]);  // nn.DataParallel(model, device_ids).to(device_ids[0])
  for (const auto& p : dp.parameters()) EXPECT_EQ(p.device(), devs[0]);
  EXPECT_EQ(dp.replica(1).fc1->weight.device(), devs[1]);
  auto out = dp(x);
  EXPECT_TRUE(all_close(out, ref, kTol, kTol));
  // A module elsewhere moved to another device: that one becomes the primary, as before.
  DataParallel<chorus::testing::Net<double>> other(nn::clone(reference, devs[2]), {devs[0], devs[1]});
  other.to(devs[1]);
  EXPECT_EQ(other.devices()[0], devs[1]);
  EXPECT_TRUE(all_close(other(x).to(devs[0]), ref, kTol, kTol));
}

// ---------------------------------------------------------------- any model: a capsule network

TEST(DataParallelSeq, ACapsuleNetworkWithDynamicRoutingGivesTheSingleDeviceGradients) {
  using Caps = chorus::testing::CapsuleNet<double>;
  manual_seed(13);
  Caps reference(2, 7, 3, /*iterations=*/3);
  auto x = r({5, 2, 7, 7}, 1), g = r({5, 3, 8}, 2);
  auto xr = x.detach().requires_grad_(true);
  auto ref = reference.forward(xr);
  ASSERT_EQ(ref.shape(), (Shape{5, 3, 8}));
  sum(ref * g).backward();
  both_schedules([&] {
    for (int k : {1, 2, 3}) {
      SCOPED_TRACE(std::to_string(k) + " devices");
      DataParallel<Caps> dp(nn::clone(reference, Device::cpu(0)), cpus(k));
      auto xd = x.detach().requires_grad_(true);
      auto out = dp(xd);
      EXPECT_TRUE(all_close(out, ref, kTol, kTol));
      sum(out * g).backward();
      EXPECT_TRUE(all_close(xd.grad(), xr.grad(), kTol, kTol)) << "input gradient";
      expect_param_grads(reference, dp.module(), "CapsuleNet");
    }
  });
}

// ---------------------------------------------------------------- no tensor, bad inputs

TEST(DataParallelSeq, AForwardWithoutATensorToSplitRunsOnOneDevice) {
  struct Count : nn::Module {
    std::shared_ptr<std::atomic<int>> calls = std::make_shared<std::atomic<int>>(0);
    Tensor<double> forward(double v, const Vec& none) {
      ++*calls;
      return full<double>({2}, v + static_cast<double>(none.size()));
    }
  };
  DataParallel<Count> dp(Count(), cpus(3));
  EXPECT_TRUE(all_close(dp(2.0, Vec{}), full<double>({2}, 2.0), 0));
  EXPECT_TRUE(all_close(dp(1.0, Vec{Tensor<double>()}), full<double>({2}, 2.0), 0));  // undefined: nothing to split
  EXPECT_EQ(dp.module().calls->load(), 2);
}

TEST(DataParallelSeq, BadDimsAndSizesNameTheArgument) {
  using State = std::tuple<Tensor<double>, Tensor<double>>;
  nn::LSTMT<double> lstm(3, 4, nn::LSTMOptions{.batch_first = true});
  auto x = r({6, 2, 3}, 1), h = r({1, 6, 4}, 2), c = r({1, 6, 4}, 3);
  for (int k : {1, 2}) {
    SCOPED_TRACE(std::to_string(k) + " devices");
    DataParallel<nn::LSTMT<double>> too_long(nn::clone(lstm, Device::cpu(0)), {.devices = cpus(k), .scatter_dims = {0, 1, 1}});
    EXPECT_TRUE(throws_with([&] { too_long(x, State{h, c}); },
                            {"scatter_dims has 3 entries but there are 2 forward arguments"}));
    DataParallel<nn::LSTMT<double>> out_of_range(nn::clone(lstm, Device::cpu(0)), {.devices = cpus(k), .scatter_dims = {0, 3}});
    EXPECT_TRUE(throws_with([&] { out_of_range(x, State{h, c}); },
                            {"argument 1[0] of shape [1, 6, 4] has no dimension 3 to split along (scatter_dims[1] = 3)"}));
    DataParallel<nn::LSTMT<double>> dim0(nn::clone(lstm, Device::cpu(0)), {.devices = cpus(k)});  // the state along 0: 1 != 6
    EXPECT_TRUE(throws_with([&] { dim0(x, State{h, c}); },
                            {"tensors disagree in the size they are split along", "argument 0 has 6 in dimension 0",
                             "argument 1[0] has 1 in dimension 0"}));
    DataParallel<nn::LSTMT<double>> short_c(nn::clone(lstm, Device::cpu(0)), {.devices = cpus(k), .scatter_dims = {0, 1}});
    EXPECT_TRUE(throws_with([&] { short_c(x, State{h, c.narrow(1, 0, 5)}); },
                            {"argument 1[1] has 5 in dimension 1"}));
    DataParallel<nn::LSTMT<double>> gather_long(nn::clone(lstm, Device::cpu(0)),
                                                {.devices = cpus(k), .scatter_dims = {0, 1}, .gather_dims = {0, 1, 1}});
    EXPECT_TRUE(throws_with([&] { gather_long(x, State{h, c}); },
                            {"gather_dims has 3 entries but there are 2 outputs of forward"}));
    EXPECT_TRUE(throws_with([&] { short_c(Tensor<double>(), State{h, c}); }, {"argument 0 is an undefined tensor"}));
  }
  EXPECT_TRUE(throws_with([&] { parallel::scatter(std::make_tuple(x, h), cpus(2), std::vector<std::int64_t>{0, 1, 2}); },
                          {"dims has 3 entries but there are 2 elements in the input"}));
  EXPECT_TRUE(throws_with([&] { parallel::scatter(std::make_tuple(x, h), cpus(2)); },
                          {"input[0] has 6 in dimension 0, input[1] has 1 in dimension 0"}));
}

// A GRU encoder-decoder on padded batches (targets padded with PAD, ignored by the loss) over
// 3 devices, the loss on the replicas: each step's loss and gradients are one device's, and it
// learns its batch.
namespace {
constexpr std::int64_t kPad = 0;
struct Seq2Seq : nn::Module {
  nn::EmbeddingT<double> src_emb, tgt_emb;
  nn::GRUT<double> encoder, decoder;
  nn::LinearT<double> out;
  Seq2Seq()
      : src_emb(register_module("src_emb", nn::EmbeddingT<double>(9, 6))),
        tgt_emb(register_module("tgt_emb", nn::EmbeddingT<double>(9, 6))),
        encoder(register_module("encoder", nn::GRUT<double>(6, 8, {.batch_first = true}))),
        decoder(register_module("decoder", nn::GRUT<double>(6, 8, {.batch_first = true}))),
        out(register_module("out", nn::LinearT<double>(8, 9))) {}
  // src [N, S], tgt_in [N, T] -> logits [N, T, 9]; the encoder's last state starts the decoder.
  Tensor<double> forward(const std::tuple<Tensor<std::int64_t>, Tensor<std::int64_t>>& batch) {
    auto [enc, h] = encoder(src_emb(std::get<0>(batch)));
    auto [dec, h_out] = decoder(tgt_emb(std::get<1>(batch)), h);
    (void)enc;
    (void)h_out;
    return out(dec);
  }
};
Tensor<double> seq_loss(const Tensor<double>& logits, const Tensor<std::int64_t>& target) {
  return nn::functional::cross_entropy(logits.reshape({-1, 9}), target.reshape({-1}), Reduction::Mean, kPad);
}
}  // namespace

TEST(DataParallelSeq, AGruEncoderDecoderOnPaddedBatchesTrainsAsOnOneDevice) {
  // 6 pairs; shorter sequences padded with PAD (0); the target is the source reversed.
  const auto src = from_vector<std::int64_t>({1, 2, 3, 4, 5, 6, 7, 0, 2, 2, 8, 0, 3, 5, 0, 0, 8, 1, 4, 6, 7, 7, 0, 0},
                                             {6, 4});
  const auto tgt_in = from_vector<std::int64_t>({1, 4, 3, 2, 1, 7, 6, 0, 1, 8, 2, 0, 1, 5, 0, 0, 1, 6, 4, 1, 1, 7, 0, 0},
                                                {6, 4});
  const auto tgt_out = from_vector<std::int64_t>({4, 3, 2, 1, 7, 6, 5, 0, 8, 2, 2, 0, 5, 3, 0, 0, 6, 4, 1, 8, 7, 7, 0, 0},
                                                 {6, 4});
  manual_seed(5);
  Seq2Seq init;
  auto one = nn::clone(init, Device::cpu(0));
  DataParallel<Seq2Seq> dp(nn::clone(init, Device::cpu(0)), cpus(3));
  optim::Adam one_opt(one.parameters(), {.lr = 0.03}), dp_opt(dp.parameters(), {.lr = 0.03});
  std::vector<double> losses;
  for (int step = 0; step < 40; ++step) {
    const auto batch = std::make_tuple(src, tgt_in);
    auto a = seq_loss(one.forward(batch), tgt_out);
    auto b = dp.forward_loss(seq_loss, batch, tgt_out, {.ignore_index = kPad});
    ASSERT_NEAR(b.item(), a.item(), kTol) << "step " << step;
    one_opt.zero_grad();
    dp_opt.zero_grad();
    a.backward();
    b.backward();
    if (step % 10 == 0) chorus::testing::expect_grads_equal<double>(one, dp.module(), 1e-9, "step " + std::to_string(step));
    one_opt.step();
    dp_opt.step();
    losses.push_back(b.item());
  }
  EXPECT_LT(losses.back(), 0.2 * losses.front());
}

// A dict of mixed values, as PyTorch users pass one: the tensors (a variant's active
// alternative) are split, the other values reach every replica as they are.
namespace {
using Mixed = std::map<std::string, std::variant<Tensor<double>, double>>;
struct MixedInputs : nn::Module {
  nn::LinearT<double> fc;
  MixedInputs() : fc(register_module("fc", nn::LinearT<double>(3, 2))) {}
  Tensor<double> forward(const Mixed& in) {
    return fc(std::get<Tensor<double>>(in.at("x"))) * std::get<double>(in.at("scale"));
  }
};
}  // namespace

TEST(DataParallelSeq, AVariantArgumentHasItsActiveAlternativeSplit) {
  manual_seed(9);
  MixedInputs init;
  const Mixed in{{"x", r({6, 3}, 4)}, {"scale", 0.5}};
  auto one = nn::clone(init, Device::cpu(0));
  auto expected = one.forward(in);
  DataParallel<MixedInputs> dp(nn::clone(init, Device::cpu(0)), cpus(3));
  auto got = dp(in);
  EXPECT_TRUE(all_close(got, expected, kTol, kTol));
  expected.sum().backward();
  got.sum().backward();
  chorus::testing::expect_grads_equal<double>(one, dp.module(), kTol, "variant argument");
}
