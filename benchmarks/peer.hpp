#pragma once
// Rounds across processes: a benchmark program serves its configurations to a driver (the
// other side's program), so that the two alternate round by round (Note [paired rounds] in
// bench_util.hpp); records and paired ratios as JSON.
//
// Note [peer protocol]: one JSON object per line, the driver writing to the server's stdin and
// reading its stdout (everything else the server prints goes to stderr):
//   {"cmd": "configs", "workload": W}                  -> {"configs": [record fields, ...]}
//   {"cmd": "round", "workload": W, "config": C, "reps": N}
//                                                      -> {"samples_ms": [N times]} (the first round of
//                                                         a configuration builds it and warms up)
//   {"cmd": "release", "workload": W}                  -> {"released": W} (frees its models)
// A failure is {"error": "..."}; end of input ends the server. Served by libtorch_bench and
// chorus_gpu_bench --serve; driven by chorus_bench (C++, PeerProcess) and by
// pytorch_gpu_bench.py --chorus (Python, the same protocol).
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bench_util.hpp"

extern char** environ;

namespace bench {

using nlohmann::json;

/// One configuration a program offers for a workload: its record's fields (impl, workload,
/// config, devices, threads; "flops" of one call where known) and how to build its step.
struct Offer {
  json meta;
  std::function<std::function<void()>()> make;  // builds the model and returns one step
  int warmup = 2;                               // untimed calls before its first round
};

using Offers = std::function<std::vector<Offer>(const std::string& workload)>;

/// One configuration in a run of rounds, local or served by a peer.
struct Entry {
  json meta;
  std::function<std::vector<double>(int reps)> round;
};

/// Runs `rounds` rounds over a (one side) and b (the other side) in round_order: returns, per
/// configuration (a's, then b's), the times of each round.
inline std::vector<std::vector<std::vector<double>>> run_rounds(const std::vector<Entry>& a,
                                                                const std::vector<Entry>& b, int rounds, int reps) {
  std::vector<std::vector<std::vector<double>>> samples(a.size() + b.size());
  for (int r = 0; r < rounds; ++r)
    for (std::size_t i : round_order(a.size(), b.size(), r))
      samples[i].push_back(i < a.size() ? a[i].round(reps) : b[i - a.size()].round(reps));
  return samples;
}

/// The record of one configuration: its fields, every round's times, the per-round medians
/// (round_ms), and median_ms (the median of those) with min_ms/max_ms (their spread).
/// `rate_key` ("gflops", "tflops") and its scale turn "flops" into a rate at median_ms.
inline json make_record(json meta, const std::vector<std::vector<double>>& samples, const std::string& rate_key,
                        double rate_scale) {
  std::vector<double> round_ms;
  for (const auto& s : samples) round_ms.push_back(median(s));
  const Spread s = spread(round_ms);
  meta["median_ms"] = s.median;
  meta["min_ms"] = s.min;
  meta["max_ms"] = s.max;
  meta["rounds"] = samples.size();
  meta["repeats"] = samples.empty() ? 0 : samples.front().size();
  meta["round_ms"] = round_ms;
  meta["samples_ms"] = samples;
  if (meta.contains("flops")) {
    const double f = meta["flops"].get<double>();
    meta.erase("flops");
    if (f > 0) meta[rate_key] = f / (s.median * rate_scale);
  }
  return meta;
}

/// The per-round ratios of two records' round_ms (num / den) and their median, min and max.
inline json paired_json(const json& num, const json& den) {
  const auto r = paired_ratios(num["round_ms"].get<std::vector<double>>(), den["round_ms"].get<std::vector<double>>());
  const Spread s = spread(r);
  return {{"median", s.median}, {"min", s.min}, {"max", s.max}, {"rounds", r}};
}

/// Serves `offers` by Note [peer protocol] until end of input; `clock` times every call.
inline int serve(const Offers& offers, Clock clock = {}) {
  // The protocol keeps the real stdout; whatever the workloads print goes to stderr.
  const int proto = dup(1);
  if (proto < 0 || dup2(2, 1) < 0) throw std::runtime_error("serve: cannot redirect stdout");
  FILE* out = fdopen(proto, "w");
  std::map<std::string, std::vector<Offer>> offered;
  std::map<std::pair<std::string, std::string>, std::unique_ptr<Timed>> live;
  for (std::string line; std::getline(std::cin, line);) {
    json reply;
    try {
      const json req = json::parse(line);
      const std::string cmd = req.at("cmd"), w = req.at("workload");
      if (cmd == "configs") {
        auto& o = offered[w];
        o = offers(w);
        reply["configs"] = json::array();
        for (const auto& x : o) reply["configs"].push_back(x.meta);
      } else if (cmd == "round") {
        const std::string c = req.at("config");
        auto& t = live[{w, c}];
        if (!t) {
          const Offer* found = nullptr;
          for (const auto& x : offered[w])
            if (x.meta.at("config") == c) found = &x;
          if (!found) throw std::runtime_error("no configuration '" + c + "' offered for workload '" + w + "'");
          t = std::make_unique<Timed>(found->make(), found->warmup, clock);
        }
        reply["samples_ms"] = t->round(req.at("reps").get<int>());
      } else if (cmd == "release") {
        for (auto it = live.begin(); it != live.end();) it = it->first.first == w ? live.erase(it) : std::next(it);
        offered.erase(w);
        reply["released"] = w;
      } else {
        throw std::runtime_error("unknown command '" + cmd + "'");
      }
    } catch (const std::exception& e) {
      reply = {{"error", e.what()}};
    }
    std::fputs((reply.dump() + "\n").c_str(), out);
    std::fflush(out);
  }
  std::fclose(out);
  return 0;
}

/// A server process (Note [peer protocol]) started with `argv` and the environment plus
/// `env` ("NAME=value" entries replacing the inherited ones).
class PeerProcess {
 public:
  PeerProcess(const std::vector<std::string>& argv, const std::vector<std::string>& env) {
    std::signal(SIGPIPE, SIG_IGN);  // a peer that died is reported by request(), not by a signal
    for (const auto& a : argv) name_ += (name_.empty() ? "" : " ") + a;
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) throw std::runtime_error("pipe: " + name_);
    std::vector<std::string> envs(env);
    for (char** e = environ; *e; ++e) {
      const std::string s = *e;
      bool replaced = false;
      for (const auto& o : env) replaced |= s.compare(0, o.find('=') + 1, o, 0, o.find('=') + 1) == 0;
      if (!replaced) envs.push_back(s);
    }
    std::vector<char*> args, envp;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    for (const auto& e : envs) envp.push_back(const_cast<char*>(e.c_str()));
    args.push_back(nullptr);
    envp.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    const int rc = posix_spawnp(&pid_, args[0], &fa, nullptr, args.data(), envp.data());
    posix_spawn_file_actions_destroy(&fa);
    close(in[0]);
    close(out[1]);
    if (rc != 0) {
      close(in[1]);
      close(out[0]);
      throw std::runtime_error("cannot start peer " + name_ + ": " + std::strerror(rc));
    }
    to_ = fdopen(in[1], "w");
    from_ = fdopen(out[0], "r");
  }
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;
  ~PeerProcess() {
    std::fclose(to_);  // end of input: the server returns
    std::fclose(from_);
    int status = 0;
    waitpid(pid_, &status, 0);
  }

