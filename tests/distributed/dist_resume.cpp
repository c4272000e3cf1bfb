// Crash and resume (issue 20 item 8, Note [checkpointer]), run by resume_check.sh:
//
//   dist_resume DIR STEPS KILL_AT OUT
//
// trains an MLP with SyncBatchNorm and dropout under DistributedDataParallel on a
// DistributedSampler's batches (ZeroRedundancyOptimizer over Adam, StepLR; several epochs, so a
// checkpoint falls mid-epoch), with a Checkpointer in DIR
// every 3 steps, resuming from it when there is one. With KILL_AT >= 0, the last rank SIGKILLs
// itself before step KILL_AT unless DIR/killed exists (it creates it first: one crash per job).
// Rank 0 writes the final model to OUT, which must be bitwise the uninterrupted run's.
#include <chorus/distributed.hpp>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

using namespace chorus;

namespace {
struct Net : nn::Module {
  nn::LinearT<double> fc1, fc2;
  nn::SyncBatchNormT<double> bn;
  nn::Dropout drop;
  Net()
      : fc1(register_module("fc1", nn::LinearT<double>(6, 16))),
        fc2(register_module("fc2", nn::LinearT<double>(16, 2))),
        bn(register_module("bn", nn::SyncBatchNormT<double>(16))),
        drop(register_module("drop", nn::Dropout(0.25))) {}
  Tensor<double> forward(const Tensor<double>& x) { return fc2(drop(relu(bn(fc1(x))))); }
};
}  // namespace

int main(int argc, char** argv) try {
  if (argc != 5) {
    std::printf("usage: dist_resume DIR STEPS KILL_AT OUT\n");
    return 2;
  }
  const std::string dir = argv[1], out = argv[4];
  const std::int64_t steps = std::stoll(argv[2]), kill_at = std::stoll(argv[3]);
  dist::init();
  const int rank = dist::rank(), last = dist::world_size() - 1;
  manual_seed(7);  // the same data everywhere
  data::TensorDataset<double, double> dataset(randn<double>({96, 6}), randn<double>({96, 2}));
  manual_seed(100 + static_cast<std::uint64_t>(rank));  // each rank its own dropout stream
  auto sampler = std::make_shared<data::DistributedSampler>(dataset, data::DistributedSamplerOptions{.seed = 3});
  data::DataLoader loader(dataset, {.batch_size = 8}, sampler);
  const auto per_epoch = static_cast<std::int64_t>(loader.num_batches());
  DistributedDataParallel<Net> ddp(Net{});
  optim::ZeroRedundancyOptimizer<optim::Adam> opt(ddp.parameters(), {.lr = 1e-2});
  optim::StepLR sched(opt, 4, 0.5);
  dist::Checkpointer ckpt(dir, ddp.module(), opt, {.every = 3, .scheduler = &sched});
  std::int64_t step = ckpt.resume();
  if (rank == 0) std::printf("rank 0: starting at step %lld of %lld\n", static_cast<long long>(step),
                             static_cast<long long>(steps));
  while (step < steps) {
    sampler->set_epoch(static_cast<std::uint64_t>(step / per_epoch));
    auto it = loader.begin();
    for (std::int64_t k = 0; k < step % per_epoch; ++k) ++it;  // the batches done before the crash
    for (; it != loader.end() && step < steps; ++it) {
      const auto marker = std::filesystem::path(dir) / "killed";
      if (step == kill_at && rank == last && !std::filesystem::exists(marker)) {
        std::filesystem::create_directories(dir);  // before the first checkpoint it does not exist yet
        std::ofstream(marker) << "killed before step " << step << "\n";
        std::printf("rank %d: SIGKILL before step %lld\n", rank, static_cast<long long>(step));
        std::fflush(stdout);
        std::raise(SIGKILL);
      }
      const auto& batch = *it;
      auto loss = nn::functional::mse_loss(ddp(batch.data), batch.target);
      opt.zero_grad();
      loss.backward();
      opt.step();
      sched.step();
      ckpt.step(++step);
    }
  }
  if (rank == 0) save(ddp.module(), out);
  dist::shutdown();
  return 0;
} catch (const std::exception& e) {
  std::printf("dist_resume: %s\n", e.what());
  return 1;
}
