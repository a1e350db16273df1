#include "amp/initialize.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/rnn.h>
#include <torch/version.h>

#include <algorithm>
#include <iostream>
#include <functional>
#include <mutex>
#include <set>

#include "amp/torchscript.h"
#include "casting/cpu_features.h"
#include "casting/jit_mirror.h"
#include "options/exception_message.h"
#include "optim/lean_masters.h"
#include "optim/master_weights.h"
#include "casting/model_casting.h"
#include "opt_levels/spec.h"
#include "casting/precision_policy.h"

namespace amp::detail {
namespace {

// Modules already through initialize, held weakly (Apex guards only optimizers; a model cast twice
// would lose its fp32 values silently).
std::mutex initialized_mutex;
std::vector<std::weak_ptr<torch::nn::Module>> initialized_modules;

bool uses_low_precision(const Properties& p) {
  return p.enabled && (p.patch_torch_functions || casts_model_to_low_precision(p));
}

// Runs a GEMM and a convolution the way the level will, so that a build without kernels for the
// dtype fails here, with advice, instead of deep inside the first forward.
void probe_dtype(c10::DeviceType device, const Properties& p) {
  if (!uses_low_precision(p)) return;
  const c10::ScalarType lp = p.low_precision_dtype;
  try {
    c10::NoGradGuard no_grad;
    const auto options = at::TensorOptions().device(device).dtype(at::kFloat);
    at::Tensor a = at::ones({4, 4}, options), image = at::ones({1, 2, 5, 5}, options);
    at::Tensor kernel = at::ones({2, 2, 3, 3}, options);
    if (p.patch_torch_functions) {
      AutocastGuard casts(device, lp);
      (void)at::mm(a, a);
      (void)at::conv2d(image, kernel);
    } else {
      (void)at::mm(a.to(lp), a.to(lp));
      (void)at::conv2d(image.to(lp), kernel.to(lp));
    }
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "amp::initialize: opt_level ", to_string(p.opt_level), " computes in ", dtype_name(lp),
                " on ", c10::DeviceTypeName(device, /*lower_case=*/true), ", but this LibTorch build (",
                TORCH_VERSION, ") can't: ", message_of(e),
                "\nUse low_precision_dtype(torch::kBFloat16) (config: low_precision_dtype = bfloat16), run on a "
                "CUDA device, or use LibTorch >= 2.3 for float16 on the CPU.");
  }
}

// Layers whose low-precision kernels some builds lack or get wrong (LibTorch 1.13's CPU bfloat16
// transposed convolution mistakes its weight layout): found in the model, they are run once here in the
// level's dtype, with fewer output than input channels and a stride, as real decoders use them.
void probe_layers(torch::nn::Module& module, c10::DeviceType device, const Properties& p) {
  if (!uses_low_precision(p)) return;
  const c10::ScalarType lp = p.low_precision_dtype;
  for (const auto& item : module.named_modules("", /*include_self=*/true)) {
    const torch::nn::Module& layer = *item.value();
    const int dims = dynamic_cast<const torch::nn::ConvTranspose1dImpl*>(&layer)   ? 1
                     : dynamic_cast<const torch::nn::ConvTranspose2dImpl*>(&layer) ? 2
                     : dynamic_cast<const torch::nn::ConvTranspose3dImpl*>(&layer) ? 3
                                                                                   : 0;
    if (dims == 0) continue;
    try {
      c10::NoGradGuard no_grad;
      std::vector<int64_t> input_shape = {1, 4}, weight_shape = {4, 2};
      for (int d = 0; d < dims; ++d) input_shape.push_back(3), weight_shape.push_back(3);
      const auto options = at::TensorOptions().device(device).dtype(p.patch_torch_functions ? at::kFloat : lp);
      const at::Tensor x = at::ones(input_shape, options), w = at::ones(weight_shape, options);
      std::optional<AutocastGuard> casts;
      if (p.patch_torch_functions) casts.emplace(device, lp);
      const std::vector<int64_t> stride(static_cast<size_t>(dims), 2), padding(static_cast<size_t>(dims), 1);
      const at::Tensor y = at::convolution(x, w, {}, stride, padding, {std::vector<int64_t>(static_cast<size_t>(dims), 1)},
                                           /*transposed=*/true, std::vector<int64_t>(static_cast<size_t>(dims), 1), 1);
      TORCH_CHECK(y.size(1) == 2, "the output has ", y.size(1), " channels instead of 2");
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "amp::initialize: the model has a ConvTranspose", dims, "d layer ('", item.key(),
                  "'), which this LibTorch build (", TORCH_VERSION, ") can't run in ", dtype_name(lp), " on ",
                  c10::DeviceTypeName(device, /*lower_case=*/true), ": ", message_of(e),
                  "\nUse opt_level O1 (its per-op casts run transposed convolutions in fp32 on this build), a "
                  "CUDA device, or LibTorch 2.x.");
    }
  }
}

