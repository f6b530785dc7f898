// amp/detail/parallel.h: amp's own CPU loops in parallel on LibTorch's
// threads, whatever the user's compiler flags.
//
//   amp::detail::parallel_chunks(blocks, /*grain=*/16, [&](int64_t b0, int64_t b1) { ... });
//
// at::parallel_for is a header template whose `#pragma omp parallel` only
// runs in parallel where the including file is compiled with -fopenmp;
// without it every chunk runs on the calling thread. Without OpenMP this
// splits the range into chunks that the calling thread and tasks on ATen's
// inter-op pool (at::launch) take in turn; the calling thread waits only for
// chunks already taken, so a busy or nested pool cannot deadlock it. Up to
// at::get_num_threads() threads work, as in at::parallel_for.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>

namespace amp {
namespace detail {

template <class F>
void parallel_chunks(int64_t n, int64_t grain, const F& f) {
#ifdef _OPENMP
  at::parallel_for(0, n, grain, f);
#else
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / std::max<int64_t>(grain, 1));
  if (threads <= 1 || at::in_parallel_region()) return f(0, n);
  const int64_t chunks = std::min<int64_t>(n, threads * 4);  // finer than the threads: a late task still helps
  const int64_t size = (n + chunks - 1) / chunks;
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mutex;
    std::condition_variable all_done;
    std::exception_ptr error;
  };
  auto shared = std::make_shared<Shared>();
  auto work = [shared, &f, n, chunks, size] {
    for (int64_t c = shared->next.fetch_add(1); c < chunks; c = shared->next.fetch_add(1)) {
      try {
        f(c * size, std::min(n, (c + 1) * size));
      } catch (...) {
        std::lock_guard<std::mutex> lock(shared->mutex);
        if (!shared->error) shared->error = std::current_exception();
      }
      if (shared->done.fetch_add(1) + 1 == chunks) {
        std::lock_guard<std::mutex> lock(shared->mutex);
        shared->all_done.notify_all();
      }
    }
  };
  // A task that starts after every chunk was taken returns without touching f.
  for (int64_t t = 1; t < threads; ++t) at::launch(work);
  work();
  std::unique_lock<std::mutex> lock(shared->mutex);
  shared->all_done.wait(lock, [&] { return shared->done.load() == chunks; });
  if (shared->error) std::rethrow_exception(shared->error);
#endif
}

}  // namespace detail
}  // namespace amp
