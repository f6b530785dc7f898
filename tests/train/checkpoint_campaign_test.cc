// The corruption campaign: damaged copies of every kind of checkpoint amp
// writes, each loaded by the object that wrote it. Every load must end in
// (a) an amp: c10::Error that names the file, the state (model, optimizer,
// scaler, counters, user state, generators) bitwise as before the load, or
// (b) a success whose state is bitwise the undamaged checkpoint's.
// A crash, an exception of another type, a partial load or a silent load of
// damaged data fails the test.
//
// Kinds: Trainer under each policy family (bf16-mixed unfused and fused,
// 16-mixed with a DynamicScaler where the CPU has fp16 autocast, true
// precision with AdamW8bit, 64-true with user state and a StepLR, Float8
// where the CPU has _scaled_mm), Fabric with two models, a Trainer with
// DataParallel at rank 0 of 1 and with a ShardedOptimizer at world 1, and
// FullyShard's two formats loaded by load_fully_sharded at world 1: a
// consolidated file, and a sharded set that two ranks (two threads, each its
// own process group) saved, re-sharded (its manifest, and each rank file
// damaged with the manifest re-signed for it or as saved; a rank file of
// another save; a missing one; a manifest of another model or world size).
// Damage: truncation at each 1%, bit flips at random offsets and in the zip
// structure (end records, central directory, local headers, descriptors),
// huge declared sizes (zip fields; a pickle's length and memo index with its
// CRC-32 fixed), zip entries removed, renamed or duplicated (CRC-32 valid),
// tensors of another dtype or shape and non-finite, negative or mistyped
// values in the scaler, counters, learning rates and generators (valid
// archives, written by LibTorch), and checkpoints of the other kinds.
//
// The seed is fixed. AMP_CAMPAIGN_CASES=N raises the random flips so that
// the campaign holds about N cases (the documented run: 10000; truncation at
// each 1%, every entry); by default it runs a few thousand (truncation at
// each 2%, every other entry). AMP_CAMPAIGN_VERBOSE=1 prints each bad case.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "amp/detail/zip_check.h"
#include "amp/distributed.h"
#include "amp/distributed/fully_shard_checkpoint.h"
#include "amp/optim/low_bit_adam.h"
#include "amp/train/fabric.h"
#include "amp/train/trainer.h"
#include "../tmp_path.h"

namespace checkpoint_campaign_test {

using amp_test::tmp_path;

// ---- the zip helpers: read a file's entries, write an archive back ----

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}
void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

amp::detail::ByteReader reader_of(const std::string& bytes) {
  return [&bytes](uint64_t pos, void* buf, size_t n) { std::memcpy(buf, bytes.data() + pos, n); };
}
std::vector<amp::detail::ZipEntry> entries_of(const std::string& bytes) {
  return amp::detail::check_zip(reader_of(bytes), bytes.size(), "the undamaged checkpoint");
}

struct RawEntry {
  std::string name;
  uint16_t method;
  std::string data;  // as stored (deflated for method 8)
  uint32_t crc;
  uint64_t uncompressed;
};
std::vector<RawEntry> raw_entries(const std::string& bytes) {
  std::vector<RawEntry> out;
  for (const auto& e : entries_of(bytes))
    out.push_back({e.name, e.method, bytes.substr(e.data, e.compressed), e.crc, e.uncompressed});
  return out;
}

