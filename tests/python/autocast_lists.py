#!/usr/bin/env python3
"""The Python side of tests/native_lists_test.cpp: torch.autocast("cpu") on the losses and normalizations.

  autocast_lists.py DIR   # reads DIR/inputs.pt (written by C++), writes DIR/reference.pt

inputs.pt holds the tensors the calls below take, in fp32 (the labels and lengths as int64). For each call, each
autocast dtype (bfloat16, float16) and each input dtype (float32 and the autocast dtype), reference.pt holds under
'call/autocast dtype/input dtype' what the call returns inside `torch.autocast("cpu", dtype)`, or the first line
of the error it raises. Only the call's first argument takes the input dtype; the others stay as inputs.pt has them.
The C++ side names the same calls through torch::nn::functional, the entry points C++ users call.
"""
import os
import sys

import torch
import torch.nn.functional as F


def calls(t):
    """name -> (input key, function of the input cast to the input dtype)."""
    return {
        "nll_loss": ("x", lambda x: F.nll_loss(x, t["labels"])),
        "nll_loss_4d": ("x4", lambda x: F.nll_loss(x, t["labels4"])),
        "cross_entropy": ("x", lambda x: F.cross_entropy(x, t["labels"])),
        "cross_entropy_4d": ("x4", lambda x: F.cross_entropy(x, t["labels4"])),
        "cross_entropy_probabilities": ("x", lambda x: F.cross_entropy(x, t["prob"])),
        "mse_loss": ("x", lambda x: F.mse_loss(x, t["target"])),
        "l1_loss": ("x", lambda x: F.l1_loss(x, t["target"])),
        "smooth_l1_loss": ("x", lambda x: F.smooth_l1_loss(x, t["target"])),
        "huber_loss": ("x", lambda x: F.huber_loss(x, t["target"])),
        "kl_div": ("x", lambda x: F.kl_div(x, t["prob"], reduction="batchmean")),
        "binary_cross_entropy": ("p", lambda x: F.binary_cross_entropy(x, t["prob"])),
        "binary_cross_entropy_with_logits": ("x", lambda x: F.binary_cross_entropy_with_logits(x, t["prob"])),
        "poisson_nll_loss": ("x", lambda x: F.poisson_nll_loss(x, t["count"])),
        "soft_margin_loss": ("x", lambda x: F.soft_margin_loss(x, t["sign"])),
        "margin_ranking_loss": ("x", lambda x: F.margin_ranking_loss(x[:, 0], x[:, 1], t["sign"][:, 0])),
        "hinge_embedding_loss": ("x", lambda x: F.hinge_embedding_loss(x, t["sign"])),
        "multilabel_margin_loss": ("x", lambda x: F.multilabel_margin_loss(x, t["multilabels"])),
        "multilabel_soft_margin_loss": ("x", lambda x: F.multilabel_soft_margin_loss(x, t["prob"])),
        "multi_margin_loss": ("x", lambda x: F.multi_margin_loss(x, t["labels"])),
        "cosine_embedding_loss": ("x", lambda x: F.cosine_embedding_loss(x, t["target"], t["sign"][:, 0])),
        "triplet_margin_loss": ("x", lambda x: F.triplet_margin_loss(x, t["target"], t["other"])),
        "ctc_loss": ("logp", lambda x: F.ctc_loss(x, t["ctc_targets"], t["ctc_input_lengths"],
                                                  t["ctc_target_lengths"])),
        "layer_norm": ("x", lambda x: F.layer_norm(x, [6], t["w6"], t["b6"])),
        "group_norm": ("x4", lambda x: F.group_norm(x, 3, t["w3"], t["b3"])),
        "batch_norm_training": ("x4", lambda x: F.batch_norm(x, t["mean3"].clone(), t["var3"].clone(), t["w3"],
                                                             t["b3"], training=True)),
        "batch_norm_eval": ("x4", lambda x: F.batch_norm(x, t["mean3"], t["var3"], t["w3"], t["b3"])),
        "instance_norm": ("x4", lambda x: F.instance_norm(x)),
        "local_response_norm": ("x4", lambda x: F.local_response_norm(x, 2)),
        "normalize": ("x", lambda x: F.normalize(x)),
        "softmax": ("x", lambda x: F.softmax(x, 1)),
        "log_softmax": ("x", lambda x: F.log_softmax(x, 1)),
        "softmin": ("x", lambda x: F.softmin(x, 1)),
    }


def main(directory):
    inputs = torch.load(os.path.join(directory, "inputs.pt"), weights_only=False)
    out = {}
    for name, (key, call) in calls(inputs).items():
        for autocast_dtype, autocast_label in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
            for input_dtype, input_label in ((torch.float32, "fp32"), (autocast_dtype, autocast_label)):
                x = inputs[key].to(input_dtype)
                try:
                    with torch.autocast("cpu", dtype=autocast_dtype):
                        result = call(x)
                except Exception as e:  # the error is the reference
                    result = str(e).splitlines()[0]
                out[f"{name}/{autocast_label}/{input_label}"] = result
    out["torch_version"] = torch.__version__
    torch.save(out, os.path.join(directory, "reference.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