  /// Sends one request and returns the reply; throws if the peer died or replied an error.
  json request(const json& req) {
    const std::string line = req.dump() + "\n";
    if (std::fputs(line.c_str(), to_) < 0 || std::fflush(to_) != 0)
      throw std::runtime_error("peer " + name_ + " is gone (writing " + req.dump() + ")");
    char* buf = nullptr;
    std::size_t cap = 0;
    const ssize_t n = getline(&buf, &cap, from_);
    const std::string reply = n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
    std::free(buf);
    if (n <= 0) throw std::runtime_error("peer " + name_ + " exited without answering " + req.dump());
    json r = json::parse(reply);
    if (r.contains("error"))
      throw std::runtime_error("peer " + name_ + ": " + r["error"].get<std::string>() + " (for " + req.dump() + ")");
    return r;
  }

  /// The peer's configurations for `workload` as Entries whose rounds it runs.
  std::vector<Entry> entries(const std::string& workload) {
    std::vector<Entry> e;
    const json reply = request({{"cmd", "configs"}, {"workload", workload}});
    for (const auto& meta : reply.at("configs")) {
      const std::string config = meta.at("config");
      e.push_back({meta, [this, workload, config](int reps) {
                     return request({{"cmd", "round"}, {"workload", workload}, {"config", config}, {"reps", reps}})
                         ["samples_ms"]
                             .get<std::vector<double>>();
                   }});
    }
    return e;
  }

  void release(const std::string& workload) { request({{"cmd", "release"}, {"workload", workload}}); }

 private:
  std::string name_;
  pid_t pid_ = -1;
  FILE* to_ = nullptr;
  FILE* from_ = nullptr;
};

}  // namespace bench
