#pragma once
// The LibTorch module types keep_fp32_types names (config: keep_fp32_types = LayerNorm, GroupNorm), written once:
// the config reader checks names against it, src/casting/precision_policy.cpp maps each to torch::nn::<name>Impl.

#define AMP_LIBTORCH_MODULE_TYPES(X)                                                                       \
  X(Linear) X(Bilinear) X(Embedding) X(EmbeddingBag)                                                       \
  X(Conv1d) X(Conv2d) X(Conv3d) X(ConvTranspose1d) X(ConvTranspose2d) X(ConvTranspose3d)                   \
  X(BatchNorm1d) X(BatchNorm2d) X(BatchNorm3d) X(InstanceNorm1d) X(InstanceNorm2d) X(InstanceNorm3d)       \
  X(LayerNorm) X(GroupNorm) X(PReLU)                                                                       \
  X(RNN) X(LSTM) X(GRU) X(RNNCell) X(LSTMCell) X(GRUCell)                                                  \
  X(MultiheadAttention) X(TransformerEncoderLayer) X(TransformerDecoderLayer) X(TransformerEncoder)        \
  X(TransformerDecoder) X(Transformer)