void put(std::string& s, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
// A plain zip (no descriptors, no ZIP64) of the entries, with their CRC-32s.
std::string write_zip(const std::vector<RawEntry>& entries) {
  std::string out, cd;
  for (const auto& e : entries) {
    const uint64_t at = out.size();
    put(out, 0x04034b50, 4);
    put(out, 20, 2);
    put(out, 0, 2);
    put(out, e.method, 2);
    put(out, 0, 4);
    put(out, e.crc, 4);
    put(out, e.data.size(), 4);
    put(out, e.uncompressed, 4);
    put(out, e.name.size(), 2);
    put(out, 0, 2);
    out += e.name;
    out += e.data;
    put(cd, 0x02014b50, 4);
    put(cd, 20, 2);
    put(cd, 20, 2);
    put(cd, 0, 2);
    put(cd, e.method, 2);
    put(cd, 0, 4);
    put(cd, e.crc, 4);
    put(cd, e.data.size(), 4);
    put(cd, e.uncompressed, 4);
    put(cd, e.name.size(), 2);
    put(cd, 0, 2);
    put(cd, 0, 2);
    put(cd, 0, 2);
    put(cd, 0, 2);
    put(cd, 0, 4);
    put(cd, at, 4);
    cd += e.name;
  }
  const uint64_t cd_at = out.size();
  out += cd;
  put(out, 0x06054b50, 4);
  put(out, 0, 4);
  put(out, entries.size(), 2);
  put(out, entries.size(), 2);
  put(out, cd.size(), 4);
  put(out, cd_at, 4);
  put(out, 0, 2);
  return out;
}

// ---- an archive as a tree: read, fingerprint, edit, write ----

struct Node {
  bool archive = false;
  c10::IValue value;
  std::vector<std::pair<std::string, Node>> children;
};

Node read_tree(torch::serialize::InputArchive& a) {
  Node n;
  n.archive = true;
  for (const auto& key : a.keys()) {
    torch::serialize::InputArchive sub;
    if (a.try_read(key, sub)) {
      n.children.emplace_back(key, read_tree(sub));
      continue;
    }
    Node leaf;
    a.read(key, leaf.value);
    if (key == "training" && leaf.value.isBool()) continue;  // every TorchScript module's own attribute
    n.children.emplace_back(key, std::move(leaf));
  }
  return n;
}
Node tree_of(const std::string& bytes) {
  torch::serialize::InputArchive a;
  a.load_from(bytes.data(), bytes.size());
  return read_tree(a);
}

void write_tree(torch::serialize::OutputArchive& out, const Node& n) {
  for (const auto& [key, child] : n.children) {
    if (child.archive) {
      torch::serialize::OutputArchive sub;
      write_tree(sub, child);
      out.write(key, sub);
    } else if (child.value.isTensor()) {
      const at::Tensor t = child.value.toTensor();
      out.write(key, t, /*is_buffer=*/!t.requires_grad());
    } else {
      out.write(key, child.value);
    }
  }
}
std::string bytes_of(const Node& n) {
  torch::serialize::OutputArchive out;
  write_tree(out, n);
  std::ostringstream s;
  out.save_to(s);
  return s.str();
}

std::string repr(const c10::IValue& v) {
  if (v.isTensor()) {
    const at::Tensor t = v.toTensor().detach().cpu().contiguous();
    std::string s = std::string("T") + c10::toString(t.scalar_type()) + c10::str(t.sizes()) + ":";
    s.append(static_cast<const char*>(t.data_ptr()), t.nbytes());
    return s;
  }
  if (v.isDouble()) {
    const double d = v.toDouble();
    uint64_t b = 0;
    std::memcpy(&b, &d, sizeof b);
    return "d" + std::to_string(b);
  }
  if (v.isInt()) return "i" + std::to_string(v.toInt());
  if (v.isBool()) return v.toBool() ? "true" : "false";
  if (v.isString()) return "s" + v.toStringRef();
  if (v.isNone()) return "None";
  if (v.isList()) {
    std::string s = "[";
    for (const auto& e : v.toListRef()) s += repr(e) + ",";
    return s + "]";
  }
  if (v.isTuple()) {
    std::string s = "(";
    for (const auto& e : v.toTupleRef().elements()) s += repr(e) + ",";
    return s + ")";
  }
  if (v.isGenericDict()) {
    std::string s = "{";
    for (const auto& kv : v.toGenericDict()) s += repr(kv.key()) + ":" + repr(kv.value()) + ",";
    return s + "}";
  }
  std::ostringstream o;
  o << v;
  return "?" + o.str();
}

using State = std::map<std::string, std::string>;
void flatten(const Node& n, const std::string& prefix, State& out) {
  for (const auto& [key, child] : n.children) {
    if (child.archive)
      flatten(child, prefix + key + "/", out);
    else
      out[prefix + key] = repr(child.value);
  }
}
State state_of_bytes(const std::string& bytes) {
  State s;
  flatten(tree_of(bytes), "", s);
  return s;
}
// The first key where two states differ ("" if none).
std::string first_difference(const State& a, const State& b) {
  for (const auto& [k, v] : a) {
    auto it = b.find(k);
    if (it == b.end()) return k + " (only before)";
    if (it->second != v) return k;
  }
  for (const auto& kv : b)
    if (!a.count(kv.first)) return kv.first + " (only after)";
  return "";
}

// ---- amp's check itself, on known bytes ----

TEST(ZipCheck, Crc32IsZipsCrc) {
  const std::string check = "123456789";
  EXPECT_EQ(amp::detail::crc32(0, check.data(), check.size()), 0xCBF43926u);
  EXPECT_EQ(amp::detail::crc32(amp::detail::crc32(0, check.data(), 4), check.data() + 4, 5), 0xCBF43926u);
}

uint32_t inflate_crc(const std::string& raw, uint64_t limit, uint64_t* produced) {
  const auto read = reader_of(raw);
  amp::detail::RangeReader in(read, 0, raw.size());
  uint32_t crc = 0;
  *produced =
      amp::detail::Inflater(in, limit, [&](const uint8_t* b, size_t n) { crc = amp::detail::crc32(crc, b, n); }).run();
  return crc;
}

// zlib's raw deflate (level 9, dynamic Huffman codes) of 600 bytes of text whose CRC-32 is 0xbc0076a3
// (Python: random.seed(61); bytes(random.choice(b"aaaaabbbccd \n") for _ in range(600))).
const std::string kDynamic(
    "\x45\x91\xd1\x91\xc4\x30\x08\x43\xff\xa9\xc2\xad\x21\xd1\x7f\x0d\xa7\x07\xd9\xb9\xcd\x64\xb2\xc6\xf2\x43\xc2\x6a"
    "\x77\xa9\x55\xaf\x25\xdd\x3b\xed\xd7\xd3\x54\xbb\x9f\x78\x25\xab\x66\xba\x9e\xa3\xe9\xfc\x9c\x8f\xf9\x97\x57\x7a"
    "\x7c\x1c\x11\xa7\xb6\xaa\x10\x46\x93\xe5\x83\x51\xe8\xfb\x75\x88\x66\x3d\xbd\xa5\x63\xad\x3c\xb8\xec\xcd\x02\x5b"
    "\xf7\x68\x26\x7d\x9f\xab\x79\x3c\x2a\x54\x29\x9a\x23\x8a\x25\xc3\xa7\x66\xd3\x2f\x2d\xa0\x60\x3c\x87\x68\xcd\x89"
    "\x40\xce\x5c\x4e\x91\x67\xd8\x8b\x87\x32\x41\x02\xf3\xd7\xd5\xae\x95\xd6\x35\xba\x98\x11\x78\x36\xdf\x8a\x50\x69"
    "\xb1\x01\xd7\x65\xd5\x9d\x27\x1d\xc9\xc8\x8b\x27\x46\x74\x3d\xd8\x9b\x78\x93\x2f\x2f\x43\x58\x75\xc8\xd0\x7f\xc5"
    "\x04\x0e\x3f\xbe\xa9\xaf\x84\xd9\x7e\xbb\xc4\xc3\x90\x36\xc5\x8e\x9f\x89\x44\xb3\xa9\x77\x82\xae\xaa\xcf\x76\xc2"
    "\xf7\xdd\x0b\x18\xe0\x19\x18\x37\x14\xf0\x5c\x37\xae\x75\xe7\xa2\x54\xf6\xb2\x59\xaf\x5d\x55\xff\x7b\xd5\x7a\xad"
    "\xda\x3b\x01\x07\x64\x99\x6f\x07\x5a\x25\x0f\xcc\xf3\x91\xa9\xfc\x01",
    241);

TEST(ZipCheck, InflatesDynamicFixedAndStoredBlocks) {
  uint64_t produced = 0;
  EXPECT_EQ(inflate_crc(kDynamic, 600, &produced), 0xbc0076a3u);
  EXPECT_EQ(produced, 600u);
  // A stored block ("abc") then a fixed-Huffman block holding only its end code.
  const std::string stored(
      "\x00\x03\x00\xfc\xff"
      "abc"
      "\x03\x00",
      10);
  EXPECT_EQ(inflate_crc(stored, 3, &produced), amp::detail::crc32(0, "abc", 3));
  EXPECT_EQ(produced, 3u);
  // Output past the declared size, and a damaged stream, are refused or change the CRC-32.
  EXPECT_THROW(inflate_crc(kDynamic, 599, &produced), std::runtime_error);
  // (Not the last byte: its high bits are padding after the end code, which nothing reads.)
  int caught = 0;
  for (size_t at = 0; at + 1 < kDynamic.size(); at += 3) {
    std::string bad = kDynamic;
    bad[at] = static_cast<char>(bad[at] ^ 0x04);
    try {
      if (inflate_crc(bad, 600, &produced) != 0xbc0076a3u || produced != 600u) ++caught;
    } catch (const std::runtime_error&) {
      ++caught;
    }
  }
  EXPECT_EQ(caught, static_cast<int>((kDynamic.size() + 1) / 3));
}

TEST(ZipCheck, PickleLengthsAndMemoIndicesStayInside) {
  using amp::detail::check_pickle;
  EXPECT_EQ(check_pickle(std::string("\x80\x02K\x07.", 5)), "");
  EXPECT_EQ(check_pickle(std::string("\x80\x02X\x03\x00\x00\x00"
                                     "abc.",
                                     11)),
            "");
  EXPECT_NE(check_pickle(std::string("\x80\x02X\xf0\xff\xff\x7f"
                                     "abc.",
                                     11))
                .find("past its end"),
            std::string::npos);
  EXPECT_NE(check_pickle(std::string("\x80\x02K\x07r\xf0\xff\xff\x7f.", 10)).find("memo index"), std::string::npos);
  EXPECT_NE(check_pickle(std::string("\x80\x02K\x07\xff.", 6)).find("unknown opcode"), std::string::npos);
  EXPECT_EQ(check_pickle(std::string("\x80\x02K\x07", 4)), "no STOP");
  EXPECT_EQ(check_pickle(std::string("\x80\x02K\x07..", 6)), "bytes after its STOP");
}

TEST(ZipCheck, RefusesWhatLibTorchsReaderWouldTake) {
  auto entry = [](const std::string& name, const std::string& data) {
    return RawEntry{name, 0, data, amp::detail::crc32(0, data.data(), data.size()), data.size()};
  };
  const RawEntry pkl = entry("a/data.pkl", std::string("\x80\x02K\x07.", 5)), version = entry("a/version", "3\n");
  auto error = [](const std::string& bytes) {
    try {
      amp::detail::check_zip(reader_of(bytes), bytes.size(), "checkpoint 'x.pt'");
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string();
  };
  EXPECT_EQ(error(write_zip({pkl, version})), "");
  EXPECT_NE(error(write_zip({pkl})).find("entry 'a/version' is missing"), std::string::npos);
  EXPECT_NE(error(write_zip({pkl, version, version})).find("entry 'a/version' appears twice"), std::string::npos);
  EXPECT_NE(error(write_zip({pkl, version, entry("b/x", "")})).find("entry 'b/x' is outside 'a/'"), std::string::npos);
  RawEntry damaged = version;
  damaged.data = "4\n";
  const std::string e = error(write_zip({pkl, damaged}));
  EXPECT_EQ(e.rfind("amp: could not read checkpoint 'x.pt': it is damaged or not a LibTorch archive (entry "
                    "'a/version': its bytes do not match their CRC-32",
                    0),
            0u)
      << e;
  // An entry marked as a directory (its external attributes' DOS bit 0x10): LibTorch's reader would
  // leave its tensor's memory unread (found by the full campaign: one flip loaded a learning rate silently).
  std::string directory = write_zip({pkl, version});
  directory[directory.find("a/version", directory.find("PK\x01\x02")) - 46 + 38] = '\x10';
  EXPECT_NE(error(directory).find("entry 'a/version' is marked as a directory"), std::string::npos);
  EXPECT_NE(error(write_zip({pkl, version, entry("a/d/", "")})).find("marked as a directory"), std::string::npos);
  EXPECT_NE(error("PK"), "");
  EXPECT_NE(error(std::string(64, '\0')).find("no end of central directory"), std::string::npos);
}

// ---- the checkpoints: what writes them and loads them ----

struct NetImpl : torch::nn::Module {
  NetImpl(int64_t width = 64)
      : fc1(register_module("fc1", torch::nn::Linear(32, width))),
        norm(register_module("norm", torch::nn::BatchNorm1d(width))),
        fc2(register_module("fc2", torch::nn::Linear(width, 32))),
        head(register_module("head", torch::nn::Linear(32, 16))) {}
  torch::Tensor forward(const torch::Tensor& x) { return head(torch::relu(fc2(torch::relu(norm(fc1(x)))))); }
  torch::nn::Linear fc1;
  torch::nn::BatchNorm1d norm;
  torch::nn::Linear fc2, head;
};
TORCH_MODULE(Net);

Net make_net(int64_t width = 64) {
  torch::manual_seed(1);
  return Net(width);
}

// One step's loss: a random batch from the global generator (so that the
// generators' state moves with training).
torch::Tensor loss_of(Net& net) {
  const torch::Tensor x = torch::randn({24, 32}).to(net->fc1->weight.scalar_type());
  const torch::Tensor y = torch::randint(0, 16, {24});
  return torch::cross_entropy_loss(net->forward(x).to(torch::kFloat), y);
}

struct Subject {
  std::string kind;
  std::function<void()> step;
  std::function<void(const std::string&)> save, load;
  std::function<std::string()> state;  // the whole state, as the loader's own save_state writes it
  std::function<State()> state_map;    // or the whole state already flattened
  std::shared_ptr<void> keep;          // owns the model, optimizer, trainer, ...
  // A checkpoint of several files (FullyShard's sharded set): where the loads
  // read it (its other files are named after it), those other files undamaged
  // (path -> bytes), and what writes the set and loads it (the undamaged
  // state), returning the bytes at case_path.
  std::string case_path;
  std::map<std::string, std::string> side_good;
  std::function<std::string()> make_good;
};

State state_of(const Subject& s) { return s.state_map ? s.state_map() : state_of_bytes(s.state()); }

amp::TrainerOptions quiet() { return amp::TrainerOptions().progress(false); }

template <class Policy, class Opt, class Setup = std::nullptr_t>
Subject trainer_subject(const std::string& kind, std::function<std::unique_ptr<Opt>(Net&)> make_opt,
                        amp::StepOptions step_options = amp::StepOptions(), int64_t width = 64, Setup setup = nullptr) {
  struct Own {
    Net net;
    std::unique_ptr<Opt> opt;
    std::unique_ptr<amp::Trainer<Policy, amp::CPU>> trainer;
    std::shared_ptr<void> extra;
  };
  auto own = std::make_shared<Own>();
  own->net = make_net(width);
  own->opt = make_opt(own->net);
  own->trainer = std::make_unique<amp::Trainer<Policy, amp::CPU>>(own->net, *own->opt, quiet().step(step_options));
  if constexpr (!std::is_same_v<Setup, std::nullptr_t>) own->extra = setup(*own->trainer, *own->opt);
  Own* o = own.get();
  Subject s;
  s.kind = kind;
  s.step = [o] { o->trainer->step([o](auto&) { return loss_of(o->net); }); };
  s.save = [o](const std::string& p) { o->trainer->save(p); };
  s.load = [o](const std::string& p) { o->trainer->load(p); };
  s.state = [o] {
    std::ostringstream out;
    o->trainer->save_state(out);
    return out.str();
  };
  s.keep = own;
  return s;
}

template <class Opt, class Options>
std::function<std::unique_ptr<Opt>(Net&)> optimizer(Options options) {
  return [options](Net& net) { return std::make_unique<Opt>(net->parameters(), options); };
}

// A port nobody listens on now, for a world of one process.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 29511;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = 29511;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}
amp::ProcessGroup& world_of_one() {
  static amp::ProcessGroup pg = [] {
    ::setenv("RANK", "0", 1);
    ::setenv("WORLD_SIZE", "1", 1);
    ::setenv("LOCAL_RANK", "0", 1);
    ::setenv("MASTER_ADDR", "127.0.0.1", 1);
    ::setenv("MASTER_PORT", std::to_string(free_port()).c_str(), 1);
    return amp::init_process_group(
        amp::ProcessGroupOptions().backend(amp::Backend::kGloo).timeout(std::chrono::seconds(60)).threads(1));
  }();
  return pg;
}

using Bf16Mixed = amp::Mixed<amp::bf16, amp::NoScaler>;
using Fp16Mixed = amp::Mixed<amp::fp16, amp::DynamicScaler>;

// ---- FullyShard (amp/distributed/fully_shard_checkpoint.h) ----

// A model without buffers (FullyShard shards parameters); 37 rows: padded shards at world 2.
struct FsNetImpl : torch::nn::Module {
  explicit FsNetImpl(int64_t width = 37)
      : fc1(register_module("fc1", torch::nn::Linear(32, width))),
        fc2(register_module("fc2", torch::nn::Linear(width, 16))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(FsNet);
using FsTrainer = amp::Trainer<amp::True<amp::fp32>, amp::CPU>;

// A Trainer under FullyShard in a process group: the net built before (by the caller's thread).
struct FsRun {
  FsNet net;
  std::unique_ptr<amp::FullyShard> fsdp;
  std::unique_ptr<torch::optim::AdamW> opt;
  std::unique_ptr<FsTrainer> trainer;
  FsRun(const amp::ProcessGroup& pg, FsNet n) : net(std::move(n)) {
    fsdp = std::make_unique<amp::FullyShard>(pg, *net, std::vector<std::shared_ptr<torch::nn::Module>>{});
    opt = std::make_unique<torch::optim::AdamW>(fsdp->parameters(), torch::optim::AdamWOptions(1e-3));
    trainer = std::make_unique<FsTrainer>(net, *opt, quiet());
    trainer->stepper().set_gradient_sync(fsdp.get());
  }
  void step(const torch::Tensor& x, const torch::Tensor& y) {
    trainer->step([&](auto&) { return torch::cross_entropy_loss(fsdp->forward(net, x), y); });
  }
  // The whole state: the Trainer's archive (its optimizer, counters, generators; the model's own
  // tensors are empty at rest) and every shard, under "fully_shard/".
  State state() {
    amp::detail::FullyShardArchiveSync view(0, {}, "");
    State s = state_of_bytes(amp::detail::trainer_archive(*trainer, view));
    const auto ps = fsdp->parameters();
    for (size_t i = 0; i < ps.size(); ++i) s["fully_shard/" + std::to_string(i)] = repr(ps[i]);
    return s;
  }
};

FsNet make_fs_net(int64_t width = 37) {
  torch::manual_seed(3);
  return FsNet(width);
}

Subject fully_shard_subject(const std::string& kind, amp::FullyShardCheckpoint format, int64_t width = 37) {
  auto run = std::make_shared<FsRun>(world_of_one(), make_fs_net(width));
  FsRun* o = run.get();
  Subject s;
  s.kind = kind;
  s.step = [o] {
    const torch::Tensor x = torch::randn({24, 32});
    const torch::Tensor y = torch::randint(0, 16, {24});
    o->step(x, y);
  };
  s.save = [o, format](const std::string& p) { amp::save_fully_sharded(*o->trainer, p, format); };
  s.load = [o](const std::string& p) { amp::load_fully_sharded(*o->trainer, p); };
  s.state_map = [o] { return o->state(); };
  s.keep = run;
  return s;
}

std::string bytes_at(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << path;
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// The rank files a manifest names (path -> bytes).
std::map<std::string, std::string> set_files(const std::string& manifest) {
  std::map<std::string, std::string> out;
  torch::serialize::InputArchive a;
  a.load_from(manifest);
  const amp::detail::Manifest mf = amp::detail::read_manifest(a, manifest);
  for (const auto& f : mf.files) out[f] = bytes_at(f);
  return out;
}

// Two ranks (two threads, each its own process group of world 2) train two steps
// and save a sharded set at `path`, then one more step and another set at
// `stale` (its rank files: another save's). The nets are built here first.
void write_two_rank_sets(const std::string& path, const std::string& stale) {
  std::vector<FsNet> nets{make_fs_net(), make_fs_net()};
  std::vector<torch::Tensor> xs, ys;
  torch::manual_seed(61);
  for (int i = 0; i < 6; ++i) {
    xs.push_back(torch::randn({12, 32}));
    ys.push_back(torch::randint(0, 16, {12}));
  }
  const int port = free_port();
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        amp::ProcessInfo info;
        info.rank = r;
        info.world_size = 2;
        info.local_rank = r;
        info.master_port = port;
        const amp::ProcessGroup pg = amp::init_process_group(
            info, amp::ProcessGroupOptions().backend(amp::Backend::kGloo).timeout(std::chrono::seconds(60)).threads(1));
        FsRun run(pg, nets[static_cast<size_t>(r)]);
        for (int i = 0; i < 2; ++i) run.step(xs[static_cast<size_t>(2 * i + r)], ys[static_cast<size_t>(2 * i + r)]);
        amp::save_fully_sharded(*run.trainer, path, amp::FullyShardCheckpoint::kSharded);
        run.step(xs[static_cast<size_t>(4 + r)], ys[static_cast<size_t>(4 + r)]);
        amp::save_fully_sharded(*run.trainer, stale, amp::FullyShardCheckpoint::kSharded);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
}

// A sharded set of two ranks loaded into a one-process FullyShard (re-sharded): its cases
// damage the manifest (at case_path) and each rank file.
Subject fully_shard_set_subject() {
  Subject s = fully_shard_subject("FullyShard sharded set, 2 ranks loaded at world 1",
                                  amp::FullyShardCheckpoint::kConsolidated);
  s.case_path = tmp_path("campaign_set.pt");
  auto load = s.load;
  s.make_good = [load, path = s.case_path]() {
    write_two_rank_sets(path, path + ".stale");
    load(path);
    return bytes_at(path);
  };
  return s;
}

std::vector<Subject> subjects() {
  std::vector<Subject> s;
  s.push_back(trainer_subject<Bf16Mixed, torch::optim::AdamW>(
      "Trainer bf16-mixed AdamW", optimizer<torch::optim::AdamW>(torch::optim::AdamWOptions(1e-3)),
      amp::StepOptions().fused(false)));
  s.push_back(trainer_subject<Bf16Mixed, torch::optim::Adam>(
      "Trainer bf16-mixed Adam fused", optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-3))));
  if constexpr (amp::is_supported_v<Fp16Mixed, amp::CPU>)
    s.push_back(trainer_subject<Fp16Mixed, torch::optim::SGD>(
        "Trainer 16-mixed DynamicScaler SGD",
        optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.05).momentum(0.9))));
  s.push_back(trainer_subject<amp::True<amp::fp32>, amp::AdamW8bit>("Trainer 32-true AdamW8bit", [](Net& net) {
    return std::make_unique<amp::AdamW8bit>(net->parameters(), torch::optim::AdamWOptions(1e-3),
                                            amp::LowBitOptions().block_size(64));
  }));
  s.push_back(trainer_subject<amp::True<amp::fp64>, torch::optim::SGD>(
      "Trainer 64-true SGD user state", optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.05).momentum(0.9)),
      amp::StepOptions(), 64, [](amp::Trainer<amp::True<amp::fp64>, amp::CPU>& t, torch::optim::SGD& opt) {
        struct Extra {
          torch::optim::StepLR lr;
          at::Tensor ema = torch::arange(6, torch::kFloat);
          int64_t best = 7;
          explicit Extra(torch::optim::SGD& o) : lr(o, 1, 0.5) {}
        };
        auto extra = std::make_shared<Extra>(opt);
        t.user_state().scheduler("lr", extra->lr).tensor("ema", extra->ema).integer("best", extra->best);
        return std::shared_ptr<void>(extra);
      }));
  using Fp8 = amp::Float8<amp::Delayed<4, 1>>;
  if constexpr (amp::is_supported_v<Fp8, amp::CPU>)
    s.push_back(trainer_subject<Fp8, torch::optim::Adam>("Trainer fp8-delayed Adam",
                                                         optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-3)),
                                                         amp::StepOptions().fused(false)));
  {  // Fabric: two models, two optimizers
    struct Own {
      Net a = make_net(), b = make_net(32);
      torch::optim::AdamW oa{a->parameters(), torch::optim::AdamWOptions(1e-3)};
      torch::optim::SGD ob{b->parameters(), torch::optim::SGDOptions(0.01).momentum(0.5)};
      amp::Fabric<Bf16Mixed, amp::CPU> fabric;
    };
    auto own = std::make_shared<Own>();
    own->fabric.setup(own->a, own->oa);
    own->fabric.setup(own->b, own->ob);
    Own* o = own.get();
    Subject f;
    f.kind = "Fabric bf16-mixed two models";
    f.step = [o] {
      o->oa.zero_grad();
      o->ob.zero_grad();
      at::Tensor loss = o->fabric.forward([o](auto&) { return loss_of(o->a) + loss_of(o->b); });
      o->fabric.backward(loss);
      o->fabric.optimizer_step(o->oa);
      o->fabric.optimizer_step(o->ob);
      o->fabric.update();
    };
    f.save = [o](const std::string& p) { o->fabric.save(p); };
    f.load = [o](const std::string& p) { o->fabric.load(p); };
    f.state = [o] {
      std::ostringstream out;
      o->fabric.save_state(out);
      return out.str();
    };
    f.keep = own;
    s.push_back(std::move(f));
  }
  s.push_back(trainer_subject<Bf16Mixed, torch::optim::AdamW>(
      "Trainer + DataParallel rank 0 of 1", optimizer<torch::optim::AdamW>(torch::optim::AdamWOptions(1e-3)),
      amp::StepOptions(), 64, [](amp::Trainer<Bf16Mixed, amp::CPU>& t, torch::optim::AdamW&) {
        return std::shared_ptr<void>(std::make_shared<amp::DataParallel>(world_of_one(), t));
      }));
  s.push_back(trainer_subject<Bf16Mixed, amp::ShardedOptimizer<torch::optim::AdamW>>(
      "Trainer + ShardedOptimizer world 1",
      [](Net& net) {
        return std::make_unique<amp::ShardedOptimizer<torch::optim::AdamW>>(world_of_one(), net->parameters(),
                                                                            torch::optim::AdamWOptions(1e-3));
      },
      amp::StepOptions(), 64,
      [](amp::Trainer<Bf16Mixed, amp::CPU>& t, amp::ShardedOptimizer<torch::optim::AdamW>&) {
        return std::shared_ptr<void>(std::make_shared<amp::DataParallel>(world_of_one(), t));
      }));
  s.push_back(fully_shard_subject("FullyShard consolidated, world 1", amp::FullyShardCheckpoint::kConsolidated));
  s.push_back(fully_shard_set_subject());
  return s;
}

