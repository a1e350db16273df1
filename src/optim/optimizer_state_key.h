#pragma once
// The key torch::optim keeps per-parameter state under: the parameter's TensorImpl, as a void* from
// LibTorch 2.0 and as a string of the pointer before (what c10::guts::to_string(TensorImpl*) produced).

#include <ATen/core/Tensor.h>

#include <sstream>
#include <string>
#include <type_traits>

namespace amp::detail {

template <class Map>
typename Map::key_type state_key(const Map&, const at::Tensor& t) {
  if constexpr (std::is_same_v<typename Map::key_type, std::string>) {
    std::ostringstream key;
    key << t.unsafeGetTensorImpl();
    return key.str();
  } else {
    return t.unsafeGetTensorImpl();
  }
}

}  // namespace amp::detail
