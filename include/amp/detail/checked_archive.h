// amp/detail/checked_archive.h: a LibTorch archive read from a file, a stream
// or bytes only after amp's own check of its bytes (zip_check.h), every
// failure one amp: c10::Error that names the source.
//
//   torch::serialize::InputArchive a = amp::detail::read_archive(path, device, "a checkpoint written by amp");
//   torch::serialize::InputArchive b = amp::detail::read_archive(stream, device, "the state", "...");
//
// LibTorch throws what its layers throw (c10::Error, torch::jit::ErrorReport,
// std::runtime_error, std::out_of_range, ...): a caller that catches
// c10::Error, as amp's docs say, would otherwise meet std::terminate.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <istream>
#include <iterator>
#include <string>

#include "amp/detail/zip_check.h"

namespace amp {
namespace detail {

// Runs LibTorch's load; any exception becomes "amp: could not read <source> (<expected>): <what>".
template <class Load>
void load_wrapped(Load&& load, const std::string& source, const std::string& expected) {
  std::string cause;
  try {
    load();
    return;
  } catch (const c10::Error& e) {
    cause = e.what_without_backtrace();
  } catch (const std::exception& e) {  // torch::jit::ErrorReport, std::runtime_error, std::out_of_range, ...
    cause = e.what();
  } catch (...) {
    cause = "an exception that is not a std::exception";
  }
  TORCH_CHECK(false, "amp: could not read ", source, " (", expected, "): ", cause);
}

// `path`'s archive; `expected` says what it should be ("a checkpoint written by amp::Trainer::save").
inline torch::serialize::InputArchive read_archive(const std::string& path, const c10::Device& device,
                                                   const std::string& expected) {
  const std::string source = "checkpoint '" + path + "'";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "amp: could not read ", source, ": ", std::strerror(errno));
  struct Close {
    int fd;
    ~Close() { ::close(fd); }
  } close_fd{fd};
  struct stat st {};
  TORCH_CHECK(::fstat(fd, &st) == 0 && S_ISREG(st.st_mode), "amp: ", source, " is not a regular file");
  const auto size = static_cast<uint64_t>(st.st_size);
  // Both amp's check and LibTorch read this one open file.
  auto pread_some = [fd](uint64_t pos, void* buf, size_t n) {
    size_t done = 0;
    while (done < n) {
      const ssize_t r = ::pread(fd, static_cast<char*>(buf) + done, n - done, static_cast<off_t>(pos + done));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) break;
      done += static_cast<size_t>(r);
    }
    return done;
  };
  check_zip(
      [&](uint64_t pos, void* buf, size_t n) {
        TORCH_CHECK(pread_some(pos, buf, n) == n, "amp: could not read ", source, ": ",
                    errno != 0 ? std::strerror(errno) : "it became shorter while it was read");
      },
      size, source);
  torch::serialize::InputArchive archive;
  load_wrapped(
      [&] {
        archive.load_from([&](uint64_t pos, void* buf, size_t n) { return pos >= size ? 0 : pread_some(pos, buf, n); },
                          [size] { return static_cast<size_t>(size); }, device);
      },
      source, expected);
  return archive;
}

// The same for an archive in memory; `source` names it in errors ("the state").
inline torch::serialize::InputArchive read_archive(const std::string& bytes, const c10::Device& device,
                                                   const std::string& source, const std::string& expected) {
  check_zip(
      [&](uint64_t pos, void* buf, size_t n) {
        TORCH_CHECK(pos <= bytes.size() && n <= bytes.size() - pos, "amp: ", source, ": a read past its end");
        std::memcpy(buf, bytes.data() + pos, n);
      },
      bytes.size(), source);
  torch::serialize::InputArchive archive;
  load_wrapped([&] { archive.load_from(bytes.data(), bytes.size(), device); }, source, expected);
  return archive;
}

inline torch::serialize::InputArchive read_archive(std::istream& in, const c10::Device& device,
                                                   const std::string& source, const std::string& expected) {
  const std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  TORCH_CHECK(!in.bad(), "amp: could not read ", source, " from its stream");
  return read_archive(bytes, device, source, expected);
}

}  // namespace detail
}  // namespace amp
