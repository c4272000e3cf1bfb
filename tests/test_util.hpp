#pragma once
// Helpers shared by the tests: closeness checks and the float64 central-difference gradient check.
#include <gtest/gtest.h>

#include <chorus/chorus.hpp>
#include <cmath>
#include <limits>
#include <functional>
#include <vector>

namespace chorus::testing {

/// Floating types the numeric tests are typed over.
using FloatTypes = ::testing::Types<float, double>;

/// Relative tolerance per element type.
template <class T>
constexpr double tol() {
  return std::is_same_v<T, float> ? 1e-5 : 1e-12;
}

template <class T>
::testing::AssertionResult all_close(const Tensor<T>& actual, const Tensor<T>& expected, double rtol, double atol = 0) {
  if (actual.shape() != expected.shape())
    return ::testing::AssertionFailure() << "shapes differ: " << actual.shape() << " vs " << expected.shape();
  auto a = actual.to_vector(), e = expected.to_vector();
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double diff = std::abs(double(a[i]) - double(e[i]));
    if (a[i] != e[i] && !(diff <= atol + rtol * std::abs(double(e[i]))))  // equal infinities match; NaN never
      return ::testing::AssertionFailure() << "element " << i << ": " << a[i] << " vs " << e[i] << " (diff " << diff
                                           << ", rtol " << rtol << ", atol " << atol << ")";
  }
  return ::testing::AssertionSuccess();
}

template <class T>
::testing::AssertionResult values_are(const Tensor<T>& actual, const std::vector<T>& expected, double tol = 1e-6) {
  auto a = actual.to_vector();
  if (a.size() != expected.size())
    return ::testing::AssertionFailure() << a.size() << " elements, expected " << expected.size();
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i] != expected[i] &&  // equal infinities match; a NaN never does
        !(std::abs(double(a[i]) - double(expected[i])) <= tol * (1 + std::abs(double(expected[i])))))
      return ::testing::AssertionFailure() << "element " << i << ": " << a[i] << " vs " << expected[i];
  return ::testing::AssertionSuccess();
}

/// Checks the gradients autograd computes for `f` against float64 central differences.
/// `f` maps the inputs to a tensor of any shape; it is reduced with fixed random weights.
inline ::testing::AssertionResult gradcheck(const std::function<Tensor<double>(const std::vector<Tensor<double>>&)>& f,
                                            std::vector<Tensor<double>> inputs, double eps = 1e-6,
                                            double atol = 1e-6, double rtol = 1e-5) {
  for (auto& x : inputs) x.requires_grad_(true);
  Tensor<double> out = f(inputs);
  Generator gen(1234);
  auto w = randn<double>(out.shape(), out.device(), 0.0, 1.0, gen);
  auto loss = [&](const std::vector<Tensor<double>>& in) { return sum(mul(f(in), w)); };
  for (auto& x : inputs) x.set_grad({});
  loss(inputs).backward();
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    auto& x = inputs[k];
    auto analytic = x.grad().defined() ? x.grad().to_vector() : std::vector<double>(x.numel(), 0.0);
    auto host = x.to(Device::cpu(0)).detach();
    for (std::int64_t i = 0; i < x.numel(); ++i) {
      double numeric;
      {
        NoGradGuard g;
        const double orig = x.to_vector()[i];
        auto set = [&](double v) {
          auto vals = x.to_vector();
          vals[i] = v;
          x.detach().copy_(from_vector<double>(vals, x.shape(), x.device()));
        };
        set(orig + eps);
        const double lp = loss(inputs).item();
        set(orig - eps);
        const double lm = loss(inputs).item();
        set(orig);
        numeric = (lp - lm) / (2 * eps);
      }
      const double a = analytic[i];
      if (!(std::abs(a - numeric) <= atol + rtol * std::abs(numeric)))  // a NaN on either side fails
        return ::testing::AssertionFailure() << "input " << k << " element " << i << ": analytic " << a
                                             << " vs numeric " << numeric;
    }
  }
  return ::testing::AssertionSuccess();
}

/// Runs `f` and checks it throws chorus::Error whose message contains every one of `parts`.
template <class F>
::testing::AssertionResult throws_with(F&& f, std::initializer_list<const char*> parts) {
  try {
    f();
  } catch (const Error& e) {
    std::string msg = e.what();
    for (const char* p : parts)
      if (msg.find(p) == std::string::npos)
        return ::testing::AssertionFailure() << "message '" << msg << "' lacks '" << p << "'";
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-chorus exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

}  // namespace chorus::testing
