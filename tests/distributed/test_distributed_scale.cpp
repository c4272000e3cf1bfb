// Balanced memory and scale across processes (issue 20): ZeroRedundancyOptimizer (ZeRO-1)
// equals the plain optimizer and writes the plain optimizer's checkpoint; SyncBatchNorm under
// DistributedDataParallel equals BatchNorm on the whole batch; join() for uneven inputs gives
// PyTorch's result. Part of the test_distributed binary (mpirun -np 1 … 4).
#include "dist_test_util.hpp"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <unistd.h>
#include <vector>

using namespace chorus;
using namespace dist_test;

namespace {

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

/// A directory every rank agrees on (rank 0's pid), removed by rank 0 at the end.
struct SharedDir {
  std::filesystem::path path;
  SharedDir() {
    auto pid = gather_all(std::vector<std::int64_t>{static_cast<std::int64_t>(::getpid())});
    path = std::filesystem::temp_directory_path() / ("chorus_zero_" + std::to_string(pid[0][0]));
    if (pg().rank() == 0) std::filesystem::create_directories(path);
    pg().barrier();
  }
  ~SharedDir() {
    pg().barrier();
    if (pg().rank() == 0) std::filesystem::remove_all(path);
  }
};

/// DDP training of two copies of one model, one stepped by O, one by ZeroRedundancyOptimizer<O>,
/// over the same parameter groups, with a StepLR schedule and (optionally) gradient clipping:
/// the parameters are bitwise equal on every rank at every step; the consolidated state equals
/// the plain optimizer's, its checkpoint is the plain one byte for byte, and a ZeRO optimizer
/// loaded from it continues exactly as the plain one does.
template <class O>
void check_zero_equals_plain(typename O::options_type options, bool two_groups, bool clip) {
  using Opts = typename O::options_type;
  const int w = pg().world_size(), r = pg().rank();
  const int batch = 12;
  manual_seed(3);
  auto x = randn<double>({batch * w, 5});
  auto y = randn<double>({batch * w, 3});
  manual_seed(11);
  DistributedDataParallel<Mlp<double>> plain_model(Mlp<double>(5, 16, 3));
  manual_seed(11);
  DistributedDataParallel<Mlp<double>> zero_model(Mlp<double>(5, 16, 3));
  auto groups = [&](const std::vector<AnyTensor>& ps) {
    if (!two_groups) return std::vector<optim::ParamGroup<Opts>>{{ps, options}};
    auto g = optim::weight_decay_groups(ps, options);
    g[1].options.lr *= 0.5;  // the groups differ in more than weight decay
    return g;
  };
  O plain(groups(plain_model.parameters()));
  optim::ZeroRedundancyOptimizer<O> zero(groups(zero_model.parameters()));
  optim::StepLR plain_sched(plain, 2, 0.5), zero_sched(zero, 2, 0.5);

  // The shard: each parameter has one owner, and a rank keeps state for its own only.
  std::int64_t mine = 0, total = 0;
  for (std::size_t i = 0; i < zero.parameters().size(); ++i) {
    ASSERT_GE(zero.owner(i), 0);
    ASSERT_LT(zero.owner(i), w);
    total += zero.parameters()[i].numel();
    if (zero.owner(i) == r) mine += zero.parameters()[i].numel();
  }
  auto all_mine = gather_all(std::vector<std::int64_t>{mine});
  std::int64_t sum = 0;
  for (const auto& m : all_mine) sum += m[0];
  EXPECT_EQ(sum, total);
  if (w > 1) {
    EXPECT_LT(mine, total) << "rank " << r << " owns every parameter";
  }

  auto train = [&](int steps) {
    for (int s = 0; s < steps; ++s) {
      auto xs = x.narrow(0, r * batch, batch), ys = y.narrow(0, r * batch, batch);
      for (auto* m : {&plain_model, &zero_model}) {
        m->zero_grad();
        nn::functional::mse_loss((*m)(xs), ys).backward();
        if (clip) nn::utils::clip_grad_norm_(m->parameters(), 0.05);
      }
      plain.step();
      zero.step();
      plain_sched.step();
      zero_sched.step();
      ASSERT_EQ(values<double>(zero_model.parameters()), values<double>(plain_model.parameters()))
          << "step " << s << " on rank " << r;
    }
  };
  train(5);
  ASSERT_EQ(zero.local_optimizer().state().size(), std::max<std::size_t>(1, [&] {
              std::size_t n = 0;
              for (std::size_t i = 0; i < zero.parameters().size(); ++i) n += zero.owner(i) == r;
              return n;
            }()));

  // Not consolidated: state() is refused rather than partial.
  EXPECT_TRUE(throws_with([&] { (void)zero.state(); }, {"consolidate_state_dict"}));
  const int to = w - 1;
  zero.consolidate_state_dict(to);
  SharedDir dir;
  const auto plain_file = (dir.path / "plain.opt").string(), zero_file = (dir.path / "zero.opt").string();
  if (r == to) {
    ASSERT_EQ(zero.state().size(), plain.state().size());
    for (std::size_t i = 0; i < plain.state().size(); ++i) {
      ASSERT_EQ(zero.state()[i].size(), plain.state()[i].size()) << "parameter " << i;
      for (const auto& [k, v] : plain.state()[i])
        EXPECT_EQ(zero.state()[i].at(k).template as<double>().to_vector(), v.template as<double>().to_vector())
            << "parameter " << i << " " << k;
    }
    save(plain, plain_file, {.scheduler = &plain_sched});
    save(zero, zero_file, {.scheduler = &zero_sched});
    EXPECT_EQ(read_bytes(zero_file), read_bytes(plain_file));
  } else {
    EXPECT_TRUE(throws_with([&] { (void)zero.state(); }, {"consolidate_state_dict"}));
  }
  pg().barrier();

  // Every rank resumes the ZeRO optimizer from the file (another rank wrote it), with the
  // schedule moved on and back, and it keeps stepping as the plain one.
  for (std::size_t g = 0; g < zero.num_groups(); ++g) zero.set_lr(g, 123.0);
  load(zero, zero_file, {.scheduler = &zero_sched});
  for (std::size_t g = 0; g < zero.num_groups(); ++g) EXPECT_EQ(zero.lr(g), plain.lr(g));
  train(3);
}

}  // namespace