// ---- the damage ----

struct Case {
  std::string damage;  // its class, for the counts
  std::string what;    // this case, for a failure message
  std::string bytes;
};

// Positions of the zip structure: end records, central directory, local headers, descriptors.
std::vector<std::pair<uint64_t, uint64_t>> structure_ranges(const std::string& bytes) {
  std::vector<std::pair<uint64_t, uint64_t>> r;
  const auto entries = entries_of(bytes);
  for (const auto& e : entries) {
    r.emplace_back(e.header, e.data);
    if (e.descriptor > 0) r.emplace_back(e.data + e.compressed, e.data + e.compressed + e.descriptor);
  }
  uint64_t last_data_end = 0;
  for (const auto& e : entries) last_data_end = std::max(last_data_end, e.data + e.compressed + e.descriptor);
  r.emplace_back(last_data_end, bytes.size());  // central directory and end records
  return r;
}

std::string fix_entry(const std::string& bytes, const std::string& name,
                      const std::function<void(std::string&)>& edit) {
  auto entries = raw_entries(bytes);
  for (auto& e : entries)
    if (e.name == name && e.method == 0) {
      edit(e.data);
      e.crc = amp::detail::crc32(0, e.data.data(), e.data.size());
      e.uncompressed = e.data.size();
    }
  return write_zip(entries);
}

