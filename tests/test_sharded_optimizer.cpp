// The optimizer step sharded over a DataParallel's devices (Note [sharded optimizer step]), and
// the gradients too (DataParallel::shard_gradients, Note [sharded gradients in one process]):
// bitwise the unsharded step for SGD, Adam and AdamW with parameter groups, clipping, gradient
// accumulation, GradScaler and a schedule; the plain optimizer's checkpoint; the state and the
// gradients on the shard's device.
#include <filesystem>
#include <fstream>
#include <iterator>
#include <unistd.h>

#include "data_parallel_util.hpp"

using namespace chorus;
using chorus::testing::cpus;
using chorus::testing::Net;
using chorus::testing::throws_with;

namespace {
// The threaded path (every replica on its device's worker).
[[maybe_unused]] const bool kThreaded = [] {
  parallel::set_inline_work_default(0);
  return true;
}();

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

template <class T>
std::vector<std::vector<T>> values(const std::vector<AnyTensor>& ts) {
  std::vector<std::vector<T>> out;
  for (const auto& t : ts) out.push_back(t.as<T>().to_vector());
  return out;
}

/// A model whose parameters are large against its activations.
struct Wide : nn::Module {
  nn::LinearT<float> fc1, fc2;
  Wide() : fc1(register_module("fc1", nn::LinearT<float>(64, 256))), fc2(register_module("fc2", nn::LinearT<float>(256, 64))) {}
  Tensor<float> forward(const Tensor<float>& x) { return fc2(relu(fc1(x))); }
};

struct Variant {
  bool two_groups = false;
  bool clip = false;
  bool shard_gradients = false;  // ZeRO-2 (DataParallel::shard_gradients)
  bool accumulate = false;       // two backward passes (half batches) per step; zero_grad(false)
  bool scaler = false;           // GradScaler (unscale_ before clipping)
};

/// Two DataParallels from one initialisation on k devices, one stepped by O, one by
/// ShardedOptimizer<O>: equal parameters at every step, the same checkpoint file, and the
/// sharded one loaded from the plain one's file keeps stepping as the plain one.
template <class O>
void check_sharded_equals_plain(typename O::options_type options, Variant v) {
  using Opts = typename O::options_type;
  const auto dir = std::filesystem::temp_directory_path() / ("chorus_sharded_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  for (int k : {1, 2, 3}) {
    const std::string what = std::to_string(k) + " device(s)";
    manual_seed(41);
    Net<double> init;
    DataParallel<Net<double>> plain_dp(nn::clone(init, Device::cpu(0)), cpus(k));
    DataParallel<Net<double>> sharded_dp(nn::clone(init, Device::cpu(0)), cpus(k));
    auto groups = [&](const std::vector<AnyTensor>& ps) {
      if (!v.two_groups) return std::vector<optim::ParamGroup<Opts>>{{ps, options}};
      auto g = optim::weight_decay_groups(ps, options);
      g[1].options.lr *= 0.5;
      return g;
    };
    O plain(groups(plain_dp.parameters()));
    parallel::ShardedOptimizer<O> sharded(groups(sharded_dp.parameters()), sharded_dp.devices());
    if (v.shard_gradients) sharded_dp.shard_gradients(sharded);
    optim::StepLR plain_sched(plain, 2, 0.5), sharded_sched(sharded, 2, 0.5);
    amp::GradScaler plain_scaler({.init_scale = 1024.0}), sharded_scaler({.init_scale = 1024.0});
    std::set<std::size_t> used;
    for (std::size_t i = 0; i < sharded.parameters().size(); ++i) used.insert(sharded.shard_of(i));
    EXPECT_EQ(used.size(), static_cast<std::size_t>(std::min(k, 4))) << what << ": every device holds a shard";

    manual_seed(42);
    auto x = randn<double>({10, 6}), y = randn<double>({10, 3});
    struct Run {
      DataParallel<Net<double>>* dp;
      optim::Optimizer* opt;
      amp::GradScaler* scaler;
    };
    const Run runs[] = {{&plain_dp, &plain, &plain_scaler}, {&sharded_dp, &sharded, &sharded_scaler}};
    auto train = [&](int steps) {
      for (int s = 0; s < steps; ++s) {
        for (const auto& run : runs) {
          if (v.accumulate && s % 2) run.opt->zero_grad(false);  // zeros in place, where the gradient is kept
          else run.dp->zero_grad();
          for (int part = 0; part < (v.accumulate ? 2 : 1); ++part) {
            auto rows = [&](const Tensor<double>& t) { return v.accumulate ? t.narrow(0, 5 * part, 5) : t; };
            auto loss = nn::functional::mse_loss((*run.dp)(rows(x)), rows(y));
            (v.scaler ? run.scaler->scale(loss) : loss).backward();
          }
          if (v.scaler) run.scaler->unscale_(*run.opt);
          if (v.clip) nn::utils::clip_grad_norm_(run.dp->parameters(), 0.05);
        }
        if (v.shard_gradients) {  // each gradient is where its shard steps
          for (std::size_t i = 0; i < sharded.parameters().size(); ++i) {
            ASSERT_EQ(sharded.parameters()[i].template as<double>().grad().device(),
                      Device::cpu(static_cast<int>(sharded.shard_of(i))))
                << what << ", parameter " << i;
          }
        }
        if (v.scaler) {
          plain_scaler.step(plain);
          sharded_scaler.step(sharded);
          plain_scaler.update();
          sharded_scaler.update();
        } else {
          plain.step();
          sharded.step();
        }
        plain_sched.step();
        sharded_sched.step();
        ASSERT_EQ(values<double>(sharded_dp.parameters()), values<double>(plain_dp.parameters()))
            << what << ", step " << s;
      }
    };
    train(5);
    // Each parameter's state lives on its shard's device.
    for (std::size_t i = 0; i < sharded.state().size(); ++i)
      for (const auto& [key, value] : sharded.state()[i])
        if (key != "step") {
          EXPECT_EQ(value.device(), Device::cpu(static_cast<int>(sharded.shard_of(i)))) << what << " " << key;
        }
    const auto plain_file = (dir / "plain.opt").string(), sharded_file = (dir / "sharded.opt").string();
    save(plain, plain_file, {.scheduler = &plain_sched});
    save(sharded, sharded_file, {.scheduler = &sharded_sched});
    EXPECT_EQ(read_bytes(sharded_file), read_bytes(plain_file)) << what;
    for (std::size_t g = 0; g < sharded.num_groups(); ++g) sharded.set_lr(g, 99.0);
    load(sharded, plain_file, {.scheduler = &sharded_sched});
    for (std::size_t g = 0; g < sharded.num_groups(); ++g) EXPECT_EQ(sharded.lr(g), plain.lr(g)) << what;
    train(3);
  }
  std::filesystem::remove_all(dir);
}
}  // namespace

