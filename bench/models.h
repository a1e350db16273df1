#pragma once
// The benchmark models: four for the CPU (amp_bench), two sized for a GPU (amp_gpu_bench).
// bench/python_amp.py builds the same ones in Python, op for op, so the C++ and Python step times compare
// like for like.

#include <amp/checkpoint.h>
#include <torch/torch.h>

#include <cmath>
#include <string>

namespace bench {

// A tiny MLP, where per-op framework overhead (not GEMM time) decides the step time.
struct TinyMlpImpl : torch::nn::Module {
  TinyMlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(32, 64))),
        fc2(register_module("fc2", torch::nn::Linear(64, 64))),
        fc3(register_module("fc3", torch::nn::Linear(64, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc3(torch::relu(fc2(torch::relu(fc1(x))))); }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(TinyMlp);

struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(784, 512))),
        fc2(register_module("fc2", torch::nn::Linear(512, 512))),
        fc3(register_module("fc3", torch::nn::Linear(512, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc3(torch::relu(fc2(torch::relu(fc1(x))))); }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(Mlp);

struct CnnImpl : torch::nn::Module {
  CnnImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 32, 3).padding(1)))),
        bn1(register_module("bn1", torch::nn::BatchNorm2d(32))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1)))),
        bn2(register_module("bn2", torch::nn::BatchNorm2d(64))),
        fc(register_module("fc", torch::nn::Linear(64 * 8 * 8, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::max_pool2d(torch::relu(bn1(conv1(x))), 2);
    h = torch::max_pool2d(torch::relu(bn2(conv2(h))), 2);
    return fc(h.flatten(1));
  }
  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  torch::nn::BatchNorm2d bn2;
  torch::nn::Linear fc;
};
TORCH_MODULE(Cnn);

// A pre-norm transformer encoder block: attention written out with matmul and softmax (as Apex-era
// scripts do), then a GELU feed-forward.
struct TransformerBlockImpl : torch::nn::Module {
  TransformerBlockImpl(int64_t d_, int64_t heads_, int64_t ff)
      : d(d_), heads(heads_),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        qkv(register_module("qkv", torch::nn::Linear(d, 3 * d))),
        proj(register_module("proj", torch::nn::Linear(d, d))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        ff1(register_module("ff1", torch::nn::Linear(d, ff))),
        ff2(register_module("ff2", torch::nn::Linear(ff, d))) {}
  torch::Tensor forward(const torch::Tensor& x) {  // x: [batch, seq, d]
    const int64_t b = x.size(0), s = x.size(1);
    auto q_k_v = linear(qkv, ln1(x)).view({b, s, 3, heads, d / heads}).permute({2, 0, 3, 1, 4});
    auto attention = torch::softmax(torch::matmul(q_k_v[0], q_k_v[1].transpose(-2, -1)) / std::sqrt(double(d / heads)), -1);
    auto h = x + linear(proj, torch::matmul(attention, q_k_v[2]).transpose(1, 2).reshape({b, s, d}));
    return h + linear(ff2, torch::gelu(linear(ff1, ln2(h))));
  }
  // Python's nn.Linear: ATen's linear, one addmm with the bias cast by autocast. torch::nn::Linear's forward on a
  // 3-D input is a matmul plus an in-place add of the fp32 bias (docs/porting.md), 8% of an O1 step here.
  static torch::Tensor linear(const torch::nn::Linear& layer, const torch::Tensor& x) {
    return torch::linear(x, layer->weight, layer->bias);
  }
  int64_t d, heads;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear ff1, ff2;
};
TORCH_MODULE(TransformerBlock);

// Transformer blocks plus a classifier head over the mean token. Default: one block, d 256, 4 heads,
// feed-forward 1024 (the CPU benchmark's).
struct TransformerImpl : torch::nn::Module {
  static constexpr int64_t d = 256;
  explicit TransformerImpl(int64_t width = d, int64_t heads = 4, int64_t ff = 1024, int64_t blocks = 1)
      : layers(register_module("blocks", torch::nn::ModuleList())),
        head(register_module("head", torch::nn::Linear(width, 10))) {
    for (int64_t i = 0; i < blocks; ++i) layers->push_back(TransformerBlock(width, heads, ff));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (const auto& block : *layers) {
      TransformerBlock b(std::dynamic_pointer_cast<TransformerBlockImpl>(block));
      x = checkpoint_blocks ? amp::checkpoint(b, x) : b->forward(x);
    }
    return head(x.mean(1));
  }
  torch::nn::ModuleList layers;
  torch::nn::Linear head;
  bool checkpoint_blocks = false;  // amp::checkpoint around each block (amp_bench --section checkpoint)
};
TORCH_MODULE(Transformer);

// GPU-sized models (amp_gpu_bench). A conv net over 64x64 images: four conv + BatchNorm stages, two of them
// strided, global average pooling, a classifier.
struct GpuCnnImpl : torch::nn::Module {
  GpuCnnImpl() : features(register_module("features", torch::nn::Sequential())),
                 fc(register_module("fc", torch::nn::Linear(256, 10))) {
    const int64_t channels[] = {3, 64, 128, 256, 256}, strides[] = {1, 2, 2, 1};
    for (int i = 0; i < 4; ++i) {
      features->push_back(torch::nn::Conv2d(
          torch::nn::Conv2dOptions(channels[i], channels[i + 1], 3).stride(strides[i]).padding(1).bias(false)));
      features->push_back(torch::nn::BatchNorm2d(channels[i + 1]));
      features->push_back(torch::nn::ReLU());
    }
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc(features->forward(x).mean({2, 3})); }
  torch::nn::Sequential features;
  torch::nn::Linear fc;
};
TORCH_MODULE(GpuCnn);

// Four blocks of d 512, 8 heads, feed-forward 2048, over 256 tokens.
struct GpuTransformerImpl : TransformerImpl {
  GpuTransformerImpl() : TransformerImpl(512, 8, 2048, 4) {}
};
TORCH_MODULE(GpuTransformer);

inline torch::Tensor input_for(const std::string& model) {
  if (model == "gpu_cnn") return torch::randn({128, 3, 64, 64});
  if (model == "gpu_transformer") return torch::randn({32, 256, 512});
  if (model == "tiny_mlp") return torch::randn({32, 32});
  if (model == "mlp") return torch::randn({128, 784});
  if (model == "cnn") return torch::randn({32, 3, 32, 32});
  return torch::randn({16, 64, TransformerImpl::d});
}

inline int64_t batch_of(const std::string& model) {
  if (model == "gpu_cnn") return 128;
  if (model == "gpu_transformer") return 32;
  return model == "tiny_mlp" ? 32 : model == "mlp" ? 128 : model == "cnn" ? 32 : 16;
}

}  // namespace bench
