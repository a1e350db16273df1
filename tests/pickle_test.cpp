// The pickle codec of Python checkpoints (src/interop/pickle.h) on its own: every opcode the reader accepts, the memo,
// shared storages, nested containers, pickles written by Python's own pickle module at protocols 2-5
// (tests/python/pickles.py), the writer's round trip, and malformed input (every prefix of a pickle is an
// error, never a crash).
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>

#include <unistd.h>

#include "interop/pickle.h"
#include "support/support.h"

namespace {

namespace fs = std::filesystem;
namespace pk = amp::detail::pickle;

at::Tensor no_storages(const std::string& key, c10::ScalarType, int64_t) {
  throw std::runtime_error("this pickle has no storages (asked for '" + key + "')");
}

c10::IValue load(const std::string& bytes, const pk::StorageLoader& loader = no_storages) {
  const auto unpickled = pk::unpickle(bytes.data(), bytes.size(), loader);
  pk::ToIValue converter;
  return converter.convert(unpickled.root, "the value");
}

// The message of the exception `bytes` throws when read and converted, or "" if it loads.
std::string error_of(const std::string& bytes) {
  try {
    load(bytes);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

std::string P(const std::string& body) { return std::string("\x80\x02", 2) + body + "."; }  // PROTO 2 ... STOP
std::string u32(uint32_t v) { return std::string(reinterpret_cast<const char*>(&v), 4); }
std::string u64(uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); }

// Structural equality of what the codec produces (dicts compared in order, as Python's are).
::testing::AssertionResult same(const c10::IValue& a, const c10::IValue& b, const std::string& at = "value") {
  auto fail = [&](const std::string& why) { return ::testing::AssertionFailure() << at << ": " << why; };
  if (a.tagKind() != b.tagKind()) return fail(a.tagKind() + " vs " + b.tagKind());
  if (a.isNone()) return ::testing::AssertionSuccess();
  if (a.isBool()) return a.toBool() == b.toBool() ? ::testing::AssertionSuccess() : fail("bool");
  if (a.isInt()) return a.toInt() == b.toInt() ? ::testing::AssertionSuccess() : fail(std::to_string(a.toInt()) + " vs " + std::to_string(b.toInt()));
  if (a.isDouble()) {
    const double x = a.toDouble(), y = b.toDouble();
    return (x == y || (std::isnan(x) && std::isnan(y))) ? ::testing::AssertionSuccess() : fail("float");
  }
  if (a.isString()) return a.toStringRef() == b.toStringRef() ? ::testing::AssertionSuccess() : fail("'" + a.toStringRef() + "' vs '" + b.toStringRef() + "'");
  if (a.isTensor()) return amp_test::bitwise_equal(a.toTensor(), b.toTensor()) ? ::testing::AssertionSuccess() : fail("tensor");
  if (a.isTuple() || a.isList()) {
    const auto x = a.isTuple() ? a.toTupleRef().elements().vec() : a.toList().vec();
    const auto y = b.isTuple() ? b.toTupleRef().elements().vec() : b.toList().vec();
    if (x.size() != y.size()) return fail("length " + std::to_string(x.size()) + " vs " + std::to_string(y.size()));
    for (size_t i = 0; i < x.size(); ++i) {
      auto r = same(x[i], y[i], at + "[" + std::to_string(i) + "]");
      if (!r) return r;
    }
    return ::testing::AssertionSuccess();
  }
  if (a.isGenericDict()) {
    const auto x = a.toGenericDict(), y = b.toGenericDict();
    if (x.size() != y.size()) return fail("size " + std::to_string(x.size()) + " vs " + std::to_string(y.size()));
    auto i = x.begin();
    auto j = y.begin();
    for (; i != x.end(); ++i, ++j) {
      auto k = same(i->key(), j->key(), at + " key");
      if (!k) return k;
      auto v = same(i->value(), j->value(), at + "[" + pk::ToIValue::describe(i->key()) + "]");
      if (!v) return v;
    }
    return ::testing::AssertionSuccess();
  }
  return fail("unexpected kind " + a.tagKind());
}

c10::impl::GenericList list_of(std::vector<c10::IValue> items) {
  c10::impl::GenericList out(c10::AnyType::get());
  for (auto& item : items) out.push_back(std::move(item));
  return out;
}
c10::IValue tuple_of(std::vector<c10::IValue> items) { return c10::ivalue::Tuple::create(std::move(items)); }
c10::impl::GenericDict dict_of(std::vector<std::pair<c10::IValue, c10::IValue>> items) {
  c10::impl::GenericDict out(c10::AnyType::get(), c10::AnyType::get());
  for (auto& [k, v] : items) out.insert(k, v);
  return out;
}

}  // namespace

TEST(PickleTest, ScalarsAndStrings) {
  EXPECT_EQ(load(P("K\x05")).toInt(), 5);                                   // BININT1
  EXPECT_EQ(load(P(std::string("M\x00\x01", 3))).toInt(), 256);            // BININT2
  EXPECT_EQ(load(P("J" + u32(0xffffffffu))).toInt(), -1);                   // BININT
  EXPECT_EQ(load(P(std::string("\x8a\x01\xff", 3))).toInt(), -1);           // LONG1, sign-extended
  EXPECT_EQ(load(P(std::string("\x8a\x00", 2))).toInt(), 0);                // LONG1 of no bytes
  EXPECT_EQ(load(P("\x8b" + u32(2) + std::string("\x00\x01", 2))).toInt(), 256);  // LONG4
  EXPECT_TRUE(load(P("N")).isNone());
  EXPECT_TRUE(load(P("\x88")).toBool());                                    // NEWTRUE
  EXPECT_FALSE(load(P("\x89")).toBool());                                   // NEWFALSE
  EXPECT_EQ(load(P(std::string("G\x3f\xf8\x00\x00\x00\x00\x00\x00", 9))).toDouble(), 1.5);  // BINFLOAT, big-endian
  EXPECT_EQ(load(P("X" + u32(3) + "abc")).toStringRef(), "abc");            // BINUNICODE
  EXPECT_EQ(load(P("\x8c\x02hi")).toStringRef(), "hi");                     // SHORT_BINUNICODE
  EXPECT_EQ(load(P("\x8d" + u64(2) + "hi")).toStringRef(), "hi");           // BINUNICODE8
  EXPECT_EQ(load(P("T" + u32(2) + "py")).toStringRef(), "py");              // BINSTRING
  EXPECT_EQ(load(P("U\x02py")).toStringRef(), "py");                        // SHORT_BINSTRING
  EXPECT_EQ(load(P("B" + u32(2) + std::string("\x00\xff", 2))).toStringRef(), std::string("\x00\xff", 2));  // BINBYTES
  EXPECT_EQ(load(P("C\x01z")).toStringRef(), "z");                          // SHORT_BINBYTES
  EXPECT_EQ(load(P("\x8e" + u64(1) + "z")).toStringRef(), "z");             // BINBYTES8
  EXPECT_EQ(load(std::string("\x80\x04\x95", 3) + u64(3) + "K\x07.").toInt(), 7);  // FRAME
  // A str that is not UTF-8 is refused where it is converted; bytes are bytes.
  EXPECT_NE(error_of(P("X" + u32(1) + "\xe9")).find("is a str that is not valid UTF-8"), std::string::npos);
  EXPECT_EQ(error_of(P("C\x01\xe9")), "");
  EXPECT_NE(error_of(P(std::string("\x8a\x09", 2) + std::string(9, '\x01'))).find("larger than int64"), std::string::npos);
}

TEST(PickleTest, ContainersAndStackOpcodes) {
  const auto one = c10::IValue(int64_t{1}), two = c10::IValue(int64_t{2}), three = c10::IValue(int64_t{3});
  EXPECT_TRUE(same(load(P("]K\x01" "a")), list_of({one})));                          // EMPTY_LIST, APPEND
  EXPECT_TRUE(same(load(P("](K\x01K\x02" "e")), list_of({one, two})));               // MARK, APPENDS
  EXPECT_TRUE(same(load(P("(K\x01K\x02l")), list_of({one, two})));                   // LIST
  EXPECT_TRUE(same(load(P(")")), tuple_of({})));                                     // EMPTY_TUPLE
  EXPECT_TRUE(same(load(P("(K\x01K\x02K\x03K\x01t")), tuple_of({one, two, three, one})));  // TUPLE
  EXPECT_TRUE(same(load(P("K\x01\x85")), tuple_of({one})));                          // TUPLE1
  EXPECT_TRUE(same(load(P("K\x01K\x02\x86")), tuple_of({one, two})));                // TUPLE2
  EXPECT_TRUE(same(load(P("K\x01K\x02K\x03\x87")), tuple_of({one, two, three})));    // TUPLE3
  EXPECT_TRUE(same(load(P("}X" + u32(1) + "aK\x01s")), dict_of({{std::string("a"), one}})));  // EMPTY_DICT, SETITEM
  EXPECT_TRUE(same(load(P("}(K\x01K\x02K\x03K\x01u")), dict_of({{one, two}, {three, one}})));  // SETITEMS
  EXPECT_TRUE(same(load(P("(K\x01K\x02" "d")), dict_of({{one, two}})));              // DICT
  EXPECT_EQ(load(P("K\x01K\x02" "0")).toInt(), 1);                                   // POP
  EXPECT_EQ(load(P("K\x03(K\x01K\x02" "1")).toInt(), 3);                             // POP_MARK
  EXPECT_TRUE(same(load(P("]2K\x01" "a0")), list_of({one})));                        // DUP: the same list twice
  // OrderedDict, by GLOBAL and by STACK_GLOBAL, then filled with SETITEMS; BUILD's state is dropped.
  const std::string ordered = "ccollections\nOrderedDict\n)R";
  EXPECT_TRUE(same(load(P(ordered + "(K\x01K\x02u")), dict_of({{one, two}})));
  EXPECT_TRUE(same(load(P("\x8c\x0b" "collections\x8c\x0bOrderedDict\x93)R(K\x01K\x02u}b")), dict_of({{one, two}})));
}

TEST(PickleTest, MemoSharesObjects) {
  // BINPUT/BINGET, LONG_BINPUT/LONG_BINGET, MEMOIZE: the same list object twice.
  for (const std::string& body : {std::string("(]q\x00h\x00t", 7), "(]r" + u32(7) + "j" + u32(7) + "t",
                                  std::string("(]\x94h\x00t", 6)}) {
    const auto value = load(std::string("\x80\x04", 2) + body + ".");
    const auto& items = value.toTupleRef().elements();
    ASSERT_EQ(items.size(), 2u);
    EXPECT_TRUE(items[0].isSameIdentity(items[1]));
  }
  EXPECT_NE(error_of(P(std::string("h\x05", 2))).find("memo entry 5 read before it was written"), std::string::npos);
  // A list appended to itself (Python pickles `a = []; a.append(a)` so): an error, and no leak (the arena breaks
  // the cycle; the sanitizer flavor checks leaks, and the pickle fuzzer found this one).
  EXPECT_NE(error_of(P(std::string("]q\x00h\x00" "a", 6))).find("refers to itself"), std::string::npos);
  EXPECT_NE(error_of(P(std::string("}q\x00X", 4) + u32(1) + std::string("kh\x00s", 4))).find("refers to itself"),
            std::string::npos);
}

TEST(PickleTest, PythonObjectsStayOpaqueAndNameTheirType) {
  // NEWOBJ + BUILD (argparse.Namespace), NEWOBJ_EX, sets (EMPTY_SET + ADDITEMS, FROZENSET).
  EXPECT_NE(error_of(P("cargparse\nNamespace\n)\x81}b")).find("holds a Python object of type argparse.Namespace"),
            std::string::npos);
  EXPECT_NE(error_of(P("cmod\nCls\n)}\x92")).find("of type mod.Cls"), std::string::npos);
  EXPECT_NE(error_of(P("\x8f(K\x01\x90")).find("of type builtins.set"), std::string::npos);
  EXPECT_NE(error_of(P("(K\x01\x91")).find("of type builtins.frozenset"), std::string::npos);
  // A list or dict subclass rebuilt by a class C++ does not know: its items are dropped with it.
  EXPECT_NE(error_of(P("cmod\nMyList\n)\x81K\x01" "a")).find("of type mod.MyList"), std::string::npos);
}

TEST(PickleTest, StoragesComeFromTheLoaderOncePerKey) {
  int calls = 0;
  const pk::StorageLoader loader = [&](const std::string& key, c10::ScalarType dtype, int64_t numel) {
    ++calls;
    EXPECT_EQ(key, "0");
    EXPECT_EQ(dtype, at::kFloat);
    return at::arange(numel, at::TensorOptions().dtype(dtype));
  };
  // ('storage', torch.FloatStorage, '0', 'cpu', 4), twice through BINPERSID: one storage, two tensors over it.
  const std::string pid = "(X" + u32(7) + "storagectorch\nFloatStorage\nX" + u32(1) + "0X" + u32(3) + "cpuK\x04tQ";
  const std::string rebuild = "ctorch._utils\n_rebuild_tensor_v2\n(" + pid + "K\x01(K\x02tK\x01\x85\x89" +
                              "ccollections\nOrderedDict\n)RtR";
  const auto value = load(P("(" + rebuild + rebuild + "t"), loader);
  EXPECT_EQ(calls, 1);
  const auto& items = value.toTupleRef().elements();
  const auto a = items[0].toTensor(), b = items[1].toTensor();
  EXPECT_TRUE(torch::equal(a, torch::tensor({1.0f, 2.0f})));
  EXPECT_EQ(a.data_ptr(), b.data_ptr());
  // A view past the end of its storage is refused.
  const std::string past = "ctorch._utils\n_rebuild_tensor_v2\n(" + pid + "K\x03(K\x02tK\x01\x85\x89" +
                           "ccollections\nOrderedDict\n)RtR";
  EXPECT_NE(error_of(P(past)).find("this pickle has no storages"), std::string::npos);  // the default loader
  try {
    load(P(past), loader);
    ADD_FAILURE() << "a view past its storage loaded";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("past the end of its storage of 4 elements"), std::string::npos) << e.what();
  }
}

