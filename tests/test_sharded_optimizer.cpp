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
#include "fsdp_models.hpp"
#include "../examples/lm_models.hpp"

using namespace chorus;
using chorus::testing::by_name;
using chorus::testing::cpus;
using chorus::testing::Deep;
using chorus::testing::expect_float32_shards_keep_small_updates;
using chorus::testing::HalfNet;
using chorus::testing::MemoryLimits;
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

// ---- ZeRO-3 in one process: parallel::FullyShardedDataParallel (Note [fully sharded replicas]) ----

namespace {

double max_difference(const std::map<std::string, std::vector<double>>& a,
                      const std::map<std::string, std::vector<double>>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (const auto& [name, v] : a) {
    const auto& w = b.at(name);
    EXPECT_EQ(v.size(), w.size()) << name;
    for (std::size_t i = 0; i < std::min(v.size(), w.size()); ++i) worst = std::max(worst, std::abs(v[i] - w[i]));
  }
  return worst;
}

/// Two FullyShard units and the root's head, buffer and dropout, in float64.
struct Units : nn::Module {
  parallel::FullyShard<nn::LinearT<double>> l1, l2;
  nn::LinearT<double> head;
  nn::Dropout drop;
  Tensor<double> scale;
  Units()
      : l1(register_module("l1", parallel::FullyShard(nn::LinearT<double>(6, 13)))),
        l2(register_module("l2", parallel::FullyShard(nn::LinearT<double>(13, 7)))),
        head(register_module("head", nn::LinearT<double>(7, 3))),
        drop(register_module("drop", nn::Dropout(0.25))) {
    scale = register_buffer("scale", full<double>({3}, 0.5));
  }
  Tensor<double> forward(const Tensor<double>& x) { return head(drop(tanh(l2(tanh(l1(x)))))) * scale; }
};

// The same parameters as the plain module after every step (1e-12, float64) on 1 to 4 devices:
// Adam with clipping (the norm over every device's shards) and two backward passes a step, with
// dropout drawing as over the whole batch; each shard, its gradient and its state on its device.
TEST(FullyShardedDataParallel, EqualsThePlainRunOnOneToFourDevices) {
  for (int k : {1, 2, 3, 4}) {
    const std::string what = std::to_string(k) + " device(s)";
    manual_seed(61);
    Units init;
    Units plain = nn::clone(init, Device::cpu(0));
    parallel::FullyShardedDataParallel<Units> fsdp(nn::clone(init, Device::cpu(0)), {.devices = cpus(k)});
    ASSERT_EQ(fsdp.units().size(), 3u);
    ASSERT_EQ(fsdp.parameters().size(), 3u * static_cast<std::size_t>(k));
    optim::Adam plain_opt(plain.parameters(), {.lr = 0.02}), opt(fsdp.parameters(), {.lr = 0.02});
    manual_seed(62);
    auto x = randn<double>({11, 6}), y = randn<double>({11, 3});
    for (int s = 0; s < 3; ++s) {
      plain_opt.zero_grad();
      opt.zero_grad();
      for (auto [from, rows] : {std::pair<std::int64_t, std::int64_t>{0, 6}, {6, 5}}) {
        manual_seed(100 + s * 2 + from);
        nn::functional::mse_loss(plain.forward(x.narrow(0, from, rows)), y.narrow(0, from, rows)).backward();
        manual_seed(100 + s * 2 + from);
        nn::functional::mse_loss(fsdp(x.narrow(0, from, rows)), y.narrow(0, from, rows)).backward();
      }
      const double plain_norm = nn::utils::clip_grad_norm_(plain.parameters(), 0.5);
      const double norm = nn::utils::clip_grad_norm_(fsdp.parameters(), 0.5);
      EXPECT_NEAR(norm, plain_norm, 1e-12) << what;
      const auto shards = fsdp.parameters();
      for (std::size_t i = 0; i < shards.size(); ++i) {
        const Device on = Device::cpu(static_cast<int>(i % static_cast<std::size_t>(k)));
        EXPECT_EQ(shards[i].device(), on) << what;
        EXPECT_EQ(shards[i].as<double>().grad().device(), on) << what;
      }
      plain_opt.step();
      opt.step();
      EXPECT_LE(max_difference(by_name(fsdp.full_state_dict()), by_name(plain.named_tensors())), 1e-12)
          << what << ", step " << s;
    }
    for (std::size_t i = 0; i < opt.state().size(); ++i)
      for (const auto& [key, value] : opt.state()[i])
        if (key != "step") {
          EXPECT_EQ(value.device(), Device::cpu(static_cast<int>(i % static_cast<std::size_t>(k)))) << what << " " << key;
        }
    // eval() reaches every replica: no dropout anywhere.
    fsdp.eval();
    plain.eval();
    NoGradGuard ng;
    const auto got = fsdp(x).to_vector(), want = plain.forward(x).to_vector();
    for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-12) << what;
  }
}

