#include "amp/python_checkpoint.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <caffe2/serialize/inline_container.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>

#include "amp/grad_scaler.h"
#include "amp/optimizer.h"
#include "options/format.h"
#include "optim/lean_masters.h"
#include "optim/master_weights.h"
#include "optim/sharding.h"
#include "optim/fp32_values.h"
#include "casting/model_casting.h"
#include "interop/optimizer_formats.h"
#include "optim/optimizer_access.h"
#include "optim/param_index.h"
#include "optim/state_format.h"
#include "optim/optimizer_state_key.h"
#include "interop/pickle.h"
#include "interop/python_values.h"
#include "interop/zip_directory.h"

// The pickle codec is src/interop/pickle.h (NOTE [Reading Python pickles without LibTorch's unpickler]); this file maps
// Python's model, optimizer, amp and GradScaler states to LibTorch's and amp's. The zip itself is read and
// written with caffe2's PyTorchStreamReader/Writer, as torch.save does, each record checked against the zip's
// central directory (zip_directory.h).

namespace amp {
namespace {

using detail::pickle::check_text;
using detail::pickle::check_texts;
using detail::pickle::kind_name;
using detail::pickle::Node;
using detail::pickle::NodePtr;
using detail::pickle::ToIValue;

// ---------------------------------------------------------------------------------------------------
// Helpers for the load_* and put_* methods.

using detail::as_number;
using detail::key_text;
using detail::quoted_list;
using detail::state_key;
using detail::type_of;

// One parameter's state, read and checked, ready to be installed.
struct PendingState {
  at::Tensor param;  // the tensor in param_groups (the fp32 master at O2)
  std::unique_ptr<torch::optim::OptimizerParamState> state;  // null: no state
};

// Returns the tensors as a Python state_dict for put_optimizer.
c10::IValue cpu_copy(const at::Tensor& t) { return t.detach().to(at::kCPU).clone(); }

c10::IValue step_tensor(int64_t step) { return at::scalar_tensor(static_cast<double>(step), at::kFloat); }

}  // namespace

// ---------------------------------------------------------------------------------------------------
// PythonCheckpointLoadOptions

PythonCheckpointLoadOptions& PythonCheckpointLoadOptions::strip_prefix(std::string prefix) {
  return replace_prefix(std::move(prefix), "");
}

PythonCheckpointLoadOptions& PythonCheckpointLoadOptions::replace_prefix(std::string from, std::string to) {
  TORCH_CHECK(!from.empty(), "amp::PythonCheckpointLoadOptions: the prefix to strip or replace is empty; name it "
              "(\"module.\" for a checkpoint of a DistributedDataParallel model).");
  rules_.emplace_back(std::move(from), std::move(to));
  return *this;
}

PythonCheckpointLoadOptions& PythonCheckpointLoadOptions::strict(bool strict) {
  strict_ = strict;
  return *this;
}

std::string PythonCheckpointLoadOptions::map_key(const std::string& key) const {
  std::string out = key;
  for (const auto& [from, to] : rules_) {
    if (out.compare(0, from.size(), from) == 0) out = to + out.substr(from.size());
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------
// PythonCheckpoint: reading

PythonCheckpoint PythonCheckpoint::load(const std::string& path) {
  {
    std::ifstream probe(path, std::ios::binary);
    TORCH_CHECK(probe.good(), "amp::PythonCheckpoint::load: cannot open '", path, "'. Check the path.");
    char magic[2] = {0, 0};
    probe.read(magic, 2);
    TORCH_CHECK(!(probe.gcount() == 2 && static_cast<uint8_t>(magic[0]) == 0x80 && magic[1] == 2),
                "amp::PythonCheckpoint::load: '", path, "' was written by torch.save's legacy format "
                "(_use_new_zipfile_serialization=False or torch < 1.6). Re-save it in Python with "
                "torch.save(torch.load(path), path) under torch >= 1.6.");
  }
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader;
  try {
    reader = std::make_unique<caffe2::serialize::PyTorchStreamReader>(path);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "amp::PythonCheckpoint::load: '", path, "' is not a file written by Python's torch.save (not "
                "a zip archive: ", e.what_without_backtrace(), "). PythonCheckpoint reads what torch.save({...}, path) "
                "writes; for torch::save archives of C++ modules use torch::load or amp::load_weights.");
  }
  TORCH_CHECK(reader->hasRecord("data.pkl") && !reader->hasRecord("constants.pkl"), "amp::PythonCheckpoint::load: '",
              path, "' is a TorchScript module or a C++ torch::save archive, not a file written by Python's torch.save. "
              "Load C++ archives with torch::load or amp::load_weights, TorchScript with torch::jit::load.");
  // Every record is checked against the zip's central directory before its bytes are used: the stream
  // reader returns uninitialized memory for a record miniz skips (see zip_directory.h).
  std::map<std::string, detail::ZipRecord> directory;
  try {
    directory = detail::read_zip_directory(path);
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, "amp::PythonCheckpoint::load: '", path, "' cannot be read: ", e.what(),
                ". The file is damaged or truncated; save it again.");
  }
  std::string prefix;  // torch.save's archive name, "<name>/"
  for (const auto& [name, record] : directory) {
    if (name.size() >= 9 && name.compare(name.size() - 9, 9, "/data.pkl") == 0) prefix = name.substr(0, name.size() - 8);
  }
  auto read_record = [&](const std::string& record) {
    const auto it = directory.find(prefix + record);
    if (it == directory.end()) throw std::runtime_error("the record '" + record + "' is missing from the zip directory");
    const detail::ZipRecord& z = it->second;
    auto damaged = [&](const std::string& why) {
      return std::runtime_error("the record '" + record + "' " + why + "; the file is damaged, save it again");
    };
    if (z.is_directory) {
      std::ostringstream attributes;
      attributes << std::hex << z.external_attributes;
      throw damaged("is marked as a directory in the zip directory (external attributes 0x" + attributes.str() +
                    "), so its bytes would not be read");
    }
    if (z.method != 0 && z.method != 8) throw damaged("has compression method " + std::to_string(z.method));
    if (z.uncompressed_size > 0 && (z.compressed_size == 0 || (z.method == 0 && z.compressed_size != z.uncompressed_size))) {
      throw damaged("has a compressed size of " + std::to_string(z.compressed_size) + " bytes for " +
                    std::to_string(z.uncompressed_size) + " bytes of data");
    }
    auto [data, size] = reader->getRecord(record);
    if (size != z.uncompressed_size) {
      throw damaged("holds " + std::to_string(size) + " bytes where the zip directory says " +
                    std::to_string(z.uncompressed_size));
    }
    // torch.save with compute_crc32=False writes 0 and leaves nothing to compare with.
    if (z.crc32 != 0 && detail::crc32(data.get(), size) != z.crc32) throw damaged("does not match its CRC-32");
    return std::make_pair(std::move(data), size);
  };
  std::pair<at::DataPtr, size_t> pickle_record;
  try {
    if (reader->hasRecord("byteorder")) {
      auto [data, size] = read_record("byteorder");
      const std::string order(static_cast<const char*>(data.get()), size);
      TORCH_CHECK(order == "little", "amp::PythonCheckpoint::load: '", path, "' was written on a ", order,
                  "-endian machine; amp reads little-endian checkpoints.");
    }
    pickle_record = read_record("data.pkl");
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, "amp::PythonCheckpoint::load: '", path, "' is not a valid torch.save checkpoint: ", e.what(), ".");
  }
  auto& [pickle, pickle_size] = pickle_record;
  auto load_storage = [&](const std::string& key, c10::ScalarType dtype, int64_t numel) {
    const std::string record = "data/" + key;
    if (!reader->hasRecord(record)) {
      throw std::runtime_error("the tensor data '" + record + "' is missing from the archive");
    }
    auto [data, size] = read_record(record);
    const size_t item = c10::elementSize(dtype);
    if (static_cast<uint64_t>(numel) > size / item) {
      throw std::runtime_error("the tensor data '" + record + "' has " + std::to_string(size) + " bytes, less than " +
                               std::to_string(numel) + " elements of " + std::to_string(item) + " bytes");
    }
    const size_t need = static_cast<size_t>(numel) * item;
    c10::Storage storage(c10::Storage::use_byte_size_t(), need, std::move(data), /*allocator=*/nullptr,
                         /*resizable=*/false);
    return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(storage, 0, {numel}, {1});
  };
  detail::pickle::Unpickled unpickled;
  try {
    unpickled = detail::pickle::unpickle(static_cast<const char*>(pickle.get()), pickle_size, load_storage);
  } catch (const std::exception& e) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    TORCH_CHECK(false, "amp::PythonCheckpoint::load: '", path, "' is not a valid torch.save checkpoint: ",
                (c10_error ? c10_error->what_without_backtrace() : e.what()), ".");
  }
  const NodePtr& root = unpickled.root;
  TORCH_CHECK(root->kind == Node::Kind::kDict, "amp::PythonCheckpoint::load: '", path, "' holds ",
              kind_name(root->kind), (root->kind == Node::Kind::kObject ? " (" + root->text + ")" : std::string()),
              ", not a dict. PythonCheckpoint reads files written by torch.save of a dict: torch.save({'model': "
              "model.state_dict(), 'optimizer': optimizer.state_dict(), ...}, path), or torch.save(model.state_dict(), path).");

  PythonCheckpoint checkpoint;
  checkpoint.path_ = path;
  ToIValue converter;
  for (size_t i = 0; i + 1 < root->items.size(); i += 2) {
    const NodePtr& key = root->items[i];
    TORCH_CHECK(key->kind == Node::Kind::kString, "amp::PythonCheckpoint::load: '", path, "' is a dict with a key "
                "that is ", kind_name(key->kind), "; PythonCheckpoint reads dicts with str keys.");
    TORCH_CHECK(!key->bad_utf8, "amp::PythonCheckpoint::load: '", path, "' has an entry whose name '",
                detail::escape_bytes(key->text), "' is not valid UTF-8 (byte ", key->bad_utf8.value_or(0), "); Python's "
                "torch.load refuses such a file with UnicodeDecodeError. Re-save it with str keys that are UTF-8 text.");
    Entry entry{key->text, c10::IValue(), ""};
    try {
      entry.value = converter.convert(root->items[i + 1], "entry '" + key->text + "'");
    } catch (const detail::pickle::InvalidText& e) {
      TORCH_CHECK(false, "amp::PythonCheckpoint::load: '", path, "': ", e.what(), "; Python's torch.load refuses such "
                  "a file with UnicodeDecodeError. Re-save that value in Python as bytes, or as text decoded from its "
                  "real encoding (e.g. b.decode('latin-1')).");
    } catch (const std::runtime_error& e) {
      entry.unreadable = e.what();
    }
    // A key written twice: the last value wins, as in Python.
    auto same = std::find_if(checkpoint.entries_.begin(), checkpoint.entries_.end(),
                             [&](const Entry& x) { return x.key == entry.key; });
    if (same != checkpoint.entries_.end()) {
      *same = std::move(entry);
    } else {
      checkpoint.entries_.push_back(std::move(entry));
    }
  }
  // A bad str inside a value C++ keeps opaque (an object's state, a set): Python refuses the file all the same.
  TORCH_CHECK(!unpickled.first_bad_utf8, "amp::PythonCheckpoint::load: '", path, "' holds a str that is not valid "
              "UTF-8 (data.pkl byte ", unpickled.first_bad_utf8.value_or(0), "), inside a Python object; Python's "
              "torch.load refuses such a file with UnicodeDecodeError. Re-save it with that text as UTF-8 or bytes.");
  return checkpoint;
}

