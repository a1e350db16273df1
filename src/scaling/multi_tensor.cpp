#include "scaling/multi_tensor.h"

#include <ATen/Dispatch.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/version.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <optional>

#include "core/host_sync.h"
#include "scaling/cpu_kernels.h"

namespace amp::detail {
namespace {

constexpr int64_t kGrain = 1 << 15;

using GroupKey = std::pair<std::string, c10::ScalarType>;  // (device string, dtype)

bool cpu_fast_path(const at::Tensor& t) { return t.device().is_cpu() && t.is_contiguous() && !t.is_sparse(); }

void check_dense(const at::Tensor& t) {
  TORCH_CHECK(!t.is_sparse(),
              "amp: sparse gradients are not supported by amp's loss scaling (got a sparse gradient of shape ",
              t.sizes(), "). Use dense gradients, e.g. torch::nn::EmbeddingOptions(...).sparse(false).");
}

std::optional<cpu::Dtype> cpu_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return cpu::Dtype::Float;
    case c10::ScalarType::BFloat16: return cpu::Dtype::BFloat16;
    case c10::ScalarType::Half: return cpu::Dtype::Half;
    default: return std::nullopt;
  }
}

// One pass of cpu::scale over a contiguous tensor, split across threads; true if it saw inf/NaN.
bool scale_cpu(const at::Tensor& in, const at::Tensor& out, float inv, bool accumulate) {
  const auto in_dtype = cpu_dtype(in.scalar_type());
  const auto out_dtype = cpu_dtype(out.scalar_type());
  TORCH_CHECK(in_dtype && out_dtype, "amp: unscale supports float32, float16 and bfloat16 gradients, got ",
              in.scalar_type());
  const auto* src = static_cast<const char*>(in.data_ptr());
  auto* dst = static_cast<char*>(out.data_ptr());
  const size_t in_size = in.element_size(), out_size = out.element_size();
  std::atomic<bool> bad{false};
  at::parallel_for(0, in.numel(), kGrain, [&](int64_t begin, int64_t end) {
    if (cpu::scale(*in_dtype, src + begin * in_size, *out_dtype, dst + begin * out_size, end - begin, inv, accumulate)) {
      bad.store(true, std::memory_order_relaxed);
    }
  });
  return bad.load();
}

void mark(at::Tensor& flag) { flag.fill_(1.0); }

}  // namespace

at::Tensor& FoundInf::on(const c10::Device& device) {
  for (auto& [d, t] : flags_) if (d == device) return t;
  flags_.emplace_back(device, at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device)));
  return flags_.back().second;
}

bool FoundInf::any() const {
  // Counted whether or not a flag exists: amp's CPU loops create one only when they find a non-finite value, a
  // device always has one, and the count must be the device's (NOTE [Counting host syncs]).
  count_host_sync();
  if (flags_.empty()) return false;
  at::Tensor total = flags_.front().second;
  for (size_t i = 1; i < flags_.size(); ++i) total = total.add(flags_[i].second.to(total.device()));
  return total.item<float>() > 0.0f;
}

at::Tensor FoundInf::any_on(const c10::Device& device) const {
  at::Tensor total = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
  for (const auto& [d, flag] : flags_) total = total.add(flag.to(device).sum());
  return total.gt(0.0);
}

namespace {
thread_local bool force_fp32_route = false;
std::atomic<int64_t> fp32_routed{0};
constexpr int64_t kFp32ChunkElements = int64_t{1} << 24;  // 64 MB of fp32 temporaries at most
}  // namespace

Fp32UnscaleRouteGuard::Fp32UnscaleRouteGuard() : previous_(force_fp32_route) { force_fp32_route = true; }
Fp32UnscaleRouteGuard::~Fp32UnscaleRouteGuard() { force_fp32_route = previous_; }
int64_t Fp32UnscaleRouteGuard::groups_routed() { return fp32_routed.load(); }

