#include "interop/pickle.h"

#include <ATen/Functions.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <sstream>

#include "options/format.h"

namespace amp::detail::pickle {
namespace {


std::optional<c10::ScalarType> storage_dtype(const std::string& name) {
  static const std::map<std::string, c10::ScalarType> types = {
      {"torch.FloatStorage", at::kFloat},          {"torch.DoubleStorage", at::kDouble},
      {"torch.HalfStorage", at::kHalf},            {"torch.BFloat16Storage", at::kBFloat16},
      {"torch.LongStorage", at::kLong},            {"torch.IntStorage", at::kInt},
      {"torch.ShortStorage", at::kShort},          {"torch.CharStorage", at::kChar},
      {"torch.ByteStorage", at::kByte},            {"torch.BoolStorage", at::kBool},
      {"torch.ComplexFloatStorage", at::kComplexFloat}, {"torch.ComplexDoubleStorage", at::kComplexDouble},
      {"torch.UntypedStorage", at::kByte}};
  const auto it = types.find(name);
  if (it == types.end()) return std::nullopt;
  return it->second;
}

class Unpickler {
 public:
  Unpickler(const char* data, size_t size, StorageLoader load_storage)
      : data_(data), size_(size), load_storage_(std::move(load_storage)) {}

  std::shared_ptr<NodeArena> arena() const { return arena_; }

  /// The pickle offset of the first str that is not UTF-8, wherever it is (inside opaque objects too).
  std::optional<size_t> first_bad_utf8() const { return first_bad_utf8_; }

  NodePtr run() {
    while (true) {
      const size_t at = pos_;
      const uint8_t op = u8();
      if (op == '.') {  // STOP
        check(stack_.size() == 1 && marks_.empty(), "STOP with ", stack_.size(), " values on the stack");
        return stack_.back();
      }
      step(op, at);
    }
  }

 private:
  // Every node goes into the arena, which breaks the cycles a pickle can build (a list appended to itself,
  // through the memo or DUP) when the last owner of the tree lets go; else each such load would leak.
  NodePtr make(Node::Kind kind) {
    arena_->nodes.push_back(std::make_shared<Node>(kind));
    return arena_->nodes.back();
  }

  template <class... Args>
  void check(bool ok, const Args&... what) const {
    if (!ok) fail(what...);
  }
  template <class... Args>
  [[noreturn]] void fail(const Args&... what) const {
    std::ostringstream out;
    (out << ... << what);
    out << " (data.pkl byte " << pos_ << ")";
    throw std::runtime_error(out.str());
  }

  const char* bytes(size_t n) {
    check(n <= size_ - pos_, "the pickle ends in the middle of a value");
    const char* p = data_ + pos_;
    pos_ += n;
    return p;
  }
  uint8_t u8() { return static_cast<uint8_t>(*bytes(1)); }
  uint64_t little(size_t n) {
    const auto* p = reinterpret_cast<const uint8_t*>(bytes(n));
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
    return v;
  }
  std::string text(size_t n) { return std::string(bytes(n), n); }
  std::string line() {
    const char* start = data_ + pos_;
    const void* end = std::memchr(start, '\n', size_ - pos_);
    check(end != nullptr, "a GLOBAL without its newline");
    const size_t n = static_cast<const char*>(end) - start;
    pos_ += n + 1;
    return std::string(start, n);
  }

  void push(NodePtr node) { stack_.push_back(std::move(node)); }
  NodePtr pop() {
    check(stack_.size() > (marks_.empty() ? 0 : marks_.back()), "an opcode needs a value the stack does not have");
    NodePtr top = std::move(stack_.back());
    stack_.pop_back();
    return top;
  }
  NodePtr& top() {
    check(!stack_.empty(), "an opcode needs a value the stack does not have");
    return stack_.back();
  }
  std::vector<NodePtr> pop_mark() {
    check(!marks_.empty(), "an opcode needs a MARK the stack does not have");
    const size_t mark = marks_.back();
    marks_.pop_back();
    std::vector<NodePtr> items(std::make_move_iterator(stack_.begin() + static_cast<std::ptrdiff_t>(mark)),
                               std::make_move_iterator(stack_.end()));
    stack_.resize(mark);
    return items;
  }
  void memo_put(uint64_t id) {
    check(!stack_.empty(), "memoizing an empty stack");
    check(id < (uint64_t{1} << 32), "memo index out of range");
    memo_[id] = stack_.back();
  }
  NodePtr memo_get(uint64_t id) {
    const auto it = memo_.find(id);
    check(it != memo_.end(), "memo entry ", id, " read before it was written");
    return it->second;
  }