std::string PythonCheckpoint::where() const { return path_.empty() ? "the checkpoint" : "'" + path_ + "'"; }

const PythonCheckpoint::Entry* PythonCheckpoint::find(std::string_view key) const {
  for (const auto& e : entries_) {
    if (e.key == key) return &e;
  }
  return nullptr;
}

bool PythonCheckpoint::contains(std::string_view key) const { return find(key) != nullptr; }

std::vector<std::string> PythonCheckpoint::keys() const {
  std::vector<std::string> out;
  for (const auto& e : entries_) out.push_back(e.key);
  return out;
}

const c10::IValue& PythonCheckpoint::value_of(std::string_view key, const char* method) const {
  const Entry* e = find(key);
  TORCH_CHECK(e != nullptr, "amp::PythonCheckpoint::", method, ": ", where(), " has no entry '", key, "' (it has ",
              (entries_.empty() ? std::string("no entries") : quoted_list(keys())), "). Pass the key the Python "
              "script saved it under.");
  TORCH_CHECK(e->unreadable.empty(), "amp::PythonCheckpoint::", method, ": ", where(), ": ", e->unreadable);
  return e->value;
}

c10::IValue PythonCheckpoint::get(std::string_view key) const { return value_of(key, "get"); }

void PythonCheckpoint::load_model(torch::nn::Module& module, std::string_view key) const {
  load_model(module, key, PythonCheckpointLoadOptions());
}

