#pragma once
// Helpers of the distributed tests (test_distributed.cpp, test_distributed_lowp.cpp: one binary
// run under mpirun -np 1 … 4).
#include <chorus/amp.hpp>
#include <chorus/distributed.hpp>
#include <gtest/gtest.h>

#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace dist_test {
using namespace chorus;

inline dist::ProcessGroup& pg() { return dist::group(); }

template <class T>
struct Mlp : nn::Module {
  nn::LinearT<T> fc1, fc2, fc3;
  Mlp(int in, int hidden, int out)
      : fc1(register_module("fc1", nn::LinearT<T>(in, hidden))),
        fc2(register_module("fc2", nn::LinearT<T>(hidden, hidden))),
        fc3(register_module("fc3", nn::LinearT<T>(hidden, out))) {}
  Tensor<T> forward(const Tensor<T>& x) { return fc3(relu(fc2(relu(fc1(x))))); }
};

/// An Mlp with a layer forward never uses.
template <class T>
struct WithUnused : nn::Module {
  nn::LinearT<T> fc1, unused, fc2;
  WithUnused()
      : fc1(register_module("fc1", nn::LinearT<T>(4, 8))),
        unused(register_module("unused", nn::LinearT<T>(8, 8))),
        fc2(register_module("fc2", nn::LinearT<T>(8, 2))) {}
  Tensor<T> forward(const Tensor<T>& x) { return fc2(relu(fc1(x))); }
};

template <class T>
std::vector<std::vector<T>> values(const std::vector<AnyTensor>& ts) {
  std::vector<std::vector<T>> out;
  for (const auto& t : ts) out.push_back(t.as<T>().to_vector());
  return out;
}

/// Every rank's copy of `v`, gathered (as raw bits, for bitwise comparison).
template <class T>
std::vector<std::vector<T>> gather_all(const std::vector<T>& v) {
  auto t = from_vector(v);
  auto all = pg().all_gather(t);
  auto flat = all.to_vector();
  std::vector<std::vector<T>> out(static_cast<std::size_t>(pg().world_size()));
  for (std::size_t r = 0; r < out.size(); ++r) out[r].assign(flat.begin() + r * v.size(), flat.begin() + (r + 1) * v.size());
  return out;
}

template <class T>
std::vector<T> concat(const std::vector<std::vector<T>>& parts) {
  std::vector<T> out;
  for (auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

/// Rank q's batch at step s of the uneven-input tests (every rank can make every rank's).
inline std::pair<Tensor<double>, Tensor<double>> batch_of(int q, int s) {
  manual_seed(static_cast<std::uint64_t>(1000 + 10 * q + s));
  auto x = randn<double>({6, 5});
  auto y = randn<double>({6, 3});
  return {x, y};
}

/// Trains `ddp` inside join() on this rank's 2 + rank batches (Note [DDP join]); with `shadow`, a
/// rank out of data takes opt's step with the others.
template <class Ddp>
void train_uneven(Ddp& ddp, optim::Optimizer& opt, bool shadow) {
  const int r = dist::group().rank();
  auto loop = [&] {
    for (int s = 0; s < 2 + r; ++s) {
      auto [x, y] = batch_of(r, s);
      opt.zero_grad();
      nn::functional::mse_loss(ddp(x), y).backward();
      opt.step();
    }
  };
  if (shadow) ddp.join(loop, [&] { opt.step(); });
  else ddp.join(loop);
}

/// Success when `f` throws a chorus::Error whose message holds every one of `parts`.
template <class F>
::testing::AssertionResult throws_with(F&& f, std::initializer_list<const char*> parts) {
  try {
    f();
  } catch (const Error& e) {
    const std::string m = e.what();
    for (const char* p : parts)
      if (m.find(p) == std::string::npos) return ::testing::AssertionFailure() << "message lacks '" << p << "': " << m;
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "no chorus::Error thrown";
}

}  // namespace dist_test
