#pragma once
// The pickle codec of Python checkpoints (PythonCheckpoint's reading and writing of data.pkl).
//
// NOTE [Reading Python pickles without LibTorch's unpickler]
// torch.save writes a zip whose data.pkl is a pickle (protocol 2 by default) and whose data/<key>
// records hold the tensor storages. LibTorch's torch::pickle_load / torch::jit::Unpickler cannot read a
// real checkpoint: every state_dict is a collections.OrderedDict, which that unpickler special-cases
// (before any type resolver is asked) into None, so the SETITEMS that fills it fails ("Expected
// GenericDict but got None"), and its BUILD (the OrderedDict's _metadata) is treated as a call. It also
// accepts protocol 2 only. Rewriting the pickle's bytes would need the same stack tracking as an
// unpickler. So amp reads the pickle itself: a data-only machine (no Python code runs; like torch.load's
// weights_only=True) that knows dicts, lists, tuples, scalars, strings, OrderedDict and torch's tensor
// rebuild functions, and keeps any other Python object as an opaque placeholder, so an `args` entry
// holding an argparse.Namespace does not make the model unreadable. Same code on LibTorch 1.13 and 2.x.
// Writing mirrors it: a protocol-2 pickle of plain dicts, lists and tensors (_rebuild_tensor_v2 over
// typed storages), which torch.load accepts with weights_only=True.
//
// The reader parses files from the outside world: every input ends in a tree or a std::runtime_error that
// names the byte offset (fuzz/pickle_fuzzer.cpp checks it); lengths are checked against the bytes left
// before anything is allocated, and storages are allocated by the caller's loader, which knows the record.

#include <ATen/core/ivalue.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace amp::detail::pickle {

// ---------------------------------------------------------------------------------------------------
// Reading: the pickle as a tree of Python values.

struct Node;
using NodePtr = std::shared_ptr<Node>;

struct Node {
  enum class Kind { kNone, kBool, kInt, kFloat, kString, kBytes, kTensor, kStorage, kList, kTuple, kDict, kGlobal, kObject };
  explicit Node(Kind k) : kind(k) {}
  Kind kind;
  bool boolean = false;
  int64_t integer = 0;
  double number = 0.0;
  std::string text;            // string, bytes; "module.name" of a global or an object's type
  at::Tensor tensor;           // tensor; storage (1-D, all its elements)
  std::vector<NodePtr> items;  // list and tuple elements; dict keys and values, interleaved
  std::optional<size_t> bad_utf8;  // a str whose bytes are not UTF-8: the offset of the first bad byte
};

// A str that Python's torch.load would refuse (UnicodeDecodeError): load() refuses the whole file too.
struct InvalidText : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

/// "a dict", "a tensor", ...: for messages.
const char* kind_name(Node::Kind kind);

// Reads one storage record: key, dtype, number of elements.
using StorageLoader = std::function<at::Tensor(const std::string&, c10::ScalarType, int64_t)>;

/// Owns every node of one pickle's tree; its destructor breaks the reference cycles a pickle may hold.
struct NodeArena {
  NodeArena() = default;
  NodeArena(const NodeArena&) = delete;
  NodeArena& operator=(const NodeArena&) = delete;
  ~NodeArena();
  std::vector<NodePtr> nodes;
};

/// The tree is whole while the Unpickled (its arena) lives: convert it before letting go.
struct Unpickled {
  NodePtr root;
  std::optional<size_t> first_bad_utf8;  // the offset of the first str that is not UTF-8, anywhere in the pickle
  std::shared_ptr<NodeArena> arena;
};

/// Runs the pickle machine over `size` bytes; storages come from `load_storage`. Throws std::runtime_error
/// naming the byte offset where the input is not a pickle amp reads.
Unpickled unpickle(const char* data, size_t size, const StorageLoader& load_storage);

/// Converts trees into IValues; throws std::runtime_error (with the path inside the entry) on what C++ cannot
/// hold, and InvalidText on a str that is not UTF-8. One converter per file: objects the pickle shares (its
/// memo) stay shared.
class ToIValue {
 public:
  c10::IValue convert(const NodePtr& node, const std::string& path, int depth = 0);
  /// An IValue as text, for messages.
  static std::string describe(const c10::IValue& v);

 private:
  static c10::TypePtr element_type(const std::vector<c10::IValue>& items);
  std::unordered_map<const Node*, c10::IValue> done_;
};

// ---------------------------------------------------------------------------------------------------
// Writing: a protocol-2 pickle of IValues, tensors as torch.save writes them.

struct Pickled {
  std::string bytes;                 // data.pkl
  std::vector<at::Tensor> storages;  // data/0, data/1, ...: contiguous CPU tensors
};

/// Pickles `root` (dicts with str/int/float/bool keys, lists, tuples, strings, ints, floats, bools, None and
/// dense tensors); throws c10::Error naming `path` inside it on anything else, and on text that is not UTF-8.
Pickled dumps(const c10::IValue& root, const std::string& path);

/// Throws c10::Error ("amp::PythonCheckpoint::<method>: <path> is a string that is not valid UTF-8 ...") where
/// `text` (or any string inside `value`) is not UTF-8: Python's torch.load could not open the file.
void check_text(const std::string& text, const std::string& path, const char* method);
void check_texts(const c10::IValue& value, const std::string& path, const char* method, int depth = 0);

}  // namespace amp::detail::pickle