TEST(ShardedOptimizer, SgdWithNesterovMomentumEqualsThePlainStep) {
  check_sharded_equals_plain<optim::SGD>({.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true}, {});
}
TEST(ShardedOptimizer, AdamWithClippingEqualsThePlainStep) {
  check_sharded_equals_plain<optim::Adam>({.lr = 1e-2, .amsgrad = true}, {.clip = true});
}
TEST(ShardedOptimizer, AdamWWithParameterGroupsEqualsThePlainStep) {
  check_sharded_equals_plain<optim::AdamW>({.lr = 1e-2, .weight_decay = 0.1}, {.two_groups = true, .clip = true});
}
TEST(ShardedGradients, SgdWithMomentumAndAccumulationEqualsThePlainStep) {
  check_sharded_equals_plain<optim::SGD>({.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3},
                                         {.shard_gradients = true, .accumulate = true});
}
TEST(ShardedGradients, AdamWithScalerAndClippingEqualsThePlainStep) {
  check_sharded_equals_plain<optim::Adam>({.lr = 1e-2}, {.clip = true, .shard_gradients = true, .scaler = true});
}
TEST(ShardedGradients, AdamWWithParameterGroupsEqualsThePlainStep) {
  check_sharded_equals_plain<optim::AdamW>({.lr = 1e-2, .weight_decay = 0.1},
                                           {.two_groups = true, .clip = true, .shard_gradients = true, .accumulate = true});
}

// The memory goes where the shard is: after the first Adam step, the other device holds its
// shard's two moments, and the primary holds fewer than the plain optimizer's.
TEST(ShardedOptimizer, TheStateIsAllocatedOnTheShardsDevice) {
  const auto devices = cpus(2);
  manual_seed(43);
  DataParallel<Wide> dp(Wide(), devices);
  parallel::ShardedOptimizer<optim::Adam> opt(dp, {.lr = 1e-3});
  std::int64_t shard_bytes[2] = {0, 0};
  for (std::size_t i = 0; i < opt.parameters().size(); ++i)
    shard_bytes[opt.shard_of(i)] += 2 * opt.parameters()[i].numel() * static_cast<std::int64_t>(sizeof(float));
  auto x = randn<float>({8, 64});
  nn::functional::mse_loss(dp(x), zeros<float>({8, 64})).backward();
  const auto before0 = memory_stats(devices[0]).allocated, before1 = memory_stats(devices[1]).allocated;
  opt.step();
  EXPECT_GE(memory_stats(devices[1]).allocated - before1, shard_bytes[1]);
  EXPECT_LT(memory_stats(devices[0]).allocated - before0, shard_bytes[0] + shard_bytes[1] / 2);
  EXPECT_GT(shard_bytes[0], 0);
  EXPECT_GT(shard_bytes[1], 0);
}