std::string name_ending(const std::string& bytes, const std::string& tail) {
  for (const auto& e : entries_of(bytes))
    if (e.name.size() >= tail.size() && e.name.compare(e.name.size() - tail.size(), tail.size(), tail) == 0)
      return e.name;
  return "";
}

// The leaves whose values a checkpoint constrains (a counter, a rate, a scale, a generator, a
// scheduler's step); the user's own tensor and integer ("user/ema", "user/best") may hold any value.
bool constrained(const std::string& path) {
  for (const char* p : {"scaler/", "amp/step", "amp/epoch", "amp/batch_in_epoch", "amp/lr", "amp/rng/", "amp/format",
                        "amp/models", "amp/optimizers", "amp/data_parallel/", "float8/", "user/lr", "amp/fully_shard/"})
    if (path.rfind(p, 0) == 0) return true;
  return false;
}

void leaves(Node& n, const std::string& prefix, std::vector<std::pair<std::string, Node*>>& out) {
  for (auto& [key, child] : n.children) {
    if (child.archive)
      leaves(child, prefix + key + "/", out);
    else
      out.emplace_back(prefix + key, &child);
  }
}

std::vector<Case> damage(const std::string& good, const std::vector<std::string>& others, int64_t random_flips,
                         int64_t structure_flips, std::mt19937_64& rng, int truncation_step = 1,
                         size_t entry_step = 1) {
  std::vector<Case> cases;
  const uint64_t n = good.size();
  for (int pct = 0; pct < 100; pct += truncation_step)
    cases.push_back({"truncated", "truncated at " + std::to_string(pct) + "%", good.substr(0, n * pct / 100)});
  for (int64_t i = 0; i < random_flips; ++i) {
    const uint64_t at = rng() % n;
    const int bit = static_cast<int>(rng() % 8);
    std::string b = good;
    b[at] = static_cast<char>(b[at] ^ (1 << bit));
    cases.push_back({"bit flip", "bit " + std::to_string(bit) + " of byte " + std::to_string(at), std::move(b)});
  }
  const auto ranges = structure_ranges(good);
  uint64_t structure_bytes = 0;
  for (const auto& r : ranges) structure_bytes += r.second - r.first;
  for (int64_t i = 0; i < structure_flips; ++i) {
    uint64_t k = rng() % structure_bytes, at = 0;
    for (const auto& r : ranges) {
      if (k < r.second - r.first) {
        at = r.first + k;
        break;
      }
      k -= r.second - r.first;
    }
    const int bit = static_cast<int>(rng() % 8);
    std::string b = good;
    b[at] = static_cast<char>(b[at] ^ (1 << bit));
    cases.push_back(
        {"bit flip in zip headers", "bit " + std::to_string(bit) + " of byte " + std::to_string(at), std::move(b)});
  }
  // Huge declared sizes: the zip's own fields, then a pickle's with its CRC-32 fixed.
  const auto entries = entries_of(good);
  auto poke = [](std::string b, uint64_t at, uint64_t v, int width) {
    for (int i = 0; i < width; ++i) b[at + static_cast<uint64_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xFF);
    return b;
  };
  {
    const uint64_t eocd = n - 22;
    cases.push_back({"huge size", "end record: central directory size", poke(good, eocd + 12, 0xFFFFFFF0u, 4)});
    cases.push_back({"huge size", "end record: entry count", poke(good, eocd + 10, 0xFFFE, 2)});
    for (size_t k = 0; k < entries.size(); k += 7) {
      const auto& e = entries[k];
      cases.push_back({"huge size", e.name + ": local header size", poke(good, e.header + 22, 0x7FFFFFF0u, 4)});
      // Its central record: find it by name after the last data byte.
      const auto at = good.find(e.name, static_cast<size_t>(entries.back().data));
      if (at != std::string::npos && at >= 46) {
        cases.push_back({"huge size", e.name + ": central compressed size", poke(good, at - 46 + 20, 0xFFFFFFF0u, 4)});
        cases.push_back({"huge size", e.name + ": central sizes",
                         poke(poke(good, at - 46 + 20, 0x7FFFFFF0u, 4), at - 46 + 24, 0x7FFFFFF0u, 4)});
      }
    }
    const std::string pkl = name_ending(good, "/data.pkl");
    for (char op : {'X', 'B', 'r'}) {  // BINUNICODE, BINBYTES, LONG_BINPUT: a 4-byte length or index
      cases.push_back({"huge size", std::string("data.pkl: opcode ") + op + " declares 2 GiB",
                       fix_entry(good, pkl, [op](std::string& d) {
                         std::string four;
                         put(four, 0x7FFFFFF0u, 4);
                         const auto at = d.find(op, 2);
                         if (at != std::string::npos) {
                           d.insert(at, std::string(1, op) + four);  // an extra opcode before the first such one
                         }
                       })});
    }
    cases.push_back({"huge size", "data.pkl: a length field of the first string set to 2 GiB",
                     fix_entry(good, pkl, [](std::string& d) {
                       const auto at = d.find('X', 2);
                       if (at != std::string::npos && at + 5 <= d.size())
                         for (int i = 0; i < 4; ++i) d[at + 1 + static_cast<size_t>(i)] = i == 3 ? '\x7f' : '\xf0';
                     })});
  }
  // Zip entries removed, renamed, duplicated (every CRC-32 valid).
  const auto raw = raw_entries(good);
  for (size_t k = 0; k < raw.size(); k += entry_step) {
    auto removed = raw;
    removed.erase(removed.begin() + static_cast<std::ptrdiff_t>(k));
    cases.push_back({"entry removed", raw[k].name, write_zip(removed)});
    auto renamed = raw;
    renamed[k].name += "x";
    cases.push_back({"entry renamed", raw[k].name, write_zip(renamed)});
    auto twice = raw;
    twice.push_back(raw[k]);
    cases.push_back({"entry duplicated", raw[k].name, write_zip(twice)});
  }
  // A tensor record shorter or longer than its tensor (CRC-32 valid).
  for (size_t k = 0; k < raw.size(); k += 3) {
    if (raw[k].name.find("/data/") == std::string::npos || raw[k].method != 0 || raw[k].data.size() < 4) continue;
    for (bool shorter : {true, false}) {
      auto resized = raw;
      RawEntry& e = resized[k];
      e.data = shorter ? e.data.substr(0, e.data.size() - 4) : e.data + std::string(8, '\x7f');
      e.crc = amp::detail::crc32(0, e.data.data(), e.data.size());
      e.uncompressed = e.data.size();
      cases.push_back({"tensor record resized", raw[k].name + (shorter ? " 4 bytes shorter" : " 8 bytes longer"),
                       write_zip(resized)});
    }
  }
  // Valid archives with a wrong tensor or value.
  Node tree = tree_of(good);
  std::vector<std::pair<std::string, Node*>> all;
  leaves(tree, "", all);
  // Float8's entries "float8/t<i>" hold names[i]: an amax history may hold a recorded inf or NaN.
  std::vector<std::string> float8_names;
  for (auto& [path, leaf] : all)
    if (path == "float8/names")
      for (const auto& name : leaf->value.toListRef()) float8_names.push_back(name.toStringRef());
  auto amax_history = [&](const std::string& path) {
    if (path.rfind("float8/t", 0) != 0) return false;
    const auto i = static_cast<size_t>(std::stoul(path.substr(8)));
    return i < float8_names.size() && float8_names[i].find("amax_history") != std::string::npos;
  };
  for (auto& [path, leaf] : all) {
    const c10::IValue saved = leaf->value;
    auto emit = [&](const std::string& cls, const std::string& how, c10::IValue v) {
      leaf->value = std::move(v);
      cases.push_back({cls, path + ": " + how, bytes_of(tree)});
      leaf->value = saved;
    };
    if (saved.isTensor()) {
      const at::Tensor t = saved.toTensor();
      const at::ScalarType other = t.scalar_type() == at::kDouble ? at::kFloat : at::kDouble;
      emit("tensor of wrong dtype", c10::toString(other), t.detach().to(other).requires_grad_(t.requires_grad()));
      emit("tensor of wrong shape", "one element more",
           at::cat({t.detach().reshape({-1}), t.detach().reshape({-1}).narrow(0, 0, std::min<int64_t>(1, t.numel()))})
               .requires_grad_(t.requires_grad() && at::isFloatingType(t.scalar_type())));
      if (t.dim() >= 1 && t.numel() > 1)
        emit("tensor of wrong shape", "flattened", t.detach().reshape({-1, 1}).requires_grad_(t.requires_grad()));
      if (constrained(path) && at::isFloatingType(t.scalar_type())) {
        for (double bad : {std::nan(""), std::numeric_limits<double>::infinity(), -1.0})
          if (bad < 0.0 || !amax_history(path)) emit("bad value", std::to_string(bad), at::full_like(t.detach(), bad));
      }
      if (constrained(path) && t.scalar_type() == at::kByte)  // a generator's state: every byte 0xFF
        emit("bad value", "all bytes 0xFF", at::full_like(t.detach(), 255));
      if (constrained(path) && (t.scalar_type() == at::kLong || t.scalar_type() == at::kInt))
        emit("bad value", "-1", at::full_like(t.detach(), -1));
    } else if (constrained(path)) {
      if (saved.isInt()) {
        emit("bad value", "-1", c10::IValue(int64_t{-1}));
        emit("bad value", "a double", c10::IValue(0.5));
      } else if (saved.isDouble()) {
        for (double bad : {std::nan(""), std::numeric_limits<double>::infinity(), -1.0})
          emit("bad value", std::to_string(bad), c10::IValue(bad));
      }
      emit("bad value", "a string", c10::IValue(std::string("damaged")));
    }
  }
  for (size_t k = 0; k < others.size(); ++k)
    cases.push_back({"another kind's checkpoint", "#" + std::to_string(k), others[k]});
  return cases;
}

