#pragma once
// Activation checkpointing (torch.utils.checkpoint with use_reentrant=False), which LibTorch lacks: a block runs
// without keeping its intermediate activations, and backward recomputes them under the autocast state (amp's O1
// casts included) and the RNG state its forward had.

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace amp {

namespace detail {

using CheckpointBody = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

/// Runs `body` on `inputs` without keeping its activations and returns its outputs, wired to a backward that
/// recomputes them without side effects (what the recompute writes outside itself is restored after it).
std::vector<at::Tensor> checkpoint(CheckpointBody body, const std::vector<at::Tensor>& inputs);

template <class R>
struct CheckpointResult {
  static_assert(std::is_same_v<R, at::Tensor> || std::is_same_v<R, std::vector<at::Tensor>>,
                "amp::checkpoint: fn must return a torch::Tensor, a std::tuple of them or a std::vector of them");
  static std::vector<at::Tensor> to_list(R r) {
    if constexpr (std::is_same_v<R, at::Tensor>) return {std::move(r)};
    else return r;
  }
  static R from_list(std::vector<at::Tensor> list) {
    if constexpr (std::is_same_v<R, at::Tensor>) return std::move(list.at(0));
    else return list;
  }
};

template <class... Ts>
struct CheckpointResult<std::tuple<Ts...>> {
  static_assert((std::is_same_v<Ts, at::Tensor> && ...),
                "amp::checkpoint: every element of the std::tuple fn returns must be a torch::Tensor");
  static std::vector<at::Tensor> to_list(std::tuple<Ts...> r) {
    return std::apply([](auto&&... t) { return std::vector<at::Tensor>{std::move(t)...}; }, std::move(r));
  }
  static std::tuple<Ts...> from_list(std::vector<at::Tensor> list) {
    return from_list(std::move(list), std::index_sequence_for<Ts...>{});
  }
  template <size_t... I>
  static std::tuple<Ts...> from_list(std::vector<at::Tensor> list, std::index_sequence<I...>) {
    return std::tuple<Ts...>{std::move(list.at(I))...};
  }
};

// Whether fn is a module holder (torch::nn::Sequential, a TORCH_MODULE): checkpoint calls its forward.
template <class F, class = void>
struct IsModuleHolder : std::false_type {};
template <class F>
struct IsModuleHolder<F, std::void_t<decltype(std::declval<F&>()->buffers(true))>> : std::true_type {};

// Calls fn on the inputs: a module through its forward (a holder's operator() hides Sequential's return type).
template <class F, size_t... I>
decltype(auto) invoke_on(F& f, const std::vector<at::Tensor>& xs, std::index_sequence<I...>) {
  if constexpr (IsModuleHolder<F>::value) return f->forward(xs[I]...);
  else return std::invoke(f, xs[I]...);
}

}  // namespace detail

/// Runs `fn(inputs...)` without keeping the activations inside it, and returns what fn returns (a tensor, a
/// std::tuple of tensors or a std::vector of tensors). On backward the activations are recomputed by running fn
/// again, under the autocast state, amp's O1 casts and the RNG state of the first run (dropout draws the same
/// masks), and the gradients flow to the inputs and to every parameter fn read, as torch.utils.checkpoint with
/// use_reentrant=False: inputs that don't require grad are fine, and parameters get their gradients through their
/// usual accumulators (amp::parallel's reduction hooks fire as without checkpointing).
///
///  - fn is copied and kept until backward: capture by value. A lambda that captures a local by reference reads
///    a dead stack frame when backward recomputes it. A lambda that calls a captured module holder must be
///    `mutable` (LibTorch's modules have no const forward): `[block](const torch::Tensor& h) mutable {...}`.
///  - The recompute has no side effects: whatever it writes outside itself (a training-mode BatchNorm's running
///    statistics and batch count, whether fn is a module, a lambda over modules or over F::batch_norm) gets back
///    the value it had, so statistics move once per step, not twice as under torch.utils.checkpoint.
///  - A tensor that requires grad and was computed outside fn must reach fn as an input, not through a capture
///    (checkpoint throws, saying so). Parameters (leaves) may be captured freely.
///  - Inputs must not be modified in place before backward (checkpoint throws at backward if they were).
///  - Without grad mode (inference, torch::NoGradGuard) fn simply runs. Double backward (create_graph) is not
///    supported and throws.
///
/// Example:
///   torch::Tensor forward(torch::Tensor x) {
///     for (auto& block : blocks) x = amp::checkpoint(block, x);   // block: a TORCH_MODULE holder
///     return head(x);
///   }
template <class Fn, class... Tensors>
auto checkpoint(Fn&& fn, Tensors&&... inputs) {
  static_assert((std::is_convertible_v<Tensors, const at::Tensor&> && ...),
                "amp::checkpoint: pass tensors as inputs; capture other arguments in fn (by value)");
  using Callable = std::decay_t<Fn>;
  using Indices = std::index_sequence_for<Tensors...>;
  using Result = std::decay_t<decltype(detail::invoke_on(std::declval<Callable&>(),
                                                         std::declval<const std::vector<at::Tensor>&>(), Indices{}))>;
  using Convert = detail::CheckpointResult<Result>;

  auto callable = std::make_shared<Callable>(std::forward<Fn>(fn));
  detail::CheckpointBody body = [callable](const std::vector<at::Tensor>& xs) {
    return Convert::to_list(detail::invoke_on(*callable, xs, Indices{}));
  };
  return Convert::from_list(detail::checkpoint(std::move(body), {at::Tensor(inputs)...}));
}

}  // namespace amp
