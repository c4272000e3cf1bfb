// The autograd engine: accumulation, graph release, grad mode, multi-device execution.
#include <atomic>
#include <chrono>
#include <set>
#include <thread>

#include "test_util.hpp"

using namespace chorus;
using chorus::testing::throws_with;
using chorus::testing::values_are;

TEST(Autograd, LeafGradientsAccumulateAcrossBackwards) {
  auto x = from_vector<double>({1, 2, 3}).requires_grad_();
  (x * x).sum().backward();
  EXPECT_TRUE(values_are(x.grad(), {2, 4, 6}));
  (x * 3.0).sum().backward();
  EXPECT_TRUE(values_are(x.grad(), {5, 7, 9}));
  x.set_grad({});
  x.sum().backward();
  EXPECT_TRUE(values_are(x.grad(), {1, 1, 1}));
}

TEST(Autograd, DiamondSumsBothPaths) {
  auto x = from_vector<double>({2}).requires_grad_();
  auto y = x * 3.0;
  auto z = y * y + y;  // dz/dx = (2y + 1) * 3 = 39
  z.sum().backward();
  EXPECT_TRUE(values_are(x.grad(), {39}));
}

TEST(Autograd, ExplicitGradientAndNonScalarError) {
  auto x = from_vector<double>({1, 2}).requires_grad_();
  auto y = x * 2.0;
  EXPECT_TRUE(throws_with([&] { y.backward(); }, {"one-element", "[2]"}));
  y.backward(from_vector<double>({1, 10}));
  EXPECT_TRUE(values_are(x.grad(), {2, 20}));
  auto z = x * 2.0;
  EXPECT_TRUE(throws_with([&] { z.backward(from_vector<double>({1, 2, 3})); }, {"[3]", "[2]"}));
}

TEST(Autograd, SecondBackwardNeedsRetainGraph) {
  auto x = from_vector<double>({1, 2}).requires_grad_();
  auto y = (x * x).sum();
  y.backward(Tensor<double>(), /*retain_graph=*/true);
  y.backward();
  EXPECT_TRUE(values_are(x.grad(), {4, 8}));
  EXPECT_TRUE(throws_with([&] { y.backward(); }, {"a second time", "retain_graph"}));
}

TEST(Autograd, NoGradDetachAndLeaves) {
  auto x = ones<double>({2}).requires_grad_();
  {
    NoGradGuard g;
    auto y = x * 2.0;
    EXPECT_FALSE(y.requires_grad());
    EXPECT_TRUE(throws_with([&] { y.sum().backward(); }, {"does not require grad"}));
  }
  auto y = x * 2.0;
  EXPECT_TRUE(y.requires_grad());
  EXPECT_FALSE(y.is_leaf());
  EXPECT_TRUE(x.is_leaf());
  auto d = y.detach();
  EXPECT_FALSE(d.requires_grad());
  EXPECT_TRUE(d.same_storage(y));
  EXPECT_TRUE(throws_with([&] { y.requires_grad_(false); }, {"non-leaf"}));
  EXPECT_TRUE(throws_with([] { zeros<std::int64_t>({2}).requires_grad_(); }, {"floating-point"}));
  // Only inputs that require grad get gradients.
  auto c = ones<double>({2});
  (x * c).sum().backward();
  EXPECT_FALSE(c.grad().defined());
  EXPECT_TRUE(values_are(x.grad(), {1, 1}));
}

TEST(Autograd, GradIsStolenOnlyWhenExclusive) {
  auto x = ones<double>({3}).requires_grad_();
  auto big = zeros<double>({6});
  // The gradient of a narrow() view must not alias another tensor's storage.
  x.sum().backward();
  auto g = x.grad();
  (x * 2.0).sum().backward();
  EXPECT_TRUE(values_are(g, {3, 3, 3}));  // accumulated in place into the existing grad
  auto w = ones<double>({2, 3}).requires_grad_();
  w.t().sum().backward();  // non-contiguous incoming gradient
  EXPECT_TRUE(w.grad().is_contiguous());
  (void)big;
}

