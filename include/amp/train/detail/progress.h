// amp/train/detail/progress.h: the progress display of Trainer::fit.
// On a terminal: one line redrawn in place (steps, loss, scale, it/s).
// Otherwise (logs, CI): a plain line every `every` steps and at the end.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace amp {
namespace detail {

// While one lives, this thread's progress output is off whatever the
// options say (fit_sharded's ranks other than 0).
class QuietProgress {
 public:
  QuietProgress() : prev_(quiet()) { quiet() = true; }
  ~QuietProgress() { quiet() = prev_; }
  QuietProgress(const QuietProgress&) = delete;
  QuietProgress& operator=(const QuietProgress&) = delete;
  static bool& quiet() {
    static thread_local bool on = false;
    return on;
  }

 private:
  bool prev_;
};

class Progress {
 public:
  Progress(bool enabled, int64_t total, std::string label, int64_t every = 50)
      : enabled_(enabled && !QuietProgress::quiet()),
        tty_(isatty(fileno(stderr)) != 0),
        total_(total),
        every_(every),
        label_(std::move(label)),
        start_(std::chrono::steady_clock::now()) {}
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  ~Progress() { finish(); }

  void update(int64_t step, double loss, double scale, bool skipped) {
    last_step_ = step;
    last_loss_ = loss;
    last_scale_ = scale;
    skipped_ += skipped ? 1 : 0;
    ++done_;
    if (!enabled_) return;
    if (tty_) {
      draw('\r');
    } else if (every_ > 0 && done_ % every_ == 0) {
      draw('\n');
    }
  }

  // One line before the bar (e.g. which optimizer path a run takes).
  void note(const std::string& text) {
    if (enabled_) std::fprintf(stderr, "%s: %s\n", label_.c_str(), text.c_str());
  }

  void finish() {
    if (!enabled_ || finished_ || done_ == 0) return;
    finished_ = true;
    if (tty_) {
      draw('\r');
      std::fputc('\n', stderr);
    } else if (every_ <= 0 || done_ % every_ != 0) {
      draw('\n');
    }
    std::fflush(stderr);
  }

 private:
  void draw(char end) {
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    const double rate = secs > 0 ? static_cast<double>(done_) / secs : 0.0;
    std::string bar;
    if (tty_ && total_ > 0) {
      const int width = 24;
      const int filled = static_cast<int>(width * std::min<double>(1.0, static_cast<double>(done_) / total_));
      bar = "[" + std::string(filled, '=') + std::string(width - filled, ' ') + "] ";
    }
    if (end == '\r') std::fputc('\r', stderr);
    std::fprintf(stderr, "%s %s%lld", label_.c_str(), bar.c_str(), static_cast<long long>(last_step_));
    if (total_ > 0) std::fprintf(stderr, "/%lld", static_cast<long long>(total_));
    std::fprintf(stderr, " loss %.4g scale %g skipped %lld %.1f it/s", last_loss_, last_scale_,
                 static_cast<long long>(skipped_), rate);
    if (end == '\n') std::fputc('\n', stderr);
    std::fflush(stderr);
  }

  bool enabled_, tty_;
  int64_t total_, every_;
  std::string label_;
  std::chrono::steady_clock::time_point start_;
  int64_t done_ = 0, last_step_ = 0, skipped_ = 0;
  double last_loss_ = 0, last_scale_ = 1;
  bool finished_ = false;
};

}  // namespace detail
}  // namespace amp
