// Sharded gradients across ranks (ZeRO-2: DistributedDataParallel::shard_gradients with
// ZeroRedundancyOptimizer; Note [ZeRO-2 over the process group] in distributed/reducer.hpp):
// each bucket is reduced to the rank that owns its parameters, the other ranks drop it, and the
// training equals the unsharded run (float64, 1e-12) for SGD, Adam and AdamW with parameter
// groups, a schedule, clipping by the global norm, no_sync accumulation, loss scaling and join.
// Part of the test_distributed binary (mpirun -np 1 … 4).
#include "dist_test_util.hpp"

#include <cmath>
#include <limits>
#include <vector>

using namespace chorus;
using namespace dist_test;

namespace {

/// One model trained three ways side by side on the same batches: DDP with O (the reference),
/// DDP with ZeroRedundancyOptimizer<O> (ZeRO-1), and DDP with sharded gradients and
/// ZeroRedundancyOptimizer<O> (ZeRO-2). ZeRO-1 equals the reference bit for bit (its own test);
/// ZeRO-2 reduces each bucket to its owner instead of to everyone, so its sums may be added in
/// another order: within 1e-12.
template <class O>
void check_zero2_equals_plain(typename O::options_type options, bool two_groups, bool clip, bool no_sync,
                              DistributedDataParallelOptions ddp_options = {}) {
  using Opts = typename O::options_type;
  const int w = pg().world_size(), r = pg().rank();
  const int rows = 4, micro = no_sync ? 2 : 1;
  manual_seed(3);
  auto x = randn<double>({rows * micro * w * 6, 5});
  auto y = randn<double>({rows * micro * w * 6, 3});
  manual_seed(11);
  DistributedDataParallel<Mlp<double>> plain_model(Mlp<double>(5, 16, 3), ddp_options);
  manual_seed(11);
  DistributedDataParallel<Mlp<double>> zero2_model(Mlp<double>(5, 16, 3), ddp_options);
  auto groups = [&](const std::vector<AnyTensor>& ps) {
    if (!two_groups) return std::vector<optim::ParamGroup<Opts>>{{ps, options}};
    auto g = optim::weight_decay_groups(ps, options);
    g[1].options.lr *= 0.5;
    return g;
  };
  O plain(groups(plain_model.parameters()));
  optim::ZeroRedundancyOptimizer<O> zero2(groups(zero2_model.parameters()));
  zero2_model.shard_gradients(zero2);
  optim::StepLR plain_sched(plain, 2, 0.5), zero2_sched(zero2, 2, 0.5);

  for (int s = 0; s < 5; ++s) {
    for (auto* m : {&plain_model, &zero2_model}) {
      m->zero_grad();
      for (int k = 0; k < micro; ++k) {
        const auto start = ((s * w + r) * micro + k) * rows;
        auto run = [&] { nn::functional::mse_loss((*m)(x.narrow(0, start, rows)), y.narrow(0, start, rows)).backward(); };
        if (k + 1 < micro) {
          auto guard = m->no_sync();
          run();
        } else {
          run();
        }
      }
    }
    // After backward a rank keeps the gradients of its own parameters only.
    const auto& ps = zero2.parameters();
    for (std::size_t i = 0; i < ps.size(); ++i)
      EXPECT_EQ(ps[i].grad().defined(), zero2.owner(i) == r) << "parameter " << i << " on rank " << r;
    if (clip) {
      if (w > 1) {  // the plain clip would take this rank's shard for the model
        EXPECT_TRUE(throws_with([&] { nn::utils::clip_grad_norm_(zero2_model.parameters(), 0.05); },
                                {"kept by another rank", "clip_grad_norm_"}));
      }
      const double want = nn::utils::clip_grad_norm_(plain_model.parameters(), 0.05);
      const double got = zero2.clip_grad_norm_(0.05);
      ASSERT_NEAR(got, want, 1e-12 * want) << "the global norm, step " << s;
    }
    plain.step();
    zero2.step();
    plain_sched.step();
    zero2_sched.step();
    const auto got = values<double>(zero2_model.parameters()), want = values<double>(plain_model.parameters());
    for (std::size_t i = 0; i < got.size(); ++i)
      for (std::size_t k = 0; k < got[i].size(); ++k)
        ASSERT_NEAR(got[i][k], want[i][k], 1e-12 * (1 + std::abs(want[i][k])))
            << "parameter " << i << " element " << k << " after step " << s << " on rank " << r;
  }
  // Every rank holds the same parameters, bit for bit.
  auto mine = concat(values<double>(zero2_model.parameters()));
  auto all = gather_all(mine);
  for (int k = 1; k < w; ++k) ASSERT_EQ(all[k], all[0]) << "rank " << k << " differs from rank 0";
}

TEST(Zero2, SgdWithMomentumEqualsThePlainOptimizer) {
  check_zero2_equals_plain<optim::SGD>({.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3}, false, false, false);
}
TEST(Zero2, AdamWithGroupsAndClippingEqualsThePlainOptimizer) {
  check_zero2_equals_plain<optim::Adam>({.lr = 1e-2, .weight_decay = 1e-3}, true, true, false);
}
TEST(Zero2, AdamWWithNoSyncAndSmallBucketsEqualsThePlainOptimizer) {
  check_zero2_equals_plain<optim::AdamW>({.lr = 1e-2, .weight_decay = 1e-2}, true, true, true,
                                         {.bucket_cap_bytes = 256, .first_bucket_bytes = 64});
}

TEST(Zero2, KeepsOnlyTheOwnedGradientsInMemory) {
  // The same model and optimizer with and without sharded gradients: after a step, the sharded
  // rank holds exactly the other ranks' gradient bytes less.
  const int w = pg().world_size(), r = pg().rank();
  // (Barriers: the communication thread lets go of a finished collective's tensors when it
  // next runs, so the counts are read once every collective before them is through.)
  auto held = [&](bool sharded) {
    pg().barrier();
    const auto before = memory_stats(Device::cpu(0)).allocated;
    std::int64_t others = 0;
    {
      manual_seed(4);
      DistributedDataParallel<Mlp<double>> ddp(Mlp<double>(5, 64, 3));
      optim::ZeroRedundancyOptimizer<optim::Adam> opt(ddp.parameters(), {.lr = 1e-3});
      if (sharded) ddp.shard_gradients(opt);
      manual_seed(5 + r);
      nn::functional::mse_loss(ddp(randn<double>({8, 5})), randn<double>({8, 3})).backward();
      opt.step();
      pg().barrier();
      for (std::size_t i = 0; i < opt.parameters().size(); ++i)
        if (opt.owner(i) != r) others += static_cast<std::int64_t>(opt.parameters()[i].nbytes());
      const auto after = memory_stats(Device::cpu(0)).allocated;
      return std::make_pair(after - before, others);
    }
  };
  (void)held(false);  // the first DDP of a process allocates what later ones reuse
  const auto [zero1, others] = held(false);
  const auto [zero2, same] = held(true);
  EXPECT_EQ(others, same);
  EXPECT_EQ(zero1 - zero2, others) << "ZeRO-1 held " << zero1 << " bytes, ZeRO-2 " << zero2 << " (world " << w << ")";
  if (w > 1) {
    EXPECT_GT(others, 0);
  }
}

TEST(Zero2, GradScalerSkipsTheStepOnEveryRankWhenOneShardHasAnInf) {
  const int w = pg().world_size(), r = pg().rank();
  manual_seed(6);
  DistributedDataParallel<Mlp<double>> ddp(Mlp<double>(5, 8, 3));
  optim::ZeroRedundancyOptimizer<optim::SGD> opt(ddp.parameters(), {.lr = 0.1});
  ddp.shard_gradients(opt);
  amp::GradScaler scaler({.init_scale = 1024.0});
  const auto before = values<double>(ddp.parameters());
  manual_seed(7 + r);
  scaler.scale(nn::functional::mse_loss(ddp(randn<double>({4, 5})), randn<double>({4, 3}))).backward();
  // Only the last rank's shard gets an inf: every rank must skip.
  if (r == w - 1) {
    for (std::size_t i = 0; i < opt.parameters().size(); ++i) {
      if (opt.owner(i) != r) continue;
      opt.parameters()[i].as<double>().grad().data()[0] = std::numeric_limits<double>::infinity();
      break;
    }
  }
  EXPECT_FALSE(scaler.step(opt)) << "rank " << r << " stepped";
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 512.0);
  EXPECT_EQ(values<double>(ddp.parameters()), before);
}

