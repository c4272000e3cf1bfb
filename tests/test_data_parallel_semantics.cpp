// DataParallel's semantics beyond equal numbers (issue 16): version counters of tensors in
// flat buffers, to() and the optimizer, buffers that require grad, the arguments forward
// takes, replicas' exceptions, the module and its names.
#include <unistd.h>

#include <array>
#include <atomic>
#include <filesystem>
#include <functional>
#include <list>
#include <map>
#include <optional>
#include <variant>

#include "data_parallel_util.hpp"

using namespace chorus;
using chorus::testing::all_close;
using chorus::testing::cpus;
using chorus::testing::expect_grads_equal;
using chorus::testing::Net;
using chorus::testing::throws_with;

namespace {
// The threaded path (every replica on its device's worker) unless a test asks for the inline one.
[[maybe_unused]] const bool kThreaded = [] {
  parallel::set_inline_work_default(0);
  return true;
}();
}  // namespace

// Item 9 (Note [storage slices]): every parameter and buffer has its own version counter, while
// still living in its flat buffer. A buffer written in forward (a step counter) beside a
// buffer backward reads, and a parameter written between forward and backward that no node
// saved, are no longer "modified by an inplace operation"; a saved one still is.
namespace {
struct CountsSteps : nn::Module {
  nn::LinearT<double> fc;
  Tensor<double> scale, steps;
  CountsSteps() : fc(register_module("fc", nn::LinearT<double>(4, 3))) {
    scale = register_buffer("scale", full<double>({3}, 0.5));
    steps = register_buffer("steps", zeros<double>({1}));
  }
  Tensor<double> forward(const Tensor<double>& x) {
    {
      NoGradGuard g;
      steps.fill_(steps.item() + 1.0);
    }
    return fc(x) * scale;
  }
};
}  // namespace

TEST(DataParallel, AnInPlaceWriteMarksOnlyTheTensorItWrites) {
  for (int k = 1; k <= 3; ++k) {
    const std::string what = std::to_string(k) + " device(s)";
    manual_seed(21);
    CountsSteps reference;
    DataParallel<CountsSteps> dp(nn::clone(reference, Device::cpu(0)), cpus(k));
    auto x = randn<double>({6, 4});
    auto loss = (dp(x) * 3.0).sum();  // every replica wrote its 'steps'; mul saved 'scale'
    {
      NoGradGuard g;
      dp.module().fc->bias.fill_(1.0);  // no node saved the bias
      reference.fc->bias.fill_(1.0);
    }
    EXPECT_NO_THROW(loss.backward()) << what;
    (reference.forward(x) * 3.0).sum().backward();
    expect_grads_equal<double>(reference, dp.module(), 1e-12, what);
    // A tensor that backward reads is still guarded, on every replica.
    auto again = dp(x).sum();
    {
      NoGradGuard g;
      dp.module().scale.fill_(2.0);
    }
    EXPECT_TRUE(throws_with([&] { again.backward(); }, {"modified by an inplace operation", "[float64 [3]]"})) << what;
  }
}

// Item 10: DataParallel::to has the strong guarantee; an optimizer built over the parameters
// keeps working after it (Note [optimizer state follows the parameters]).
namespace {
struct CopyFails : nn::Module {
  nn::LinearT<double> fc;
  std::shared_ptr<std::atomic<bool>> fail = std::make_shared<std::atomic<bool>>(false);
  CopyFails() : fc(register_module("fc", nn::LinearT<double>(4, 2))) {}
  CopyFails(const CopyFails& o) : nn::Module(o), fc(o.fc), fail(o.fail) {
    if (*fail) throw std::runtime_error("this module cannot be copied now");
  }
  CopyFails(CopyFails&&) = default;
  Tensor<double> forward(const Tensor<double>& x) { return fc(x); }
};
}  // namespace

