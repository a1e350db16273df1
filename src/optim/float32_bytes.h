#pragma once
// fp32 bytes under a float16/bfloat16 tensor: what torch::load (Tensor::set_) leaves in a model amp has cast.

#include <ATen/core/Tensor.h>

#include <string>

namespace amp::detail {

/// Returns whether `t`, a 2-byte floating tensor, sits alone on a storage exactly twice its size: what
/// torch::load (Tensor::set_) leaves when it puts an fp32 tensor's bytes under a float16/bfloat16 one.
bool holds_float32_bytes(const at::Tensor& t);

/// The error for such a tensor: names it and gives the fix.
[[noreturn]] void fail_float32_bytes(const std::string& what, const std::string& name, const at::Tensor& t);

}  // namespace amp::detail