TEST(ShardedOptimizer, ParametersOffThePrimaryAreRefused) {
  const auto devices = cpus(2);
  auto a = from_vector<double>({1.0}, devices[1]).requires_grad_(true);
  EXPECT_TRUE(throws_with([&] { parallel::ShardedOptimizer<optim::SGD>({AnyTensor(a)}, {.lr = 1}, devices); },
                          {"parameter 0 is on cpu:1", "primary device cpu:0"}));
  EXPECT_TRUE(throws_with([&] { parallel::ShardedOptimizer<optim::SGD>({AnyTensor(a)}, {.lr = 1}, {}); },
                          {"no devices"}));
}

// ZeRO-2's memory: after backward the other device holds its shard's gradients and the primary
// only its own; destroying the optimizer hands them back to the parameters.
TEST(ShardedGradients, TheGradientsAreAllocatedOnTheShardsDevice) {
  const auto devices = cpus(2);
  manual_seed(44);
  DataParallel<Wide> dp(Wide(), devices);
  auto x = randn<float>({8, 64});
  auto run = [&] {
    dp.zero_grad();
    nn::functional::mse_loss(dp(x), zeros<float>({8, 64})).backward();
  };
  run();
  std::vector<std::vector<float>> plain_grads;
  for (const auto& p : dp.parameters()) plain_grads.push_back(p.as<float>().grad().to_vector());
  {
    parallel::ShardedOptimizer<optim::SGD> opt(dp, {.lr = 0.1});
    dp.shard_gradients(opt);
    std::int64_t shard_bytes[2] = {0, 0};
    for (std::size_t i = 0; i < opt.parameters().size(); ++i) {
      shard_bytes[opt.shard_of(i)] += opt.parameters()[i].numel() * static_cast<std::int64_t>(sizeof(float));
      // The gradient there before went with it.
      EXPECT_EQ(opt.parameters()[i].as<float>().grad().device(), devices[opt.shard_of(i)]);
    }
    ASSERT_GT(shard_bytes[1], 0);
    dp.zero_grad();
    const auto before0 = memory_stats(devices[0]).allocated, before1 = memory_stats(devices[1]).allocated;
    run();
    EXPECT_GE(memory_stats(devices[1]).allocated - before1, shard_bytes[1]);
    EXPECT_LE(memory_stats(devices[0]).allocated - before0, shard_bytes[0]);
    auto params = dp.parameters();
    for (std::size_t i = 0; i < params.size(); ++i) EXPECT_EQ(params[i].as<float>().grad().to_vector(), plain_grads[i]);
    // A plain optimizer refuses a gradient kept on another device.
    optim::SGD plain(params, {.lr = 0.1});
    EXPECT_TRUE(throws_with([&] { plain.step(); }, {"is on cpu:1", "the parameter on cpu:0"}));
  }
  auto params = dp.parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i].as<float>().grad().device(), devices[0]) << "handed back";
    EXPECT_EQ(params[i].as<float>().grad().to_vector(), plain_grads[i]);
  }
  run();  // backward accumulates on the primary again
  for (std::size_t i = 0; i < params.size(); ++i) EXPECT_EQ(params[i].as<float>().grad().device(), devices[0]);
}

TEST(ShardedGradients, AnotherDataParallelsOptimizerIsRefused) {
  DataParallel<Net<double>> a(Net<double>(), cpus(2)), b(Net<double>(), cpus(2)), c(Net<double>(), cpus(3));
  parallel::ShardedOptimizer<optim::SGD> opt(a, {.lr = 0.1});
  EXPECT_TRUE(throws_with([&] { b.shard_gradients(opt); }, {"other parameters", "dp.parameters()"}));
  parallel::ShardedOptimizer<optim::SGD> opt3(c.parameters(), {.lr = 0.1}, cpus(2));
  EXPECT_TRUE(throws_with([&] { c.shard_gradients(opt3); }, {"shards are on cpu:0, cpu:1", "cpu:0, cpu:1, cpu:2"}));
}