  NodePtr integer(int64_t v) {
    auto n = make(Node::Kind::kInt);
    n->integer = v;
    return n;
  }
  NodePtr long_integer(size_t n) {
    check(n <= 8, "an integer of ", n, " bytes, larger than int64");
    if (n == 0) return integer(0);
    uint64_t v = little(n);
    if (n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t{0} << (8 * n);  // sign-extend
    return integer(static_cast<int64_t>(v));
  }
  // `unicode`: a Python 3 str opcode, decoded with 'surrogatepass' as pickle does; Python 2 str opcodes
  // (BINSTRING) are decoded strictly, with torch.load's encoding='utf-8'.
  NodePtr string(Node::Kind kind, size_t n, bool unicode = true) {
    check(n <= size_ - pos_, "a string longer than the pickle");
    auto node = make(kind);
    const size_t at = pos_;
    node->text = text(n);
    if (kind == Node::Kind::kString) {
      node->bad_utf8 = invalid_utf8_at(node->text, /*surrogates=*/unicode);
      if (node->bad_utf8 && !first_bad_utf8_) first_bad_utf8_ = at + *node->bad_utf8;
    }
    return node;
  }

  void append(const NodePtr& list, std::vector<NodePtr> items) {
    if (list->kind == Node::Kind::kObject) return;  // a list subclass C++ does not rebuild
    check(list->kind == Node::Kind::kList, "APPEND to ", kind_name(list->kind));
    for (auto& item : items) list->items.push_back(std::move(item));
  }
  void set_items(const NodePtr& dict, std::vector<NodePtr> items) {
    if (dict->kind == Node::Kind::kObject) return;  // a dict subclass C++ does not rebuild
    check(dict->kind == Node::Kind::kDict, "SETITEM on ", kind_name(dict->kind));
    check(items.size() % 2 == 0, "SETITEMS with an odd number of values");
    for (auto& item : items) dict->items.push_back(std::move(item));
  }
  NodePtr tuple(std::vector<NodePtr> items) {
    auto t = make(Node::Kind::kTuple);
    t->items = std::move(items);
    return t;
  }

  std::vector<int64_t> int_tuple(const NodePtr& node, const char* what) {
    check(node->kind == Node::Kind::kTuple || node->kind == Node::Kind::kList, "a tensor's ", what, " is ",
          kind_name(node->kind), ", not a tuple");
    std::vector<int64_t> out;
    for (const auto& item : node->items) {
      check(item->kind == Node::Kind::kInt && item->integer >= 0, "a tensor's ", what, " holds a non-integer");
      out.push_back(item->integer);
    }
    return out;
  }

  NodePtr rebuild_tensor(const std::vector<NodePtr>& args) {
    check(args.size() >= 4, "_rebuild_tensor with ", args.size(), " arguments");
    check(args[0]->kind == Node::Kind::kStorage, "_rebuild_tensor over ", kind_name(args[0]->kind));
    check(args[1]->kind == Node::Kind::kInt && args[1]->integer >= 0, "a tensor's storage offset is not an int");
    const at::Tensor& storage = args[0]->tensor;
    const int64_t offset = args[1]->integer;
    const auto sizes = int_tuple(args[2], "size");
    const auto strides = int_tuple(args[3], "stride");
    check(sizes.size() == strides.size(), "a tensor with ", sizes.size(), " sizes and ", strides.size(), " strides");
    // The last element the view reaches must lie inside the storage.
    const int64_t available = storage.numel();
    bool empty = false;
    int64_t last = offset, numel = 1;
    for (size_t d = 0; d < sizes.size(); ++d) {
      if (sizes[d] == 0) empty = true;
      check(!__builtin_mul_overflow(numel, sizes[d], &numel), "a tensor with more elements than int64 counts");
    }
    for (size_t d = 0; d < sizes.size() && !empty; ++d) {
      const int64_t reach = sizes[d] - 1;
      check(reach == 0 || strides[d] <= (available - std::min(last, available)) / reach, "a tensor of size ",
            c10::IntArrayRef(sizes), " and stride ", c10::IntArrayRef(strides), " at offset ", offset,
            " past the end of its storage of ", available, " elements");
      last += reach * strides[d];
    }
    check(empty || last < available, "a tensor of size ", c10::IntArrayRef(sizes), " at offset ", offset,
          " past the end of its storage of ", available, " elements");
    auto node = make(Node::Kind::kTensor);
    node->tensor = at::empty({0}, storage.options()).set_(storage.storage(), offset, sizes, strides);
    return node;
  }

  NodePtr call(const NodePtr& callable, const NodePtr& args_node) {
    if (callable->kind == Node::Kind::kObject) return callable;
    check(callable->kind == Node::Kind::kGlobal, "REDUCE on ", kind_name(callable->kind));
    const std::string& name = callable->text;
    if (args_node->kind != Node::Kind::kTuple) {
      auto object = make(Node::Kind::kObject);
      object->text = name;
      return object;
    }
    const auto& args = args_node->items;
    if (name == "collections.OrderedDict" || name == "builtins.dict") {
      auto dict = make(Node::Kind::kDict);
      if (!args.empty() && (args[0]->kind == Node::Kind::kList || args[0]->kind == Node::Kind::kTuple)) {
        for (const auto& pair : args[0]->items) {
          check((pair->kind == Node::Kind::kTuple || pair->kind == Node::Kind::kList) && pair->items.size() == 2,
                "OrderedDict built from something else than pairs");
          dict->items.push_back(pair->items[0]);
          dict->items.push_back(pair->items[1]);
        }
      }
      return dict;
    }
    if (name == "torch._utils._rebuild_tensor_v2" || name == "torch._utils._rebuild_tensor") return rebuild_tensor(args);
    if (name == "torch._utils._rebuild_parameter" || name == "torch._utils._rebuild_parameter_with_state") {
      check(!args.empty() && args[0]->kind == Node::Kind::kTensor, "_rebuild_parameter without a tensor");
      return args[0];
    }
    if (name == "torch._tensor._rebuild_from_type_v2") {  // a tensor subclass or a tensor with Python attributes
      check(args.size() >= 3, "_rebuild_from_type_v2 with ", args.size(), " arguments");
      NodePtr inner = call(args[0], args[2]);
      if (inner->kind == Node::Kind::kTensor) return inner;
    }
    if (name == "torch.torch_version.TorchVersion" && args.size() == 1 && args[0]->kind == Node::Kind::kString) {
      return args[0];  // torch.__version__, a str subclass scripts like to save
    }
    // torch.Size pickles as torch.Size((2, 3)): a tuple of ints, which is how C++ reads it.
    if (name == "torch.Size" && args.size() == 1 &&
        (args[0]->kind == Node::Kind::kTuple || args[0]->kind == Node::Kind::kList)) {
      return tuple(args[0]->items);
    }
    auto object = make(Node::Kind::kObject);  // anything else: kept as an opaque placeholder
    object->text = name;
    return object;
  }

  NodePtr persistent_load(const NodePtr& pid) {
    check(pid->kind == Node::Kind::kTuple && pid->items.size() == 5 && pid->items[0]->kind == Node::Kind::kString &&
              pid->items[0]->text == "storage",
          "a persistent id that is not torch.save's ('storage', type, key, location, numel)");
    const auto& type = pid->items[1];
    const auto& key = pid->items[2];
    const auto& numel = pid->items[4];
    check(type->kind == Node::Kind::kGlobal, "a storage whose type is ", kind_name(type->kind));
    const auto dtype = storage_dtype(type->text);
    check(dtype.has_value(), "a storage of type ", type->text, ", which amp does not read");
    check(key->kind == Node::Kind::kString && numel->kind == Node::Kind::kInt && numel->integer >= 0,
          "a malformed storage reference");
    auto& cached = storages_[key->text];
    if (!cached) {
      cached = make(Node::Kind::kStorage);
      cached->tensor = load_storage_(key->text, *dtype, numel->integer);
    }
    check(cached->tensor.scalar_type() == *dtype, "storage '", key->text, "' read with two dtypes");
    return cached;
  }

  void step(uint8_t op, size_t at) {
    switch (op) {
      case 0x80: {  // PROTO
        const uint8_t protocol = u8();
        check(protocol <= 5, "pickle protocol ", int(protocol));
        break;
      }
      case 0x95: bytes(8); break;  // FRAME
      case '(': marks_.push_back(stack_.size()); break;  // MARK
      case '0':  // POP
        if (!marks_.empty() && marks_.back() == stack_.size()) {
          marks_.pop_back();
        } else {
          pop();
        }
        break;
      case '1': pop_mark(); break;  // POP_MARK
      case '2': push(top()); break;  // DUP
      case 'N': push(make(Node::Kind::kNone)); break;
      case 0x88:
      case 0x89: {  // NEWTRUE, NEWFALSE
        auto b = make(Node::Kind::kBool);
        b->boolean = op == 0x88;
        push(b);
        break;
      }
      case 'J': push(integer(static_cast<int32_t>(static_cast<uint32_t>(little(4))))); break;  // BININT
      case 'K': push(integer(u8())); break;                                                   // BININT1
      case 'M': push(integer(static_cast<int64_t>(little(2)))); break;                        // BININT2
      case 0x8a: push(long_integer(u8())); break;                                             // LONG1
      case 0x8b: push(long_integer(little(4))); break;                                        // LONG4
      case 'G': {  // BINFLOAT, big-endian
        const auto* p = reinterpret_cast<const uint8_t*>(bytes(8));
        uint64_t bits = 0;
        for (int i = 0; i < 8; ++i) bits = (bits << 8) | p[i];
        auto f = make(Node::Kind::kFloat);
        std::memcpy(&f->number, &bits, sizeof(double));
        push(f);
        break;
      }
      case 'X': push(string(Node::Kind::kString, little(4))); break;     // BINUNICODE
      case 0x8c: push(string(Node::Kind::kString, u8())); break;         // SHORT_BINUNICODE
      case 0x8d: push(string(Node::Kind::kString, little(8))); break;    // BINUNICODE8
      case 'T': push(string(Node::Kind::kString, little(4), false)); break;  // BINSTRING (Python 2 str)
      case 'U': push(string(Node::Kind::kString, u8(), false)); break;       // SHORT_BINSTRING
      case 'B': push(string(Node::Kind::kBytes, little(4))); break;      // BINBYTES
      case 'C': push(string(Node::Kind::kBytes, u8())); break;           // SHORT_BINBYTES
      case 0x8e: push(string(Node::Kind::kBytes, little(8))); break;     // BINBYTES8
      case ']': push(make(Node::Kind::kList)); break;                    // EMPTY_LIST
      case ')': push(make(Node::Kind::kTuple)); break;                   // EMPTY_TUPLE
      case '}': push(make(Node::Kind::kDict)); break;                    // EMPTY_DICT
      case 0x8f: {                                                       // EMPTY_SET
        auto set = make(Node::Kind::kObject);
        set->text = "builtins.set";
        push(set);
        break;
      }
      case 0x90: pop_mark(); break;  // ADDITEMS (into a set, kept opaque)
      case 0x91: {                   // FROZENSET
        pop_mark();
        auto set = make(Node::Kind::kObject);
        set->text = "builtins.frozenset";
        push(set);
        break;
      }
      case 'a': {  // APPEND
        NodePtr v = pop();
        append(top(), {v});
        break;
      }
      case 'e': {  // APPENDS
        auto items = pop_mark();
        append(top(), std::move(items));
        break;
      }
      case 'l': {  // LIST
        auto list = make(Node::Kind::kList);
        list->items = pop_mark();
        push(list);
        break;
      }
      case 't': push(tuple(pop_mark())); break;  // TUPLE
      case 0x85: push(tuple({pop()})); break;    // TUPLE1
      case 0x86: {                               // TUPLE2
        NodePtr b = pop(), a = pop();
        push(tuple({a, b}));
        break;
      }
      case 0x87: {  // TUPLE3
        NodePtr c = pop(), b = pop(), a = pop();
        push(tuple({a, b, c}));
        break;
      }
      case 'd': {  // DICT
        auto dict = make(Node::Kind::kDict);
        set_items(dict, pop_mark());
        push(dict);
        break;
      }
      case 's': {  // SETITEM
        NodePtr value = pop(), key = pop();
        set_items(top(), {key, value});
        break;
      }
      case 'u': {  // SETITEMS
        auto items = pop_mark();
        set_items(top(), std::move(items));
        break;
      }
      case 'c': {  // GLOBAL
        auto global = make(Node::Kind::kGlobal);
        std::string module = line();
        // Protocol 2 names Python 2's modules; Python 3's unpickler maps them back (fix_imports), so does amp.
        if (module == "__builtin__") module = "builtins";
        if (module == "copy_reg") module = "copyreg";
        global->text = module + "." + line();
        push(global);
        break;
      }
      case 0x93: {  // STACK_GLOBAL
        NodePtr name = pop(), module = pop();
        check(name->kind == Node::Kind::kString && module->kind == Node::Kind::kString, "STACK_GLOBAL without names");
        auto global = make(Node::Kind::kGlobal);
        global->text = module->text + "." + name->text;
        push(global);
        break;
      }
      case 'R': {  // REDUCE
        NodePtr args = pop(), callable = pop();
        push(call(callable, args));
        break;
      }
      case 0x81: {  // NEWOBJ: cls.__new__(cls, *args); its state follows in BUILD
        NodePtr args = pop(), cls = pop();
        push(call(cls, args));
        break;
      }
      case 0x92: {  // NEWOBJ_EX
        pop();
        NodePtr args = pop(), cls = pop();
        push(call(cls, args));
        break;
      }
      case 'b': {  // BUILD: an object's state (an OrderedDict's _metadata, ...), not needed in C++
        pop();
        top();
        break;
      }
      case 'Q': push(persistent_load(pop())); break;  // BINPERSID
      case 'q': memo_put(u8()); break;                // BINPUT
      case 'r': memo_put(little(4)); break;           // LONG_BINPUT
      case 0x94: memo_put(memo_.size()); break;       // MEMOIZE
      case 'h': push(memo_get(u8())); break;          // BINGET
      case 'j': push(memo_get(little(4))); break;     // LONG_BINGET
      default:
        pos_ = at;
        fail("unsupported pickle opcode 0x", std::hex, int(op),
             " (torch.save writes binary protocols 2 and up; text protocols 0 and 1 are not read)");
    }
  }

  const char* data_;
  size_t size_;
  size_t pos_ = 0;
  StorageLoader load_storage_;
  std::vector<NodePtr> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, NodePtr> memo_;
  std::unordered_map<std::string, NodePtr> storages_;
  std::optional<size_t> first_bad_utf8_;
  std::shared_ptr<NodeArena> arena_ = std::make_shared<NodeArena>();
};

const char* storage_name(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return "FloatStorage";
    case at::kDouble: return "DoubleStorage";
    case at::kHalf: return "HalfStorage";
    case at::kBFloat16: return "BFloat16Storage";
    case at::kLong: return "LongStorage";
    case at::kInt: return "IntStorage";
    case at::kShort: return "ShortStorage";
    case at::kChar: return "CharStorage";
    case at::kByte: return "ByteStorage";
    case at::kBool: return "BoolStorage";
    case at::kComplexFloat: return "ComplexFloatStorage";
    case at::kComplexDouble: return "ComplexDoubleStorage";
    default: return nullptr;
  }
}

class Pickler {
 public:
  Pickler() { op(0x80), op(2); }  // PROTO 2