// A case's other files (a sharded set's rank files): those written instead of the undamaged ones, those left out.
struct Side {
  std::map<std::string, std::string> files;
  std::vector<std::string> removed;
};

// The manifest with rank r's file's size and CRC-32 those of `bytes` (as if the damage came before the save).
std::string resign(const std::string& manifest, int r, const std::string& bytes) {
  Node tree = tree_of(manifest);
  for (auto& [key, leaf] : tree.children) {
    if (key == "amp/fully_shard/size" + std::to_string(r)) leaf.value = c10::IValue(static_cast<int64_t>(bytes.size()));
    if (key == "amp/fully_shard/crc" + std::to_string(r))
      leaf.value = c10::IValue(static_cast<int64_t>(amp::detail::crc32(0, bytes.data(), bytes.size())));
  }
  return bytes_of(tree);
}

// A sharded set's cases beyond its manifest's: each rank file damaged as any checkpoint (with the manifest
// re-signed for it, so that the loader's own checks are reached; every 16th also with the manifest as saved;
// fewer entries removed, renamed or duplicated than in the manifest),
// the file of another save (stale), a missing file.
void rank_file_cases(const std::string& manifest, const std::map<std::string, std::string>& side,
                     const std::map<std::string, std::string>& stale, int64_t flips, int truncation_step,
                     size_t entry_step, std::mt19937_64& rng, std::vector<Case>& cases, std::vector<Side>& sides) {
  int r = 0;
  auto stale_it = stale.begin();
  for (const auto& [file, good] : side) {
    const std::string rank = "rank " + std::to_string(r) + " file";
    const std::vector<Case> fc = damage(good, {}, flips, flips / 2, rng, truncation_step, entry_step);
    for (size_t i = 0; i < fc.size(); ++i) {
      cases.push_back({rank + " (manifest re-signed): " + fc[i].damage, fc[i].what, resign(manifest, r, fc[i].bytes)});
      sides.push_back({{{file, fc[i].bytes}}, {}});
      if (i % 16 == 0) {
        cases.push_back({rank + ": " + fc[i].damage, fc[i].what, manifest});
        sides.push_back({{{file, fc[i].bytes}}, {}});
      }
    }
    if (stale_it != stale.end()) {
      cases.push_back({rank + ": another save's", stale_it->first, manifest});
      sides.push_back({{{file, stale_it->second}}, {}});
      cases.push_back(
          {rank + " (manifest re-signed): another save's", stale_it->first, resign(manifest, r, stale_it->second)});
      sides.push_back({{{file, stale_it->second}}, {}});
      ++stale_it;
    }
    cases.push_back({rank + ": missing", file, manifest});
    sides.push_back({{}, {file}});
    ++r;
  }
}

