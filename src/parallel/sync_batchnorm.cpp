#include "amp/parallel/sync_batchnorm.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/modules/container/sequential.h>

#include <torch/version.h>

#include <cmath>
#include <ostream>
#include <string>
#include <vector>

#include "amp/batchnorm.h"
#include "casting/precision_policy.h"
#include "group_state.h"

#if TORCH_VERSION_MAJOR < 2
// NOTE [LibTorch 1.13's missing BatchNorm pretty_print]
// Debian's libtorch_cpu 1.13 does not export BatchNormImplBase<D, ...>::pretty_print, which the construction
// vtables of any class derived from BatchNorm{1,2,3}dImpl (Module is a virtual base) refer to. Defining the three
// specializations here (what LibTorch's own batchnorm.cpp prints) lets SyncBatchNorm link there.
namespace torch::nn {
namespace {
template <class Options>
void print_batchnorm(std::ostream& stream, int dims, const Options& options) {
  stream << std::boolalpha << "torch::nn::BatchNorm" << dims << "d(" << options.num_features() << ", eps=" << options.eps()
         << ", momentum=";
  if (options.momentum().has_value()) {
    stream << options.momentum().value();
  } else {
    stream << "None";
  }
  stream << ", affine=" << options.affine() << ", track_running_stats=" << options.track_running_stats() << ")";
}
}  // namespace
template <>
void BatchNormImplBase<1, BatchNorm1dImpl>::pretty_print(std::ostream& stream) const { print_batchnorm(stream, 1, options); }
template <>
void BatchNormImplBase<2, BatchNorm2dImpl>::pretty_print(std::ostream& stream) const { print_batchnorm(stream, 2, options); }
template <>
void BatchNormImplBase<3, BatchNorm3dImpl>::pretty_print(std::ostream& stream) const { print_batchnorm(stream, 3, options); }
}  // namespace torch::nn
#endif

