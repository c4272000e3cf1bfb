// PyTorch's own DataParallel tests (test/distributed/test_data_parallel.py), the cases that
// apply to chorus, ported to virtual CPU devices: cpu:0 and cpu:1 play cuda:0 and cuda:1.
// Cases ported elsewhere: buffers_requiring_grad and module_zero_inputs (test_data_parallel.cpp),
// nested_input, nested_output, the LSTM's state and functional data_parallel
// (test_data_parallel_seq.cpp). Not ported: sparse gradients, complex numbers, autocast, lazy
// modules, kwargs and gradient penalty (double backward), which chorus does not have yet.
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <mutex>
#include <stdexcept>

#include "test_util.hpp"

using namespace chorus;
using chorus::testing::all_close;
using chorus::testing::throws_with;
namespace F = chorus::nn::functional;

namespace {
std::vector<Device> cpus(std::initializer_list<int> ids) {
  int top = 0;
  for (int i : ids) top = std::max(top, i + 1);
  set_cpu_device_count(std::max(cpu_device_count(), top));
  std::vector<Device> d;
  for (int i : ids) d.push_back(Device::cpu(i));
  return d;
}

template <class T>
void expect_same_grads(const nn::Module& a, const nn::Module& b, double tol, const std::string& what) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size()) << what;
  for (std::size_t i = 0; i < pa.size(); ++i) {
    auto ga = pa[i].tensor.template as<T>().grad(), gb = pb[i].tensor.template as<T>().grad();
    ASSERT_TRUE(ga.defined() && gb.defined()) << what << " " << pa[i].name;
    EXPECT_TRUE(all_close(ga.to(Device::cpu(0)), gb.to(Device::cpu(0)), tol, tol)) << what << " " << pa[i].name;
  }
}
}  // namespace

// test_data_parallel_no_grad: the replicas run in the caller's grad mode.
TEST(PyTorchDataParallel, NoGrad) {
  struct Layer : nn::Module {
    std::shared_ptr<std::atomic<int>> grad_on = std::make_shared<std::atomic<int>>(0);
    std::shared_ptr<std::atomic<int>> calls = std::make_shared<std::atomic<int>>(0);
    Tensor<float> forward(const Tensor<float>& x) {
      *grad_on += autograd::is_grad_enabled();
      ++*calls;
      return x;
    }
  };
  DataParallel<Layer> dp(Layer(), cpus({0, 1}));
  auto i = randn<float>({20, 10});
  {
    NoGradGuard g;
    dp(i);
  }
  EXPECT_EQ(dp.module().grad_on->load(), 0);
  EXPECT_EQ(dp.module().calls->load(), 2);
  dp(i);
  EXPECT_EQ(dp.module().grad_on->load(), 2);
}

// test_data_parallel_rnn (with an MLP): a DataParallel built and called without grad trains
// exactly as the module alone afterwards.
TEST(PyTorchDataParallel, BuiltWithoutGradThenTrained) {
  struct Mlp : nn::Module {
    nn::LinearT<double> a, b;
    Mlp() : a(register_module("a", nn::LinearT<double>(30, 16))), b(register_module("b", nn::LinearT<double>(16, 8))) {}
    Tensor<double> forward(const Tensor<double>& x) { return b(chorus::tanh(a(x))); }
  };
  manual_seed(1);
  Mlp model;
  std::optional<DataParallel<Mlp>> model_dp;
  {
    NoGradGuard g;
    model_dp.emplace(nn::clone(model, Device::cpu(0)), cpus({0, 1}));
    (*model_dp)(randn<double>({2, 30}));  // does not crash with grad disabled
  }
  auto step = [](auto&& m, auto params) {
    optim::SGD opt(params, {.lr = 10});
    auto input = ones<double>({4, 30});
    auto output = m(input);
    auto loss = F::mse_loss(output, zeros_like(output));
    loss.backward();
    opt.step();
  };
  step([&](const Tensor<double>& x) { return model.forward(x); }, model.parameters());
  step(*model_dp, model_dp->parameters());
  auto p1 = model.parameters(), p2 = model_dp->parameters();
  for (std::size_t k = 0; k < p1.size(); ++k) EXPECT_TRUE(all_close(p1[k].as<double>(), p2[k].as<double>(), 1e-12, 1e-12));
}