bool aten_unscale_takes(const c10::Device& device, c10::ScalarType dtype) {
  if (!has_aten_unscale_kernel(device.type())) return false;
  if (dtype != at::kBFloat16) return true;
  if (force_fp32_route) return false;
  // One probe per device type: dispatching the kernel on a 1-element tensor throws "not implemented for
  // 'BFloat16'" before any launch where the build lacks the case.
  static std::mutex mutex;
  static std::map<c10::DeviceType, bool> known;
  std::lock_guard<std::mutex> lock(mutex);
  const auto it = known.find(device.type());
  if (it != known.end()) return it->second;
  bool takes = true;
  try {
    const auto options = at::TensorOptions().device(device);
    std::vector<at::Tensor> probe{at::ones({1}, options.dtype(at::kBFloat16))};
    at::Tensor flag = at::zeros({1}, options.dtype(at::kFloat));
    at::_amp_foreach_non_finite_check_and_unscale_(probe, flag, at::ones({1}, options.dtype(at::kFloat)));
  } catch (const c10::Error&) {
    takes = false;
  }
  known.emplace(device.type(), takes);
  return takes;
}

namespace {
// The product in fp32, rounded once into the gradient's dtype (uncounted: unscale_through_fp32_ counts).
void unscale_fp32_copies_(const std::vector<at::Tensor>& group, const InvScale& inv_scale, at::Tensor& found_inf) {
  c10::NoGradGuard no_grad;
  const at::Tensor inv = inv_scale.on(found_inf.options());
  const bool aten = has_aten_unscale_kernel(found_inf.device().type());
  std::vector<at::Tensor> chunk, wide;
  int64_t elements = 0;
  auto flush = [&] {
    if (chunk.empty()) return;
    if (aten) {
      at::_amp_foreach_non_finite_check_and_unscale_(wide, found_inf, inv);
    } else {  // CPU LibTorch < 2.3: the same check and product, two passes
      for (const auto& w : wide) {
        found_inf.add_(at::isfinite(w).all().logical_not());
        w.mul_(inv);
      }
    }
    copy_(chunk, wide);  // rounds once into the gradient's dtype, as the kernel does
    chunk.clear(), wide.clear(), elements = 0;
  };
  for (const auto& t : group) {
    chunk.push_back(t);
    wide.push_back(t.to(at::kFloat));
    elements += t.numel();
    if (elements >= kFp32ChunkElements) flush();
  }
  flush();
}
}  // namespace

void unscale_through_fp32_(const std::vector<at::Tensor>& group, const InvScale& inv_scale, at::Tensor& found_inf) {
  fp32_routed.fetch_add(1, std::memory_order_relaxed);
  unscale_fp32_copies_(group, inv_scale, found_inf);
}

bool has_aten_unscale_kernel(c10::DeviceType device) {
  static const auto handle =
      c10::Dispatcher::singleton().findSchema({"aten::_amp_foreach_non_finite_check_and_unscale_", ""});
  if (!handle) return false;
  return handle->hasKernelForDispatchKey(device == c10::DeviceType::CUDA ? c10::DispatchKey::CUDA
                                                                         : c10::DispatchKey::CPU);
}

float InvScale::host() const {
  if (!tensor_.defined()) return host_;
  if (!tensor_.device().is_cpu()) count_host_sync();
  return tensor_.item<float>();
}

at::Tensor InvScale::on(const at::TensorOptions& options) const {
  if (!tensor_.defined()) return at::full({1}, host_, options.dtype(at::kFloat));
  return tensor_.to(options.device()).reshape({1});
}