TEST(ZeroRedundancyOptimizer, SgdWithMomentumEqualsThePlainOptimizer) {
  check_zero_equals_plain<optim::SGD>({.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3}, false, false);
}
TEST(ZeroRedundancyOptimizer, AdamWithClippingEqualsThePlainOptimizer) {
  check_zero_equals_plain<optim::Adam>({.lr = 1e-2, .amsgrad = true}, false, true);
}
TEST(ZeroRedundancyOptimizer, AdamWWithParameterGroupsEqualsThePlainOptimizer) {
  check_zero_equals_plain<optim::AdamW>({.lr = 1e-2, .weight_decay = 0.1}, true, true);
}

// More ranks than parameters: a rank may own nothing and still steps, schedules and loads.
TEST(ZeroRedundancyOptimizer, ARankWithoutParametersTakesPart) {
  auto a = from_vector<double>({1.0, 2.0, 3.0}).requires_grad_(true);
  auto b = from_vector<double>({4.0}).requires_grad_(true);
  optim::ZeroRedundancyOptimizer<optim::SGD> zero({AnyTensor(a), AnyTensor(b)}, {.lr = 0.5});
  EXPECT_EQ(zero.owner(0), 0);  // the larger first, to the least loaded (rank 0)
  EXPECT_EQ(zero.owner(1), pg().world_size() > 1 ? 1 : 0);
  a.set_grad(from_vector<double>({1.0, 1.0, 1.0}));
  b.set_grad(from_vector<double>({2.0}));
  zero.step();
  EXPECT_EQ(a.to_vector(), (std::vector<double>{0.5, 1.5, 2.5}));
  EXPECT_EQ(b.to_vector(), (std::vector<double>{3.0}));
  zero.set_lr(0, 0.25);
  EXPECT_EQ(zero.lr(0), 0.25);
  zero.consolidate_state_dict(0);
  if (pg().rank() == 0) {
    EXPECT_EQ(zero.state().size(), 2u);
  }
  EXPECT_TRUE(throws_with([&] { zero.consolidate_state_dict(pg().world_size()); }, {"is not a rank"}));
}

TEST(ZeroRedundancyOptimizer, ParametersOnTwoDevicesAreRefused) {
  const int before = cpu_device_count();
  set_cpu_device_count(std::max(before, 2));
  auto a = from_vector<double>({1.0}).requires_grad_(true);
  auto b = from_vector<double>({1.0}, Device::cpu(1)).requires_grad_(true);
  EXPECT_TRUE(throws_with([&] { optim::ZeroRedundancyOptimizer<optim::SGD>({AnyTensor(a), AnyTensor(b)}, {.lr = 1}); },
                          {"parameter 1 is on cpu:1", "one device per process"}));
  set_cpu_device_count(before);
}

// ---- SyncBatchNorm across processes ----

namespace {
template <class Norm>
struct ConvBn : nn::Module {
  nn::LinearT<double> fc;
  Norm bn;
  explicit ConvBn(Norm n) : fc(register_module("fc", nn::LinearT<double>(4, 3))), bn(register_module("bn", std::move(n))) {}
  Tensor<double> forward(const Tensor<double>& x) { return bn(fc(x).reshape({x.shape()[0], 3, 1, 1})); }
};
}  // namespace