// ---- the campaign ----

struct Counts {
  int64_t refused = 0, loaded_same = 0, bad = 0;
};

struct Result {
  std::map<std::string, double> seconds;                        // kind -> time of its loads
  std::map<std::string, std::map<std::string, Counts>> counts;  // kind -> damage -> outcome counts
  std::vector<std::string> failures;
  int64_t cases = 0;
};

void run_cases(Subject& s, const std::vector<Case>& cases, const std::vector<Side>& sides,
               const std::string& before_path, const State& ck, Result& result) {
  const std::string path = s.case_path.empty() ? tmp_path("campaign_case.pt") : s.case_path;
  const bool verbose = std::getenv("AMP_CAMPAIGN_VERBOSE") != nullptr;
  State before = state_of(s);
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    ++result.cases;
    Counts& counts = result.counts[s.kind][c.damage];
    write_file(path, c.bytes);
    const Side none;
    const Side& side = i < sides.size() ? sides[i] : none;
    for (const auto& [file, bytes] : s.side_good) {
      if (std::find(side.removed.begin(), side.removed.end(), file) != side.removed.end()) {
        std::remove(file.c_str());
        continue;
      }
      auto it = side.files.find(file);
      write_file(file, it != side.files.end() ? it->second : bytes);
    }
    std::string error, other;
    try {
      s.load(path);
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    } catch (const std::exception& e) {
      other = e.what();
    } catch (...) {
      other = "an exception that is not a std::exception";
    }
    State after;
    std::string wrong;
    try {
      after = state_of(s);
    } catch (const std::exception& e) {  // the load left a state that cannot even be saved
      wrong = std::string("the state cannot be saved after the load: ") + e.what();
    }
    if (!wrong.empty()) {
    } else if (!other.empty()) {
      wrong = "escaped as another exception type: " + other;
    } else if (!error.empty()) {
      if (error.rfind("amp: ", 0) != 0 || error.find(path) == std::string::npos)
        wrong = "the error does not start with amp: or does not name the file: " + error;
      else if (after != before)
        wrong = "refused, but the state changed (a partial load) at " + first_difference(before, after) + ": " + error;
    } else if (after != ck) {
      wrong = "loaded damaged data silently: " + first_difference(ck, after) + " differs";
    }
    if (wrong.empty()) {
      ++(error.empty() ? counts.loaded_same : counts.refused);
    } else {
      ++counts.bad;
      const std::string line = s.kind + " / " + c.damage + " / " + c.what + ": " + wrong.substr(0, 400);
      if (verbose) std::cerr << line << "\n";
      if (result.failures.size() < 40) result.failures.push_back(line);
    }
    if (error.empty() || !wrong.empty()) {  // back to the state before, for the next case
      s.load(before_path);
      before = state_of(s);
    }
  }
}