  void value(const c10::IValue& v, const std::string& path) {
    if (v.isNone()) {
      op('N');
    } else if (v.isBool()) {
      op(v.toBool() ? 0x88 : 0x89);
    } else if (v.isInt()) {
      integer(v.toInt());
    } else if (v.isDouble()) {
      floating(v.toDouble());
    } else if (v.isString()) {
      check_text(v.toStringRef(), path, "save");
      string(v.toStringRef());
    } else if (v.isTensor()) {
      tensor(v.toTensor(), path);
    } else if (v.isTuple()) {
      const auto& items = v.toTupleRef().elements();
      if (items.empty()) {
        op(')');
      } else {
        op('(');
        for (size_t i = 0; i < items.size(); ++i) value(items[i], path + "[" + std::to_string(i) + "]");
        op('t');
      }
    } else if (v.isList()) {
      const auto list = v.toList();
      op(']');
      if (!list.empty()) {
        op('(');
        for (size_t i = 0; i < list.size(); ++i) value(list.get(i), path + "[" + std::to_string(i) + "]");
        op('e');
      }
    } else if (v.isGenericDict()) {
      const auto dict = v.toGenericDict();
      op('}');
      if (!dict.empty()) {
        op('(');
        for (const auto& item : dict) {
          const c10::IValue& key = item.key();
          TORCH_CHECK(key.isString() || key.isInt() || key.isDouble() || key.isBool(), "amp::PythonCheckpoint::save: ",
                      path, " has a key of type ", key.tagKind(), "; Python checkpoints take str, int, float and bool keys.");
          value(key, path);
          value(item.value(), path + "[" + (key.isString() ? "'" + key.toStringRef() + "'" : ToIValue::describe(key)) + "]");
        }
        op('u');
      }
    } else {
      TORCH_CHECK(false, "amp::PythonCheckpoint::save: ", path, " is a ", v.tagKind(), ", which a Python checkpoint "
                  "cannot hold. Put dicts, lists, tuples, strings, ints, floats, bools, None and tensors.");
    }
  }