// Each rank normalises by the statistics of every rank's batch, batches of different sizes
// included: outputs, input gradients, parameter gradients (after DDP's average) and running
// statistics equal one process's BatchNorm over the whole batch.
TEST(Ddp, SyncBatchNormEqualsBatchNormOnTheWholeBatch) {
  const int w = pg().world_size(), r = pg().rank();
  std::vector<std::int64_t> sizes, starts;
  std::int64_t total = 0;
  for (int k = 0; k < w; ++k) {
    starts.push_back(total);
    sizes.push_back(3 + k);  // uneven on purpose
    total += sizes.back();
  }
  manual_seed(5);
  auto x = randn<double>({total, 4});
  auto weights = randn<double>({total, 3, 1, 1});  // loss = Σ out·weights
  manual_seed(8);
  ConvBn<nn::BatchNorm2dT<double>> whole(nn::BatchNorm2dT<double>(3));
  manual_seed(8);
  DistributedDataParallel<ConvBn<nn::SyncBatchNormT<double>>> ddp(ConvBn<nn::SyncBatchNormT<double>>(nn::SyncBatchNormT<double>(3)));

  for (int step = 0; step < 2; ++step) {
    auto xw = x.clone().requires_grad_(true);
    whole.zero_grad();
    auto out_w = whole.forward(xw);
    sum(mul(out_w, weights)).backward();

    auto xr = x.narrow(0, starts[r], sizes[r]).clone().requires_grad_(true);
    ddp.zero_grad();
    auto out_r = ddp(xr);
    // DDP averages the gradients over the ranks: scale by w to get the whole batch's sum.
    mul(sum(mul(out_r, weights.narrow(0, starts[r], sizes[r]))), from_vector<double>({double(w)}).reshape({})).backward();

    auto near = [&](const std::vector<double>& got, const std::vector<double>& want, const char* what) {
      ASSERT_EQ(got.size(), want.size()) << what;
      for (std::size_t k = 0; k < got.size(); ++k)
        ASSERT_NEAR(got[k], want[k], 1e-10) << what << " element " << k << " step " << step << " rank " << r;
    };
    near(out_r.to_vector(), out_w.narrow(0, starts[r], sizes[r]).to_vector(), "output");
    auto gx = mul(xw.grad().narrow(0, starts[r], sizes[r]), from_vector<double>({double(w)}).reshape({}));
    near(xr.grad().to_vector(), gx.to_vector(), "input gradient");
    auto got = ddp.module().named_parameters(), want = whole.named_parameters();
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < got.size(); ++i)
      near(got[i].tensor.as<double>().grad().to_vector(), want[i].tensor.as<double>().grad().to_vector(),
           got[i].name.c_str());
    auto gb = ddp.module().named_buffers(), wb = whole.named_buffers();
    for (std::size_t i = 0; i < gb.size(); ++i) {
      if (gb[i].tensor.dtype() == DType::Float64)
        near(gb[i].tensor.as<double>().to_vector(), wb[i].tensor.as<double>().to_vector(), gb[i].name.c_str());
      else
        EXPECT_EQ(gb[i].tensor.as<std::int64_t>().to_vector(), wb[i].tensor.as<std::int64_t>().to_vector());
    }
  }
  ddp.module().eval();
  NoGradGuard g;
  auto xr = x.narrow(0, starts[r], sizes[r]);
  EXPECT_EQ(ddp(xr).shape(), (Shape{sizes[r], 3, 1, 1}));  // eval: the running statistics, no collective
  pg().barrier();
}

// ---- uneven inputs: DistributedDataParallel::join (Note [DDP join]) ----

