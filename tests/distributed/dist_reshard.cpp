// Resharding checkpoints (Note [resharding checkpoints]): the program reshard_check.sh runs
// under mpirun with different worlds. A small model (two FullyShard units and a root head, float64,
// sizes that pad differently on 2, 3 and 4 ranks) trains with Adam and StepLR on a global batch of
// 12 rows a step, each rank taking its share.
//   dist_reshard train DIR K          train K steps, save_sharded into DIR (and DIR.full.safetensors)
//   dist_reshard resume DIR T OUT     load_sharded from DIR, train on to step T, write the full model
//   dist_reshard straight T OUT       train T steps from the start, write the full model
//   dist_reshard consolidate DIR OUT  dist::consolidate_sharded (one process; what the
//                                     consolidate_sharded example program does)
//   dist_reshard compare A B TOL      the largest difference of two files' tensors must be <= TOL
// and the same for a ZeRO-2 job (DistributedDataParallel with shard_gradients and a
// ZeroRedundancyOptimizer<Adam>, ZeroRedundancyOptimizer::save_sharded / load_sharded, the model
// saved whole by rank 0): zero-train DIR K, zero-resume DIR T OUT, zero-straight T OUT.
#include <chorus/distributed.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>

using namespace chorus;

namespace {
struct Net : nn::Module {
  dist::FullyShard<nn::LinearT<double>> l1, l2;
  nn::LinearT<double> head;
  Net()
      : l1(register_module("l1", dist::FullyShard(nn::LinearT<double>(5, 7)))),
        l2(register_module("l2", dist::FullyShard(nn::LinearT<double>(7, 7)))),
        head(register_module("head", nn::LinearT<double>(7, 3))) {}
  Tensor<double> forward(const Tensor<double>& x) { return head(tanh(l2(tanh(l1(x))))); }
};

/// The same layers without units: the ZeRO job's model.
struct PlainNet : nn::Module {
  nn::LinearT<double> l1, l2, head;
  PlainNet()
      : l1(register_module("l1", nn::LinearT<double>(5, 7))),
        l2(register_module("l2", nn::LinearT<double>(7, 7))),
        head(register_module("head", nn::LinearT<double>(7, 3))) {}
  Tensor<double> forward(const Tensor<double>& x) { return head(tanh(l2(tanh(l1(x))))); }
};

constexpr int kRows = 12;  // a step's global batch

void write(const std::vector<nn::Module::NamedTensor>& tensors, const std::string& path) {
  io::detail::write_atomically(path, io::detail::serialise(tensors, {}));
}

/// Trains from step `from` to step `to` (the batches of a step are the same whatever the world):
/// `model` is the FSDP or DDP wrapper, `opt` clips (the wrapper or the ZeRO optimizer).
template <class Model, class Clip>
void train(Model& model, Clip& clip, optim::Optimizer& opt, optim::LRScheduler& sched, int from, int to) {
  const int w = dist::init().world_size(), r = dist::init().rank(), rows = kRows / w;
  manual_seed(21);
  auto x = randn<double>({kRows * 16, 5}), y = randn<double>({kRows * 16, 3});
  for (int s = from; s < to; ++s) {
    opt.zero_grad();
    const auto at = s * kRows + r * rows;
    nn::functional::mse_loss(model(x.narrow(0, at, rows)), y.narrow(0, at, rows)).backward();
    clip.clip_grad_norm_(0.5);
    opt.step();
    sched.step();
  }
}

/// The ZeRO-2 job's modes (see the top).
int run_zero(const std::string& mode, int argc, char** argv) {
  auto& pg = dist::init();
  manual_seed(3);
  PlainNet net;
  const std::string dir = argc > 2 ? argv[2] : "";
  if (mode == "zero-resume") chorus::load(net, dir + "/model.safetensors");
  DistributedDataParallel<PlainNet> ddp(std::move(net));
  optim::ZeroRedundancyOptimizer<optim::Adam> opt(ddp.parameters(), {.lr = 0.05});
  ddp.shard_gradients(opt);
  optim::StepLR sched(opt, 2, 0.5);
  if (mode == "zero-train" && argc == 4) {
    const int k = std::stoi(argv[3]);
    train(ddp, opt, opt, sched, 0, k);
    if (pg.rank() == 0) {
      std::filesystem::create_directories(dir);
      chorus::save(ddp.module(), dir + "/model.safetensors");
    }
    opt.save_sharded(dir, {.scheduler = &sched}, {{"step", std::to_string(k)}});
    return 0;
  }
  if (mode == "zero-resume" && argc == 5) {
    const auto meta = opt.load_sharded(dir, {.scheduler = &sched});
    train(ddp, opt, opt, sched, std::stoi(meta.at("step")), std::stoi(argv[3]));
  } else if (mode == "zero-straight" && argc == 4) {
    train(ddp, opt, opt, sched, 0, std::stoi(argv[2]));
  } else {
    std::fprintf(stderr, "usage: dist_reshard zero-train DIR K | zero-resume DIR T OUT | zero-straight T OUT\n");
    return 2;
  }
  if (pg.rank() == 0) write(ddp.module().named_parameters(), argv[argc - 1]);
  return 0;
}

int run(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "consolidate" && argc == 4) {
    dist::consolidate_sharded(argv[2], argv[3]);
    return 0;
  }
  if (mode == "compare" && argc == 5) {
    const auto a = io::read(argv[2]), b = io::read(argv[3]);
    const double tol = std::stod(argv[4]);
    CHORUS_CHECK(a.tensors.size() == b.tensors.size(), "compare: ", a.tensors.size(), " against ", b.tensors.size(),
                 " tensors");
    double worst = 0;
    for (const auto& [name, rec] : a.tensors) {
      CHORUS_CHECK(b.tensors.count(name), "compare: ", argv[3], " has no '", name, "'");
      const auto u = io::detail::host_tensor<double>(a, rec).to_vector();
      const auto v = io::detail::host_tensor<double>(b, b.tensors.at(name)).to_vector();
      CHORUS_CHECK(u.size() == v.size(), "compare: '", name, "' differs in size");
      for (std::size_t i = 0; i < u.size(); ++i) worst = std::max(worst, std::abs(u[i] - v[i]));
    }
    std::printf("compare: %zu tensors, largest difference %.3g (tolerance %.3g)\n", a.tensors.size(), worst, tol);
    return worst <= tol ? 0 : 1;
  }
  if (mode.rfind("zero-", 0) == 0) return run_zero(mode, argc, argv);
  auto& pg = dist::init();
  manual_seed(3);
  dist::FullyShardedDataParallel<Net> fsdp{Net()};
  optim::Adam opt(fsdp.parameters(), {.lr = 0.05});
  optim::StepLR sched(opt, 2, 0.5);
  if (mode == "train" && argc == 4) {
    const int k = std::stoi(argv[3]);
    train(fsdp, fsdp, opt, sched, 0, k);
    fsdp.save_sharded(opt, argv[2], {.scheduler = &sched}, {{"step", std::to_string(k)}});
    const auto full = fsdp.full_state_dict();
    if (pg.rank() == 0) write(full, std::string(argv[2]) + ".full.safetensors");
    return 0;
  }
  if (mode == "resume" && argc == 5) {
    const auto meta = fsdp.load_sharded(opt, argv[2], {.scheduler = &sched});
    train(fsdp, fsdp, opt, sched, std::stoi(meta.at("step")), std::stoi(argv[3]));
  } else if (mode == "straight" && argc == 4) {
    train(fsdp, fsdp, opt, sched, 0, std::stoi(argv[2]));
  } else {
    std::fprintf(stderr, "usage: dist_reshard train DIR K | resume DIR T OUT | straight T OUT | consolidate DIR OUT "
                         "| compare A B TOL\n");
    return 2;
  }
  const auto full = fsdp.full_state_dict();
  if (pg.rank() == 0) write(full, argv[argc - 1]);
  return 0;
}
}  // namespace

int main(int argc, char** argv) try {
  return run(argc, argv);
} catch (const std::exception& e) {
  std::fprintf(stderr, "dist_reshard: %s\n", e.what());
  return 1;
}