// Recurrent layers: oneDNN's CPU LSTM has no float16 primitive on CPUs without native fp16 support
// ("could not create a primitive descriptor"), and autocast sends O1's LSTM there. One tiny instance of
// each recurrent type the model holds runs forward and backward here, as the level will run it.
void probe_recurrent_layers(torch::nn::Module& module, c10::DeviceType device, const Properties& p) {
  if (!uses_low_precision(p)) return;
  const c10::ScalarType lp = p.low_precision_dtype;
  std::set<std::string> probed;
  for (const auto& item : module.named_modules("", /*include_self=*/true)) {
    const torch::nn::Module& layer = *item.value();
    std::function<at::Tensor(const at::Tensor&)> run;
    std::shared_ptr<torch::nn::Module> instance;
    std::vector<int64_t> input_shape;
    std::string type;
    if (dynamic_cast<const torch::nn::LSTMImpl*>(&layer)) {
      auto m = torch::nn::LSTM(torch::nn::LSTMOptions(4, 3));
      instance = m.ptr(), type = "LSTM", input_shape = {2, 1, 4};
      run = [m](const at::Tensor& x) mutable { return std::get<0>(m->forward(x)); };
    } else if (dynamic_cast<const torch::nn::GRUImpl*>(&layer)) {
      auto m = torch::nn::GRU(torch::nn::GRUOptions(4, 3));
      instance = m.ptr(), type = "GRU", input_shape = {2, 1, 4};
      run = [m](const at::Tensor& x) mutable { return std::get<0>(m->forward(x)); };
    } else if (dynamic_cast<const torch::nn::RNNImpl*>(&layer)) {
      auto m = torch::nn::RNN(torch::nn::RNNOptions(4, 3));
      instance = m.ptr(), type = "RNN", input_shape = {2, 1, 4};
      run = [m](const at::Tensor& x) mutable { return std::get<0>(m->forward(x)); };
    } else if (dynamic_cast<const torch::nn::LSTMCellImpl*>(&layer)) {
      auto m = torch::nn::LSTMCell(torch::nn::LSTMCellOptions(4, 3));
      instance = m.ptr(), type = "LSTMCell", input_shape = {1, 4};
      run = [m](const at::Tensor& x) mutable { return std::get<0>(m->forward(x)); };
    } else if (dynamic_cast<const torch::nn::GRUCellImpl*>(&layer)) {
      auto m = torch::nn::GRUCell(torch::nn::GRUCellOptions(4, 3));
      instance = m.ptr(), type = "GRUCell", input_shape = {1, 4};
      run = [m](const at::Tensor& x) mutable { return m->forward(x); };
    } else if (dynamic_cast<const torch::nn::RNNCellImpl*>(&layer)) {
      auto m = torch::nn::RNNCell(torch::nn::RNNCellOptions(4, 3));
      instance = m.ptr(), type = "RNNCell", input_shape = {1, 4};
      run = [m](const at::Tensor& x) mutable { return m->forward(x); };
    } else {
      continue;
    }
    if (!probed.insert(type).second) continue;
    try {
      const bool per_op = p.patch_torch_functions;
      instance->to(device, per_op ? at::kFloat : lp);
      const at::Tensor x = at::ones(input_shape, at::TensorOptions().device(device).dtype(per_op ? at::kFloat : lp));
      at::Tensor y;
      {
        std::optional<AutocastGuard> casts;
        if (per_op) casts.emplace(device, lp);
        y = run(x);
      }
      y.to(at::kFloat).sum().backward();
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "amp::initialize: the model has a ", type, " layer ('", item.key(), "'), which this LibTorch "
                  "build (", TORCH_VERSION, ") can't run in ", dtype_name(lp), " on ",
                  c10::DeviceTypeName(device, /*lower_case=*/true), " at opt_level ", to_string(p.opt_level), ": ",
                  message_of(e), "\nUse low_precision_dtype(torch::kBFloat16) (config: low_precision_dtype = "
                  "bfloat16)", (p.patch_torch_functions ? ", opt_level O2 (its cast weights take another kernel)" : ""),
                  ", or a CUDA device.");
    }
  }
}

