#pragma once
// The interception room: one dispatch key that amp::Model's forward turns on, one boxed fallback on it, and the
// ordered handlers that fallback runs. Features that act on the ops of a forward (fp32 islands, FP8 GEMMs, member
// BatchNorm kernels, auto_fp32's diagnosis) are handlers; a new one is a class and a registration line.
//
// NOTE [One interception key]
// torch::nn::Module has no hooks (NOTE [Why no forward hooks] in src/casting/cast_kernels.cpp), so amp acts on the
// ops instead. The key is DeferredInit: it sits above the Autocast and Autograd keys, so what a handler does
// (casts, replacement kernels) is recorded by autograd and precedes O1's casts. PyTorch reserves it for an
// out-of-core library (torchdistx's deferred init, which a LibTorch process doesn't load); amp registers its
// fallback once, and says so if another library holds the key. The fallback redispatches below the key and
// excludes it for the op's own inner ops, which see what the handlers made of the arguments already. Ops that
// write into an argument pass only the handlers that say they see writes (ZeRO stage 3's gather). Backward never
// runs under the key: guards live in the forward only.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/DispatchKeySet.h>

#include <functional>
#include <memory>
#include <vector>

namespace amp::detail {

constexpr c10::DispatchKey kInterceptionKey = c10::DispatchKey::DeferredInit;

/// One op that reached the key: a handler may change its arguments (on the stack) and the keys it runs on below.
struct InterceptedOp {
  const c10::OperatorHandle& op;
  c10::DispatchKeySet keys;  // the keys below interception the op is redispatched to
  torch::jit::Stack* stack;

  size_t num_arguments() const { return op.schema().arguments().size(); }
  c10::IValue* arguments() const { return stack->data() + (stack->size() - num_arguments()); }
};

class InterceptionHandler;

/// The rest of the chain: the later handlers, then the op itself.
class InterceptNext {
 public:
  InterceptNext(const std::vector<std::shared_ptr<InterceptionHandler>>& handlers, size_t index)
      : handlers_(handlers), index_(index) {}
  void operator()(InterceptedOp& op) const;

 private:
  const std::vector<std::shared_ptr<InterceptionHandler>>& handlers_;
  size_t index_;
};

class InterceptionHandler {
 public:
  virtual ~InterceptionHandler() = default;
  /// Runs `op` exactly once: by itself (results pushed on the stack in place of the arguments) or through
  /// next(op), after changing what it likes.
  virtual void handle(InterceptedOp& op, const InterceptNext& next) = 0;
  /// Whether the handler also sees ops that write into an argument (which the others never see).
  virtual bool sees_writes() const { return false; }
};

/// The handlers' places in the chain (lower runs first): a handler that runs an op whole comes before those that
/// adjust its arguments, and diagnosis last, to see the op as it will run.
enum InterceptionOrder : int {
  kZeroGatherOrder = 0,        // src/parallel/zero_units.cpp: ZeRO stage 3 makes a unit's parameters whole first
  kFp8GemmOrder = 10,          // src/casting/fp8.cpp: an FP8 layer's GEMMs
  kMemberBatchNormOrder = 20,  // src/casting/precision_policy.cpp: amp::parallel's kernel for a member BatchNorm
  kIslandCastOrder = 30,       // src/casting/precision_policy.cpp: fp32 islands' casts
  kDiagnosisOrder = 40,        // src/casting/precision_policy.cpp: auto_fp32's search for the overflowing module
};

/// Adds `handler` at `order` (once per process and handler; later registrations of the same order run after).
void register_interception_handler(int order, std::shared_ptr<InterceptionHandler> handler);

/// Installs the fallback on kInterceptionKey, once per process (throws if another library holds the key). Call
/// before turning the key on.
void register_interception_fallback();

/// A per-thread state of a forward that a region recomputed in backward must see again (ZeRO stage 3's gatherers:
/// amp::checkpoint recomputes a unit's ops after its forward ended). A capture runs in the forward and returns what
/// re-enters that state for the recompute (the object it returns lives as long as the recompute), or null.
using ForwardContext = std::function<std::shared_ptr<void>()>;
using ForwardContextCapture = std::function<ForwardContext()>;
/// Adds `capture` (once per process and feature).
void register_forward_context(ForwardContextCapture capture);
/// Every registered capture's context now (amp::checkpoint's forward); the null ones left out.
std::vector<ForwardContext> capture_forward_contexts();

}  // namespace amp::detail
