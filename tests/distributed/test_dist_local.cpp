// The distributed layer without MPI and without a launcher: a world of one process, which
// needs nothing installed; and DistributedSampler's arithmetic against PyTorch's.
#include <chorus/distributed.hpp>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "../test_util.hpp"

using namespace chorus;

namespace {

struct EnvGuard {  // sets variables for one test, restores them after
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
  void set(const char* name, const char* value) {
    const char* old = std::getenv(name);
    saved.push_back({name, old ? std::optional<std::string>(old) : std::nullopt});
    if (value) ::setenv(name, value, 1);
    else ::unsetenv(name);
  }
  ~EnvGuard() {
    for (auto it = saved.rbegin(); it != saved.rend(); ++it) {
      if (it->second) ::setenv(it->first.c_str(), it->second->c_str(), 1);
      else ::unsetenv(it->first.c_str());
    }
  }
};

TEST(ProcessGroupLocal, WorldOfOne) {
  auto& g = dist::init();
  EXPECT_EQ(g.world_size(), 1);
  EXPECT_EQ(g.rank(), 0);
  EXPECT_EQ(g.local_rank(), 0);
  EXPECT_EQ(g.backend(), "local");
  auto t = from_vector(std::vector<double>{1, 2, 3});
  g.all_reduce(t, dist::ReduceOp::Sum);
  g.all_reduce(t, dist::ReduceOp::Avg);
  g.broadcast(t, 0);
  EXPECT_EQ(t.to_vector(), (std::vector<double>{1, 2, 3}));
  auto all = g.all_gather(t);
  EXPECT_EQ(all.shape(), Shape({1, 3}));
  EXPECT_EQ(all.to_vector(), (std::vector<double>{1, 2, 3}));
  g.barrier();
  EXPECT_THROW(g.broadcast(t, 1), Error);
}

TEST(ProcessGroupLocal, TorchrunWithoutNcclIsRefusedClearly) {
  EnvGuard env;
  env.set("RANK", "0");
  env.set("WORLD_SIZE", "2");
  env.set("LOCAL_RANK", "0");
  env.set("MASTER_ADDR", "127.0.0.1");
  env.set("MASTER_PORT", "29500");
  if constexpr (!kCudaEnabled) {
    try {
      dist::ProcessGroup g;
      FAIL() << "expected an error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("NCCL"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("WORLD_SIZE=2"), std::string::npos) << e.what();
    }
  }
  env.set("WORLD_SIZE", "1");
  dist::ProcessGroup one;
  EXPECT_EQ(one.launcher(), dist::Launcher::Torchrun);
  EXPECT_EQ(one.world_size(), 1);
  env.set("RANK", "3");
  env.set("WORLD_SIZE", "2");
  EXPECT_THROW(dist::ProcessGroup bad, Error);
}

// `mpirun -np 2` on a program built without MPI would start two jobs that each say "world 1"
// and write the same checkpoints: refused, naming what to link. `mpirun -np 1` is a world of 1.
TEST(ProcessGroupLocal, SeveralProcessesFromAnMpiLauncherWithoutMpiAreRefused) {
  for (auto [name, value] : std::vector<std::pair<const char*, const char*>>{
           {"OMPI_COMM_WORLD_SIZE", "2"}, {"PMI_SIZE", "4"}, {"OMPI_COMM_WORLD_RANK", "1"}, {"PMIX_RANK", "3"}}) {
    EnvGuard env;
    env.set(name, value);
    EXPECT_TRUE(chorus::testing::throws_with([] { dist::ProcessGroup g; },
                            {"dist::init", "MPI launcher", name, "built without MPI", "chorus::distributed"}))
        << name;
  }
  EnvGuard env;
  env.set("OMPI_COMM_WORLD_SIZE", "1");
  env.set("OMPI_COMM_WORLD_RANK", "0");
  dist::ProcessGroup one;
  EXPECT_EQ(one.world_size(), 1);
}

// Note [timeout precedence]: a timeout set in code wins over CHORUS_DIST_TIMEOUT_S, which
// applies only where the code leaves it unset.
TEST(ProcessGroupLocal, ATimeoutSetInCodeWinsOverTheEnvironment) {
  EnvGuard env;
  env.set("CHORUS_DIST_TIMEOUT_S", "7");
  dist::ProcessGroup g;
  EXPECT_EQ(g.timeout(), std::chrono::seconds(7));
  EXPECT_EQ(dist::ProcessGroup({.timeout = std::chrono::seconds(600)}).timeout(), std::chrono::seconds(600));
  EXPECT_EQ(dist::ProcessGroup({.timeout = std::chrono::milliseconds(1500)}).timeout().count(), 1500);
  env.set("CHORUS_DIST_TIMEOUT_S", nullptr);
  EXPECT_EQ(dist::ProcessGroup().timeout(), std::chrono::minutes(10));
  EXPECT_THROW(dist::ProcessGroup({.timeout = std::chrono::milliseconds(0)}), Error);
  for (const char* bad : {"x", "-3", "0"}) {
    env.set("CHORUS_DIST_TIMEOUT_S", bad);
    EXPECT_THROW(dist::ProcessGroup(), Error) << bad;
    EXPECT_NO_THROW(dist::ProcessGroup({.timeout = std::chrono::seconds(1)})) << "not read when the code sets it";
  }
}

// Note [one process group]: init() again returns the group; init(options) that contradict it
// is an error, not silently ignored.
TEST(ProcessGroupLocal, ASecondInitWithOtherOptionsIsAnError) {
  dist::detail::global_group().reset();  // this test makes the group itself
  EnvGuard env;
  env.set("CHORUS_DIST_TIMEOUT_S", "9");
  auto& g = dist::init({.timeout = std::chrono::seconds(42)});
  EXPECT_EQ(g.timeout(), std::chrono::seconds(42));
  EXPECT_EQ(&dist::init(), &g);  // no options (what DistributedDataParallel calls): the group as it is
  EXPECT_EQ(&dist::init({.timeout = std::chrono::seconds(42)}), &g);
  try {
    dist::init({.timeout = std::chrono::seconds(5)});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("42000 ms"), std::string::npos) << msg;
    EXPECT_NE(msg.find("5000 ms"), std::string::npos) << msg;
  }
  EXPECT_EQ(dist::group().timeout(), std::chrono::seconds(42));
  dist::detail::global_group().reset();
  auto& d = dist::init();  // made without a timeout: the environment's, which a later init() may repeat
  EXPECT_EQ(d.timeout(), std::chrono::seconds(9));
  EXPECT_EQ(&dist::init({.timeout = std::chrono::seconds(9)}), &d);
  EXPECT_THROW(dist::init({.timeout = std::chrono::seconds(10)}), Error);
  dist::detail::global_group().reset();
}