void PythonCheckpoint::load_model(torch::nn::Module& module, std::string_view key,
                                  const PythonCheckpointLoadOptions& options) const {
  const std::string what = key.empty() ? where() : "entry '" + key_text(key) + "'";
  // The state_dict: one entry, or (empty key) the whole file, as torch.save(model.state_dict(), path) writes.
  std::vector<std::pair<std::string, c10::IValue>> state;
  if (key.empty()) {
    for (const auto& e : entries_) {
      TORCH_CHECK(e.unreadable.empty(), "amp::PythonCheckpoint::load_model: ", where(), ": ", e.unreadable);
      state.emplace_back(e.key, e.value);
    }
  } else {
    if (!contains(key)) {
      const bool bare = !entries_.empty() && std::all_of(entries_.begin(), entries_.end(), [](const Entry& e) {
        return e.unreadable.empty() && e.value.isTensor();
      });
      TORCH_CHECK(!bare, "amp::PythonCheckpoint::load_model: ", where(), " has no entry '", key, "': it is a bare "
                  "state_dict (torch.save(model.state_dict(), path), keys ", quoted_list(keys(), 4), "). Load it "
                  "with an empty key: load_model(module, \"\").");
    }
    const c10::IValue& value = value_of(key, "load_model");
    TORCH_CHECK(value.isGenericDict(), "amp::PythonCheckpoint::load_model: ", what, " of ", where(), " is ",
                type_of(value), ", not a state_dict (a dict of tensors). Pass the key of model.state_dict().");
    for (const auto& item : value.toGenericDict()) {
      TORCH_CHECK(item.key().isString(), "amp::PythonCheckpoint::load_model: ", what, " of ", where(),
                  " has a key that is ", type_of(item.key()), ", so it is not a model's state_dict.");
      state.emplace_back(item.key().toStringRef(), item.value());
    }
  }

  const std::vector<std::pair<std::string, at::Tensor>> targets = detail::named_tensors(module);
  std::unordered_map<std::string, size_t> target_index;
  for (size_t i = 0; i < targets.size(); ++i) target_index.emplace(targets[i].first, i);

  struct Pending {
    std::string key;  // as in the checkpoint
    at::Tensor target;
    at::Tensor value;
  };
  std::vector<Pending> pending;
  std::vector<std::string> unexpected;
  std::unordered_map<std::string, std::string> mapped_from;  // module name -> checkpoint key
  for (const auto& [ckpt_key, value] : state) {
    const std::string name = options.map_key(ckpt_key);
    const auto it = target_index.find(name);
    if (it == target_index.end()) {
      unexpected.push_back(ckpt_key);
      continue;
    }
    const auto [prev, inserted] = mapped_from.emplace(name, ckpt_key);
    TORCH_CHECK(inserted, "amp::PythonCheckpoint::load_model: ", what, " has both '", prev->second, "' and '", ckpt_key,
                "', which the prefix rules both map to '", name, "'.");
    const at::Tensor& target = targets[it->second].second;
    TORCH_CHECK(value.isTensor(), "amp::PythonCheckpoint::load_model: '", ckpt_key, "' in ", what, " is ", type_of(value),
                ", not a tensor.");
    const at::Tensor& t = value.toTensor();
    TORCH_CHECK(t.sizes() == target.sizes(), "amp::PythonCheckpoint::load_model: '", ckpt_key, "' has shape ",
                t.sizes(), " in the checkpoint and ", target.sizes(), " in the model",
                (ckpt_key == name ? std::string() : " ('" + name + "')"), ".");
    TORCH_CHECK(t.is_floating_point() == target.is_floating_point(), "amp::PythonCheckpoint::load_model: '", ckpt_key,
                "' is ", t.scalar_type(), " in the checkpoint and ", target.scalar_type(), " in the model.");
    detail::check_loadable(target, name, "amp::PythonCheckpoint::load_model");
    pending.push_back({ckpt_key, target, t});
  }
  std::vector<std::string> missing;
  for (const auto& [name, tensor] : targets) {
    if (!mapped_from.count(name)) missing.push_back(name);
  }
  if (options.strict() && (!missing.empty() || !unexpected.empty())) {
    std::string hint;
    // A DistributedDataParallel / DataParallel model's state_dict: every key starts with "module.".
    const bool ddp = !unexpected.empty() && std::all_of(unexpected.begin(), unexpected.end(), [](const std::string& k) {
      return k.compare(0, 7, "module.") == 0;
    });
    if (ddp) {
      hint = " The checkpoint's keys start with 'module.' (saved from a DistributedDataParallel or DataParallel "
             "model): pass amp::PythonCheckpointLoadOptions().strip_prefix(\"module.\").";
    } else {
      hint = " Map the names with amp::PythonCheckpointLoadOptions().strip_prefix(...) / replace_prefix(...), or skip "
             "them with .strict(false).";
    }
    TORCH_CHECK(false, "amp::PythonCheckpoint::load_model: ", what, " does not match the model.",
                (missing.empty() ? std::string() : " Missing key(s) in the checkpoint: " + quoted_list(missing) + "."),
                (unexpected.empty() ? std::string() : " Unexpected key(s) in the checkpoint: " + quoted_list(unexpected) + "."),
                hint);
  }
  TORCH_CHECK(!pending.empty() || targets.empty(), "amp::PythonCheckpoint::load_model: none of the keys of ", what,
              " (", quoted_list(unexpected, 4), ") names a parameter or buffer of the model (", quoted_list(missing, 4),
              "); map the names with amp::PythonCheckpointLoadOptions().strip_prefix(...) / replace_prefix(...).");

  // Everything read and checked: now write (as amp::load_weights does).
  for (const auto& p : pending) detail::write_loaded(p.target, p.value);
}