TEST(DataParallel, AToThatFailsLeavesTheDataParallelAsItWas) {
  set_cpu_device_count(std::max(cpu_device_count(), 4));
  manual_seed(31);
  CopyFails reference;
  DataParallel<CopyFails> dp(nn::clone(reference, Device::cpu(0)), cpus(3));
  auto x = randn<double>({6, 4});
  dp(x).sum().backward();  // a gradient that moves with the parameters
  const auto grad = dp.module().fc->weight.grad().clone();
  dp.module().fail->store(true);  // building the new replicas fails
  EXPECT_THROW(dp.to(Device::cpu(3)), std::runtime_error);
  dp.module().fail->store(false);
  EXPECT_EQ(dp.devices(), cpus(3));
  EXPECT_EQ(dp.output_device(), Device::cpu(0));
  for (auto& t : dp.module().named_tensors()) EXPECT_EQ(t.tensor.device(), Device::cpu(0)) << t.name;
  EXPECT_TRUE(all_close(dp.module().fc->weight.grad(), grad, 0));
  auto out = dp(x);
  EXPECT_TRUE(all_close(out, reference.forward(x), 1e-12, 1e-12));
  out.sum().backward();
  EXPECT_TRUE(all_close(dp.module().fc->weight.grad(), grad * 2.0, 1e-12, 1e-12));
  // And a later move succeeds.
  dp.to(Device::cpu(3));
  EXPECT_EQ(dp(x).device(), Device::cpu(3));
}

TEST(DataParallel, TheOptimizersStateFollowsTheParametersThroughTo) {
  set_cpu_device_count(std::max(cpu_device_count(), 4));
  manual_seed(32);
  Net<double> reference;
  DataParallel<Net<double>> dp(nn::clone(reference, Device::cpu(0)), cpus(3));
  optim::SGD opt(dp.parameters(), {.lr = 0.1, .momentum = 0.9});
  optim::SGD ref_opt(reference.parameters(), {.lr = 0.1, .momentum = 0.9});
  for (int step = 0; step < 4; ++step) {
    if (step == 2) dp.to(Device::cpu(3));
    auto x = randn<double>({7, 6});
    auto loss = dp(x.to(dp.devices()[0])).sum();
    opt.zero_grad();
    loss.backward();
    opt.step();
    auto ref_loss = reference.forward(x).sum();
    ref_opt.zero_grad();
    ref_loss.backward();
    ref_opt.step();
    EXPECT_NEAR(loss.item(), ref_loss.item(), 1e-10) << "step " << step;
  }
  for (const auto& s : opt.state()) EXPECT_EQ(s.at("momentum_buffer").device(), Device::cpu(3));
  EXPECT_TRUE(all_close(dp.module().fc1->weight.to(Device::cpu(0)), reference.fc1->weight, 1e-10, 1e-10));
}

// Item 12: a buffer that requires grad gets the gradients of every replica (PyTorch's
// test_data_parallel_buffers_requiring_grad), also when it starts requiring grad after the
// DataParallel was built (the buckets follow requires_grad, as a layer frozen or unfrozen).
namespace {
struct BufferNeedsGrad : nn::Module {
  Tensor<double> t_rg, t_not_rg;
  explicit BufferNeedsGrad(const Tensor<double>& t) {
    t_rg = register_buffer("t_rg", t);
    t_not_rg = register_buffer("t_not_rg", t.detach().clone());
  }
  Tensor<double> forward(const Tensor<double>& x) { return x * t_rg + t_not_rg; }
};
}  // namespace

TEST(DataParallel, ABufferThatRequiresGradGetsEveryReplicasGradient) {
  using TL = std::vector<Tensor<double>>;
  manual_seed(33);
  DataParallel<BufferNeedsGrad> dpm(BufferNeedsGrad(randn<double>({20}).requires_grad_()), cpus(3));
  EXPECT_TRUE(dpm.module().t_rg.requires_grad());
  auto inp = randn<double>({3, 20});
  EXPECT_TRUE(chorus::testing::gradcheck([&](const TL&) { return dpm(inp); }, {dpm.module().t_rg}));
  // Unfrozen after construction: the next step wires it.
  DataParallel<BufferNeedsGrad> later(BufferNeedsGrad(randn<double>({20})), cpus(3));
  later.module().t_not_rg.requires_grad_();
  later(inp).sum().backward();
  EXPECT_TRUE(all_close(later.module().t_not_rg.grad(), full<double>({20}, 3.0), 1e-12));
  // Frozen again: no gradient.
  later.module().t_not_rg.set_grad({});
  later.module().t_not_rg.requires_grad_(false);
  later.module().t_rg.requires_grad_();
  later(inp).sum().backward();
  EXPECT_FALSE(later.module().t_not_rg.grad().defined());
  EXPECT_TRUE(all_close(later.module().t_rg.grad(), inp.sum(0), 1e-12, 1e-12));
}