// Note [MPI counts]: MPI takes int counts; 2^31 elements would wrap in the cast.
// The average's division (ReduceOp::Avg over MPI, DDP's compression hooks) runs as a backend
// kernel on the tensor's device (a GPU bucket is device memory: a host loop would dereference a
// device pointer), with the bits of the division in the element type (16-bit: in float, once).
template <class T>
void check_divide(std::int64_t world) {
  std::vector<T> v;
  for (int i = 0; i < 64; ++i) v.push_back(T(static_cast<float>(i * 7 - 200) / 3.0f));
  auto t = from_vector(v);
  dist::detail::divide_in_place(t, world);
  const auto got = t.to_vector();
  for (std::size_t i = 0; i < v.size(); ++i) {
    T want = v[i];
    want /= static_cast<T>(world);
    EXPECT_EQ(std::memcmp(&got[i], &want, sizeof(T)), 0) << i;
  }
}
TEST(ProcessGroupLocal, TheAverageDividesInTheElementTypeThroughTheBackend) {
  for (std::int64_t world : {1, 2, 3, 7}) {
    check_divide<float>(world);
    check_divide<double>(world);
    check_divide<bfloat16>(world);
    check_divide<half>(world);
  }
}

TEST(ProcessGroupLocal, MpiCountsStopBelowTwoToThe31) {
  EXPECT_EQ(dist::detail::checked_int_count((std::int64_t{1} << 31) - 1, "all_reduce"), 2147483647);
  EXPECT_EQ(dist::detail::checked_int_count(0, "all_reduce"), 0);
  try {
    dist::detail::checked_int_count(std::int64_t{1} << 31, "all_reduce of 8589934592 bytes");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("2147483648 elements"), std::string::npos) << e.what();
  }
}