// The destructor gives the module its whole parameters back (the same tensors, viewing memory again).
TEST(FullyShardedDataParallel, TheModuleGetsItsParametersBack) {
  manual_seed(63);
  std::vector<nn::Module::NamedTensor> params;
  std::map<std::string, std::vector<double>> trained;
  {
    parallel::FullyShardedDataParallel<Units> fsdp(Units(), {.devices = cpus(3)});
    params = fsdp.module().named_parameters();
    optim::SGD opt(fsdp.parameters(), {.lr = 0.1});
    nn::functional::mse_loss(fsdp(randn<double>({5, 6})), randn<double>({5, 3})).backward();
    opt.step();
    trained = by_name(fsdp.full_state_dict());
    for (const auto& [name, t] : params) EXPECT_EQ(t.visit([](const auto& x) { return static_cast<const void*>(x.data()); }), nullptr) << name;
  }
  auto named = params;
  for (const auto& [name, v] : trained)
    if (name == "scale") named.push_back({name, AnyTensor(full<double>({3}, 0.5))});
  EXPECT_EQ(by_name(named), trained);
}

// A model whose Adam training does not fit one device's memory trains over four, and its losses
// equal the unsharded run's where that fits.
TEST(FullyShardedDataParallel, ModelLargerThanOneDeviceTrainsOverFourDevices) {
  const auto devices = cpus(4);
  const std::int64_t bytes = 12 * (64 * 64 + 64) * 8;
  const MemoryLimits lift{devices};
  manual_seed(64);
  const Deep init;
  manual_seed(65);
  auto x = randn<double>({8, 64});
  auto train = [&](auto&& forward, std::vector<AnyTensor> ps) {
    std::vector<double> losses;
    optim::Adam opt(ps, {.lr = 1e-3});
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      auto loss = forward(x).square().mean();
      loss.backward();
      opt.step();
      losses.push_back(loss.item());
    }
    return losses;
  };
  Deep unsharded = nn::clone(init, Device::cpu(0));
  const auto want = train([&](const Tensor<double>& in) { return unsharded.forward(in); }, unsharded.parameters());
  // Room for the model twice on each device (it is built whole on the first before it is sharded):
  // plain Adam needs four times the model, sharded over 4 devices once and a few blocks.
  {
    Deep plain = nn::clone(init, Device::cpu(0));
    set_memory_limit(devices[0], memory_stats(devices[0]).allocated + bytes * 2);
    EXPECT_TRUE(throws_with([&] { train([&](const Tensor<double>& in) { return plain.forward(in); }, plain.parameters()); },
                            {"out of memory on cpu:0"}));
    set_memory_limit(devices[0], 0);
  }
  Deep model = nn::clone(init, Device::cpu(0));
  for (auto d : devices) set_memory_limit(d, memory_stats(d).allocated + bytes * 2);
  parallel::FullyShardedDataParallel<Deep> fsdp(std::move(model), {.devices = devices});
  const auto got = train([&](const Tensor<double>& in) { return fsdp(in); }, fsdp.parameters());
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t s = 0; s < got.size(); ++s) EXPECT_NEAR(got[s], want[s], 1e-12) << "step " << s;
}