// test_parallel_apply: one task per module and device, each output its module's.
TEST(PyTorchDataParallel, ParallelApply) {
  auto devs = cpus({0, 1});
  nn::Linear l1(10, 5), l2(10, 5);
  l2->to(devs[1]);
  auto i1 = randn<float>({2, 10}), i2 = randn<float>({2, 10}, devs[1]);
  auto expected1 = l1(i1), expected2 = l2(i2);
  std::vector<Stream*> streams{&current_stream(devs[0]), &get_stream(devs[1])};
  auto outputs = parallel::parallel_apply(streams, [&](std::size_t r) { return r == 0 ? l1(i1) : l2(i2); });
  ASSERT_EQ(outputs.size(), 2u);
  EXPECT_TRUE(all_close(outputs[0], expected1, 0));
  EXPECT_TRUE(all_close(outputs[1], expected2, 0));
  EXPECT_EQ(outputs[1].device(), devs[1]);
}

// test_parallel_apply_passes_exception: the replica's exception keeps its type, with the
// replica and device named (one device twice, as PyTorch's test does).
TEST(PyTorchDataParallel, ParallelApplyPassesTheException) {
  struct KeyError : std::out_of_range {
    using std::out_of_range::out_of_range;
  };
  std::vector<Stream*> streams{&current_stream(Device::cpu(0)), &get_stream(Device::cpu(0), 1)};
  for (std::size_t failing : {0u, 1u}) {
    try {
      parallel::parallel_apply(streams, [&](std::size_t r) -> int {
        if (r == failing) throw KeyError("wonderful");
        return 0;
      });
      ADD_FAILURE() << "did not throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("in replica " + std::to_string(failing) + " on cpu:0: wonderful"),
                std::string::npos)
          << e.what();
      EXPECT_THROW(std::rethrow_if_nested(e), KeyError);
    }
  }
}

// test_data_parallel_multiple_input: tensors and a float; device orders (0, 1), (1, 0), (0).
TEST(PyTorchDataParallel, MultipleInputs) {
  struct TestModule : nn::Module {
    Tensor<float> forward(const Tensor<float>& var1, const Tensor<float>& var2, float float1) {
      return (var1 * var2) * float1;
    }
  };
  manual_seed(2);
  auto var1 = randn<float>({5, 5}).requires_grad_(), var2 = randn<float>({5, 5}).requires_grad_();
  const float float1 = randn<float>({1}).item();
  TestModule m;
  auto expected = m.forward(var1, var2, float1);
  expected.sum().backward();
  auto gvar1_exp = var1.grad().clone(), gvar2_exp = var2.grad().clone();
  for (auto order : {cpus({0, 1}), cpus({1, 0}), cpus({0})}) {
    var1.set_grad({});
    var2.set_grad({});
    DataParallel<TestModule> dp(TestModule(), order);
    auto out = dp(var1, var2, float1);
    EXPECT_EQ(out.device(), order[0]);
    out.sum().backward();
    EXPECT_TRUE(all_close(out.to(Device::cpu(0)), expected, 1e-6, 1e-6));
    EXPECT_TRUE(all_close(var1.grad(), gvar1_exp, 1e-6, 1e-6));
    EXPECT_TRUE(all_close(var2.grad(), gvar2_exp, 1e-6, 1e-6));
  }
}

// test_data_parallel_small_back.
TEST(PyTorchDataParallel, SmallBack) {
  manual_seed(3);
  nn::Linear l(10, 5);
  auto i = randn<float>({20, 10});
  auto expected = l(i);
  DataParallel<nn::Linear> dp(l, cpus({0, 1}));
  EXPECT_TRUE(all_close(dp(i), expected, 1e-6, 1e-6));
}