// Item 13 (Note [nested arguments]): tensors inside tuples, pairs, arrays, vectors, optionals and
// string-keyed maps are scattered (tests/test_data_parallel_seq.cpp); an argument whose tensors
// DataParallel cannot see into would reach every replica whole, and is refused at compile time
// (tests/compile_fail/dp_nested_argument.cpp shows the message).
static_assert(parallel::detail::is_replicable_argument_v<const Tensor<float>&>);
static_assert(parallel::detail::is_replicable_argument_v<double>);
static_assert(parallel::detail::is_replicable_argument_v<const std::string&>);
static_assert(parallel::detail::is_replicable_argument_v<std::vector<int>>);
static_assert(parallel::detail::is_replicable_argument_v<std::tuple<Tensor<float>, Tensor<float>>>);
static_assert(parallel::detail::is_replicable_argument_v<const std::pair<int, Tensor<double>>&>);
static_assert(parallel::detail::is_replicable_argument_v<std::vector<Tensor<float>>>);
static_assert(parallel::detail::is_replicable_argument_v<std::optional<Tensor<float>>>);
static_assert(parallel::detail::is_replicable_argument_v<std::map<std::string, Tensor<float>>>);
static_assert(parallel::detail::is_replicable_argument_v<std::array<Tensor<std::int64_t>, 2>>);
static_assert(parallel::detail::is_replicable_argument_v<std::tuple<int, std::vector<std::optional<Tensor<float>>>>>);
static_assert(!parallel::detail::is_replicable_argument_v<AnyTensor>);
static_assert(!parallel::detail::is_replicable_argument_v<const Tensor<float>*>);
static_assert(parallel::detail::is_replicable_argument_v<std::variant<int, Tensor<float>>>);
static_assert(parallel::detail::is_replicable_argument_v<std::map<std::string, std::variant<Tensor<float>, double>>>);
static_assert(!parallel::detail::is_replicable_argument_v<std::variant<int, AnyTensor>>);
static_assert(!parallel::detail::is_replicable_argument_v<std::map<int, Tensor<float>>>);
static_assert(!parallel::detail::is_replicable_argument_v<std::list<Tensor<float>>>);
static_assert(!parallel::detail::is_replicable_argument_v<std::vector<std::shared_ptr<Tensor<float>>>>);

// Item 14 (Note [replica errors]): a replica's exception keeps its type (nested in the
// chorus::Error that names the replica), the same on one device, on k, and inline.
namespace {
struct WonderfulError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct Wonderful : nn::Module {
  nn::Linear fc;
  Device fails_on;
  explicit Wonderful(Device d) : fc(register_module("fc", nn::Linear(3, 3))), fails_on(d) {}
  Tensor<float> forward(const Tensor<float>& x) {
    if (x.device() == fails_on) throw WonderfulError("wonderful");
    return fc(x);
  }
};

void expect_wonderful(const std::function<void()>& f, const std::string& where, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << what << ": did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(where + ": wonderful"), std::string::npos) << what << ": " << e.what();
    try {
      std::rethrow_if_nested(e);
      ADD_FAILURE() << what << ": nothing nested in '" << e.what() << "'";
    } catch (const WonderfulError& inner) {
      EXPECT_STREQ(inner.what(), "wonderful") << what;
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": not a chorus::Error: " << e.what();
  }
}
}  // namespace