TEST(Zero2, JoinWithAShadowStepEqualsThePlainJoin) {
  // Rank q has 2 + q batches; a finished rank takes part in the others' reductions with zeros
  // and steps its shard with the owners' averaged gradients (Note [DDP join]).
  const int r = pg().rank();
  manual_seed(21);
  DistributedDataParallel<Mlp<double>> plain_model(Mlp<double>(5, 8, 3));
  manual_seed(21);
  DistributedDataParallel<Mlp<double>> zero2_model(Mlp<double>(5, 8, 3));
  optim::SGD plain(plain_model.parameters(), {.lr = 0.05, .momentum = 0.9});
  optim::ZeroRedundancyOptimizer<optim::SGD> zero2(zero2_model.parameters(), {.lr = 0.05, .momentum = 0.9});
  zero2_model.shard_gradients(zero2);
  train_uneven(plain_model, plain, false);
  train_uneven(zero2_model, zero2, true);
  const auto a = values<double>(plain_model.parameters()), b = values<double>(zero2_model.parameters());
  for (std::size_t i = 0; i < a.size(); ++i)
    for (std::size_t k = 0; k < a[i].size(); ++k) ASSERT_NEAR(a[i][k], b[i][k], 1e-12) << i << " " << k << " rank " << r;
  pg().barrier();
}

TEST(Zero2, BadUseIsRefused) {
  manual_seed(8);
  DistributedDataParallel<Mlp<double>> ddp(Mlp<double>(5, 8, 3));
  Mlp<double> other(5, 8, 3);
  optim::ZeroRedundancyOptimizer<optim::SGD> foreign(other.parameters(), {.lr = 0.1});
  EXPECT_TRUE(throws_with([&] { ddp.shard_gradients(foreign); }, {"shard_gradients", "not a parameter of"}));
  optim::ZeroRedundancyOptimizer<optim::SGD> opt(ddp.parameters(), {.lr = 0.1});
  nn::functional::mse_loss(ddp(randn<double>({4, 5})), randn<double>({4, 3})).backward();
  EXPECT_TRUE(throws_with([&] { ddp.shard_gradients(opt); }, {"shard_gradients", "before the first"}));
}

}  // namespace
