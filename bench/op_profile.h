#pragma once
// A per-op time profile from the dispatcher's RecordFunction callbacks: self time (an op's time minus the ops it
// calls) per op name, and per category, over the steps run while an OpProfile is alive (amp_bench --section
// o1_profile).
//
// Categories follow an op's outermost categorized caller, so a cast inside softmax counts as a cast and the
// _softmax inside softmax as softmax. An op that calls itself by the same name directly (an autocast kernel, amp's
// or ATen's, casts the arguments and calls the op again) spends its self time in the "autocast kernels" category:
// that is the cost of the cast kernel's own dispatch work, what amp can remove.

#include <ATen/record_function.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

namespace bench {

class OpProfile {
 public:
  enum Category { kCast, kNormSoftmaxGelu, kGemm, kAutocastKernel, kOther, kCategories };
  static const char* category_name(int c) {
    static const char* names[] = {"casts (aten::to, _to_copy)", "softmax, GELU, LayerNorm (fwd + bwd)",
                                  "GEMMs and convolutions", "autocast kernels (dispatch work)",
                                  "everything else"};
    return names[c];
  }

  OpProfile() {
    state() = State{};
    handle_ = at::addThreadLocalCallback(at::RecordFunctionCallback(&enter, &leave).scopes({at::RecordScope::FUNCTION}));
  }
  ~OpProfile() { at::removeCallback(handle_); }
  OpProfile(const OpProfile&) = delete;
  OpProfile& operator=(const OpProfile&) = delete;

  /// Nanoseconds of self time per category, and per op name (the autocast kernels' frames as "<op> (kernel)").
  static const std::vector<double>& category_ns() { return state().category_ns; }
  static const std::map<std::string, double>& op_ns() { return state().op_ns; }
  /// Calls per op name (as op_ns names them).
  static const std::map<std::string, int64_t>& op_calls() { return state().op_calls; }
  /// Nanoseconds inside outermost ops (the rest of a step is the C++ frontend, autograd's engine, amp's host code).
  static double op_total_ns() { return state().top_ns; }

 private:
  using Clock = std::chrono::steady_clock;
  struct Frame {
    const char* name;
    Clock::time_point start;
    double children_ns;
    Category category;
    bool calls_itself;
  };
  struct State {
    std::vector<Frame> stack;
    std::vector<double> category_ns = std::vector<double>(kCategories, 0.0);
    std::map<std::string, double> op_ns;
    std::map<std::string, int64_t> op_calls;
    double top_ns = 0;
  };
  static State& state() {
    static thread_local State s;
    return s;
  }

  static bool is(const char* name, std::initializer_list<const char*> names) {
    for (const char* n : names) {
      if (std::strcmp(name, n) == 0) return true;
    }
    return false;
  }
  static Category categorize(const char* name, const std::vector<Frame>& stack) {
    if (!stack.empty() && stack.back().category != kOther) return stack.back().category;
    if (is(name, {"aten::to", "aten::_to_copy"})) return kCast;
    if (is(name, {"aten::softmax", "aten::_softmax", "aten::_softmax_backward_data", "aten::gelu", "aten::gelu_backward",
                  "aten::layer_norm", "aten::native_layer_norm", "aten::native_layer_norm_backward"})) {
      return kNormSoftmaxGelu;
    }
    if (is(name, {"aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear", "aten::conv2d",
                  "aten::convolution", "aten::_convolution", "aten::mkldnn_convolution", "aten::convolution_backward"})) {
      return kGemm;
    }
    return kOther;
  }

  static std::unique_ptr<at::ObserverContext> enter(const at::RecordFunction& fn) {
    State& s = state();
    const char* name = fn.name();
    if (!s.stack.empty() && std::strcmp(s.stack.back().name, name) == 0) s.stack.back().calls_itself = true;
    s.stack.push_back({name, Clock::now(), 0.0, categorize(name, s.stack), false});
    return nullptr;
  }
  static void leave(const at::RecordFunction&, at::ObserverContext*) {
    State& s = state();
    if (s.stack.empty()) return;  // a callback added mid-op
    const Frame f = s.stack.back();
    s.stack.pop_back();
    const double total = std::chrono::duration<double, std::nano>(Clock::now() - f.start).count();
    const double self = total - f.children_ns;
    const std::string name = f.calls_itself ? std::string(f.name) + " (kernel)" : std::string(f.name);
    s.category_ns[f.calls_itself ? kAutocastKernel : f.category] += self;
    s.op_ns[name] += self;
    ++s.op_calls[name];
    if (s.stack.empty()) s.top_ns += total;
    else s.stack.back().children_ns += total;
  }

  at::CallbackHandle handle_;
};

}  // namespace bench