// test_data_parallel_model_device: the module must live on devices[0], wholly.
TEST(PyTorchDataParallel, ModelDevice) {
  auto i = randn<float>({2, 2});
  auto test = [&](nn::Sequential s, const std::vector<Device>& device_ids, bool should_fail) {
    if (should_fail) {
      EXPECT_TRUE(throws_with([&] { DataParallel<nn::Sequential> dp(s, device_ids); dp(i); },
                              {"is on", "the primary device is", device_ids[0].str().c_str()}));
    } else {
      DataParallel<nn::Sequential> dp(s, device_ids);
      EXPECT_EQ(dp(i).shape(), (Shape{2, 2}));
    }
  };
  auto on = [](Device d) {
    nn::Linear l(2, 2);
    l->to(d);
    return l;
  };
  test(nn::Sequential(on(Device::cpu(1))), cpus({0, 1}), true);
  test(nn::Sequential(on(Device::cpu(0))), cpus({1, 0}), true);
  test(nn::Sequential(on(Device::cpu(0))), cpus({0, 1}), false);
  test(nn::Sequential(on(Device::cpu(1))), cpus({1, 0}), false);
  test(nn::Sequential(on(Device::cpu(0)), on(Device::cpu(1))), cpus({0, 1}), true);
  test(nn::Sequential(on(Device::cpu(0)), on(Device::cpu(1))), cpus({1, 0}), true);
  test(nn::Sequential(on(Device::cpu(0)), on(Device::cpu(0))), cpus({0, 1}), false);
  test(nn::Sequential(on(Device::cpu(0)), on(Device::cpu(0))), cpus({1, 0}), true);
  // DataParallel::to moves a module onto its primary device (dpm.to(dp_device)).
  DataParallel<nn::Sequential> moved(nn::Sequential(on(Device::cpu(0))), cpus({0, 1}));
  moved.to(Device::cpu(1));
  EXPECT_EQ(moved(i).device(), Device::cpu(1));
}

// test_data_parallel_model_no_refcycles: once a DataParallel (and its step's graph) is gone,
// every device's memory is back where it was: no ownership cycle keeps replicas alive.
TEST(PyTorchDataParallel, NoReferenceCycles) {
  auto devs = cpus({0, 1});
  std::vector<std::int64_t> before;
  for (auto d : devs) before.push_back(memory_stats(d).allocated);
  {
    struct Model : nn::Module {
      nn::Linear linear;
      Model() : linear(register_module("linear", nn::Linear(1, 1))) {}
      Tensor<float> forward(const Tensor<float>& x) { return linear(x); }
    };
    DataParallel<Model> model(Model(), devs);
    auto data = randn<float>({2, 1});
    model(data).sum().backward();
    model(data);  // a graph that is never run backward
  }
  for (std::size_t r = 0; r < devs.size(); ++r) EXPECT_EQ(memory_stats(devs[r]).allocated, before[r]) << devs[r];
}

// test_data_parallel (and _sparse, with a dense Embedding): device orders (0, 1) and (1, 0);
// the output on devices[0], equal outputs and gradients.
TEST(PyTorchDataParallel, DeviceOrdersGiveTheSameOutputAndGradients) {
  (void)cpus({0, 1});  // makes cpu:1 available before its first use: each test runs alone
  manual_seed(4);
  nn::Linear l(10, 5);
  l->to(Device::cpu(1));
  auto i = randn<float>({20, 10}, Device::cpu(1));
  auto expected_out = l(i);
  expected_out.sum().backward();
  nn::Linear expected = nn::clone(l, Device::cpu(1));
  for (auto p : expected->parameters()) p.set_grad(AnyTensor());
  auto eparams = l->parameters(), xparams = expected->parameters();
  for (std::size_t k = 0; k < eparams.size(); ++k) xparams[k].as<float>().set_grad(eparams[k].as<float>().grad().clone());
  for (auto order : {cpus({0, 1}), cpus({1, 0})}) {
    l->to(order[0]);
    l->zero_grad();
    DataParallel<nn::Linear> dp(l, order);
    auto out = dp(i);
    out.sum().backward();
    EXPECT_EQ(out.device(), order[0]);
    EXPECT_TRUE(all_close(out.to(Device::cpu(1)), expected_out, 1e-6, 1e-6));
    expect_same_grads<float>(*l, *expected, 1e-5, "order " + order[0].str());
  }
  // Embedding (PyTorch's test uses a sparse one).
  nn::Embedding e(10, 5);
  auto idx = randint(0, 10, {20, 5});
  auto eout = e(idx);
  eout.sum().backward();
  auto egrad = e->weight.grad().clone();
  e->zero_grad();
  DataParallel<nn::Embedding> edp(e, cpus({0, 1}));
  auto out = edp(idx);
  out.sum().backward();
  EXPECT_TRUE(all_close(out, eout, 0));
  EXPECT_TRUE(all_close(e->weight.grad(), egrad, 1e-6, 1e-6));
}

