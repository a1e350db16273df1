#pragma once
// scikit-learn's 8x8 handwritten digits (shipped by Debian's python3-sklearn; scripts/train.sh unpacks
// them to build/data/digits.csv), with a generated stand-in when the file is absent.

#include <torch/torch.h>

#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

// Reads scikit-learn's digits.csv (64 pixel values 0..16, then the label, per line).
inline bool read_digits(const std::string& path, torch::Tensor& images, torch::Tensor& labels) {
  std::ifstream in(path);
  if (!in) return false;
  std::vector<float> pixels;
  std::vector<int64_t> targets;
  std::string line;
  while (std::getline(in, line)) {
    std::stringstream row(line);
    std::string cell;
    std::vector<float> values;
    while (std::getline(row, cell, ',')) values.push_back(std::stof(cell));
    if (values.size() != 65) throw std::runtime_error("digits: " + path + ": expected 65 values per line");
    pixels.insert(pixels.end(), values.begin(), values.begin() + 64);
    targets.push_back(static_cast<int64_t>(values[64]));
  }
  const auto n = static_cast<int64_t>(targets.size());
  images = torch::from_blob(pixels.data(), {n, 1, 8, 8}).clone() / 16.0;
  labels = torch::from_blob(targets.data(), {n}, torch::kLong).clone();
  return true;
}

// Fallback data: each class is a fixed random 8x8 pattern plus noise.
inline void generate_digits(int64_t n, torch::Tensor& images, torch::Tensor& labels) {
  auto prototypes = torch::rand({10, 1, 8, 8});
  labels = torch::randint(10, {n}, torch::kLong);
  images = (prototypes.index_select(0, labels) + 0.3 * torch::randn({n, 1, 8, 8})).clamp(0, 1);
}

/// Loads `path` (empty or missing: 1797 generated images); returns the source's name.
inline std::string load_digits(const std::string& path, torch::Tensor& images, torch::Tensor& labels) {
  if (!path.empty() && read_digits(path, images, labels)) return path;
  generate_digits(1797, images, labels);
  return "generated";
}

/// Digits 0-4 (`low`) or 5-9 relabelled 0-4, in file order: the first 80% to train, the rest to validate
/// (examples/finetune_torchscript/pretrain.py splits them the same way). Returns (x, y, val_x, val_y).
inline std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> split_digits(const torch::Tensor& images,
                                                                                           const torch::Tensor& labels,
                                                                                           bool low) {
  const auto mask = low ? labels.lt(5) : labels.ge(5);
  const auto x = images.index({mask}), y = labels.index({mask}) - (low ? 0 : 5);
  const int64_t n = x.size(0) * 4 / 5;
  return {x.narrow(0, 0, n), y.narrow(0, 0, n), x.narrow(0, n, x.size(0) - n), y.narrow(0, n, y.size(0) - n)};
}