TEST(DataParallel, AReplicasExceptionKeepsItsTypeOnOneAndManyDevices) {
  for (int k = 1; k <= 3; ++k) {
    const Device last = Device::cpu(k - 1);
    DataParallel<Wonderful> dp(Wonderful(last), cpus(k));
    const std::string where = "in replica " + std::to_string(k - 1) + " on " + last.str();
    expect_wonderful([&] { dp(randn<float>({6, 3})); }, where, std::to_string(k) + " device(s), threaded");
    dp.set_inline_work(std::int64_t{1} << 40);
    expect_wonderful([&] { dp(randn<float>({6, 3})); }, where, std::to_string(k) + " device(s), inline");
  }
  // In backward, too: the engine nests a node's exception in the error naming the node.
  struct ThrowsInBackward final : autograd::Node<float> {
    std::string name() const override { return "ThrowsInBackward"; }
    TensorList apply(TensorList&&) override { throw WonderfulError("wonderful"); }
  };
  auto x = ones<float>({2}).requires_grad_();
  auto y = x.detach().clone();
  autograd::set_history(y, std::shared_ptr<autograd::Node<float>>(autograd::make_node<ThrowsInBackward, float>({&x})));
  expect_wonderful([&] { y.sum().backward(); }, "in backward of ThrowsInBackward on cpu:0", "backward");
}