void print_banner(const Options& options, const Properties& properties) {
  std::cout << "Selected optimization level " << brief(options.opt_level()) << "\n\n"
            << "Defaults for this optimization level are:\n"
            << to_string(opt_levels::spec(options.opt_level()).defaults)
            << "Processing user overrides (additional kwargs that are not None)...\n"
            << options.describe_overrides()
            << "After processing overrides, optimization options are:\n"
            << to_string(properties) << std::flush;
}

}  // namespace

bool already_initialized(const torch::nn::Module& module) {
  std::lock_guard<std::mutex> lock(initialized_mutex);
  for (const auto& weak : initialized_modules) {
    if (auto m = weak.lock(); m.get() == &module) return true;
  }
  return false;
}

c10::DeviceType check_model(torch::nn::Module& module, const Options& options, const Properties& properties) {
  note_initialize();
  TORCH_CHECK(!already_initialized(module),
              "amp::initialize: this model (", module.name(), ") has already been passed through amp::initialize. "
              "Call amp::initialize once per model and keep using the Model it returned.");
  std::optional<c10::Device> device;
  auto check_fp32 = [&](const std::string& kind, const std::string& name, const at::Tensor& t) {
    if (!device) device = t.device();
    if (!t.is_floating_point()) return;
    TORCH_CHECK(t.scalar_type() == at::kFloat, "amp::initialize: found ", kind, " '", name, "' with dtype ",
                dtype_name(t.scalar_type()), ", expected torch.float32. amp casts the model itself: pass an fp32 "
                "model (you do not need to call .to(torch::kHalf) or .to(torch::kDouble) on the model before "
                "amp::initialize).");
  };
  for (const auto& item : module.named_parameters()) check_fp32("parameter", item.key(), item.value());
  for (const auto& item : module.named_buffers()) check_fp32("buffer", item.key(), item.value());
  const c10::DeviceType device_type = device ? device->type() : c10::DeviceType::CPU;
  if (properties.enabled && properties.verbosity >= 1) print_banner(options, properties);
  probe_dtype(device_type, properties);
  if (device_type == c10::DeviceType::CPU && uses_low_precision(properties) && properties.verbosity >= 1) {
    if (auto notice = slow_dtype_notice(properties.low_precision_dtype, cpu_features())) std::cout << *notice << std::endl;
  }
  probe_layers(module, device_type, properties);
  probe_recurrent_layers(module, device_type, properties);
  return device_type;
}