  std::string finish() {
    op('.');
    return std::move(out_);
  }
  const std::vector<at::Tensor>& storages() const { return storages_; }

 private:
  void op(int code) { out_.push_back(static_cast<char>(code)); }
  void raw(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }
  void little(uint64_t v, size_t n) {
    for (size_t i = 0; i < n; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  void integer(int64_t v) {
    if (v >= 0 && v < 256) {
      op('K');
      little(static_cast<uint64_t>(v), 1);
    } else if (v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max()) {
      op('J');
      little(static_cast<uint32_t>(static_cast<int32_t>(v)), 4);
    } else {
      op(0x8a);  // LONG1, 8 bytes two's complement
      little(8, 1);
      little(static_cast<uint64_t>(v), 8);
    }
  }
  void floating(double v) {
    uint64_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    op('G');
    for (int i = 7; i >= 0; --i) out_.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
  }
  void string(const std::string& s) {
    op('X');
    little(s.size(), 4);
    raw(s.data(), s.size());
  }
  void global(const char* module, const char* name) {
    op('c');
    out_ += module;
    out_ += '\n';
    out_ += name;
    out_ += '\n';
  }
  void tensor(const at::Tensor& t, const std::string& path) {
    TORCH_CHECK(t.defined(), "amp::PythonCheckpoint::save: ", path, " is an undefined tensor.");
    TORCH_CHECK(t.layout() == at::kStrided && !t.is_quantized(), "amp::PythonCheckpoint::save: ", path,
                " is a sparse or quantized tensor; Python checkpoints written by amp hold dense tensors.");
    const char* storage = storage_name(t.scalar_type());
    TORCH_CHECK(storage != nullptr, "amp::PythonCheckpoint::save: ", path, " has dtype ", t.scalar_type(),
                ", which amp does not write.");
    const at::Tensor data = t.detach().to(at::kCPU).contiguous();
    const std::string key = std::to_string(storages_.size());
    storages_.push_back(data);
    global("torch._utils", "_rebuild_tensor_v2");
    op('(');
    op('(');  // the persistent id: ('storage', torch.<Type>Storage, key, location, numel)
    string("storage");
    global("torch", storage);
    string(key);
    string("cpu");
    integer(data.numel());
    op('t');
    op('Q');       // BINPERSID
    integer(0);    // storage offset
    op('(');
    for (const auto s : data.sizes()) integer(s);
    op('t');
    op('(');
    for (const auto s : data.strides()) integer(s);
    op('t');
    op(0x89);  // requires_grad False
    global("collections", "OrderedDict");  // backward hooks: an empty OrderedDict
    op(')');
    op('R');
    op('t');
    op('R');
  }

  std::string out_;
  std::vector<at::Tensor> storages_;
};

}  // namespace

NodeArena::~NodeArena() {
  for (auto& node : nodes) node->items.clear();
}

const char* kind_name(Node::Kind kind) {
  switch (kind) {
    case Node::Kind::kNone: return "None";
    case Node::Kind::kBool: return "a bool";
    case Node::Kind::kInt: return "an int";
    case Node::Kind::kFloat: return "a float";
    case Node::Kind::kString: return "a str";
    case Node::Kind::kBytes: return "bytes";
    case Node::Kind::kTensor: return "a tensor";
    case Node::Kind::kStorage: return "a storage";
    case Node::Kind::kList: return "a list";
    case Node::Kind::kTuple: return "a tuple";
    case Node::Kind::kDict: return "a dict";
    case Node::Kind::kGlobal: return "a Python class or function";
    case Node::Kind::kObject: return "a Python object";
  }
  return "?";
}

Unpickled unpickle(const char* data, size_t size, const StorageLoader& load_storage) {
  Unpickler unpickler(data, size, load_storage);
  NodePtr root = unpickler.run();
  return {std::move(root), unpickler.first_bad_utf8(), unpickler.arena()};
}

c10::IValue ToIValue::convert(const NodePtr& node, const std::string& path, int depth) {
  if (depth > 200) throw std::runtime_error(path + " is nested more than 200 levels deep (or refers to itself)");
  const auto cached = done_.find(node.get());
  if (cached != done_.end()) return cached->second;
  c10::IValue out;
  switch (node->kind) {
    case Node::Kind::kNone: break;
    case Node::Kind::kBool: out = node->boolean; break;
    case Node::Kind::kInt: out = node->integer; break;
    case Node::Kind::kFloat: out = node->number; break;
    case Node::Kind::kString:
      if (node->bad_utf8) {
        throw InvalidText(path + " is a str that is not valid UTF-8 (byte " + std::to_string(*node->bad_utf8) +
                          " of '" + escape_bytes(node->text) + "')");
      }
      out = node->text;
      break;
    case Node::Kind::kBytes: out = node->text; break;
    case Node::Kind::kTensor:
    case Node::Kind::kStorage: out = node->tensor; break;
    case Node::Kind::kTuple: {
      std::vector<c10::IValue> items;
      for (size_t i = 0; i < node->items.size(); ++i) {
        items.push_back(convert(node->items[i], path + "[" + std::to_string(i) + "]", depth + 1));
      }
      out = c10::ivalue::Tuple::create(std::move(items));
      break;
    }
    case Node::Kind::kList: {
      std::vector<c10::IValue> items;
      for (size_t i = 0; i < node->items.size(); ++i) {
        items.push_back(convert(node->items[i], path + "[" + std::to_string(i) + "]", depth + 1));
      }
      c10::impl::GenericList list(element_type(items));
      for (auto& item : items) list.push_back(std::move(item));
      out = list;
      break;
    }
    case Node::Kind::kDict: {
      std::vector<c10::IValue> keys, values;
      for (size_t i = 0; i + 1 < node->items.size(); i += 2) {
        c10::IValue key = convert(node->items[i], path + " key", depth + 1);
        if (!(key.isString() || key.isInt() || key.isDouble() || key.isBool())) {
          throw std::runtime_error(path + " has a key that is " + kind_name(node->items[i]->kind) +
                                   "; C++ dicts take str, int, float and bool keys");
        }
        const std::string item_path = path + "[" + (key.isString() ? "'" + key.toStringRef() + "'" : describe(key)) + "]";
        keys.push_back(std::move(key));
        values.push_back(convert(node->items[i + 1], item_path, depth + 1));
      }
      c10::impl::GenericDict dict(element_type(keys), element_type(values));
      for (size_t i = 0; i < keys.size(); ++i) dict.insert_or_assign(std::move(keys[i]), std::move(values[i]));
      out = dict;
      break;
    }
    case Node::Kind::kGlobal:
    case Node::Kind::kObject:
      throw std::runtime_error(path + " holds a Python object of type " + node->text +
                               ", which C++ cannot rebuild (it reads dict, list, tuple, str, int, float, bool, None "
                               "and tensors). Save a plain value in Python (vars(args), float(x), x.tolist()) if "
                               "C++ needs it.");
  }
  done_.emplace(node.get(), out);
  return out;
}

std::string ToIValue::describe(const c10::IValue& v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

c10::TypePtr ToIValue::element_type(const std::vector<c10::IValue>& items) {
  if (items.empty()) return c10::AnyType::get();
  auto all = [&](auto pred) { return std::all_of(items.begin(), items.end(), pred); };
  if (all([](const c10::IValue& v) { return v.isString(); })) return c10::StringType::get();
  if (all([](const c10::IValue& v) { return v.isInt(); })) return c10::IntType::get();
  if (all([](const c10::IValue& v) { return v.isDouble(); })) return c10::FloatType::get();
  if (all([](const c10::IValue& v) { return v.isBool(); })) return c10::BoolType::get();
  if (all([](const c10::IValue& v) { return v.isTensor(); })) return c10::TensorType::get();
  return c10::AnyType::get();
}

// Python's torch.load decodes every str as UTF-8 and refuses the whole file otherwise, so amp refuses to
// write one: `method` names the call, `path` the value.
void check_text(const std::string& text, const std::string& path, const char* method) {
  const auto bad = invalid_utf8_at(text);
  TORCH_CHECK(!bad, "amp::PythonCheckpoint::", method, ": ", path, " is a string that is not valid UTF-8 (byte ",
              bad.value_or(0), " of '", escape_bytes(text), "'); Python's torch.load could not open the file "
              "(UnicodeDecodeError). Convert the text to UTF-8 first (a Latin-1 \\xe9 is \\xc3\\xa9 in UTF-8).");
}

void check_texts(const c10::IValue& v, const std::string& path, const char* method, int depth) {
  TORCH_CHECK(depth <= 200, "amp::PythonCheckpoint::", method, ": ", path, " is nested more than 200 levels deep.");
  if (v.isString()) {
    check_text(v.toStringRef(), path, method);
  } else if (v.isTuple()) {
    const auto& items = v.toTupleRef().elements();
    for (size_t i = 0; i < items.size(); ++i) check_texts(items[i], path + "[" + std::to_string(i) + "]", method, depth + 1);
  } else if (v.isList()) {
    const auto list = v.toList();
    for (size_t i = 0; i < list.size(); ++i) check_texts(list.get(i), path + "[" + std::to_string(i) + "]", method, depth + 1);
  } else if (v.isGenericDict()) {
    for (const auto& item : v.toGenericDict()) {
      check_texts(item.key(), path + " (a key)", method, depth + 1);
      const std::string key = item.key().isString() ? "'" + escape_bytes(item.key().toStringRef()) + "'"
                                                    : ToIValue::describe(item.key());
      check_texts(item.value(), path + "[" + key + "]", method, depth + 1);
    }
  }
}

Pickled dumps(const c10::IValue& root, const std::string& path) {
  Pickler pickler;
  pickler.value(root, path);
  Pickled out;
  out.storages = pickler.storages();
  out.bytes = pickler.finish();
  return out;
}

}  // namespace amp::detail::pickle