struct Net : nn::Module {
  nn::LinearT<double> fc1, fc2, spare;
  Net()
      : fc1(register_module("fc1", nn::LinearT<double>(3, 6))),
        fc2(register_module("fc2", nn::LinearT<double>(6, 2))),
        spare(register_module("spare", nn::LinearT<double>(2, 2))) {}
  bool use_spare = true;
  Tensor<double> forward(const Tensor<double>& x) {
    auto h = fc2(relu(fc1(x)));
    return use_spare ? spare(h) : h;
  }
};

TEST(DdpLocal, EqualsPlainTrainingAndParametersStayLeaves) {
  manual_seed(1);
  auto x = randn<double>({8, 3});
  manual_seed(2);
  Net plain;
  manual_seed(2);
  DistributedDataParallel<Net> ddp(Net{}, {.first_bucket_bytes = 64});
  optim::Adam opt(ddp.parameters(), {.lr = 0.01});
  optim::Adam ref_opt(plain.parameters(), {.lr = 0.01});
  for (int step = 0; step < 3; ++step) {
    auto out = ddp(x);
    auto loss = sum(out * out);
    opt.zero_grad();
    loss.backward();
    opt.step();
    auto ref_out = plain.forward(x);
    auto ref = sum(ref_out * ref_out);
    ref_opt.zero_grad();
    ref.backward();
    ref_opt.step();
  }
  auto a = ddp.parameters(), b = plain.parameters();
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(a[i].as<double>().is_leaf());
    auto u = a[i].as<double>().to_vector(), v = b[i].as<double>().to_vector();
    for (std::size_t k = 0; k < u.size(); ++k) ASSERT_NEAR(u[k], v[k], 1e-12);
  }
}

TEST(DdpLocal, UnusedParameterIsNamedUnlessAllowed) {
  manual_seed(3);
  Net net;
  net.use_spare = false;
  DistributedDataParallel<Net> ddp(std::move(net));
  auto loss = sum(ddp(randn<double>({2, 3})));
  try {
    loss.backward();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'spare.weight'"), std::string::npos) << e.what();
  }
  Net net2;
  net2.use_spare = false;
  DistributedDataParallel<Net> lenient(std::move(net2), {.find_unused_parameters = true});
  sum(lenient(randn<double>({2, 3}))).backward();
  EXPECT_TRUE(lenient.module().fc1->weight.grad().defined());
  EXPECT_FALSE(lenient.module().spare->weight.grad().defined());
}

TEST(DdpLocal, NoGradForwardDoesNotReduce) {
  DistributedDataParallel<Net> ddp(Net{});
  NoGradGuard ng;
  auto out = ddp(zeros<double>({1, 3}));
  EXPECT_FALSE(out.requires_grad());
}

// ---- DistributedSampler: the same indices as torch.utils.data.DistributedSampler ----

std::vector<std::size_t> share(std::size_t n, int world, int rank, data::DistributedSamplerOptions o) {
  return data::DistributedSampler(n, world, rank, o).indices();
}
using V = std::vector<std::size_t>;