void unscale_(const std::vector<at::Tensor>& tensors, const InvScale& inv_scale, FoundInf& found_inf) {
  std::map<GroupKey, std::vector<at::Tensor>> groups;
  for (const auto& t : tensors) {
    check_dense(t);
    groups[{t.device().str(), t.scalar_type()}].push_back(t);
  }
  for (auto& [key, group] : groups) {
    const c10::Device device = group.front().device();
    at::Tensor& flag = found_inf.on(device);
    if (aten_unscale_takes(device, key.second)) {
      at::_amp_foreach_non_finite_check_and_unscale_(group, flag, inv_scale.on(flag.options()));
      continue;
    }
    if (key.second == at::kBFloat16 && (force_fp32_route || !device.is_cpu())) {
      unscale_through_fp32_(group, inv_scale, flag);
      continue;
    }
    bool bad = false;
    std::vector<at::Tensor> strided_reduced;
    const float inv = inv_scale.host();
    for (const auto& t : group) {
      if (cpu_fast_path(t)) {
        bad |= scale_cpu(t, t, inv, /*accumulate=*/false);
      } else if (t.scalar_type() == at::kFloat) {  // strided tensors: still no host sync, two passes
        flag.add_(at::isfinite(t).all().logical_not());
        t.mul_(inv);
      } else {  // a bf16/fp16 t.mul_(inv) on LibTorch 1.13 rounds inv first: 1/3 would unscale by 0.333984
        strided_reduced.push_back(t);
      }
    }
    if (!strided_reduced.empty()) unscale_fp32_copies_(strided_reduced, inv_scale, flag);
    if (bad) mark(flag);
  }
}

void check_finite(const std::vector<at::Tensor>& tensors, FoundInf& found_inf) {
  std::vector<at::Tensor> rest;
  for (const auto& t : tensors) {
    check_dense(t);
    const auto dtype = cpu_dtype(t.scalar_type());
    if (!dtype || !cpu_fast_path(t) || (force_fp32_route && t.scalar_type() == at::kBFloat16)) {
      rest.push_back(t);
      continue;
    }
    std::atomic<bool> bad{false};
    at::parallel_for(0, t.numel(), kGrain, [&](int64_t begin, int64_t end) {
      if (cpu::any_non_finite(*dtype, static_cast<const char*>(t.data_ptr()) + begin * t.element_size(), end - begin)) {
        bad = true;
      }
    });
    if (bad) mark(found_inf.on(t.device()));
  }
  if (!rest.empty()) unscale_(rest, 1.0, found_inf);
}

void unscale_into(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& out, bool accumulate,
                  const InvScale& inv_scale, FoundInf& found_inf) {
  TORCH_INTERNAL_ASSERT(in.size() == out.size());
  std::optional<float> inv;  // read only where amp's CPU loop runs
  std::vector<at::Tensor> slow_in, slow_out;
  for (size_t i = 0; i < in.size(); ++i) {
    const at::Tensor& src = in[i];
    const at::Tensor& dst = out[i];
    check_dense(src);
    if (cpu_fast_path(src) && cpu_fast_path(dst) && dst.scalar_type() == at::kFloat) {
      if (!inv) inv = inv_scale.host();
      if (scale_cpu(src, dst, *inv, accumulate)) mark(found_inf.on(src.device()));
    } else {
      slow_in.push_back(src);
      slow_out.push_back(dst);
    }
  }
  if (slow_in.empty()) return;
  // Devices without amp's loop (CUDA). Overwriting: two passes, no temporary -- the converting copy into the
  // fp32 destinations (one multi-tensor launch where ATen has _foreach_copy_), then ATen's fused unscale and
  // inf/NaN check on them. ATen has no kernel that converts and unscales in one pass.
  if (!accumulate) {
    copy_(slow_out, slow_in);
    unscale_(slow_out, inv_scale, found_inf);
    return;
  }
  // Accumulating: the new contribution is unscaled and checked on its own fp32 copy before it is added.
  std::vector<at::Tensor> converted;
  converted.reserve(slow_in.size());
  for (size_t i = 0; i < slow_in.size(); ++i) converted.push_back(slow_in[i].to(slow_out[i].scalar_type()));
  unscale_(converted, inv_scale, found_inf);
  for (size_t i = 0; i < slow_in.size(); ++i) {
    if (accumulate) slow_out[i].add_(converted[i]);
    else slow_out[i].copy_(converted[i]);
  }
}