void cast_model(torch::nn::Module& module, const Properties& properties) {
  const auto to_cast = tensors_to_cast(module, properties);
  if (!to_cast.empty()) {
    c10::NoGradGuard no_grad;
    const c10::ScalarType dtype = *properties.cast_model_type;
    // set_data keeps each tensor's identity (its TensorImpl), so holders of the parameter, such as
    // the optimizer, see the cast. Apex's convert_network does the same with `param.data =`.
    for (auto& t : module.parameters()) {
      if (!to_cast.count(t.unsafeGetTensorImpl())) continue;
      if (auto lean = find_lean(t)) {  // cast keeping its fp32 value in the lean form (master_weights_format)
        lean->first->cast_from_float(lean->second);
        continue;
      }
      t.set_data(t.to(dtype));
      t.mutable_grad() = at::Tensor();  // a stale fp32 gradient would not match the new dtype
      // The master holds the fp32 original; the cast is not a user's write to copy into it.
      if (auto master = find_master(t)) master->first->mark_synced(master->second);
    }
    for (auto& t : module.buffers()) {
      if (to_cast.count(t.unsafeGetTensorImpl())) t.set_data(t.to(dtype));
    }
  }
  if (auto policy = precision_policy_of(module)) policy->note_cast(module);
  std::lock_guard<std::mutex> lock(initialized_mutex);
  initialized_modules.erase(std::remove_if(initialized_modules.begin(), initialized_modules.end(),
                                           [](const auto& weak) { return weak.expired(); }),
                            initialized_modules.end());
  initialized_modules.push_back(module.shared_from_this());
}

}  // namespace amp::detail

namespace amp {
namespace detail {

std::pair<std::shared_ptr<torch::nn::Module>, c10::DeviceType> begin_initialize(const torch::jit::Module& model,
                                                                                const Options& options,
                                                                                const Properties& properties) {
  TORCH_CHECK(properties.auto_fp32 == 0, "amp::initialize: auto_fp32 (", properties.auto_fp32, ") does not take "
              "TorchScript models yet: its diagnosis watches the ops of torch::nn::Module layers. Name the modules to "
              "keep in fp32 with keep_fp32 (config keep_fp32 = ...), or set auto_fp32 0.");
  auto mirror = jit_mirror_node(model);
  TORCH_CHECK(!mirror->parameters().empty(), "amp::initialize: the TorchScript module (", mirror->type_name(),
              ") has no parameters, so amp has nothing to cast or train. A module saved after torch.jit.freeze or "
              "torch.jit.optimize_for_inference holds its weights as graph constants: save the module before freezing "
              "it (torch.jit.script(model).save(path)).");
  auto check_fp32 = [](const char* kind, const std::string& name, const at::Tensor& t) {
    TORCH_CHECK(!t.is_floating_point() || t.scalar_type() == at::kFloat, "amp::initialize: the TorchScript module's ",
                kind, " '", name, "' is ", dtype_name(t.scalar_type()), ": the module was saved after .half(), "
                ".bfloat16() or .double() in Python. amp casts the model itself and keeps fp32 where the level asks: "
                "save it in fp32 (model.float() before torch.jit.script / torch.jit.trace and save).");
  };
  if (!already_initialized(*mirror)) {  // else check_model says so: its tensors are cast
    for (const auto& item : mirror->named_parameters()) check_fp32("parameter", item.key(), item.value());
    for (const auto& item : mirror->named_buffers()) check_fp32("buffer", item.key(), item.value());
  }
  const c10::DeviceType device = check_model(*mirror, options, properties);
  resolve_precision_policy({mirror.get()}, properties);
  return {mirror, device};
}

void check_trainable(const torch::optim::Optimizer& optimizer, const torch::nn::Module& mirror) {
  size_t count = 0, trainable = 0;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      ++count;
      trainable += p.requires_grad() ? 1 : 0;
    }
  }
  TORCH_CHECK(count == 0 || trainable > 0, "amp::initialize: none of the optimizer's ", count, " parameters requires "
              "grad, so training would change nothing. A TorchScript module (", mirror.name(), ") keeps the "
              "requires_grad its parameters had when Python saved it (requires_grad_(False) on a backbone, ...): turn "
              "it on for the parameters to train (p.set_requires_grad(true) on amp::parameters(net)'s) before building "
              "the optimizer.");
}

}  // namespace detail

Model<torch::jit::Module> initialize(torch::jit::Module model, const Options& options) {
  const Properties properties = options.resolve();
  auto [mirror, device] = detail::begin_initialize(model, options, properties);
  detail::cast_model(*mirror, properties);
  return Model<torch::jit::Module>(std::move(model), mirror, properties, device);
}

}  // namespace amp
