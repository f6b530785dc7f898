// amp/detail/atomic_file.h: writing a file so that a crash leaves the old one
// or the new one, never a torn one.
//
//   amp::detail::atomic_write(path, [&](const std::string& tmp) { archive.save_to(tmp); });
//
// The writer fills a temporary file in the same directory; it is fsync'ed and
// renamed over `path`, then the directory is fsync'ed. On any failure the
// temporary file is removed and an `amp:` error names the path. POSIX only.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

namespace amp {
namespace detail {

inline void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) return;
  (void)::fsync(fd);
  ::close(fd);
}

template <class Writer>
void atomic_write(const std::string& path, Writer&& write) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  try {
    write(tmp);
  } catch (const c10::Error& e) {
    std::remove(tmp.c_str());
    TORCH_CHECK(false, "amp: could not write '", path, "': ", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::remove(tmp.c_str());
    TORCH_CHECK(false, "amp: could not write '", path, "': ", e.what());
  }
  fsync_path(tmp, false);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    TORCH_CHECK(false, "amp: could not move '", tmp, "' into place at '", path, "': ", std::strerror(err));
  }
  const auto slash = path.find_last_of('/');
  fsync_path(slash == std::string::npos ? "." : path.substr(0, slash == 0 ? 1 : slash), true);
}

}  // namespace detail
}  // namespace amp