// Rank q has 2 + q batches. Inside join() nothing hangs, and every rank ends with PyTorch's
// result: at step s the gradient is the sum over the ranks still training of their gradients,
// divided by the world size (divide_by_initial_world_size), and the parameters are those of the
// last rank to finish (whose optimizer took every step).
TEST(Ddp, JoinWithUnevenInputsGivesPyTorchsResult) {
  const int w = pg().world_size(), r = pg().rank();
  auto batches = [](int q) { return 2 + q; };
  manual_seed(21);
  Mlp<double> reference(5, 8, 3);
  manual_seed(21);
  DistributedDataParallel<Mlp<double>> ddp(Mlp<double>(5, 8, 3), {.bucket_cap_bytes = 256, .first_bucket_bytes = 64});
  optim::SGD opt(ddp.parameters(), {.lr = 0.05, .momentum = 0.9});
  int steps = 0;
  ddp.join([&] {
    for (int s = 0; s < batches(r); ++s) {
      auto [x, y] = batch_of(r, s);
      opt.zero_grad();
      nn::functional::mse_loss(ddp(x), y).backward();
      opt.step();
      ++steps;
    }
  });
  EXPECT_EQ(steps, batches(r));
  optim::SGD ref_opt(reference.parameters(), {.lr = 0.05, .momentum = 0.9});
  for (int s = 0; s < batches(w - 1); ++s) {
    Tensor<double> loss;
    for (int q = 0; q < w; ++q) {
      if (s >= batches(q)) continue;
      auto [x, y] = batch_of(q, s);
      auto l = mul(nn::functional::mse_loss(reference.forward(x), y), 1.0 / w);
      loss = loss.defined() ? add(loss, l) : l;
    }
    ref_opt.zero_grad();
    loss.backward();
    ref_opt.step();
  }
  auto got = values<double>(ddp.parameters()), want = values<double>(reference.parameters());
  for (std::size_t i = 0; i < got.size(); ++i)
    for (std::size_t k = 0; k < got[i].size(); ++k)
      ASSERT_NEAR(got[i][k], want[i][k], 1e-12) << "parameter " << i << " element " << k << " on rank " << r;
  // The group is in step afterwards, and a forward outside join() reduces as before.
  auto [x, y] = batch_of(r, 0);
  opt.zero_grad();
  nn::functional::mse_loss(ddp(x), y).backward();
  pg().barrier();
}

// A shadow step (Note [DDP join]): a finished rank steps its optimizer with the averaged
// gradients the others step with, so every rank's Adam state stays the last rank's (a
// checkpoint saved by any rank resumes the same run) and the parameters need no final copy; a
// ZeroRedundancyOptimizer, whose step is a collective, works only that way, and join refuses to
// start without it instead of hanging in the step's broadcasts.
TEST(Ddp, JoinWithAShadowStepKeepsEveryRanksOptimizerAndTakesPartInZero) {
  const int w = pg().world_size(), r = pg().rank();
  // Adam: the same state on every rank (the plain join leaves the finished ranks' behind).
  manual_seed(21);
  DistributedDataParallel<Mlp<double>> ddp(Mlp<double>(5, 8, 3));
  optim::Adam adam(ddp.parameters(), {.lr = 0.01});
  train_uneven(ddp, adam, true);
  const auto moments = adam.state()[0].at("exp_avg").as<double>();
  auto from_last = moments.clone();
  pg().broadcast(from_last, w - 1);
  EXPECT_EQ(moments.to_vector(), from_last.to_vector()) << "rank " << r;
  auto params = values<double>(ddp.parameters());
  auto last = ddp.parameters()[0].as<double>().clone();
  pg().broadcast(last, w - 1);
  EXPECT_EQ(params[0], last.to_vector());
  // ZeRO over SGD with momentum: with the shadow step it equals the plain optimizer's join.
  manual_seed(21);
  DistributedDataParallel<Mlp<double>> plain_model(Mlp<double>(5, 8, 3));
  manual_seed(21);
  DistributedDataParallel<Mlp<double>> zero_model(Mlp<double>(5, 8, 3));
  optim::SGD plain(plain_model.parameters(), {.lr = 0.05, .momentum = 0.9});
  optim::ZeroRedundancyOptimizer<optim::SGD> zero(zero_model.parameters(), {.lr = 0.05, .momentum = 0.9});
  train_uneven(plain_model, plain, false);
  if (w > 1) {
    EXPECT_TRUE(throws_with([&] { train_uneven(zero_model, zero, false); }, {"ZeroRedundancyOptimizer", "pass the step"}));
  }
  train_uneven(zero_model, zero, true);
  const auto a = values<double>(plain_model.parameters()), b = values<double>(zero_model.parameters());
  for (std::size_t i = 0; i < a.size(); ++i)
    for (std::size_t k = 0; k < a[i].size(); ++k) ASSERT_NEAR(a[i][k], b[i][k], 1e-12) << i << " " << k << " rank " << r;
  pg().barrier();
}

TEST(Ddp, JoinRefusesAForwardThatDoesNotReduce) {
  DistributedDataParallel<Mlp<double>> ddp(Mlp<double>(5, 8, 3));
  auto x = randn<double>({4, 5});
  if (pg().world_size() == 1) GTEST_SKIP() << "one process: join() only runs the loop";
  EXPECT_TRUE(throws_with([&] { ddp.join([&] {
                                  NoGradGuard g;
                                  ddp(x);
                                }); },
                          {"join", "training step"}));
  ddp.join([] {});  // every rank out of data at once: one round of flags, nothing else
  pg().barrier();
}
