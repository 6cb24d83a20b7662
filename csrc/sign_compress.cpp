// 1-bit compression of momentum for DeepSpeed's 1-bit Adam / 0/1 Adam
// (runtime/sign_compression.py says the scheme and the bit layout).
//
// sign_pack: x (float32, n a multiple of 8) and a float32 scale in; out: the signs packed 8
// per byte, least significant bit first (bit k of byte j is element 8j + k; 1 means +1, and
// zero and NaN count as +1, as DeepSpeed's sign().add_(1).bool()), and the compression error
// x - scale * sign, one rounding per element.
//
// sign_unpack: `rows` packed rows of m/8 bytes and one float32 scale per row in; out: either
// the `rows * m` values scale_r * sign, or with `average` their sum over rows in float32, in
// row order, divided by `rows`. Built with -ffp-contract=off, so every operation rounds as the
// torch reference's and the results are bitwise the reference's. Parallel over bytes.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kGrain = 4096;   // bytes per parallel task

}  // namespace

std::vector<torch::Tensor> sign_pack(const torch::Tensor& x, const torch::Tensor& scale) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "sign_pack: x must be a contiguous float32 CPU tensor");
  const int64_t n = x.numel();
  TORCH_CHECK(n % 8 == 0, "sign_pack: the number of elements must be a multiple of 8, got ", n);
  const float s = scale.to(torch::kFloat32).item<float>();
  auto packed = torch::empty({n / 8}, x.options().dtype(torch::kUInt8));
  auto error = torch::empty({n}, x.options());
  const float* in = x.data_ptr<float>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  float* err = error.data_ptr<float>();
  at::parallel_for(0, n / 8, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      uint8_t byte = 0;
      for (int k = 0; k < 8; ++k) {
        const float v = in[8 * j + k];
        const bool positive = !(v < 0.0f);
        byte |= static_cast<uint8_t>(positive) << k;
        err[8 * j + k] = v - s * (positive ? 1.0f : -1.0f);
      }
      out[j] = byte;
    }
  });
  return {packed, error};
}

torch::Tensor sign_unpack(const torch::Tensor& packed, const torch::Tensor& scales, bool average) {
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 2,
              "sign_unpack: packed must be a contiguous 2-d uint8 tensor");
  const int64_t rows = packed.size(0), bytes = packed.size(1), m = 8 * bytes;
  auto sc = scales.to(torch::kFloat32).contiguous();
  TORCH_CHECK(sc.numel() == rows, "sign_unpack: one scale per row");
  const uint8_t* in = packed.data_ptr<uint8_t>();
  const float* scale = sc.data_ptr<float>();
  auto out = torch::empty({average ? m : rows * m}, packed.options().dtype(torch::kFloat32));
  float* o = out.data_ptr<float>();
  const float divisor = static_cast<float>(rows);
  at::parallel_for(0, bytes, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      for (int k = 0; k < 8; ++k) {
        if (average) {
          float acc = 0.0f;
          for (int64_t r = 0; r < rows; ++r) {
            const bool positive = (in[r * bytes + j] >> k) & 1;
            acc = acc + scale[r] * (positive ? 1.0f : -1.0f);
          }
          o[8 * j + k] = acc / divisor;
        } else {
          for (int64_t r = 0; r < rows; ++r) {
            const bool positive = (in[r * bytes + j] >> k) & 1;
            o[r * m + 8 * j + k] = scale[r] * (positive ? 1.0f : -1.0f);
          }
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sign_pack", &sign_pack, "Signs packed 8 per byte and the compression error");
  m.def("sign_unpack", &sign_unpack, "Scaled signs of packed rows, or their average over rows");
}