TEST(DistributedSamplerLocal, PadsToAMultipleOfTheWorld) {
  const data::DistributedSamplerOptions seq{.shuffle = false};
  EXPECT_EQ(share(10, 3, 0, seq), (V{0, 3, 6, 9}));
  EXPECT_EQ(share(10, 3, 1, seq), (V{1, 4, 7, 0}));
  EXPECT_EQ(share(10, 3, 2, seq), (V{2, 5, 8, 1}));
  EXPECT_EQ(share(2, 5, 4, seq), (V{0}));  // more padding than data: the order repeats
  EXPECT_EQ(share(2, 5, 3, seq), (V{1}));
}

TEST(DistributedSamplerLocal, DropLastCutsToAMultipleOfTheWorld) {
  const data::DistributedSamplerOptions seq{.shuffle = false, .drop_last = true};
  EXPECT_EQ(share(10, 3, 0, seq), (V{0, 3, 6}));
  EXPECT_EQ(share(10, 3, 2, seq), (V{2, 5, 8}));
  EXPECT_EQ(data::DistributedSampler(10, 3, 0, seq).size(), 3u);
  EXPECT_EQ(data::DistributedSampler(2, 5, 0, seq).size(), 0u);
}

TEST(DistributedSamplerLocal, ShuffleDependsOnSeedAndEpochOnly) {
  data::DistributedSampler a(100, 4, 1, {.seed = 5}), b(100, 4, 1, {.seed = 5}), c(100, 4, 1, {.seed = 6});
  EXPECT_EQ(a.indices(), b.indices());
  EXPECT_NE(a.indices(), c.indices());
  const auto first = a.indices();
  a.set_epoch(1);
  EXPECT_NE(a.indices(), first);
  a.set_epoch(0);
  EXPECT_EQ(a.indices(), first);
  // The ranks of one epoch partition a permutation.
  std::vector<int> seen(100, 0);
  for (int r = 0; r < 4; ++r)
    for (auto i : data::DistributedSampler(100, 4, r, {.seed = 5}).indices()) ++seen[i];
  for (int s : seen) EXPECT_EQ(s, 1);
}

TEST(DistributedSamplerLocal, BadArgumentsAreRefused) {
  EXPECT_THROW(data::DistributedSampler(10, 0, 0), Error);
  EXPECT_THROW(data::DistributedSampler(10, 2, 2), Error);
  EXPECT_THROW(data::DistributedSampler(10, 2, -1), Error);
  data::TensorDataset<float, float> ds(zeros<float>({4, 1}), zeros<float>({4, 1}));
  EXPECT_THROW(data::DataLoader(ds, {.batch_size = 2, .shuffle = true}, data::DistributedSampler(4, 1, 0)), Error);
}

// ---- Issue 16: DistributedSampler(dataset) from the default process group; sizes that wrap ----

TEST(DistributedSamplerLocal, FromTheDatasetAndTheDefaultGroup) {
  data::TensorDataset<float, float> ds(arange<float>(10).view({10, 1}), zeros<float>({10, 1}));
  if (!dist::is_initialized()) {  // run alone (as CTest runs each test): no group yet
    EXPECT_TRUE(chorus::testing::throws_with([&] { data::DistributedSampler{ds}; },
                                             {"DistributedSampler", "not initialised", "dist::init()"}));
  }
  auto& g = dist::init();
  data::DistributedSampler s(ds, {.shuffle = false});
  EXPECT_EQ(s.num_replicas(), g.world_size());
  EXPECT_EQ(s.rank(), g.rank());
  EXPECT_EQ(s.size(), 10u);
  data::DistributedSampler explicit_one(ds, 3, 2, {.shuffle = false});  // PyTorch's num_replicas, rank
  EXPECT_EQ(explicit_one.indices(), (V{2, 5, 8, 1}));
  // The loader shares it: set_epoch between epochs reaches the loader.
  auto shared = std::make_shared<data::DistributedSampler>(ds, data::DistributedSamplerOptions{.seed = 4});
  data::DataLoader loader(ds, {.batch_size = 4}, shared);
  auto epoch = [&] {
    V seen;
    for (const auto& b : loader)
      for (float v : b.data.to_vector()) seen.push_back(static_cast<std::size_t>(v));
    return seen;
  };
  const V first = epoch();
  EXPECT_EQ(first, shared->indices());
  shared->set_epoch(1);
  EXPECT_EQ(epoch(), shared->indices());
  EXPECT_NE(shared->indices(), first);
}