namespace {
// A node that records which thread ran its backward.
template <class T>
class ProbeBackward final : public autograd::Node<T> {
 public:
  explicit ProbeBackward(std::set<Stream*>* seen, std::mutex* m) : seen_(seen), m_(m) {}
  std::string name() const override { return "ProbeBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    std::lock_guard<std::mutex> lk(*m_);
    seen_->insert(::chorus::detail::worker_stream_of_thread());
    return {g[0]};
  }

 private:
  std::set<Stream*>* seen_;
  std::mutex* m_;
};

template <class T>
Tensor<T> probe(const Tensor<T>& x, std::set<Stream*>* seen, std::mutex* m) {
  auto out = x.detach().clone();
  auto node = autograd::make_node<ProbeBackward<T>, T>({&x}, seen, m);
  autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  return out;
}

template <class T>
class FailingBackward final : public autograd::Node<T> {
 public:
  std::string name() const override { return "FailingBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&&) override {
    CHORUS_FAIL("boom");
  }
};
}  // namespace

TEST(Autograd, NodesRunOnTheStreamsTheirForwardRanOn) {
  set_cpu_device_count(4);
  std::set<Stream*> seen;
  std::mutex m;
  auto w = ones<double>({8, 3}).requires_grad_();
  std::vector<Tensor<double>> outs(4);
  // Forward of chunk i on device i's stream (as parallel_apply does).
  std::vector<Future<Tensor<double>>> futs;
  for (int i = 1; i < 4; ++i) {
    futs.push_back(get_stream(Device::cpu(i)).async([&, i] {
      auto xi = w.narrow(0, 2 * i, 2).to(Device::cpu(i));
      return probe(xi * 2.0, &seen, &m).to(Device::cpu(0));
    }));
  }
  outs[0] = probe(w.narrow(0, 0, 2) * 2.0, &seen, &m);
  for (int i = 1; i < 4; ++i) outs[i] = futs[i - 1].get();
  cat(outs, 0).sum().backward();
  EXPECT_TRUE(values_are(w.grad(), std::vector<double>(24, 2.0)));
  std::set<Stream*> expected = {nullptr};  // the calling thread ran device 0's nodes inline
  for (int i = 1; i < 4; ++i) expected.insert(&get_stream(Device::cpu(i)));
  EXPECT_EQ(seen, expected);
}

namespace {
// A pass-through node that sleeps `ms` before handing its gradient on.
template <class T>
class SleepBackward final : public autograd::Node<T> {
 public:
  explicit SleepBackward(int ms) : ms_(ms) {}
  std::string name() const override { return "SleepBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms_));
    return {g[0]};
  }

 private:
  int ms_;
};

template <class T>
Tensor<T> sleepy(const Tensor<T>& x, int ms) {
  auto out = x.detach().clone();
  autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(autograd::make_node<SleepBackward<T>, T>({&x}, ms)));
  return out;
}

// x's gradient from three uses, one of them on device 1's worker, which (with `remote_ms`) or
// the calling thread (`local_ms`) is delayed: 1e16 - 1e16 + 1 gives 1 or 0 by the order of
// the additions.
double gradient_with_delays(int local_ms, int remote_ms) {
  auto x = ones<double>({1}).requires_grad_();
  auto far = get_stream(Device::cpu(1)).async([&] {
    auto xi = x.to(Device::cpu(1));
    return sleepy(xi * 1.0, remote_ms).to(Device::cpu(0));
  }).get();
  auto near = sleepy(x * 1e16, local_ms);
  (near.sum() + (x * -1e16).sum() + far.sum()).backward();
  return x.grad().item();
}
}  // namespace

// Gradients that meet at one input are added in an order fixed by the graph, not by which
// thread delivered first: the same graph gives the same bits however the devices' work is
// timed (DataParallel over CPU devices is reproducible run to run).
TEST(Autograd, GradientsMeetingAtAnInputAreAddedInAFixedOrder) {
  set_cpu_device_count(std::max(cpu_device_count(), 2));
  const double remote_late = gradient_with_delays(0, 150);
  const double local_late = gradient_with_delays(150, 0);
  EXPECT_EQ(remote_late, local_late);
  EXPECT_EQ(gradient_with_delays(0, 0), remote_late);
}