TEST(PickleTest, MalformedInputIsAnErrorNamingTheByte) {
  EXPECT_NE(error_of(std::string("\x80\x02" "I1\n.", 6)).find("unsupported pickle opcode 0x49"), std::string::npos);
  EXPECT_NE(error_of(P("K\x01K\x02")).find("STOP with 2 values on the stack"), std::string::npos);
  EXPECT_NE(error_of(P("a")).find("needs a value the stack does not have"), std::string::npos);
  EXPECT_NE(error_of(P("e")).find("needs a MARK"), std::string::npos);
  EXPECT_NE(error_of(std::string("\x80\x02X\xff\xff\xff\x7f", 7)).find("longer than the pickle"), std::string::npos);
  EXPECT_NE(error_of(std::string("\x80\x09.", 3)).find("pickle protocol 9"), std::string::npos);
  EXPECT_NE(error_of(std::string("\x80\x02K", 3)).find("(data.pkl byte 3)"), std::string::npos);
  // Every prefix of a real pickle is an error, never a crash or a value.
  const std::string whole = pk::dumps(dict_of({{std::string("a"), list_of({int64_t{1}, 2.5, std::string("x")})},
                                               {std::string("b"), tuple_of({true, c10::IValue()})}}),
                                      "the value")
                                .bytes;
  for (size_t n = 0; n < whole.size(); ++n) {
    EXPECT_THROW(load(whole.substr(0, n)), std::runtime_error) << "prefix of " << n << " bytes";
  }
  EXPECT_NO_THROW(load(whole));
}