int64_t requested_cases() {
  const char* v = std::getenv("AMP_CAMPAIGN_CASES");
  return v ? std::atoll(v) : 0;
}

TEST(CheckpointCampaign, EveryDamagedCheckpointIsRefusedOrLoadsTheSameState) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<Subject> all = subjects();
  // Each kind: two steps, the checkpoint; one more step, the state "before" each load.
  std::vector<std::string> good(all.size()), before_paths(all.size());
  std::vector<State> ck(all.size());
  for (size_t k = 0; k < all.size(); ++k) {
    auto& s = all[k];
    if (s.make_good) {
      good[k] = s.make_good();
      s.side_good = set_files(s.case_path);
    } else {
      s.step();
      s.step();
      const std::string path = tmp_path("campaign_good_" + std::to_string(k) + ".pt");
      s.save(path);
      good[k] = read_file(path);
    }
    ck[k] = state_of(s);
    s.step();
    before_paths[k] = tmp_path("campaign_before_" + std::to_string(k) + ".pt");
    s.save(before_paths[k]);
    ASSERT_NE(state_of(s), ck[k]) << s.kind << ": the state before must differ from the checkpoint's";
  }
  // The same policy, another model (wider layers): refused by every kind of its policy.
  Subject wide = trainer_subject<Bf16Mixed, torch::optim::AdamW>(
      "wide", optimizer<torch::optim::AdamW>(torch::optim::AdamWOptions(1e-3)), amp::StepOptions().fused(false), 48);
  wide.step();
  wide.save(tmp_path("campaign_wide.pt"));
  const std::string wide_bytes = read_file(tmp_path("campaign_wide.pt"));
  // FullyShard's: another model's (wider) consolidated file and manifest, a manifest of world 1 (its
  // rank files removed: a set of another world size whose files are not beside it).
  std::vector<std::string> fully_shard_others;
  for (const int64_t width : {48, 37}) {
    Subject fs = fully_shard_subject("other", amp::FullyShardCheckpoint::kSharded, width);
    fs.step();
    const std::string set = tmp_path("campaign_fs_other_" + std::to_string(width) + ".pt");
    fs.save(set);
    fully_shard_others.push_back(read_file(set));
    for (const auto& kv : set_files(set)) std::remove(kv.first.c_str());
    if (width != 37) {
      amp::save_fully_sharded(*static_cast<FsRun*>(fs.keep.get())->trainer, set);
      fully_shard_others.push_back(read_file(set));
    }
  }

  // A few thousand cases by default; AMP_CAMPAIGN_CASES raises the random flips to reach it.
  const int64_t target = requested_cases();
  const int64_t fixed_per_kind = 400;  // about: truncation, sizes, entries, values, other kinds
  const int64_t flips =
      target > 0 ? std::max<int64_t>(60, target / static_cast<int64_t>(all.size()) - fixed_per_kind) : 50;
  // The full run: truncation at each 1% of the file, every entry removed, renamed, duplicated; by default
  // each 2%, every other entry.
  const int truncation_step = target > 0 ? 1 : 2;
  const size_t entry_step = target > 0 ? 1 : 2;
  std::mt19937_64 rng(61);
  Result result;
  for (size_t k = 0; k < all.size(); ++k) {
    // Another policy's, another model's (wider, or Fabric's two against a Trainer's one).
    auto fabric = [&](size_t i) { return ck[i].count("amp/models") > 0; };
    std::vector<std::string> others;
    // FullyShard's kinds (a model of their own): every other kind's, and the FullyShard ones above.
    auto fully_shard = [&](size_t i) { return all[i].kind.rfind("FullyShard", 0) == 0; };
    if (!fabric(k)) others.push_back(wide_bytes);
    for (size_t j = 0; j < all.size(); ++j)
      if (j != k && (ck[j].at("amp/precision") != ck[k].at("amp/precision") || fabric(j) != fabric(k) ||
                     (fully_shard(k) && !fully_shard(j))))
        others.push_back(good[j]);
    if (fully_shard(k)) others.insert(others.end(), fully_shard_others.begin(), fully_shard_others.end());
    std::vector<Case> cases = damage(good[k], others, flips, flips / 2, rng, truncation_step, entry_step);
    std::vector<Side> sides;
    if (!all[k].side_good.empty()) {
      for (auto& c : cases) c.damage = "manifest: " + c.damage;
      sides.resize(cases.size());
      rank_file_cases(good[k], all[k].side_good, set_files(all[k].case_path + ".stale"), flips / 2, truncation_step * 5,
                      entry_step * 2, rng, cases, sides);
    }
    const char* only = std::getenv("AMP_CAMPAIGN_KIND");  // to rerun one kind's cases (the same ones)
    if (only != nullptr && std::to_string(k) != only) continue;
    all[k].load(before_paths[k]);
    const auto kind_start = std::chrono::steady_clock::now();
    run_cases(all[k], cases, sides, before_paths[k], ck[k], result);
    result.seconds[all[k].kind] = std::chrono::duration<double>(std::chrono::steady_clock::now() - kind_start).count();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  std::cout << "corruption campaign: " << result.cases << " cases in " << seconds << " s\n";
  std::cout << "kind | damage | cases | (a) refused | (b) loaded, same state | bad\n";
  std::map<std::string, Counts> per_kind;
  for (const auto& [kind, by_damage] : result.counts)
    for (const auto& [dmg, c] : by_damage) {
      std::cout << kind << " | " << dmg << " | " << c.refused + c.loaded_same + c.bad << " | " << c.refused << " | "
                << c.loaded_same << " | " << c.bad << "\n";
      per_kind[kind].refused += c.refused;
      per_kind[kind].loaded_same += c.loaded_same;
      per_kind[kind].bad += c.bad;
    }
  std::cout << "per kind:\n";
  for (const auto& [kind, c] : per_kind)
    std::cout << kind << " | " << c.refused + c.loaded_same + c.bad << " | " << c.refused << " | " << c.loaded_same
              << " | " << c.bad << " | " << result.seconds[kind] << " s\n";
  for (const auto& f : result.failures) ADD_FAILURE() << f;
  if (target > 0) {
    EXPECT_GE(result.cases, target);
  }
}

}  // namespace checkpoint_campaign_test