void PythonCheckpoint::load_optimizer(OptimizerBase& optimizer, std::string_view key) const {
  torch::optim::Optimizer& torch_optimizer = detail::OptimizerAccess::synced_torch_optimizer(optimizer);
  const auto names = detail::OptimizerAccess::param_group_names(optimizer);  // for messages
  load_optimizer_state(torch_optimizer, key, [&](const at::Tensor& p) {
    const auto it = names.find(p.unsafeGetTensorImpl());
    return it != names.end() ? it->second : std::string();
  });
  // Python's fp32 moments, stored in optimizer_state_format (NOTE [Optimizer state formats]).
  if (const auto& format = detail::OptimizerAccess::index(optimizer).state_format()) {
    detail::encode_moments(torch_optimizer, *format);
  }
  // ZeRO: the state was read for the whole tensors; each rank keeps its slices.
  if (auto* sharding = detail::OptimizerAccess::sharding(optimizer)) sharding->adopt_loaded_state(optimizer);
}

void PythonCheckpoint::load_optimizer(torch::optim::Optimizer& optimizer, std::string_view key) const {
  // An amp::Optimizer reached through its torch::optim base: its masters and names come along.
  if (auto* amp_optimizer = dynamic_cast<OptimizerBase*>(&optimizer)) return load_optimizer(*amp_optimizer, key);
  load_optimizer_state(optimizer, key, [](const at::Tensor&) { return std::string(); });
}