TEST(PickleTest, WriterRoundTripsThroughTheReader) {
  const auto weights = torch::randn({3, 4});
  const auto value = dict_of({
      {std::string("ints"), list_of({int64_t{0}, int64_t{255}, int64_t{256}, int64_t{-1}, int64_t{1} << 40,
                                     std::numeric_limits<int64_t>::min()})},
      {std::string("floats"), list_of({0.5, -1e300, 1e-310, std::numeric_limits<double>::infinity()})},
      {std::string("text"), std::string("caf\xc3\xa9")},
      {std::string("nested"), dict_of({{int64_t{1}, tuple_of({c10::IValue(), true, false})}, {2.5, list_of({})}})},
      {std::string("transposed"), weights.t()},
      {std::string("bf16"), weights.to(torch::kBFloat16)},
      {std::string("scalar"), torch::tensor(7, torch::kLong).reshape({})},
  });
  const auto pickled = pk::dumps(value, "the value");
  const pk::StorageLoader loader = [&](const std::string& key, c10::ScalarType dtype, int64_t numel) {
    const auto& t = pickled.storages.at(std::stoul(key));
    EXPECT_EQ(t.scalar_type(), dtype);
    EXPECT_EQ(t.numel(), numel);
    return t.reshape({-1});
  };
  auto expected = value.copy();
  expected.insert_or_assign(std::string("transposed"), weights.t().contiguous());
  EXPECT_TRUE(same(load(pickled.bytes, loader), expected));
  // What the writer refuses, naming the place.
  ASSERT_THROWS_WITH(pk::dumps(dict_of({{std::string("x"), c10::IValue(c10::complex<double>(1, 2))}}), "the value"),
                     "the value['x'] is a ComplexDouble, which a Python checkpoint cannot hold");
  ASSERT_THROWS_WITH(pk::dumps(list_of({torch::Tensor()}), "the value"), "the value[0] is an undefined tensor");
}

