// amp/distributed/detail/checkpoint_entries.h: a Trainer archive's entries as
// FullyShard's checkpoints read and rewrite them: a copy with some tensors
// replaced, the model's entries by parameter name, and the optimizer's state
// fields by parameter index.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "amp/detail/zip_bytes.h"

namespace amp::detail {

using ArchivePath = std::vector<std::string>;
using TensorSubstitute = std::function<std::optional<at::Tensor>(const ArchivePath&)>;

// Copies `in` into `out` entry by entry (sub-archives recursively); a tensor
// is replaced by substitute(its path) where that returns one.
inline void copy_archive(torch::serialize::InputArchive& in, torch::serialize::OutputArchive& out, ArchivePath& path,
                         const TensorSubstitute& substitute) {
  for (const std::string& key : in.keys()) {
    path.push_back(key);
    torch::serialize::InputArchive sub;
    if (in.try_read(key, sub)) {
      torch::serialize::OutputArchive copy(out.compilation_unit());
      copy_archive(sub, copy, path, substitute);
      out.write(key, copy);
    } else {
      c10::IValue v;
      in.read(key, v);
      if (v.isTensor()) {
        const std::optional<at::Tensor> t = substitute(path);
        out.write(key, t ? *t : v.toTensor(), /*is_buffer=*/true);
      } else {
        out.write(key, v);
      }
    }
    path.pop_back();
  }
}

inline std::string archive_bytes(torch::serialize::OutputArchive& archive) {
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

inline std::string join(const std::vector<std::string>& parts, size_t begin, size_t end, char sep) {
  std::string out;
  for (size_t i = begin; i < end; ++i) out += (i > begin ? std::string(1, sep) : std::string()) + parts[i];
  return out;
}

// The optimizer archive's state keys, by parameter index: its param_groups'
// lists, position by position against the optimizer's (`positions`).
inline std::map<std::string, size_t> state_keys(torch::serialize::InputArchive& optim,
                                                const std::vector<std::vector<size_t>>& positions,
                                                const std::string& source) {
  auto fail = [&](const std::string& why) {
    TORCH_CHECK(false, "amp: ", source, ": its optimizer ", why,
                ": it was written for another optimizer or model, or is damaged");
  };
  torch::serialize::InputArchive groups;
  at::Tensor count;
  if (!optim.try_read("param_groups", groups) || !groups.try_read("param_groups/size", count) || count.numel() != 1)
    fail("has no parameter groups");
  if (count.item<int64_t>() != static_cast<int64_t>(positions.size()))
    fail("has " + std::to_string(count.item<int64_t>()) + " parameter groups where this one has " +
         std::to_string(positions.size()));
  std::map<std::string, size_t> keys;
  for (size_t g = 0; g < positions.size(); ++g) {
    torch::serialize::InputArchive group;
    at::Tensor n;
    if (!groups.try_read("param_groups/" + std::to_string(g), group) || !group.try_read("params/size", n) ||
        n.numel() != 1 || n.item<int64_t>() != static_cast<int64_t>(positions[g].size()))
      fail("has another number of parameters in group " + std::to_string(g));
    for (size_t j = 0; j < positions[g].size(); ++j) {
      c10::IValue key;
      if (!group.try_read("params/" + std::to_string(j), key) || !key.isString())
        fail("lacks parameter " + std::to_string(j) + " of group " + std::to_string(g));
      keys[key.toStringRef()] = positions[g][j];
    }
  }
  return keys;
}

// A parameter's optimizer state in an archive: field name -> value.
using StateFields = std::map<std::string, c10::IValue>;

// Each parameter's state fields in `optim` (an optimizer's archive), by index.
inline std::map<size_t, StateFields> read_state_fields(torch::serialize::InputArchive& optim,
                                                       const std::map<std::string, size_t>& keys,
                                                       const std::string& source) {
  std::map<size_t, StateFields> out;
  torch::serialize::InputArchive state;
  if (!optim.try_read("state", state)) return out;
  for (const std::string& key : state.keys()) {
    auto it = keys.find(key);
    TORCH_CHECK(it != keys.end(), "amp: ", source, ": its optimizer holds state for '", key,
                "', which none of its parameter groups lists: it is damaged");
    torch::serialize::InputArchive fields;
    TORCH_CHECK(state.try_read(key, fields), "amp: ", source, ": its optimizer state '", key, "' is damaged");
    StateFields f;
    for (const std::string& name : fields.keys()) {
      c10::IValue v;
      fields.read(name, v);
      f[name] = v;
    }
    out[it->second] = std::move(f);
  }
  return out;
}

// Whether a state field is elementwise with a tensor of `shape` (sharded with it).
inline bool elementwise(const c10::IValue& v, at::IntArrayRef shape) {
  return v.isTensor() && v.toTensor().defined() && v.toTensor().dim() >= 1 && v.toTensor().sizes() == shape;
}

// The tensor under `name` ("blocks.0.fc1.weight") in a model archive.
inline std::optional<at::Tensor> read_model_entry(torch::serialize::InputArchive& model, const std::string& name) {
  std::vector<std::string> parts;
  std::stringstream ss(name);
  for (std::string part; std::getline(ss, part, '.');) parts.push_back(part);
  std::vector<torch::serialize::InputArchive> chain(parts.size());
  torch::serialize::InputArchive* here = &model;
  for (size_t k = 0; k + 1 < parts.size(); ++k) {
    if (!here->try_read(parts[k], chain[k])) return std::nullopt;
    here = &chain[k];
  }
  at::Tensor t;
  if (!here->try_read(parts.back(), t)) return std::nullopt;
  return t;
}

inline std::string crc_hex(const std::string& bytes) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%08x", static_cast<unsigned>(crc32(0, bytes.data(), bytes.size())));
  return buf;
}

// A parameter's state fields as one line: elementwise ones (with `shape`) by
// dtype, others by value (tensors by dtype, shape and CRC-32).
inline std::string describe_fields(const StateFields& fields, at::IntArrayRef shape) {
  std::string s;
  for (const auto& kv : fields) {
    s += kv.first + "=";
    if (elementwise(kv.second, shape)) {
      s += "E" + std::string(c10::toString(kv.second.toTensor().scalar_type()));
    } else if (kv.second.isTensor() && kv.second.toTensor().defined()) {
      const at::Tensor t = kv.second.toTensor().contiguous().to(at::kCPU);
      s += "T" + std::string(c10::toString(t.scalar_type())) + c10::str(t.sizes()) +
           crc_hex(std::string(static_cast<const char*>(t.data_ptr()), t.nbytes()));
    } else {
      std::ostringstream v;
      v << kv.second;
      s += "V" + v.str();
    }
    s += ",";
  }
  return s;
}

// A model entry of `source` for parameter `name`: there, fp32, of `shape`.
inline void check_entry(const std::optional<at::Tensor>& t, at::IntArrayRef shape, const std::string& source,
                        const std::string& name) {
  TORCH_CHECK(t && t->defined(), "amp: ", source, " has no 'model/", name,
              "' for this model: it was written for another model, or is damaged");
  TORCH_CHECK(t->sizes() == shape && t->scalar_type() == at::kFloat, "amp: ", source, "'s 'model/", name, "' is ",
              t->toString(), c10::str(t->sizes()), " but this model's is Float", c10::str(shape),
              ": it was written for another model, or is damaged");
}

}  // namespace amp::detail