void PythonCheckpoint::load_optimizer_state(torch::optim::Optimizer& opt, std::string_view key,
                                            const std::function<std::string(const at::Tensor&)>& name_of) const {
  const std::string what = "entry '" + key_text(key) + "'";
  const char* m = "amp::PythonCheckpoint::load_optimizer: ";
  const c10::IValue& value = value_of(key, "load_optimizer");
  TORCH_CHECK(value.isGenericDict(), m, what, " of ", where(), " is ", type_of(value),
              ", not an optimizer.state_dict() (a dict with 'state' and 'param_groups').");
  const auto dict = value.toGenericDict();
  const c10::IValue state_key_name(std::string("state")), groups_key_name(std::string("param_groups"));
  TORCH_CHECK(dict.contains(state_key_name) && dict.contains(groups_key_name), m, what, " has no 'state' and "
              "'param_groups', so it is not an optimizer.state_dict(). Pass the key of optimizer.state_dict().");
  const c10::IValue& py_state_value = dict.at(state_key_name);
  const c10::IValue& py_groups_value = dict.at(groups_key_name);
  TORCH_CHECK(py_state_value.isGenericDict(), m, what, "['state'] is ", type_of(py_state_value), ", not a dict.");
  TORCH_CHECK(py_groups_value.isList(), m, what, "['param_groups'] is ", type_of(py_groups_value), ", not a list.");
  const auto py_state = py_state_value.toGenericDict();
  const auto py_groups = py_groups_value.toList();

  const detail::OptimizerFormat* format = detail::format_of(opt);
  TORCH_CHECK(format, m, "this optimizer is not one whose Python state_dict amp reads; amp reads ",
              detail::optimizer_format_names(), " (and amp::optim's fused ones, FusedLAMB as Apex's).");
  const std::string type_name = format->python_class;
  auto& groups = opt.param_groups();
  TORCH_CHECK(py_groups.size() == groups.size(), m, what, " has ", py_groups.size(), " param group(s), this optimizer has ",
              groups.size(), ". Build the optimizer's param groups as the Python script did.");

  std::vector<detail::Hyperparameters> hyper(groups.size());
  std::vector<PendingState> pending;
  std::unordered_set<int64_t> seen_ids;
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string group_what = what + "['param_groups'][" + std::to_string(g) + "]";
    const c10::IValue& group_value = py_groups.get(g);
    TORCH_CHECK(group_value.isGenericDict(), m, group_what, " is ", type_of(group_value), ", not a dict.");
    const auto group = group_value.toGenericDict();
    if (!format->accepts(group)) {
      const detail::OptimizerFormat* py_format = detail::python_format_of(group);
      std::vector<std::string> keys;
      for (const auto& item : group) {
        if (item.key().isString() && item.key().toStringRef() != "params") keys.push_back(item.key().toStringRef());
      }
      TORCH_CHECK(false, m, what, " was saved from ", (py_format ? std::string(std::strchr(py_format->python_class, '.') ? "" : "torch.optim.") + py_format->python_class
                                                                  : std::string("another optimizer type")),
                  " (param group ", g, " has ", quoted_list(keys), "), this optimizer is ", type_name,
                  ". Build the C++ optimizer of the type the Python script used.");
    }
    for (const auto& [key, kind] : format->group_keys) {
      const std::string k = key;
      if (kind == detail::GroupValue::kCount && !group.contains(c10::IValue(k))) {  // written after the first step
        hyper[g][k] = 0.0;
        continue;
      }
      TORCH_CHECK(group.contains(c10::IValue(k)), m, group_what, " has no '", k, "', which ", type_name, " needs.");
      const c10::IValue& v = group.at(c10::IValue(k));
      if (kind == detail::GroupValue::kPair || kind == detail::GroupValue::kTriple) {
        const size_t n = kind == detail::GroupValue::kPair ? 2 : 3;
        const char* what_it_is = n == 2 ? "a pair of floats" : "a tuple of three floats";
        TORCH_CHECK(v.isTuple() || v.isList(), m, group_what, "['", k, "'] is ", type_of(v), ", not ", what_it_is, ".");
        std::vector<c10::IValue> items;
        if (v.isTuple()) {
          items = v.toTupleRef().elements().vec();
        } else {
          for (const auto& x : v.toList()) items.push_back(x);
        }
        bool numbers = items.size() == n;
        for (const auto& x : items) numbers = numbers && as_number(x).has_value();
        TORCH_CHECK(numbers, m, group_what, "['", k, "'] is not ", what_it_is, ".");
        for (size_t j = 0; j < n; ++j) {  // the names read_group and write_group use
          hyper[g][n == 2 ? "beta" + std::to_string(j + 1) : k + std::to_string(j)] = *as_number(items[j]);
        }
      } else if (kind == detail::GroupValue::kName) {
        std::string choices;
        for (size_t j = 0; j < format->names.size(); ++j) choices += (j ? ", '" : "'") + std::string(format->names[j]) + "'";
        if (v.isNone()) {
          hyper[g][k] = 0.0;
          continue;
        }
        TORCH_CHECK(v.isString(), m, group_what, "['", k, "'] is ", type_of(v), ", not None or one of ", choices, ".");
        const auto it = std::find_if(format->names.begin(), format->names.end(),
                                     [&](const char* name) { return v.toStringRef() == name; });
        TORCH_CHECK(it != format->names.end(), m, group_what, "['", k, "'] is '", v.toStringRef(), "', which ",
                    type_name, " does not have; it takes None or one of ", choices, ".");
        hyper[g][k] = static_cast<double>(it - format->names.begin());
      } else {
        const auto number = as_number(v);
        TORCH_CHECK(number.has_value(), m, group_what, "['", k, "'] is ", type_of(v), ", not a number.");
        TORCH_CHECK(kind != detail::GroupValue::kCount ||
                        (*number >= 0 && std::floor(*number) == *number && *number < 9.2e18),
                    m, group_what, "['", k, "'] is ", detail::format_float(*number), ", not a step count.");
        TORCH_CHECK(kind != detail::GroupValue::kInt || (std::floor(*number) == *number && std::abs(*number) < 9.2e18),
                    m, group_what, "['", k, "'] is ", detail::format_float(*number), ", not an integer.");
        hyper[g][k] = *number;
      }
    }
    const c10::IValue maximize_key(std::string("maximize"));
    TORCH_CHECK(!group.contains(maximize_key) || !as_number(group.at(maximize_key)).value_or(0.0), m, group_what,
                " has maximize=True, which LibTorch's optimizers do not have.");

    const c10::IValue params_key(std::string("params"));
    TORCH_CHECK(group.contains(params_key) && group.at(params_key).isList(), m, group_what, " has no 'params' list.");
    const auto ids = group.at(params_key).toList();
    const auto& params = groups[g].params();
    TORCH_CHECK(ids.size() == params.size(), m, "param group ", g, " has ", ids.size(), " parameter(s) in ", what,
                " and ", params.size(), " in this optimizer. Build the optimizer from the same model and param groups "
                "as the Python script.");
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      const std::string name = name_of(p);
      const std::string param_what = "param group " + std::to_string(g) + ", parameter " + std::to_string(i) +
                                     (!name.empty() ? " ('" + name + "')" : std::string());
      const c10::IValue& id = ids.get(i);
      TORCH_CHECK(id.isInt(), m, group_what, "['params'][", i, "] is ", type_of(id), ", not a parameter index.");
      TORCH_CHECK(seen_ids.insert(id.toInt()).second, m, group_what, " lists parameter index ", id.toInt(), " twice.");
      PendingState entry{p, nullptr};
      if (!py_state.contains(id)) {
        pending.push_back(std::move(entry));
        continue;
      }
      const c10::IValue& s = py_state.at(id);
      TORCH_CHECK(s.isGenericDict(), m, what, "['state'][", id.toInt(), "] (", param_what, ") is ", type_of(s),
                  ", not a dict.");
      const auto fields = s.toGenericDict();
      // The parameter's dtype, or fp32 beside a bf16 weight with a lean master (its step runs in fp32).
      const at::ScalarType state_dtype = detail::find_lean(p) ? at::kFloat : p.scalar_type();
      auto field = [&](const char* name, bool required) -> at::Tensor {
        const c10::IValue k{std::string(name)};
        if (!fields.contains(k) || fields.at(k).isNone()) {
          TORCH_CHECK(!required, m, what, "['state'][", id.toInt(), "] (", param_what, ") has no '", name, "', which ",
                      type_name, " needs.");
          return at::Tensor();
        }
        const c10::IValue& v = fields.at(k);
        TORCH_CHECK(v.isTensor(), m, what, "['state'][", id.toInt(), "]['", name, "'] (", param_what, ") is ", type_of(v),
                    ", not a tensor.");
        const at::Tensor& t = v.toTensor();
        TORCH_CHECK(t.sizes() == p.sizes(), m, "'", name, "' of ", param_what, " has shape ", t.sizes(), " in ", what,
                    " and the parameter has shape ", p.sizes(), " here. The checkpoint was saved from another model "
                    "or another parameter order.");
        return at::empty_like(p, p.options().dtype(state_dtype), at::MemoryFormat::Preserve).copy_(t);  // a copy
      };
      auto step = [&]() -> int64_t {
        const c10::IValue k{std::string("step")};
        TORCH_CHECK(fields.contains(k), m, what, "['state'][", id.toInt(), "] (", param_what, ") has no 'step', which ",
                    type_name, " needs.");
        const auto number = as_number(fields.at(k));
        TORCH_CHECK(number && *number >= 0 && std::floor(*number) == *number && *number < 9.2e18, m, what, "['state'][",
                    id.toInt(), "]['step'] (", param_what, ") is not a step count.");
        return static_cast<int64_t>(*number);
      };
      const int64_t steps = format->has_step ? step() : 0;
      detail::StateTensors tensors;
      for (const auto& f : format->state_fields) tensors[f.name] = field(f.name, format->needs(f, hyper[g]));
      entry.state = format->make_state(opt, tensors, steps);
      pending.push_back(std::move(entry));
    }
  }

  // Everything read and checked: now install the state and the hyperparameters.
  auto& state = opt.state();
  for (auto& entry : pending) {
    const auto k = state_key(state, entry.param);
    state.erase(k);
    if (entry.state) state[k] = std::move(entry.state);
  }
  for (size_t g = 0; g < groups.size(); ++g) format->write_group(hyper[g], groups[g].options());
}