TEST(PickleTest, PicklesWrittenByPythonAtEveryProtocol) {
  const std::string interpreter = amp_test::python_interpreter();
  if (!amp_test::python_has_torch()) {
    GTEST_SKIP() << interpreter << " with torch is needed for Python's side of this test";
  }
  const fs::path dir = fs::path(::testing::TempDir()) / ("amp_pickle_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  ASSERT_EQ(std::system((interpreter + " '" AMP_SOURCE_DIR "/tests/python/pickles.py' '" + dir.string() + "'").c_str()), 0);
  auto read = [](const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  // tests/python/pickles.py's values(), rebuilt here.
  auto ints = list_of({});
  for (int64_t v : {int64_t{0}, int64_t{1}, int64_t{255}, int64_t{256}, int64_t{65535}, int64_t{65536}, int64_t{-1},
                    int64_t{-256}, -(int64_t{1} << 31), (int64_t{1} << 31) - 1, int64_t{1} << 31, int64_t{1} << 62,
                    std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()}) {
    ints.push_back(v);
  }
  const auto shared = list_of({int64_t{1}, int64_t{2}});
  auto many = list_of({});
  for (int64_t i = 0; i < 2000; ++i) many.push_back(i);
  auto bigdict = dict_of({});
  for (int64_t i = 0; i < 1500; ++i) bigdict.insert(std::to_string(i), i);
  const auto expected = dict_of({
      {std::string("ints"), ints},
      {std::string("floats"), list_of({0.0, 0.5, -1e300, 1e-310, std::numeric_limits<double>::infinity()})},
      {std::string("strs"), list_of({std::string(""), std::string("a"), std::string("caf\xc3\xa9"),
                                     std::string("\xe2\x9c\x93\xf0\x9f\x98\x80"), std::string(300, 'x')})},
      {std::string("bools"), list_of({true, false, c10::IValue()})},
      {std::string("tuples"), list_of({tuple_of({}), tuple_of({int64_t{1}}), tuple_of({int64_t{1}, int64_t{2}}),
                                       tuple_of({int64_t{1}, int64_t{2}, int64_t{3}}),
                                       tuple_of({int64_t{1}, int64_t{2}, int64_t{3}, int64_t{4}}),
                                       tuple_of({tuple_of({int64_t{1}}), tuple_of({tuple_of({int64_t{2}})})})})},
      {std::string("nested"), dict_of({{std::string("empty_list"), list_of({})}, {std::string("empty_dict"), dict_of({})},
                                       {std::string("list_of_lists"),
                                        list_of({list_of({int64_t{1}}), list_of({int64_t{2}, list_of({int64_t{3}})})})}})},
      {std::string("int_keys"), dict_of({{int64_t{1}, std::string("one")}, {int64_t{2}, std::string("two")}})},
      {std::string("float_keys"), dict_of({{0.5, std::string("half")}})},
      {std::string("shared"), list_of({shared, shared})},
      {std::string("many"), many},
      {std::string("bigdict"), bigdict},
  });
  for (int protocol : {2, 3, 4, 5}) {
    const auto value = load(read(dir / ("values_p" + std::to_string(protocol) + ".pkl")));
    EXPECT_TRUE(same(value, expected)) << "protocol " << protocol;
    const auto pair = value.toGenericDict().at(std::string("shared")).toList();
    EXPECT_TRUE(pair.get(0).isSameIdentity(pair.get(1))) << "protocol " << protocol << ": the memo shares the list";
  }
  for (int protocol : {2, 4}) {
    const std::string bytes = read(dir / ("objects_p" + std::to_string(protocol) + ".pkl"));
    const auto unpickled = pk::unpickle(bytes.data(), bytes.size(), no_storages);
    const auto& root = unpickled.root;
    ASSERT_EQ(root->kind, pk::Node::Kind::kDict);
    std::map<std::string, std::string> errors;
    pk::ToIValue converter;
    for (size_t i = 0; i + 1 < root->items.size(); i += 2) {
      try {
        converter.convert(root->items[i + 1], root->items[i]->text);
      } catch (const std::runtime_error& e) {
        errors[root->items[i]->text] = e.what();
      }
    }
    EXPECT_NE(errors["set"].find("of type builtins.set"), std::string::npos) << protocol;
    EXPECT_NE(errors["frozenset"].find("of type builtins.frozenset"), std::string::npos) << protocol;
    EXPECT_NE(errors["namespace"].find("of type argparse.Namespace"), std::string::npos) << protocol;
    EXPECT_NE(errors["class"].find("of type argparse.Namespace"), std::string::npos) << protocol;
    EXPECT_EQ(errors.count("after"), 0u) << "the entry after the objects reads";
  }
  // torch.save's shared storages: a view and a tensor saved twice share memory as in Python.
  const auto ck = amp::PythonCheckpoint::load((dir / "shared.pt").string());
  const auto base = ck.get("base").toTensor(), view = ck.get("view").toTensor(), again = ck.get("again").toTensor();
  EXPECT_TRUE(torch::equal(view, torch::tensor({2.0f, 3.0f, 4.0f})));
  EXPECT_EQ(view.data_ptr(), static_cast<float*>(base.data_ptr()) + 2);
  EXPECT_TRUE(base.is_same(again) || base.data_ptr() == again.data_ptr());
  fs::remove_all(dir);
}