// The goal in one process: train_lm's Transformer (each encoder layer a unit), whose Adam
// training does not fit one device's cap, trains over four capped devices, and its loss curve is
// the unsharded run's where that fits (float32: 1e-5 relative, the gradients summed per device).
TEST(FullyShardedDataParallel, TransformerLmLargerThanOneDeviceTrainsOverFourDevices) {
  using Lm = examples::CharTransformerT<parallel::FullyShard>;
  const auto devices = cpus(4);
  const MemoryLimits lift{devices};
  manual_seed(71);
  const Lm init(32, 16, 128, 4, 4, 0.0);  // vocab 32, 16 positions, width 128, 4 heads, 4 layers
  std::int64_t bytes = 0;
  for (const auto& p : init.parameters()) bytes += static_cast<std::int64_t>(p.nbytes());
  auto tokens = randint(0, 32, {8, 16}), next = randint(0, 32, {8 * 16});
  auto train = [&](auto&& forward, std::vector<AnyTensor> ps) {
    std::vector<double> losses;
    optim::Adam opt(ps, {.lr = 1e-3});
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      auto loss = nn::functional::cross_entropy(forward(tokens).reshape({8 * 16, 32}), next);
      loss.backward();
      opt.step();
      losses.push_back(loss.item());
    }
    return losses;
  };
  Lm unsharded = nn::clone(init, Device::cpu(0));
  const auto want = train([&](const Tensor<std::int64_t>& t) { return unsharded.forward(t); }, unsharded.parameters());
  {  // plain Adam needs four times the model on one device: over a cap of twice the model, it stops
    Lm plain = nn::clone(init, Device::cpu(0));
    set_memory_limit(devices[0], memory_stats(devices[0]).allocated + bytes * 2);
    EXPECT_TRUE(throws_with([&] { train([&](const Tensor<std::int64_t>& t) { return plain.forward(t); }, plain.parameters()); },
                            {"out of memory on cpu:0"}));
    set_memory_limit(devices[0], 0);
  }
  Lm model = nn::clone(init, Device::cpu(0));
  for (auto d : devices) set_memory_limit(d, memory_stats(d).allocated + bytes * 2);
  parallel::FullyShardedDataParallel<Lm> fsdp(std::move(model), {.devices = devices});
  EXPECT_EQ(fsdp.units().size(), 5u);  // the root (embeddings, norm, head) and the 4 layers
  const auto got = train([&](const Tensor<std::int64_t>& t) { return fsdp(t); }, fsdp.parameters());
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t s = 0; s < got.size(); ++s) EXPECT_NEAR(got[s], want[s], 1e-5 * want[s]) << "step " << s;
}

// Mixed precision: a bfloat16 module with float32 shards keeps the updates that bfloat16
// parameters would round away (expect_float32_shards_keep_small_updates, fsdp_models.hpp).
TEST(FullyShardedDataParallel, Bfloat16ComputeWithFloat32Shards) {
  manual_seed(66);
  HalfNet init;
  parallel::FullyShardedDataParallel<HalfNet> fsdp(nn::clone(init, Device::cpu(0)),
                                                   {.devices = cpus(2), .shard_dtype = DType::Float32});
  expect_float32_shards_keep_small_updates(fsdp, by_name(init.named_parameters()));
}