// ---------------------------------------------------------------------------------------------------
// PythonCheckpoint: writing

void PythonCheckpoint::put(std::string_view key, c10::IValue value) {
  check_text(key_text(key), "the entry name", "put");
  check_texts(value, "entry '" + detail::escape_bytes(key) + "'", "put");
  for (auto& e : entries_) {
    if (e.key == key) {
      e.value = std::move(value);
      e.unreadable.clear();
      return;
    }
  }
  entries_.push_back({key_text(key), std::move(value), ""});
}

void PythonCheckpoint::erase(std::string_view key) {
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.key == key; }),
                 entries_.end());
}

void PythonCheckpoint::put_model(std::string_view key, torch::nn::Module& module) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  for (const auto& [name, value] : detail::fp32_state(module)) dict.insert(name, cpu_copy(value));
  put(key, dict);
}

void PythonCheckpoint::put_optimizer(std::string_view key, OptimizerBase& optimizer) {
  torch::optim::Optimizer& opt = detail::OptimizerAccess::synced_torch_optimizer(optimizer);
  // torch.optim's fp32 moments, whatever optimizer_state_format stores them in.
  const detail::StateFormat* format = detail::OptimizerAccess::index(optimizer).state_format().get();
  auto put_fp32 = [&] { detail::with_fp32_moments(opt, format, [&] { put_optimizer_state(key, opt); }); };
  if (auto* sharding = detail::OptimizerAccess::sharding(optimizer)) {  // ZeRO: collective, every rank puts it whole
    sharding->with_full_state(optimizer, put_fp32);
    return;
  }
  put_fp32();
}

