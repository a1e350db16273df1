"""FlashOptim 0.1.4's 24-bit master (bf16 weight + int8 error-correction bits) in torch ops, for
tests/master_weights_format_test.cpp's Residual8ReferenceTest: master_weights_format residual8 must give these bits.

    residual8.py OUT_DIR     # writes OUT_DIR/residual8.pt: {"x", "weight", "residual", "value", "w2", "r2", "v2"}

flashoptim's compute_ecc_bits and reconstruct_fp32_param run Triton kernels (GPU only); their arithmetic is re-expressed
here op for op from flashoptim/optimizers.py (0.1.4): _get_unbiased_exponent, _log_ulp_for_mantissa, _compute_ecc_bits
and _apply_error_correction, each line quoted beside its torch form. The parameter's bf16 weight is `param.to(bf16)`
(the kernel's store after the update: round to nearest even).
"""
import os
import sys

import torch

NUM_MANTISSA_BITS = 7  # bf16 (flashoptim's _NUM_MANTISSA_BITS)
SIGNED_MAX_VAL = 127   # int8 error bits (master_bytewidth 3)


def log_ulp_for_mantissa(narrow):
    # f = tl.abs(f); f_bits = f.to(tl.uint16, bitcast=True); exponent_bias = 127
    f_bits = narrow.view(torch.int16).to(torch.int32) & 0x7FFF
    # exponent_bits = f_bits >> mantissa_bits
    exponent_bits = f_bits >> NUM_MANTISSA_BITS
    # tl.where(exponent_bits == 0, 1 - exponent_bias, exponent_bits.to(tl.int32) - exponent_bias)
    exponent = torch.where(exponent_bits == 0, torch.full_like(exponent_bits, 1 - 127), exponent_bits - 127)
    # return exponent - mantissa_bits
    return exponent - NUM_MANTISSA_BITS


def compute_ecc_bits(x_f32, x_narrow):
    x_recon = x_narrow.to(torch.float32)                     # x_recon = x_narrow.to(tl.float32)
    e = x_f32 - x_recon                                      # e = x_f32 - x_recon
    log_scale = log_ulp_for_mantissa(x_narrow) - 1           # log_scale = _log_ulp_for_mantissa(...) - 1
    neg_log_scale = (-log_scale).to(torch.float32)           # neg_log_scale = (-log_scale).to(tl.float32)
    h = torch.floor(neg_log_scale / 2.0)                     # h = tl.floor(neg_log_scale / 2.0)
    temp = e * torch.exp2(h)                                 # temp = e * tl.exp2(h)
    e_norm = temp * torch.exp2(neg_log_scale - h)            # e_norm = temp * tl.exp2(neg_log_scale - h)
    e_clamped = torch.clamp(e_norm, -1.0, 1.0)               # e_clamped = tl.clamp(e_norm, -1.0, 1.0)
    scaled_e = e_clamped * SIGNED_MAX_VAL                    # scaled_e = e_clamped * SIGNED_MAX_VAL
    rounded_val = torch.floor(torch.abs(scaled_e) + 0.5)     # rounded_val = tl.floor(tl.abs(scaled_e) + 0.5)
    rounded_val = torch.copysign(rounded_val, scaled_e)      # libdevice.copysign(rounded_val, scaled_e)
    return rounded_val.to(torch.int8)                        # rounded_val.to(SIGNED_ERROR_T)


def reconstruct_fp32_param(x_narrow, ecc):
    x_recon = x_narrow.to(torch.float32)                     # x_recon = x_narrow.to(tl.float32)
    log_scale = log_ulp_for_mantissa(x_narrow) - 1           # log_scale = _log_ulp_for_mantissa(...) - 1
    correction_factor = ecc.to(torch.float32) / SIGNED_MAX_VAL  # ecc.to(tl.float32) / SIGNED_MAX_VAL
    log_scale_f32 = log_scale.to(torch.float32)              # log_scale_f32 = log_scale.to(tl.float32)
    h = torch.floor(log_scale_f32 / 2.0)                     # h = tl.floor(log_scale_f32 / 2.0)
    e = correction_factor * torch.exp2(h) * torch.exp2(log_scale_f32 - h)  # e = cf * tl.exp2(h) * tl.exp2(ls - h)
    return x_recon + e                                       # return x_recon + e


def main():
    torch.manual_seed(0)
    parts = [torch.randn(4096) * scale for scale in (1e-4, 1e-2, 1.0, 1e2, 1e6)]
    parts.append(torch.randn(1024) * 1e-38)                  # bf16 subnormals and their neighbours
    parts.append(torch.randn(512).to(torch.bfloat16).float())  # exact bf16 values: residual 0
    midpoints = torch.randn(512).to(torch.bfloat16).float()    # halfway between two bf16 values
    parts.append((midpoints.view(torch.int32) + 0x8000).view(torch.float32))
    parts.append(torch.tensor([0.0, -0.0, 1.0, -1.0, 3.0e38, -3.0e38, 1e-45, -1e-45]))
    x = torch.cat(parts)
    weight = x.to(torch.bfloat16)
    residual = compute_ecc_bits(x, weight)
    value = reconstruct_fp32_param(weight, residual)
    # Decoding alone, over every int8 value (-128 included) and weights of every exponent.
    w2 = (torch.randint(-32768, 32767, (65536,), dtype=torch.int32)).to(torch.int16).view(torch.bfloat16)
    w2 = torch.where(torch.isfinite(w2.float()), w2, torch.zeros_like(w2))
    r2 = torch.randint(-128, 128, (65536,), dtype=torch.int32).to(torch.int8)
    v2 = reconstruct_fp32_param(w2, r2)
    torch.save({"x": x, "weight": weight, "residual": residual, "value": value, "w2": w2, "r2": r2, "v2": v2,
                "torch_version": str(torch.__version__)}, os.path.join(sys.argv[1], "residual8.pt"))


if __name__ == "__main__":
    main()