// Checkpoints that reshard (Note [resharding checkpoints]): 3 devices train 3 steps and save; the
// uninterrupted 3-device run, and runs resumed from the files on 1, 2, 3 and 4 devices, take 3 more
// steps: the same parameters (bitwise on 3 devices, 1e-12 on others: the gradients are summed over
// another grouping of the batch), the schedule and Adam's step count resumed; another model's
// checkpoint and an optimizer over other tensors are refused.
TEST(FullyShardedDataParallel, ShardedCheckpointsResumeOnOtherDeviceCounts) {
  const auto dir = (std::filesystem::temp_directory_path() / ("chorus_fsdp_dp_" + std::to_string(::getpid()))).string();
  manual_seed(68);
  const Units init;
  manual_seed(69);
  auto x = randn<double>({12, 6}), y = randn<double>({12, 3});
  auto steps = [&](parallel::FullyShardedDataParallel<Units>& m, optim::Adam& opt, optim::StepLR& sched, int from, int n) {
    for (int s = from; s < from + n; ++s) {
      opt.zero_grad();
      manual_seed(200 + s);
      nn::functional::mse_loss(m(x), y).backward();
      opt.step();
      sched.step();
    }
  };
  parallel::FullyShardedDataParallel<Units> first(nn::clone(init, Device::cpu(0)), {.devices = cpus(3)});
  optim::Adam opt(first.parameters(), {.lr = 0.01});
  optim::StepLR sched(opt, 2, 0.5);
  steps(first, opt, sched, 0, 3);
  first.save_sharded(opt, dir, {.scheduler = &sched}, {{"step", "3"}});
  steps(first, opt, sched, 3, 3);
  const auto want = by_name(first.full_state_dict());
  for (int k : {1, 2, 3, 4}) {
    parallel::FullyShardedDataParallel<Units> resumed(nn::clone(Units(), Device::cpu(0)), {.devices = cpus(k)});
    optim::Adam ropt(resumed.parameters(), {.lr = 0.01});
    optim::StepLR rsched(ropt, 2, 0.5);
    const auto meta = resumed.load_sharded(ropt, dir, {.scheduler = &rsched});
    EXPECT_EQ(meta.at("step"), "3");
    EXPECT_EQ(rsched.last_epoch(), 3);
    steps(resumed, ropt, rsched, 3, 3);
    const double diff = max_difference(by_name(resumed.full_state_dict()), want);
    if (k == 3) EXPECT_EQ(diff, 0.0) << "resumed on the same 3 devices";
    else EXPECT_LE(diff, 1e-12) << k << " device(s)";
  }
  struct Other : nn::Module {
    parallel::FullyShard<nn::LinearT<double>> l1;
    Other() : l1(register_module("l1", parallel::FullyShard(nn::LinearT<double>(6, 14)))) {}
    Tensor<double> forward(const Tensor<double>& in) { return l1(in); }
  };
  parallel::FullyShardedDataParallel<Other> other(Other(), {.devices = cpus(2)});
  optim::Adam other_opt(other.parameters(), {.lr = 0.01});
  EXPECT_TRUE(throws_with([&] { other.load_sharded(other_opt, dir); }, {"load_sharded", "holds 3 units"}));
  optim::Adam partial({first.parameters()[0]}, {.lr = 0.01});
  EXPECT_TRUE(throws_with([&] { first.save_sharded(partial, dir + "/x"); }, {"must step the wrapper's parameters()"}));
  std::filesystem::remove_all(dir);
}

// Refusals: a batch with fewer rows than devices, a module off the primary device; a replica that
// cannot be built (out of memory on its device) leaves the module as it was.
TEST(FullyShardedDataParallel, RefusalsLeaveTheModuleWhole) {
  manual_seed(67);
  const auto devices = cpus(3);
  Units model;
  const auto before = by_name(model.named_tensors());
  {
    Units moved = nn::clone(model, Device::cpu(1));
    EXPECT_TRUE(throws_with([&] { parallel::FullyShardedDataParallel<Units> f(moved, {.devices = devices}); },
                            {"not on the primary device cpu:0"}));
  }
  {
    const MemoryLimits lift{{Device::cpu(2)}};
    set_memory_limit(Device::cpu(2), memory_stats(Device::cpu(2)).allocated + 64);
    EXPECT_TRUE(throws_with([&] { parallel::FullyShardedDataParallel<Units> f(model, {.devices = devices}); },
                            {"in replica 2 on cpu:2", "out of memory on cpu:2"}));
    EXPECT_EQ(by_name(model.named_tensors()), before);
  }
  parallel::FullyShardedDataParallel<Units> fsdp(model, {.devices = devices});
  EXPECT_TRUE(throws_with([&] { fsdp(randn<double>({2, 6})); }, {"a batch of 2 rows over 3 devices", "at least one row"}));
  EXPECT_TRUE(throws_with([&] { parallel::FullyShardedDataParallel<Units> again(fsdp.module(), {.devices = devices}); },
                          {"'l1' is a unit of another FullyShardedDataParallel"}));
  fsdp(randn<double>({3, 6})).sum().backward();  // still usable after the refusals
}

}  // namespace