// test_data_parallel_device_args: output_device, devices as Device values, inputs that need grad.
TEST(PyTorchDataParallel, DeviceArgs) {
  manual_seed(5);
  nn::Linear l(10, 5);
  auto i = randn<float>({20, 10}).requires_grad_();
  DataParallel<nn::Linear> dp(l, cpus({0, 1}), Device::cpu(0));
  EXPECT_TRUE(all_close(dp(i), l(i), 1e-6, 1e-6));
  DataParallel<nn::Linear> on_one(l, {Device::cpu(0), Device::cpu(1)}, Device::cpu(1));
  auto out = on_one(i);
  EXPECT_EQ(out.device(), Device::cpu(1));
  out.sum().backward();
  EXPECT_TRUE(i.grad().defined());
}

// test_gather_cpu: parts on two devices joined on one, scalars stacked; backward splits.
TEST(PyTorchDataParallel, Gather) {
  auto devs = cpus({0, 1});
  for (Device target : {Device::cpu(0), Device::cpu(1)}) {
    auto a = randn<double>({2, 4}, devs[0]).requires_grad_(), b = randn<double>({2, 4}, devs[1]).requires_grad_();
    auto result = parallel::gather<double>({a, b}, 0, target);
    EXPECT_EQ(result.shape(), (Shape{4, 4}));
    EXPECT_EQ(result.device(), target);
    EXPECT_TRUE(all_close(result.narrow(0, 0, 2).to(devs[0]), a, 0));
    EXPECT_TRUE(all_close(result.narrow(0, 2, 2).to(devs[0]), b.to(devs[0]), 0));
    auto grad = randn<double>({4, 4}, target);
    result.backward(grad);
    EXPECT_TRUE(all_close(a.grad(), grad.narrow(0, 0, 2).to(devs[0]), 0));
    EXPECT_TRUE(all_close(b.grad().to(devs[0]), grad.narrow(0, 2, 2).to(devs[0]), 0));
    auto s0 = randn<double>({}, devs[0]).requires_grad_(), s1 = randn<double>({}, devs[1]).requires_grad_();
    auto stacked = parallel::gather<double>({s0, s1}, 0, target);
    EXPECT_EQ(stacked.shape(), (Shape{2}));
    stacked.backward(from_vector<double>({3, 4}, {2}, target));
    EXPECT_EQ(s0.grad().item(), 3.0);
    EXPECT_EQ(s1.grad().item(), 4.0);
  }
}

// test_replicate and test_replicate_buffers: each replica lives on its device (buffers too,
// num_batches_tracked included) and computes what the module does.
TEST(PyTorchDataParallel, ReplicasAndTheirBuffers) {
  manual_seed(6);
  nn::Linear module(10, 5);
  auto input = randn<float>({2, 10});
  auto expected = module(input);
  DataParallel<nn::Linear> dp(module, cpus({0, 1}));
  for (std::size_t r = 0; r < 2; ++r) {
    const auto d = Device::cpu(static_cast<int>(r));
    for (auto& p : dp.replica(r).parameters()) EXPECT_EQ(p.device(), d);
    EXPECT_TRUE(all_close(dp.replica(r).forward(input.to(d)).to(Device::cpu(0)), expected, 1e-6, 1e-6));
  }
  struct WithBn : nn::Module {
    nn::BatchNorm2d bn;
    WithBn() : bn(register_module("bn", nn::BatchNorm2d(10))) {}
    Tensor<float> forward(const Tensor<float>& x) { return bn(x); }
  };
  DataParallel<WithBn> net(WithBn(), cpus({0, 1}));
  for (std::size_t r = 0; r < 2; ++r) {
    const auto d = Device::cpu(static_cast<int>(r));
    EXPECT_EQ(net.replica(r).bn->running_mean.device(), d);
    EXPECT_EQ(net.replica(r).bn->running_var.device(), d);
    EXPECT_EQ(net.replica(r).bn->num_batches_tracked.device(), d);
  }
}

