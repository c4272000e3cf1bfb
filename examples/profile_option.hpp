#pragma once
// The examples' --profile FILE [--profile-steps N]: after two warm-up steps, records N training
// steps (default 5) with chorus::profiler, writes their Chrome trace to FILE (one file per rank
// under --distributed: FILE with ".rank<R>" before its extension; scripts/merge_traces.py joins
// them), and prints the per-step summary. Open the trace in Perfetto (ui.perfetto.dev) or
// chrome://tracing; scripts/plot_trace.py draws a step as a PNG.
#include <chorus/chorus.hpp>

#include <cstdio>
#include <optional>
#include <string>

namespace examples {

/// `path` with ".<tag>" before its extension ("trace.json", "rank1": "trace.rank1.json").
inline std::string tagged_path(const std::string& path, const std::string& tag) {
  const auto dot = path.rfind('.');
  if (dot == std::string::npos || path.find('/', dot) != std::string::npos) return path + "." + tag;
  return path.substr(0, dot) + "." + tag + path.substr(dot);
}

/// --profile FILE [--profile-steps N] (see above).
class ProfileOption {
 public:
  /// Consumes argv[i] (and its value) when it is --profile or --profile-steps.
  bool parse(int& i, int argc, char** argv) {
    const std::string a = argv[i];
    if ((a == "--profile" || a == "--profile-steps") && i + 1 >= argc) throw chorus::Error(a + " needs a value");
    if (a == "--profile") {
      path_ = argv[++i];
      return true;
    }
    if (a == "--profile-steps") {
      steps_ = std::stoi(argv[++i]);
      CHORUS_CHECK(steps_ > 0, "--profile-steps must be positive, got ", steps_);
      return true;
    }
    return false;
  }
  /// The options' usage text.
  static const char* usage() { return " [--profile FILE [--profile-steps N]]"; }

  /// Call after each training step; `rank` names the file of a process of a group (-1: none).
  void after_step(int rank = -1) {
    if (path_.empty() || done_) return;
    ++seen_;
    if (seen_ == kWarmup) {
      prof_.emplace();  // records from the next step on
      return;
    }
    if (!prof_) return;
    prof_->step();
    if (seen_ < kWarmup + steps_) return;
    const auto& p = prof_->stop();
    const std::string path = rank >= 0 ? tagged_path(path_, "rank" + std::to_string(rank)) : path_;
    p.save(path);
    if (rank <= 0) {
      std::printf("\nprofile of %d steps written to %s\n%s", steps_, path.c_str(), p.summary().table().c_str());
      std::fflush(stdout);
    }
    prof_.reset();
    done_ = true;
  }

 private:
  static constexpr int kWarmup = 2;
  std::string path_;
  int steps_ = 5;
  int seen_ = 0;
  bool done_ = false;
  std::optional<chorus::profiler::Profiler> prof_;
};

}  // namespace examples