namespace amp::parallel {
namespace detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::vector<int64_t> reduced_dims(const at::Tensor& x) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

std::vector<int64_t> channel_shape(const at::Tensor& x) {
  std::vector<int64_t> shape(static_cast<size_t>(x.dim()), 1);
  shape[1] = x.size(1);
  return shape;
}

// Carries the group through autograd's saved data (an IValue capsule), keeping it alive until backward.
struct GroupHolder : torch::CustomClassHolder {
  explicit GroupHolder(ProcessGroup g) : group(std::move(g)) {}
  ProcessGroup group;
};

const GroupState& group_in(const c10::IValue& capsule) {
  return state_of(c10::static_intrusive_pointer_cast<GroupHolder>(capsule.toCapsule())->group);
}

// NOTE [SyncBatchNorm statistics]
// Each rank computes its count n_r, mean m_r and M2_r = sum (x - m_r)^2 per channel in fp32 (whatever the
// activations' dtype), all ranks all-gather them (one collective), and every rank merges them in rank order
// with Chan et al.'s parallel formula: n = n_a + n_b, d = m_b - m_a, m = m_a + d n_b / n,
// M2 = M2_a + M2_b + d^2 n_a n_b / n. Unlike sum / sum-of-squares, this never subtracts two large
// nearly equal numbers, and the order is fixed, so every rank gets bit-identical statistics.
struct SyncBatchNormFunction : public torch::autograd::Function<SyncBatchNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& bias, const at::Tensor& running_mean, const at::Tensor& running_var,
                            double momentum, double eps, c10::IValue group_capsule) {
    const GroupState& group = group_in(group_capsule);
    const int64_t channels = input.size(1);
    const auto dims = reduced_dims(input);
    const auto shape = channel_shape(input);
    const at::Tensor x = input.to(at::kFloat);
    const int64_t local_count = channels > 0 ? input.numel() / channels : 0;
    at::Tensor local_mean = local_count > 0 ? x.mean(dims) : at::zeros({channels}, x.options());
    at::Tensor local_m2 = local_count > 0 ? (x - local_mean.view(shape)).pow(2).sum(dims) : at::zeros({channels}, x.options());
    at::Tensor packed = at::cat({at::full({1}, static_cast<double>(local_count), x.options().dtype(at::kDouble)),
                                 local_mean.to(at::kDouble), local_m2.to(at::kDouble)});
    std::vector<std::vector<at::Tensor>> gathered(1);
    for (int r = 0; r < group.world_size; ++r) gathered[0].push_back(at::empty_like(packed));
    std::vector<at::Tensor> mine{packed};
    wait(group.group->allgather(gathered, mine), group, "SyncBatchNorm (gathering batch statistics)");
    double n = 0;
    at::Tensor mean = at::zeros({channels}, packed.options());
    at::Tensor m2 = at::zeros({channels}, packed.options());
    for (const auto& stats : gathered[0]) {
      const double n_r = stats[0].item<double>();
      if (n_r == 0) continue;
      const at::Tensor mean_r = stats.narrow(0, 1, channels);
      const at::Tensor m2_r = stats.narrow(0, 1 + channels, channels);
      const double total = n + n_r;
      const at::Tensor delta = mean_r - mean;
      mean = mean + delta * (n_r / total);
      m2 = m2 + m2_r + delta.pow(2) * (n * n_r / total);
      n = total;
    }
    TORCH_CHECK(n > 1, "amp::parallel::SyncBatchNorm: expected more than 1 value per channel over all ranks when "
                "training, got input size ", input.sizes(), " on this rank and ", n, " values in all.");
    const at::Tensor var = (m2 / n).to(at::kFloat);
    const at::Tensor mean_f = mean.to(at::kFloat);
    const at::Tensor invstd = (var + eps).rsqrt();
    if (running_mean.defined()) {
      c10::NoGradGuard no_grad;
      const at::Tensor unbiased = (m2 / (n - 1)).to(at::kFloat);
      running_mean.copy_(running_mean.to(at::kFloat) * (1 - momentum) + mean_f * momentum);
      running_var.copy_(running_var.to(at::kFloat) * (1 - momentum) + unbiased * momentum);
    }
    at::Tensor y = (x - mean_f.view(shape)) * invstd.view(shape);
    if (weight.defined()) y = y * weight.to(at::kFloat).view(shape);
    if (bias.defined()) y = y + bias.to(at::kFloat).view(shape);
    ctx->save_for_backward({input, weight, mean_f, invstd});
    ctx->saved_data["count"] = n;
    ctx->saved_data["group"] = std::move(group_capsule);
    ctx->saved_data["has_bias"] = bias.defined();
    return y.to(input.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& mean = saved[2];
    const at::Tensor& invstd = saved[3];
    const double n = ctx->saved_data["count"].toDouble();
    const GroupState& group = group_in(ctx->saved_data["group"]);
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const auto dims = reduced_dims(input);
    const auto shape = channel_shape(input);
    const int64_t channels = input.size(1);
    const at::Tensor dy = grad_outputs[0].to(at::kFloat);
    const at::Tensor xhat = (input.to(at::kFloat) - mean.view(shape)) * invstd.view(shape);
    const at::Tensor sum_dy = dy.sum(dims);
    const at::Tensor sum_dy_xhat = (dy * xhat).sum(dims);
    at::Tensor grad_input, grad_weight, grad_bias;
    if (ctx->needs_input_grad(0)) {
      std::vector<at::Tensor> sums{at::cat({sum_dy, sum_dy_xhat})};
      wait(group.group->allreduce(sums), group, "SyncBatchNorm backward (summing gradients)");
      const at::Tensor mean_dy = sums[0].narrow(0, 0, channels) / n;
      const at::Tensor mean_dy_xhat = sums[0].narrow(0, channels, channels) / n;
      at::Tensor scale = invstd;
      if (weight.defined()) scale = scale * weight.to(at::kFloat);
      grad_input = ((dy - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape)) * scale.view(shape))
                       .to(input.scalar_type());
    }
    // Parameter gradients stay local: DistributedDataParallel averages them like any other.
    if (weight.defined() && ctx->needs_input_grad(1)) grad_weight = sum_dy_xhat.to(weight.scalar_type());
    if (has_bias && ctx->needs_input_grad(2)) grad_bias = sum_dy.to(weight.defined() ? weight.scalar_type() : at::kFloat);
    return {grad_input, grad_weight, grad_bias, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor sync_batch_norm(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                           const at::Tensor& running_mean, const at::Tensor& running_var, double momentum, double eps,
                           const ProcessGroup& group) {
  TORCH_CHECK(input.dim() >= 2, "amp::parallel::SyncBatchNorm: expected an input of shape (N, C, ...), got ",
              input.sizes(), ".");
  auto capsule = c10::IValue::make_capsule(c10::make_intrusive<GroupHolder>(group));
  return SyncBatchNormFunction::apply(input, weight, bias, running_mean, running_var, momentum, eps, capsule);
}

}  // namespace detail

bool is_sync_batchnorm(const torch::nn::Module& module) {
  return dynamic_cast<const SyncBatchNorm1dImpl*>(&module) || dynamic_cast<const SyncBatchNorm2dImpl*>(&module) ||
         dynamic_cast<const SyncBatchNorm3dImpl*>(&module);
}

namespace {

template <class Sync, class Base>
std::shared_ptr<torch::nn::Module> make_sync(const std::shared_ptr<torch::nn::Module>& module, const ProcessGroup& group) {
  if (auto* bn = dynamic_cast<Base*>(module.get())) return std::make_shared<Sync>(*bn, group);
  return nullptr;
}

template <class Sync>
torch::nn::AnyModule any_of(const std::shared_ptr<torch::nn::Module>& m) {
  return torch::nn::AnyModule(std::dynamic_pointer_cast<Sync>(m));
}

void convert(torch::nn::Module& parent, const std::string& path, const ProcessGroup& group) {
  auto* sequential = dynamic_cast<torch::nn::SequentialImpl*>(&parent);
  for (const auto& item : parent.named_children()) {
    const std::string name = path.empty() ? item.key() : path + "." + item.key();
    const std::shared_ptr<torch::nn::Module> child = item.value();
    if (auto* s1 = dynamic_cast<SyncBatchNorm1dImpl*>(child.get())) {
      s1->set_process_group(group);
      continue;
    }
    if (auto* s2 = dynamic_cast<SyncBatchNorm2dImpl*>(child.get())) {
      s2->set_process_group(group);
      continue;
    }
    if (auto* s3 = dynamic_cast<SyncBatchNorm3dImpl*>(child.get())) {
      s3->set_process_group(group);
      continue;
    }
    if (!is_batchnorm(*child)) {
      convert(*child, name, group);
      continue;
    }
    if (!sequential) {
      // A member the parent's forward reaches directly can't be swapped: its training-mode batch_norm runs
      // synchronized instead, through the precision policy's dispatch key (NOTE [Precision policy dispatch key]),
      // whenever an amp::Model's forward (or make_distributed's) reaches it.
      amp::detail::replace_batch_norm(*child, [group](const at::Tensor& input, const at::Tensor& weight,
                                                      const at::Tensor& bias, const at::Tensor& running_mean,
                                                      const at::Tensor& running_var, double momentum, double eps) {
        if (group.world_size() == 1) return at::Tensor();  // exactly BatchNorm
        return detail::sync_batch_norm(input, weight, bias, running_mean, running_var, momentum, eps, group);
      });
      continue;
    }
    std::shared_ptr<torch::nn::Module> sync;
    torch::nn::AnyModule any;
    if ((sync = make_sync<SyncBatchNorm1dImpl, torch::nn::BatchNorm1dImpl>(child, group))) {
      any = any_of<SyncBatchNorm1dImpl>(sync);
    } else if ((sync = make_sync<SyncBatchNorm2dImpl, torch::nn::BatchNorm2dImpl>(child, group))) {
      any = any_of<SyncBatchNorm2dImpl>(sync);
    } else if ((sync = make_sync<SyncBatchNorm3dImpl, torch::nn::BatchNorm3dImpl>(child, group))) {
      any = any_of<SyncBatchNorm3dImpl>(sync);
    }
    TORCH_INTERNAL_ASSERT(sync, "convert_syncbn_model: '", name, "' is BatchNorm but not BatchNorm1d/2d/3d");
    size_t index = 0;
    for (auto it = sequential->begin(); it != sequential->end(); ++it, ++index) {
      if (it->ptr().get() == child.get()) {
        *it = std::move(any);
        break;
      }
    }
    TORCH_INTERNAL_ASSERT(index < sequential->size(), "convert_syncbn_model: layer not found in its Sequential");
    parent.replace_module(item.key(), sync);
  }
}

}  // namespace

void convert_syncbn_model(torch::nn::Module& module, const ProcessGroup& group) {
  if (auto* s1 = dynamic_cast<SyncBatchNorm1dImpl*>(&module)) return s1->set_process_group(group);
  if (auto* s2 = dynamic_cast<SyncBatchNorm2dImpl*>(&module)) return s2->set_process_group(group);
  if (auto* s3 = dynamic_cast<SyncBatchNorm3dImpl*>(&module)) return s3->set_process_group(group);
  TORCH_CHECK(!is_batchnorm(module), "amp::parallel::convert_syncbn_model: the module itself is a BatchNorm layer (",
              module.name(), "), which can't replace itself. Declare it as amp::parallel::SyncBatchNorm2d (1d, 3d), or "
              "convert the model that holds it.");
  convert(module, "", group);
}

}  // namespace amp::parallel