// ceil(n / w) was (n + w - 1) / w, which wraps to 0 samples for n near SIZE_MAX.
TEST(DistributedSamplerLocal, HugeDatasetSizesDoNotWrap) {
  constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max();
  EXPECT_EQ(data::DistributedSampler(kMax - 1, 3, 0, {.shuffle = false}).size(), (kMax - 1) / 3 + 1);
  EXPECT_EQ(data::DistributedSampler(kMax, 2, 1, {.shuffle = false, .drop_last = true}).size(), kMax / 2);
  EXPECT_TRUE(chorus::testing::throws_with([] { data::DistributedSampler(kMax, 2, 0); }, {"overflow a size_t"}));
}

}  // namespace

// Note [checkpointer]: what a directory may hold that the Checkpointer did not write, or no
// longer holds, is a chorus::Error naming it, never another exception or a silent fresh start.
TEST(CheckpointerLocal, StrayNamesMissingLatestAndUnwritableDirectoriesAreErrors) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("chorus-ckpt-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  manual_seed(5);
  nn::LinearT<double> model(3, 2);
  optim::SGD opt(model->parameters(), {.lr = 0.1, .momentum = 0.9});
  auto step = [&] {
    auto loss = model(randn<double>({4, 3})).sum();
    opt.zero_grad();
    loss.backward();
    opt.step();
  };
  dist::Checkpointer ckpt(dir.string(), model, opt, {.keep = 1});
  EXPECT_EQ(ckpt.resume(), 0);  // nothing there: a fresh start
  step();
  ckpt.save(1);
  // A stray directory named like a checkpoint, beyond int64: ignored by keep-N, the save goes on.
  fs::create_directories(dir / "step-99999999999999999999");
  step();
  EXPECT_NO_THROW(ckpt.save(2));
  EXPECT_FALSE(fs::exists(dir / "step-1"));  // keep = 1
  EXPECT_TRUE(fs::exists(dir / "step-99999999999999999999"));
  EXPECT_EQ(ckpt.latest_step(), 2);
  // `latest` naming a step beyond int64.
  std::ofstream(dir / "latest") << "step-99999999999999999999\n";
  EXPECT_TRUE(chorus::testing::throws_with([&] { ckpt.resume(); }, {"latest' names 'step-99999999999999999999'", "not a checkpoint"}));
  // No `latest` with step-2 there: refused, not a silent restart from step 0.
  fs::remove(dir / "latest");
  EXPECT_TRUE(chorus::testing::throws_with([&] { ckpt.resume(); }, {"holds step-2", "no readable 'latest'"}));
  std::ofstream(dir / "latest") << "step-2\n";
  EXPECT_EQ(ckpt.resume(), 2);
  // A truncated optimizer file: refused before the model is touched.
  const auto weights = model->weight.to_vector();
  fs::resize_file(dir / "step-2" / "optimizer.safetensors", 20);
  {
    NoGradGuard g;
    model->weight.fill_(7.0);
  }
  EXPECT_THROW(ckpt.resume(), Error);
  EXPECT_EQ(model->weight.to_vector(), std::vector<double>(weights.size(), 7.0));
  // A directory that cannot be made (a file stands in its path).
  std::ofstream(dir / "file") << "x";
  dist::Checkpointer blocked((dir / "file" / "ckpt").string(), model, opt);
  EXPECT_TRUE(chorus::testing::throws_with([&] { blocked.save(3); }, {"Checkpointer: cannot write step 3", "file/ckpt"}));
  fs::remove_all(dir);
}