// test_save_replica_module: a replica saves like any module.
TEST(PyTorchDataParallel, SaveAReplica) {
  manual_seed(7);
  DataParallel<nn::Linear> dp(nn::Linear(8, 8), cpus({0, 1}));
  const auto dir = std::filesystem::temp_directory_path() / ("chorus_replica_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string file = (dir / "replica.safetensors").string();
  save(dp.replica(1), file);
  nn::Linear plain(8, 8);
  load(plain, file);
  EXPECT_TRUE(all_close(plain->weight, dp.module().weight, 0));
  std::filesystem::remove_all(dir);
}

// test_parameter_list_dict_replica: parameters registered directly on the module; in every
// replica but the primary they are outputs of the step's broadcast (grad_fn set, requiring grad).
// chorus's replica 0 is the primary module itself, whose parameters are leaves.
TEST(PyTorchDataParallel, DirectlyRegisteredParametersInTheReplicas) {
  struct MyMod : nn::Module {
    Tensor<float> p1, p2;
    std::shared_ptr<std::mutex> m = std::make_shared<std::mutex>();
    std::shared_ptr<std::vector<std::string>> problems = std::make_shared<std::vector<std::string>>();
    MyMod() {
      p1 = register_parameter("0", rand<float>({10}));
      p2 = register_parameter("1", rand<float>({10}));
    }
    Tensor<float> forward(const Tensor<float>& inp) {
      const bool primary = inp.device() == Device::cpu(0);
      std::lock_guard lk(*m);
      for (const auto* p : {&p1, &p2}) {
        if (!p->requires_grad()) problems->push_back(inp.device().str() + ": does not require grad");
        if (primary != (p->grad_fn() == nullptr)) problems->push_back(inp.device().str() + ": grad_fn");
      }
      return inp;
    }
  };
  DataParallel<MyMod> model(MyMod(), cpus({0, 1}));
  model(randn<float>({8, 8}));
  EXPECT_TRUE(model.module().problems->empty()) << model.module().problems->front();
  EXPECT_TRUE(all_close(model.replica(1).p1.to(Device::cpu(0)), model.module().p1, 0));
}

// test_strided_grad_layout (contiguous layouts, float): two iterations of a convolutional net,
// the first creating the gradients and the second after zero_grad, equal the single module.
TEST(PyTorchDataParallel, ConvNetTwoIterations) {
  struct ConvNet : nn::Module {
    nn::Conv2d conv0, conv1, conv2, conv3;
    ConvNet()
        : conv0(register_module("conv0", nn::Conv2d(8, 16, 2))),
          conv1(register_module("conv1", nn::Conv2d(16, 32, 2))),
          conv2(register_module("conv2", nn::Conv2d(32, 16, 2))),
          conv3(register_module("conv3", nn::Conv2d(16, 8, 2))) {}
    Tensor<float> forward(const Tensor<float>& x) { return conv3(conv2(conv1(conv0(x)))); }
  };
  manual_seed(8);
  ConvNet m;
  auto devs = cpus({0, 1, 2});
  DataParallel<ConvNet> m_dp(nn::clone(m, Device::cpu(0)), devs);
  optim::SGD opt(m.parameters(), {.lr = 0.1}), opt_dp(m_dp.parameters(), {.lr = 0.1});
  auto input = randn<float>({static_cast<std::int64_t>(devs.size()) * 2, 8, 8, 8});
  auto target = randn<float>({static_cast<std::int64_t>(devs.size()) * 2, 8, 4, 4});
  for (int it = 0; it < 2; ++it) {
    F::mse_loss(m.forward(input), target).backward();
    F::mse_loss(m_dp(input), target).backward();
    expect_same_grads<float>(m, m_dp.module(), 1e-4, "iter " + std::to_string(it));
    for (const auto& p : m_dp.module().named_parameters())
      EXPECT_TRUE(p.tensor.as<float>().grad().is_contiguous()) << p.name;
    opt.step();
    opt_dp.step();
    opt.zero_grad();
    opt_dp.zero_grad();
  }
}
