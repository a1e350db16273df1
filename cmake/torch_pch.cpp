// The translation unit that builds the precompiled <torch/torch.h> shared by amp's tests, examples and bench
// (CMakeLists.txt: amp_torch_pch).
