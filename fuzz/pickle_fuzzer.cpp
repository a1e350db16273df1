// libFuzzer target over amp's pickle reader (src/interop/pickle.h), which parses data.pkl from files of the outside
// world. Every input must end in a value or in the reader's refusal (std::runtime_error naming the byte, or
// InvalidText for a str that is not UTF-8; PythonCheckpoint::load turns both into a c10::Error); any other
// exception, crash, hang, sanitizer report or out-of-memory is a finding. Storages come from a stand-in for
// the zip: every record holds 4096 bytes, and a storage asking for more is refused as load() refuses it.
#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "interop/pickle.h"

namespace pk = amp::detail::pickle;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  constexpr int64_t kRecordBytes = 4096;
  const pk::StorageLoader loader = [](const std::string& key, c10::ScalarType dtype, int64_t numel) {
    if (numel > kRecordBytes / static_cast<int64_t>(c10::elementSize(dtype))) {
      throw std::runtime_error("the tensor data 'data/" + key + "' has fewer bytes than its storage needs");
    }
    return at::zeros({numel}, at::TensorOptions().dtype(dtype));
  };
  try {
    const auto unpickled = pk::unpickle(reinterpret_cast<const char*>(data), size, loader);
    pk::ToIValue converter;
    const auto& root = unpickled.root;
    if (root->kind == pk::Node::Kind::kDict) {  // as load(): entry by entry, a failing entry does not stop the rest
      for (size_t i = 0; i + 1 < root->items.size(); i += 2) {
        try {
          converter.convert(root->items[i + 1], "entry");
        } catch (const std::runtime_error&) {
        }
      }
    } else {
      converter.convert(root, "the value");
    }
  } catch (const pk::InvalidText&) {
  } catch (const std::runtime_error&) {
  } catch (const c10::Error&) {
  }
  return 0;
}