void PythonCheckpoint::put_optimizer(std::string_view key, torch::optim::Optimizer& optimizer) {
  if (auto* amp_optimizer = dynamic_cast<OptimizerBase*>(&optimizer)) return put_optimizer(key, *amp_optimizer);
  put_optimizer_state(key, optimizer);
}

void PythonCheckpoint::put_optimizer_state(std::string_view key, torch::optim::Optimizer& opt) {
  const detail::OptimizerFormat* format = detail::format_of(opt);
  TORCH_CHECK(format, "amp::PythonCheckpoint::put_optimizer: this optimizer is not one whose Python state_dict amp "
              "writes; amp writes ", detail::optimizer_format_names(), " (and amp::optim's fused ones, FusedLAMB as Apex's).");
  auto& state = opt.state();
  c10::impl::GenericDict py_state(c10::IntType::get(), c10::AnyType::get());
  c10::impl::GenericList py_groups(c10::AnyType::get());
  int64_t id = 0;
  for (auto& group : opt.param_groups()) {
    // The keys and Python defaults of torch.optim's own state_dict(), in its order.
    const detail::Hyperparameters h = format->read_group(group.options());
    c10::impl::GenericDict g(c10::StringType::get(), c10::AnyType::get());
    for (const auto& [key, kind] : format->group_keys) {
      switch (kind) {
        case detail::GroupValue::kNumber: g.insert(key, h.at(key)); break;
        case detail::GroupValue::kBool: g.insert(key, h.at(key) != 0.0); break;
        case detail::GroupValue::kCount:
          if (h.at(key) > 0) g.insert(key, static_cast<int64_t>(h.at(key)));
          break;
        case detail::GroupValue::kPair:
          g.insert(key, c10::ivalue::Tuple::create(std::vector<c10::IValue>{h.at("beta1"), h.at("beta2")}));
          break;
        case detail::GroupValue::kTriple: {
          const std::string k = key;
          g.insert(key, c10::ivalue::Tuple::create(std::vector<c10::IValue>{h.at(k + "0"), h.at(k + "1"), h.at(k + "2")}));
          break;
        }
        case detail::GroupValue::kInt: g.insert(key, static_cast<int64_t>(h.at(key))); break;
        case detail::GroupValue::kName: g.insert(key, std::string(format->names.at(static_cast<size_t>(h.at(key))))); break;
      }
    }
    for (const auto& [key, value] : format->python_only_keys) g.insert(key, value);
    c10::impl::GenericList ids(c10::IntType::get());
    for (const auto& p : group.params()) {
      ids.push_back(id);
      const auto it = state.find(state_key(state, p));
      if (it != state.end()) {
        c10::impl::GenericDict s(c10::StringType::get(), c10::AnyType::get());
        int64_t steps = 0;
        const detail::StateTensors tensors = format->read_state(*it->second, &steps);
        if (format->has_step) s.insert("step", step_tensor(steps));
        for (const auto& f : format->state_fields) {
          const at::Tensor& t = tensors.at(f.name);
          if (t.defined() && (!f.written_only_when_needed || format->needs(f, h))) s.insert(f.name, cpu_copy(t));
        }
        if (!s.empty()) py_state.insert(id, s);
      }
      ++id;
    }
    g.insert("params", ids);
    py_groups.push_back(g);
  }
  c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());
  out.insert("state", py_state);
  out.insert("param_groups", py_groups);
  put(key, out);
}

