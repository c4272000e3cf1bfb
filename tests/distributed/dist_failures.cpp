// Failure scenarios of the distributed layer, one per mode, each run by CTest under mpirun:
//
//   dist_failures watchdog  the last rank stops participating; the others' all_reduce must end
//                           in a chorus::Error naming it within the timeout (CHORUS_DIST_TIMEOUT_S)
//   dist_failures kill      the last rank SIGKILLs itself during DDP training; the job must end
//   dist_failures throw     the last rank throws inside backward; the job must end (well before
//                           the watchdog's timeout)
//   dist_failures shutdown  the last rank never reaches the exit barrier; the others'
//                           dist::shutdown() must throw a chorus::Error saying so within the timeout
//   dist_failures between   the last rank throws between two DDP steps (as a data loader would),
//                           and main returns; the others' next collective must fail at once,
//                           naming the rank that left (Note [leaving notice]), though the
//                           timeout is long
//
// The expectations on the job as a whole (a non-zero exit status, in time) are checked by
// expect_job_failure.sh; this program prints "watchdog ok" / "shutdown ok" / "between ok" where
// a rank saw what it should.
#include <chorus/distributed.hpp>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <string>
#include <thread>

using namespace chorus;

namespace {
struct Net : nn::Module {
  nn::LinearT<double> fc1, fc2, fc3;
  int fail_rank = -1, fail_step = -1, step = 0;
  Net()
      : fc1(register_module("fc1", nn::LinearT<double>(8, 32))),
        fc2(register_module("fc2", nn::LinearT<double>(32, 32))),
        fc3(register_module("fc3", nn::LinearT<double>(32, 1))) {}
  Tensor<double> forward(const Tensor<double>& x);
};

/// Identity in forward; throws in backward (after the later layers' gradients are ready).
struct Boom final : autograd::Node<double> {
  std::string name() const override { return "Boom"; }
  TensorList apply(TensorList&&) override { throw std::runtime_error("boom: a failure inside backward"); }
};

Tensor<double> Net::forward(const Tensor<double>& x) {
  auto h = relu(fc1(x));
  if (dist::rank() == fail_rank && step == fail_step) {
    auto node = autograd::make_node<Boom, double>({&h});
    auto passed = h.detach();
    autograd::set_history(passed, std::shared_ptr<autograd::Node<double>>(node));
    h = passed;
  }
  ++step;
  return fc3(relu(fc2(h)));
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

int train(int fail_rank, bool kill) {
  const int last = dist::world_size() - 1;
  Net net;
  net.fail_rank = kill ? -1 : fail_rank;
  net.fail_step = 3;
  // Small buckets: some are in flight when the failure happens.
  DistributedDataParallel<Net> ddp(std::move(net), {.bucket_cap_bytes = 4096, .first_bucket_bytes = 512});
  optim::SGD opt(ddp.parameters(), {.lr = 0.01});
  auto x = randn<double>({16, 8});
  for (int step = 0; step < 1000; ++step) {
    if (kill && step == 3 && dist::rank() == last) {
      std::printf("rank %d: SIGKILL\n", dist::rank());
      std::fflush(stdout);
      std::raise(SIGKILL);
    }
    auto loss = sum(ddp(x));
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
  return 0;  // not reached by a correct implementation: the job ends before
}

/// The last rank leaves between steps; the others must fail at their next collective, promptly.
int between() {
  const int rank = dist::rank(), last = dist::world_size() - 1;
  Net net;
  DistributedDataParallel<Net> ddp(std::move(net));
  optim::SGD opt(ddp.parameters(), {.lr = 0.01});
  auto x = randn<double>({16, 8});
  std::chrono::steady_clock::time_point start;
  try {
    for (int step = 0; step < 1000; ++step) {
      if (step == 3 && rank == last) throw std::runtime_error("the data loader failed between steps");
      if (step == 3) start = std::chrono::steady_clock::now();
      auto loss = sum(ddp(x));
      opt.zero_grad();
      loss.backward();
      opt.step();
    }
  } catch (const Error& e) {  // the others: the collective the last rank never joins
    const double s = seconds_since(start), limit = std::chrono::duration<double>(dist::group().timeout()).count();
    const std::string msg = e.what();
    std::printf("rank %d: after %.1f s: %s\n", rank, s, msg.c_str());
    const bool named = msg.find("rank " + std::to_string(last) + " left the process group") != std::string::npos;
    if (named && s < 10 && s < limit / 4) std::printf("between ok\n");
    std::fflush(stdout);
    return 4;
  } catch (const std::exception& e) {  // the last rank: caught, and main returns (destructors run)
    std::printf("rank %d: %s; leaving\n", rank, e.what());
    std::fflush(stdout);
    return 3;
  }
  return 0;
}
}  // namespace

int main(int argc, char** argv) try {
  const std::string mode = argc > 1 ? argv[1] : "";
  dist::init();
  const int rank = dist::rank(), last = dist::world_size() - 1;
  if (dist::world_size() < 2) {
    std::printf("dist_failures needs at least 2 ranks\n");
    return 2;
  }
  if (mode == "watchdog") {
    auto t = full<double>({16}, 1.0);
    if (rank == last) {  // stops participating (but stays alive)
      std::this_thread::sleep_for(std::chrono::seconds(60));
      return 0;
    }
    const auto start = std::chrono::steady_clock::now();
    try {
      dist::all_reduce(t);
      std::printf("rank %d: all_reduce completed without the last rank\n", rank);
      return 1;
    } catch (const Error& e) {
      const double s = seconds_since(start);
      const std::string msg = e.what();
      const bool named = msg.find("all_reduce") != std::string::npos && msg.find("did not complete") != std::string::npos;
      const double limit = std::chrono::duration<double>(dist::group().timeout()).count();
      std::printf("rank %d: after %.1f s: %s\n", rank, s, msg.c_str());
      // A broken group refuses further collectives at once.
      bool refused = false;
      try {
        dist::barrier();
      } catch (const Error&) {
        refused = true;
      }
      if (named && refused && s >= limit * 0.9 && s < limit + 5) std::printf("watchdog ok\n");
      std::fflush(stdout);
      return 4;  // the collective failed, as it should have: a failed job either way
    }
  }
  if (mode == "shutdown") {
    if (rank == last) {  // busy elsewhere: never meets the others at the exit barrier in time
      std::this_thread::sleep_for(std::chrono::seconds(60));
      return 0;
    }
    const double limit = std::chrono::duration<double>(dist::group().timeout()).count();
    const auto start = std::chrono::steady_clock::now();
    try {
      dist::shutdown();
      std::printf("rank %d: shutdown reported success without the last rank\n", rank);
      return 1;
    } catch (const Error& e) {
      const double s = seconds_since(start);
      const std::string msg = e.what();
      std::printf("rank %d: after %.1f s: %s\n", rank, s, msg.c_str());
      const bool named = msg.find("shutdown on rank") != std::string::npos && msg.find("barrier") != std::string::npos;
      bool idempotent = true;  // a second call neither throws nor waits again
      const auto again = std::chrono::steady_clock::now();
      try {
        dist::shutdown();
      } catch (const Error&) {
        idempotent = false;
      }
      idempotent = idempotent && seconds_since(again) < 1;
      if (named && idempotent && s < limit + 5) std::printf("shutdown ok\n");
      std::fflush(stdout);
      return 4;
    }
  }
  if (mode == "between") return between();
  if (mode == "kill") return train(last, true);
  if (mode == "throw") return train(last, false);
  std::printf("usage: dist_failures watchdog|kill|throw|shutdown|between\n");
  return 2;
} catch (const std::exception& e) {
  std::printf("rank %d: error: %s\n", chorus::dist::is_initialized() ? chorus::dist::rank() : -1, e.what());
  std::fflush(stdout);
  return 3;
}
