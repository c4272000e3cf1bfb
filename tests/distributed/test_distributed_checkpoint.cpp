// Activation checkpointing under DistributedDataParallel (Note [activation checkpointing] in
// autograd/checkpoint.hpp): a model whose blocks are checkpointed — one of them applied twice —
// trains bit for bit as the same model without checkpoints, through no_sync accumulation, small
// buckets rebuilt after the first step, ZeroRedundancyOptimizer and sharded gradients (ZeRO-2);
// each parameter's gradient is reported ready once per backward. Part of the test_distributed binary (mpirun -np 1 … 4).
#include "dist_test_util.hpp"

#include <cstring>
#include <vector>

using namespace chorus;
using namespace dist_test;

namespace {

// Two residual blocks with dropout; `shared` runs twice (weights reused, as a recurrent step).
struct CheckpointedNet : nn::Module {
  nn::LinearT<double> in, shared, mid, out;
  bool ckpt;
  explicit CheckpointedNet(bool ckpt)
      : in(register_module("in", nn::LinearT<double>(5, 12))),
        shared(register_module("shared", nn::LinearT<double>(12, 12))),
        mid(register_module("mid", nn::LinearT<double>(12, 12))),
        out(register_module("out", nn::LinearT<double>(12, 3))),
        ckpt(ckpt) {}
  Tensor<double> forward(const Tensor<double>& x) {
    auto block = [this](const Tensor<double>& h) { return h + dropout(chorus::tanh(shared(h)), 0.2, is_training()); };
    auto pair = [this, block](const Tensor<double>& h) { return block(chorus::tanh(mid(h))); };
    auto h = chorus::tanh(in(x));
    h = ckpt ? nn::utils::checkpoint(block, h) : block(h);
    h = ckpt ? nn::utils::checkpoint(pair, h) : pair(h);
    return out(h);
  }
};

std::vector<double> flat_params(const std::vector<AnyTensor>& ps) { return concat(values<double>(ps)); }

template <class O>
std::vector<std::vector<double>> train(bool ckpt, bool zero, bool sharded, DistributedDataParallelOptions options) {
  const int w = pg().world_size(), r = pg().rank();
  const int micro = 2, rows = 3;
  manual_seed(5);
  auto x = randn<double>({w * micro * rows * 3, 5});
  auto y = randn<double>({w * micro * rows * 3, 3});
  manual_seed(17);
  DistributedDataParallel<CheckpointedNet> ddp(CheckpointedNet(ckpt), options);
  std::unique_ptr<optim::Optimizer> opt;
  const typename O::options_type o{.lr = 0.05};
  if (zero) {
    auto z = std::make_unique<optim::ZeroRedundancyOptimizer<O>>(ddp.parameters(), o);
    if (sharded) ddp.shard_gradients(*z);  // ZeRO-2
    opt = std::move(z);
  } else {
    opt = std::make_unique<O>(ddp.parameters(), o);
  }
  std::vector<std::vector<double>> trace;
  for (int step = 0; step < 3; ++step) {
    opt->zero_grad();
    for (int m = 0; m < micro; ++m) {
      const auto start = ((step * w + r) * micro + m) * rows;
      manual_seed(100 * step + 10 * r + m);  // the dropout masks
      auto run = [&] { nn::functional::mse_loss(ddp(x.narrow(0, start, rows)), y.narrow(0, start, rows)).backward(); };
      if (m + 1 < micro) {
        auto guard = ddp.no_sync();
        run();
      } else {
        run();
      }
    }
    std::vector<double> grads;
    for (const auto& p : ddp.parameters()) {
      if (!p.grad().defined()) continue;  // another rank's shard (ZeRO-2)
      auto g = p.as<double>().grad().to_vector();
      grads.insert(grads.end(), g.begin(), g.end());
    }
    trace.push_back(grads);
    opt->step();
    trace.push_back(flat_params(ddp.parameters()));
  }
  return trace;
}

template <class O>
void check_same_as_plain(bool zero, DistributedDataParallelOptions options, bool sharded = false) {
  const auto plain = train<O>(false, zero, sharded, options);
  const auto ckpt = train<O>(true, zero, sharded, options);
  ASSERT_EQ(plain.size(), ckpt.size());
  for (std::size_t i = 0; i < plain.size(); ++i) {
    ASSERT_EQ(plain[i].size(), ckpt[i].size());
    EXPECT_EQ(std::memcmp(plain[i].data(), ckpt[i].data(), plain[i].size() * sizeof(double)), 0)
        << (i % 2 ? "parameters after step " : "gradients of step ") << i / 2 << " differ on rank " << pg().rank();
  }
}

TEST(DdpCheckpoint, EqualsThePlainModelThroughNoSync) { check_same_as_plain<optim::SGD>(false, {}); }

TEST(DdpCheckpoint, EqualsThePlainModelWithSmallBucketsAndZero) {
  check_same_as_plain<optim::Adam>(true, {.bucket_cap_bytes = 512, .first_bucket_bytes = 64});
}

TEST(DdpCheckpoint, EqualsThePlainModelWithShardedGradients) {
  check_same_as_plain<optim::Adam>(true, {.bucket_cap_bytes = 512, .first_bucket_bytes = 64}, /*sharded=*/true);
}

}  // namespace
