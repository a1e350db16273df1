#include "optim/cpu_state_codec.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "optim/stochastic_rounding.h"
#include "scaling/cpu_kernels.h"

// Built with -ffp-contract=off (CMakeLists.txt): every product and quotient below is rounded as torchao's ATen ops
// round them, so the codes are torchao's bit for bit.

namespace amp::detail::cpu {
namespace {

// torchao's quantize_8bit_with_qmap for one value already divided by its block's scale: a branchless binary
// search for the last map entry <= y (ties and NaN as torch.where's comparisons decide them), then up one code
// where y is at least half-way to the next entry.
inline uint8_t code_of(float y, const float* map) {
  int c = y >= map[128] ? 128 : 0;
  c += y >= map[c + 64] ? 64 : 0;
  c += y >= map[c + 32] ? 32 : 0;
  c += y >= map[c + 16] ? 16 : 0;
  c += y >= map[c + 8] ? 8 : 0;
  c += y >= map[c + 4] ? 4 : 0;
  c += y >= map[c + 2] ? 2 : 0;
  c += y >= map[c + 1] ? 1 : 0;
  const int up = std::min(c + 1, 255);
  const float down = map[c];
  return static_cast<uint8_t>(y - down >= (map[up] - down) * 0.5f ? up : c);
}

AMP_VECTOR_CLONES void encode_block(const float* __restrict in, uint8_t* __restrict codes, float* scale,
                                    const float* __restrict map) {
  // torchao's scale_tensor: the block's absmax, clipped to 1e-12 (NaN propagates, as amax does).
  float amax = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < kCodeBlock; ++i) {
    const float a = std::fabs(in[i]);
    nan = nan || a != a;
    amax = a > amax ? a : amax;
  }
  const float s = nan ? std::numeric_limits<float>::quiet_NaN() : std::max(amax, 1e-12f);
  *scale = s;
  for (int64_t i = 0; i < kCodeBlock; ++i) codes[i] = code_of(in[i] / s, map);
}

AMP_VECTOR_CLONES void decode_block(const uint8_t* __restrict codes, float scale, const float* __restrict map,
                                    float* __restrict out) {
  for (int64_t i = 0; i < kCodeBlock; ++i) out[i] = map[codes[i]] * scale;
}

}  // namespace

void decode(const StateView& view, int64_t begin, int64_t n, float* out) {
  switch (view.kind) {
    case StateKind::kFloat: std::memcpy(out, static_cast<const float*>(view.data) + begin, n * sizeof(float)); return;
    case StateKind::kBFloat16: {
      const auto* in = static_cast<const c10::BFloat16*>(view.data) + begin;
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]);
      return;
    }
    case StateKind::kHalf: {
      const auto* in = static_cast<const c10::Half*>(view.data) + begin;
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]);
      return;
    }
    case StateKind::kCodes: {
      const auto* codes = static_cast<const uint8_t*>(view.data);
      for (int64_t b = 0; b < n; b += kCodeBlock) {
        decode_block(codes + begin + b, view.scales[(begin + b) / kCodeBlock], view.map, out + b);
      }
      return;
    }
  }
}

void encode(const StateView& view, int64_t begin, int64_t n, const float* in) {
  switch (view.kind) {
    case StateKind::kFloat: std::memcpy(static_cast<float*>(view.data) + begin, in, n * sizeof(float)); return;
    case StateKind::kBFloat16: {
      auto* out = static_cast<uint16_t*>(view.data) + begin;
      if (!view.stochastic) {
        convert(in, Dtype::BFloat16, out, n);
        return;
      }
      const uint64_t first = view.first + static_cast<uint64_t>(begin);
      for (int64_t i = 0; i < n; ++i) {
        out[i] = round_stochastically(in[i], static_cast<uint16_t>(random_bits(view.seed, first + static_cast<uint64_t>(i))));
      }
      return;
    }
    case StateKind::kHalf: convert(in, Dtype::Half, static_cast<char*>(view.data) + begin * 2, n); return;
    case StateKind::kCodes: {
      auto* codes = static_cast<uint8_t*>(view.data);
      for (int64_t b = 0; b < n; b += kCodeBlock) {
        encode_block(in + b, codes + begin + b, view.scales + (begin + b) / kCodeBlock, view.map);
      }
      return;
    }
  }
}

}  // namespace amp::detail::cpu