void PythonCheckpoint::save(const std::string& path) const {
  c10::impl::GenericDict root(c10::StringType::get(), c10::AnyType::get());
  for (const auto& e : entries_) {
    TORCH_CHECK(e.unreadable.empty(), "amp::PythonCheckpoint::save: entry '", e.key, "' was read from ", where(),
                " but holds a Python object C++ cannot write back; replace it with put(\"", e.key, "\", ...) or drop "
                "it with erase(\"", e.key, "\").");
    root.insert(e.key, e.value);
  }
  const detail::pickle::Pickled pickled = detail::pickle::dumps(root, "the checkpoint");

  const std::string tmp = path + ".tmp";
  {
    std::ofstream file(tmp, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(file.good(), "amp::PythonCheckpoint::save: cannot write '", tmp, "'. Check that the directory exists "
                "and is writable.");
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) -> size_t {
      file.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
      return file.good() ? size : 0;
    });
    writer.writeRecord("data.pkl", pickled.bytes.data(), pickled.bytes.size());
    writer.writeRecord("byteorder", "little", 6);
    const auto& storages = pickled.storages;
    for (size_t i = 0; i < storages.size(); ++i) {
      const at::Tensor& t = storages[i];
      writer.writeRecord("data/" + std::to_string(i), t.data_ptr(), static_cast<size_t>(t.numel()) * t.element_size());
    }
    writer.writeEndOfFile();
    file.flush();
    TORCH_CHECK(file.good(), "amp::PythonCheckpoint::save: writing '", tmp, "' failed (disk full?).");
  }
  TORCH_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "amp::PythonCheckpoint::save: cannot rename '", tmp,
              "' to '", path, "': ", std::strerror(errno), ".");
}

}  // namespace amp