// PyTorch's model.module and the names of its nn.DataParallel state_dict.
TEST(DataParallel, TheModuleItsRegistryAndPyTorchsNames) {
  nn::LinearT<double> holder(4, 3);
  DataParallel<nn::LinearT<double>> dp(holder, cpus(2));
  // dp.module() is the module, whether M is a holder or a module type.
  EXPECT_EQ(&dp.module(), holder.get());
  EXPECT_EQ(dp.module().named_parameters().size(), 2u);
  EXPECT_EQ(dp.module().forward(ones<double>({1, 4})).shape(), (Shape{1, 3}));
  EXPECT_EQ(&dp.replica(0), holder.get());
  EXPECT_EQ(dp.replica(1).weight.device(), Device::cpu(1));
  DataParallel<Net<float>> net(Net<float>(), cpus(2));
  ASSERT_EQ(net.named_buffers().size(), 1u);
  EXPECT_EQ(net.named_buffers()[0].name, "scale");
  EXPECT_EQ(net.buffers().size(), 1u);
  EXPECT_EQ(net.module().named_buffers()[0].name, "scale");
  EXPECT_TRUE(net.is_training());
  // The prefix of PyTorch's nn.DataParallel names, for checkpoints that match one.
  net.set_name_prefix("module.");
  EXPECT_EQ(net.named_parameters()[0].name, "module.fc1.weight");
  EXPECT_EQ(net.named_buffers()[0].name, "module.scale");
  EXPECT_EQ(net.named_tensors().back().name, "module.scale");
  EXPECT_EQ(net.module().named_parameters()[0].name, "fc1.weight");  // the module keeps its own
  EXPECT_TRUE(throws_with([&] { net.set_name_prefix("module"); }, {"'module'", "ending in '.'"}));
  const auto dir = std::filesystem::temp_directory_path() / ("chorus_dp_names_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string file = (dir / "dp.safetensors").string();
  save(net, file);
  auto f = io::read(file);
  EXPECT_TRUE(f.tensors.count("module.fc1.weight"));
  EXPECT_TRUE(f.tensors.count("module.scale"));
  DataParallel<Net<float>> other(Net<float>(), cpus(2));
  other.set_name_prefix("module.");
  load(other, file);  // the prefix is stripped again
  EXPECT_TRUE(all_close(other.module().fc2->weight, net.module().fc2->weight, 0));
  Net<float> plain;
  load(plain, file, {.strip_prefix = "module."});
  EXPECT_TRUE(all_close(plain.fc1->bias, net.module().fc1->bias, 0));
  std::filesystem::remove_all(dir);
}

// A forward without arguments runs once, on the primary (PyTorch's
// test_data_parallel_module_zero_inputs); so does one whose arguments hold no tensor.
TEST(DataParallel, AForwardWithoutArgumentsRunsOnThePrimary) {
  struct NoInputs : nn::Module {
    Tensor<float> forward() { return ones<float>({2, 3}); }
    Tensor<float> forward(double v) { return full<float>({2}, static_cast<float>(v)); }
  };
  set_cpu_device_count(std::max(cpu_device_count(), 2));  // the output device cpu:1 (each test runs alone)
  for (int k : {1, 2}) {
    DataParallel<NoInputs> dp(NoInputs(), cpus(k), Device::cpu(1));
    auto out = dp();
    EXPECT_EQ(out.device(), Device::cpu(1));
    EXPECT_TRUE(all_close(out, ones<float>({2, 3}, Device::cpu(1)), 0));
    EXPECT_TRUE(all_close(dp(2.0), full<float>({2}, 2.0f, Device::cpu(1)), 0));
  }
}

// A sibling of item 9: the flat layout has room for each tensor's shape at construction; a
// tensor re-seated with another shape would be copied past its slot. Refused, naming it.
TEST(DataParallel, ATensorThatChangedShapeIsRefused) {
  DataParallel<Net<float>> dp(Net<float>(), cpus(2));
  {
    NoGradGuard g;
    auto bigger = zeros<float>({32, 6});
    auto& impl = *dp.module().fc1->weight.impl();
    impl.storage = bigger.impl()->storage;
    impl.shape = bigger.shape();
    impl.strides = bigger.strides();
  }
  EXPECT_TRUE(throws_with([&] { dp(randn<float>({4, 6})); },
                          {"parameter 'fc1.weight' has shape [32, 6] but had shape [16, 6]", "build a new DataParallel"}));
}

// Issue 20 item 2: losses computed on the replicas (forward_loss, the "DataParallelCriterion"
// PyTorch users write by hand) equal the loss of the gathered outputs, with the same gradients,
// threaded and inline (Note [inline small steps]), for a mean and a sum reduction and for an
// integer target (cross_entropy).
namespace {
struct Classifier : nn::Module {
  nn::LinearT<double> fc1, fc2;
  Classifier(int in, int hidden, int classes)
      : fc1(register_module("fc1", nn::LinearT<double>(in, hidden))),
        fc2(register_module("fc2", nn::LinearT<double>(hidden, classes))) {}
  Tensor<double> forward(const Tensor<double>& x) { return fc2(relu(fc1(x))); }
};
}  // namespace

TEST(DataParallel, ForwardLossEqualsTheLossOfTheGatheredOutputs) {
  const auto mse = [](const Tensor<double>& out, const Tensor<double>& y) { return nn::functional::mse_loss(out, y); };
  const auto mse_sum = [](const Tensor<double>& out, const Tensor<double>& y) {
    return nn::functional::mse_loss(out, y, Reduction::Sum);
  };
  const auto ce = [](const Tensor<double>& out, const Tensor<std::int64_t>& y) {
    return nn::functional::cross_entropy(out, y);
  };
  for (int k : {1, 2, 3, 8})
    for (std::int64_t inline_work : {std::int64_t{0}, std::int64_t{1} << 30}) {
      const std::string what = std::to_string(k) + " device(s), " + (inline_work ? "inline" : "threaded");
      manual_seed(31);
      Net<double> reference;
      DataParallel<Net<double>> dp(nn::clone(reference, Device::cpu(0)), cpus(k));
      dp.set_inline_work(inline_work);
      auto x = randn<double>({10, 6}), y = randn<double>({10, 3});  // 3 devices: 4, 4, 2 rows
      for (bool sum : {false, true}) {
        reference.zero_grad();
        auto want = nn::functional::mse_loss(reference.forward(x), y, sum ? Reduction::Sum : Reduction::Mean);
        want.backward();
        dp.zero_grad();
        auto got = sum ? dp.forward_loss(mse_sum, x, y, Reduction::Sum) : dp.forward_loss(mse, x, y);
        EXPECT_EQ(got.dim(), 0) << what;
        EXPECT_EQ(got.device(), Device::cpu(0)) << what;
        EXPECT_NEAR(got.item(), want.item(), 1e-12 * std::abs(want.item())) << what << (sum ? ", sum" : ", mean");
        got.backward();
        expect_grads_equal<double>(dp.module(), reference, 1e-12, what);
      }
      manual_seed(32);
      Classifier cref(6, 8, 5);
      DataParallel<Classifier> cdp(nn::clone(cref, Device::cpu(0)), cpus(k));
      cdp.set_inline_work(inline_work);
      auto labels = from_vector<std::int64_t>({0, 4, 2, 1, 3, 3, 0, 1, 2, 4});
      auto want = nn::functional::cross_entropy(cref.forward(x), labels);
      want.backward();
      auto got = cdp.forward_loss(ce, x, labels);
      EXPECT_NEAR(got.item(), want.item(), 1e-12 * std::abs(want.item())) << what << ", cross_entropy";
      got.backward();
      expect_grads_equal<double>(cdp.module(), cref, 1e-12, what + ", cross_entropy");
      // Ignored targets: each replica weighs by its targets that count, and one whose targets
      // are all ignored (rows 8 and 9: the last of 3 or 8 devices) weighs nothing, not NaN.
      for (std::int64_t ignore : {std::int64_t{-100}, std::int64_t{7}}) {
        const auto ce_ignoring = [ignore](const Tensor<double>& out, const Tensor<std::int64_t>& y) {
          return nn::functional::cross_entropy(out, y, Reduction::Mean, ignore);
        };
        const std::int64_t i = ignore;
        auto sparse = from_vector<std::int64_t>({0, i, 2, i, i, 3, 0, 1, i, i});
        cref.zero_grad();
        cdp.zero_grad();
        auto want_s = ce_ignoring(cref.forward(x), sparse);
        want_s.backward();
        auto got_s = ignore == -100 ? cdp.forward_loss(ce_ignoring, x, sparse)
                                    : cdp.forward_loss(ce_ignoring, x, sparse, {.ignore_index = ignore});
        EXPECT_TRUE(std::isfinite(got_s.item())) << what;
        EXPECT_NEAR(got_s.item(), want_s.item(), 1e-12 * std::abs(want_s.item())) << what << ", ignoring " << ignore;
        got_s.backward();
        expect_grads_equal<double>(cdp.module(), cref, 1e-12, what + ", ignoring " + std::to_string(ignore));
      }
    }
}

TEST(DataParallel, ForwardLossRefusesWhatCannotCombine) {
  DataParallel<Net<double>> dp(Net<double>(), cpus(2));
  auto x = randn<double>({4, 6}), y = randn<double>({4, 3});
  const auto per_element = [](const Tensor<double>& out, const Tensor<double>& t) {
    return nn::functional::mse_loss(out, t, Reduction::None);
  };
  EXPECT_TRUE(throws_with([&] { dp.forward_loss(per_element, x, y); }, {"must return one value", "replica 0", "[2, 3]"}));
  EXPECT_TRUE(throws_with([&] { dp.forward_loss(per_element, x, y, Reduction::None); }, {"Reduction::Mean", "not None"}));
  EXPECT_TRUE(throws_with([&] { dp.forward_loss(per_element, x, randn<double>({3, 3})); }, {"argument 1"}));
  DataParallel<Net<double>> one(Net<double>(), cpus(1));  // one device: the same check
  EXPECT_TRUE(throws_with([&] { one.forward_loss(per_element, x, y); }, {"must return one value", "[4, 3]"}));
}

// The point of losses on the replicas: with large outputs (logits over many classes), the
// gathered path makes the primary hold the whole batch's outputs, their softmax and their
// gradient besides its own chunk's; forward_loss keeps its peak within 1.2x of another device's.
TEST(DataParallel, ForwardLossKeepsThePrimarysPeakMemoryNearTheOthers) {
  const auto devices = cpus(2);
  manual_seed(33);
  DataParallel<Classifier> dp(Classifier(8, 16, 4096), devices);
  dp.set_inline_work(0);
  auto x = randn<double>({256, 8});
  std::vector<std::int64_t> ls;
  for (int i = 0; i < 256; ++i) ls.push_back(i * 37 % 4096);
  auto labels = from_vector(ls);
  const auto ce = [](const Tensor<double>& out, const Tensor<std::int64_t>& y) {
    return nn::functional::cross_entropy(out, y);
  };
  auto peaks = [&](auto&& step) {
    dp.zero_grad();
    for (auto d : devices) allocator_of(d).reset_peak();
    std::vector<std::int64_t> base;
    for (auto d : devices) base.push_back(memory_stats(d).allocated);
    step();
    std::vector<double> out;
    for (std::size_t r = 0; r < devices.size(); ++r)
      out.push_back(static_cast<double>(memory_stats(devices[r]).peak_allocated - base[r]));
    return out;
  };
  const auto gathered = peaks([&] { nn::functional::cross_entropy(dp(x), labels).backward(); });
  const auto replicas = peaks([&] { dp.forward_loss(ce, x, labels).backward(); });
  // The test can tell: the gathered path loads the primary (its outputs alone are 8 MB here).
  EXPECT_GT(gathered[0], 1.5 * gathered[1]) << gathered[0] << " vs " << gathered[1];
  EXPECT_LE(replicas[0], 1.2 * replicas[1]) << replicas[0] << " vs " << replicas[1];
  EXPECT_GT(replicas[1], 0.0);
}

// Note [BLAS threads shared by devices]: DataParallel over k CPU devices gives each its share
// of the cores for OpenBLAS's products (each device's thread computes at once), unless the
// program chose the count.
TEST(DataParallel, CpuDevicesShareTheCoresForBlas) {
  if (std::getenv("OPENBLAS_NUM_THREADS") || std::getenv("OMP_NUM_THREADS"))
    GTEST_SKIP() << "the environment chose OpenBLAS's thread count";
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const int before = backend::cpu::blas_threads();
  if (before == 1 && cores > 1) GTEST_SKIP() << "this OpenBLAS is single-threaded";
  DataParallel<Net<double>> one(Net<double>(), cpus(1));
  EXPECT_EQ(backend::cpu::blas_threads(), before) << "one device computes alone";
  DataParallel<Net<double>> three(Net<double>(), cpus(3));
  EXPECT_EQ(backend::cpu::blas_threads(), std::max(1, cores / 3));
  backend::cpu::set_blas_threads(2);
  DataParallel<Net<double>> again(Net<double>(), cpus(3));
  EXPECT_EQ(backend::cpu::blas_threads(), 2) << "the program's choice stands";
}

// An argument under kBroadcast reaches every replica whole, on its device (a mask [L, L]
// beside a batch [N, L]); a gradient it needs is the replicas' summed, as on one device.
namespace {
struct MaskedScore : nn::Module {
  nn::LinearT<double> fc;
  MaskedScore() : fc(register_module("fc", nn::LinearT<double>(4, 4))) {}
  Tensor<double> forward(const Tensor<double>& x, const Tensor<double>& mask) {
    EXPECT_EQ(mask.shape(), Shape({4, 4}));
    EXPECT_EQ(mask.device(), x.device());
    return matmul(fc(x), mask);
  }
};
}  // namespace

TEST(DataParallel, ABroadcastArgumentReachesEveryReplicaWhole) {
  manual_seed(3);
  MaskedScore init;
  auto x = randn<double>({6, 4});
  auto mask = randn<double>({4, 4}).requires_grad_();
  auto one = nn::clone(init, Device::cpu(0));
  auto expected = one.forward(x, mask);
  expected.sum().backward();
  const auto mask_grad = mask.grad().clone();
  mask.set_grad({});
  DataParallel<MaskedScore> dp(nn::clone(init, Device::cpu(0)), {.devices = cpus(3), .scatter_dims = {0, kBroadcast}});
  auto out = dp(x, mask);
  EXPECT_TRUE(all_close(out, expected, 1e-14, 1e-14));
  out.sum().backward();
  EXPECT_TRUE(all_close(mask.grad(), mask_grad, 1e-13, 1e-13));
  expect_grads_equal<double>(one, dp.module(), 1e-13, "broadcast mask");

  auto ce = [](const Tensor<double>& y, const Tensor<double>& t) { return nn::functional::mse_loss(y, t); };
  DataParallel<Net<double>> both(Net<double>(), {.devices = cpus(2), .scatter_dims = {0, kBroadcast}});
  EXPECT_TRUE(throws_with([&] { both.forward_loss(ce, randn<double>({4, 6}), randn<double>({4, 3})); },
                          {"forward_loss", "scatter_dims[1] is kBroadcast"}));
  EXPECT_TRUE(throws_with([] { DataParallel<Net<double>> bad(Net<double>(), {.gather_dims = {kBroadcast}}); },
                          {"gather_dims holds kBroadcast"}));
}