void copy_(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src) {
  TORCH_INTERNAL_ASSERT(dst.size() == src.size());
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> slow_dst, slow_src;
  for (size_t i = 0; i < dst.size(); ++i) {
    const at::Tensor& d = dst[i];
    const at::Tensor& s = src[i];
    const auto out_dtype = cpu_dtype(d.scalar_type());
    if (out_dtype && cpu_fast_path(d) && cpu_fast_path(s) && s.scalar_type() == at::kFloat && d.numel() == s.numel()) {
      const float* in = s.data_ptr<float>();
      auto* out = static_cast<char*>(d.data_ptr());
      const size_t size = d.element_size();
      at::parallel_for(0, d.numel(), kGrain, [&](int64_t b, int64_t e) {
        cpu::convert(in + b, *out_dtype, out + b * size, e - b);
      });
    } else {
      slow_dst.push_back(d);
      slow_src.push_back(s);
    }
  }
  if (slow_dst.empty()) return;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 2)
  at::_foreach_copy_(slow_dst, slow_src);
#else
  for (size_t i = 0; i < slow_dst.size(); ++i) slow_dst[i].copy_(slow_src[i]);
#endif
}

at::Tensor total_norm(const std::vector<at::Tensor>& tensors, double norm_type) {
  c10::NoGradGuard no_grad;
  const auto fp32_on = [](const c10::Device& device) { return at::TensorOptions().dtype(at::kFloat).device(device); };
  if (tensors.empty()) return at::zeros({}, fp32_on(at::kCPU));
  const c10::Device first = tensors.front().device();
  const cpu::Norm norm = norm_type == 1.0 ? cpu::Norm::kL1 : norm_type == 2.0 ? cpu::Norm::kL2 : cpu::Norm::kInf;
  // The CPU pass: partials over fixed chunks, combined in order (the same value for any thread count).
  double cpu_total = 0.0;
  bool any_cpu = false;
  std::map<GroupKey, std::vector<at::Tensor>> others;
  for (const auto& t : tensors) {
    check_dense(t);
    const auto dtype = cpu_dtype(t.scalar_type());
    if (!dtype || !cpu_fast_path(t)) {
      others[{t.device().str(), t.scalar_type()}].push_back(t);
      continue;
    }
    any_cpu = true;
    const auto* data = static_cast<const char*>(t.data_ptr());
    const int64_t n = t.numel(), chunks = (n + kGrain - 1) / kGrain;
    std::vector<double> partials(static_cast<size_t>(chunks), 0.0);
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        const int64_t from = c * kGrain;
        partials[c] = cpu::norm_partial(*dtype, data + from * t.element_size(), std::min(kGrain, n - from), norm);
      }
    });
    for (const double p : partials) cpu_total = norm == cpu::Norm::kInf ? std::max(cpu_total, p) : cpu_total + p;
  }
  std::vector<at::Tensor> norms;  // fp32 0-dim, on `first`
  if (any_cpu) {
    const double value = norm == cpu::Norm::kL2 ? std::sqrt(cpu_total) : cpu_total;
    norms.push_back(at::scalar_tensor(static_cast<float>(value), fp32_on(at::kCPU)).to(first));
  }
  for (auto& [key, group] : others) {  // torch's clip_grad_norm_: per-tensor norms, then the norm of the norms
    for (const auto& n : at::_foreach_norm(group, norm_type)) norms.push_back(n.to(first, at::kFloat));
  }
  if (norms.size() == 1) return norms.front();
  return at::linalg_vector_norm(at::stack(norms), norm_type);
}

void mul_(const std::vector<at::Tensor>& tensors, const at::Tensor& factor) {
  c10::NoGradGuard no_grad;
  TORCH_INTERNAL_ASSERT(factor.dim() == 0 && factor.scalar_type() == at::kFloat);
  std::optional<float> on_cpu;  // read once: a CPU tensor's value needs no device sync
  for (const auto& t : tensors) {
    if (cpu_fast_path(t) && cpu_dtype(t.scalar_type()) && factor.device().is_cpu()) {
      if (!on_cpu) on_cpu = factor.item<float>();
      scale_cpu(t, t, *on_cpu, /*accumulate=*/false);
    } else {
      t.mul_(factor.to(t.device()));
    }
  }
}

}  // namespace amp::detail