TEST(Autograd, ErrorInABackwardNodeNamesNodeAndDevice) {
  set_cpu_device_count(2);
  auto x = ones<double>({2}).requires_grad_();
  auto y = get_stream(Device::cpu(1)).async([&] {
    auto xi = x.to(Device::cpu(1));
    auto out = xi * 1.0;
    auto node = autograd::make_node<FailingBackward<double>, double>({&xi});
    autograd::set_history(out, std::shared_ptr<autograd::Node<double>>(node));
    return out.to(Device::cpu(0));
  }).get();
  EXPECT_TRUE(throws_with([&] { (y + x).sum().backward(); }, {"FailingBackward", "cpu:1", "boom"}));
  // The engine and the worker are usable afterwards.
  (x * 2.0).sum().backward();
  EXPECT_TRUE(x.grad().defined());
}

// Issue 16, item 11: moving a module whose parameters have a live gradient accumulator (a graph
// built before the move still holds it) gives them a new one on the new device, as PyTorch
// resets it; the old one would refuse gradients from the new device.
TEST(Autograd, ModuleToGivesMovedParametersANewGradientAccumulator) {
  set_cpu_device_count(std::max(cpu_device_count(), 2));
  nn::LinearT<double> fc(3, 2);
  auto x = from_vector<double>({1, 2, 3, 4, 5, 6}, {2, 3});
  auto first = fc(x).sum();
  first.backward();  // `first` keeps its graph, and with it the accumulators, alive
  fc->to(Device::cpu(1));
  auto second = fc(x.to(Device::cpu(1))).sum();
  EXPECT_NO_THROW(second.backward());
  EXPECT_EQ(fc->weight.grad().device(), Device::cpu(1));
  EXPECT_TRUE(values_are(fc->weight.grad(), {10, 14, 18, 10, 14, 18}));  // both backwards: 2 x column sums
  EXPECT_TRUE(values_are(fc->bias.grad(), {4, 4}));
}

namespace {
// A node whose gradient is a host alias of memory the test still holds.
template <class T>
class AliasGradBackward final : public autograd::Node<T> {
 public:
  explicit AliasGradBackward(Tensor<T> owner) : owner_(std::move(owner)) {}
  std::string name() const override { return "AliasGradBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&&) override {
    return {parallel::detail::host_alias(owner_, Device::cpu(0))};
  }

 private:
  Tensor<T> owner_;
};
}  // namespace

// Code health (issue 16): exclusively_owned understands host aliases and slices: a storage over
// another's memory is unshared only if that owner is held by nobody else. A gradient that
// aliases memory someone else holds is copied, never stolen and then accumulated into.
TEST(Autograd, AnAliasIsExclusiveOnlyWhenItsOwnerIsHeldByNobodyElse) {
  set_cpu_device_count(std::max(cpu_device_count(), 2));
  auto owner = full<double>({3}, 1.0, Device::cpu(1));
  EXPECT_FALSE(autograd::detail::exclusively_owned(parallel::detail::host_alias(owner, Device::cpu(0))));
  EXPECT_TRUE(autograd::detail::exclusively_owned(
      parallel::detail::host_view(full<double>({3}, 1.0, Device::cpu(1)), Device::cpu(0))));
  auto block = make_storage(Device::cpu(0), 64);
  Tensor<double> slice(std::make_shared<TensorImpl<double>>());
  slice.impl()->storage = make_slice_storage(block, 0, 24);
  slice.impl()->shape = Shape{3};
  slice.impl()->strides = contiguous_strides(Shape{3});
  EXPECT_FALSE(autograd::detail::exclusively_owned(slice));
  block.reset();
  EXPECT_TRUE(autograd::detail::exclusively_owned(slice));

  auto x = zeros<double>({3}).requires_grad_();
  auto y = x.detach().clone();
  autograd::set_history(
      y, std::shared_ptr<autograd::Node<double>>(autograd::make_node<AliasGradBackward<double>, double>({&x}, owner)));
  y.sum().backward(Tensor<double>(), /*retain_graph=*/true);
  EXPECT_NE(x.grad().data(), owner.data());
  y.sum().backward();  // accumulates into x's gradient, never into `owner`
  EXPECT_TRUE(values_are(x.grad(), {2, 2, 2}));
  EXPECT_TRUE(values_are(owner, {1, 1, 1}));
}
