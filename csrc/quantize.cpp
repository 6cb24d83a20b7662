// Blockwise int8 quantization into, and dequantization out of, the quantized buckets of
// ZeRO++ qwZ (runtime/quantization.py says the scheme and the layout).
//
// quantize_pack: the shards of one rank (flat, contiguous, one float dtype) are read as one
// concatenated sequence of n elements, without copying them together; per block of `block`
// elements: amax in float32, scale = amax / 127, q = nearbyint(x * (127 / amax)) (round half to
// even), 0 where amax is 0; NaN or infinite values leave q = 0 and a NaN or infinite scale. The
// result is one uint8 row: n int8 values, zero padding to a multiple of 4, the float32 scales.
//
// dequantize_unpack: `world` such rows in; per block, q * scale in float32 cast to the output
// dtype, written straight into parameter i's output at row r (the outputs are the
// parameters' flat tensors, world * chunks[i] elements, rank-major), again without an
// intermediate buffer.
//
// quantize_rows (qgZ): the gradients of a reduce-scatter bucket, each viewed as [world, chunk],
// become `world` quantized rows, row r holding chunk r of every gradient (what rank r reduces);
// dequantize_reduce: the `world` rows a rank received, dequantized and summed in float32 in rank
// order, divided by `divisor` (the world size for an average), cast to the output dtype.
//
// Every operation rounds as the torch reference does (built with -ffp-contract=off), so the
// results are bitwise the reference's. Blocks run in parallel with at::parallel_for.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

int64_t scales_offset(int64_t n) { return (n + 3) / 4 * 4; }
int64_t num_blocks(int64_t n, int64_t block) { return (n + block - 1) / block; }

// Where element `begin` of the concatenation lives: the segment and the offset in it.
struct Cursor {
  int64_t segment;
  int64_t offset;
};

Cursor locate(const std::vector<int64_t>& starts, int64_t begin) {
  // starts[i] = first element of segment i in the concatenation; starts.back() = n
  auto it = std::upper_bound(starts.begin(), starts.end() - 1, begin);
  int64_t segment = static_cast<int64_t>(it - starts.begin()) - 1;
  return {segment, begin - starts[segment]};
}

template <typename T>
void quantize_blocks(const std::vector<const T*>& src, const std::vector<int64_t>& starts, int64_t n,
                     int64_t block, int8_t* q, float* scales) {
  at::parallel_for(0, num_blocks(n, block), 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> values(block);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * block, len = std::min(block, n - begin);
      Cursor c = locate(starts, begin);
      float amax = 0.0f;
      bool nan = false;
      for (int64_t k = 0; k < len; ++k) {
        while (c.offset == starts[c.segment + 1] - starts[c.segment]) {
          ++c.segment;
          c.offset = 0;
        }
        const float v = static_cast<float>(src[c.segment][c.offset++]);
        values[k] = v;
        const float a = std::fabs(v);
        nan = nan || std::isnan(a);
        amax = a > amax ? a : amax;
      }
      if (nan) amax = std::numeric_limits<float>::quiet_NaN();
      float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      if (nan) inv = amax;
      for (int64_t k = 0; k < len; ++k) {
        const float y = std::nearbyint(values[k] * inv);
        q[begin + k] = std::isfinite(y) ? static_cast<int8_t>(y) : 0;
      }
      scales[b] = amax / 127.0f;
    }
  });
}

template <typename T>
void dequantize_rows(const uint8_t* gathered, int64_t world, int64_t n, int64_t block, const std::vector<int64_t>& chunks,
                     const std::vector<int64_t>& starts, const std::vector<T*>& outs) {
  const int64_t blocks = num_blocks(n, block), row = scales_offset(n) + 4 * blocks;
  at::parallel_for(0, world * blocks, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t r = w / blocks, b = w % blocks;
      const uint8_t* base = gathered + r * row;
      const int8_t* q = reinterpret_cast<const int8_t*>(base);
      float scale;
      std::memcpy(&scale, base + scales_offset(n) + 4 * b, sizeof(float));
      const int64_t begin = b * block, len = std::min(block, n - begin);
      Cursor c = locate(starts, begin);
      for (int64_t k = 0; k < len; ++k) {
        while (c.offset == chunks[c.segment]) {
          ++c.segment;
          c.offset = 0;
        }
        const float v = static_cast<float>(q[begin + k]) * scale;
        outs[c.segment][r * chunks[c.segment] + c.offset++] = static_cast<T>(v);
      }
    }
  });
}

template <typename T>
void reduce_rows(const uint8_t* received, int64_t world, int64_t n, int64_t block, float divisor, T* out) {
  const int64_t blocks = num_blocks(n, block), row = scales_offset(n) + 4 * blocks;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(block);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * block, len = std::min(block, n - begin);
      std::fill(acc.begin(), acc.begin() + len, 0.0f);
      for (int64_t r = 0; r < world; ++r) {
        const uint8_t* base = received + r * row;
        const int8_t* q = reinterpret_cast<const int8_t*>(base);
        float scale;
        std::memcpy(&scale, base + scales_offset(n) + 4 * b, sizeof(float));
        for (int64_t k = 0; k < len; ++k) acc[k] += static_cast<float>(q[begin + k]) * scale;
      }
      for (int64_t k = 0; k < len; ++k) {
        const float v = divisor == 1.0f ? acc[k] : acc[k] / divisor;
        out[begin + k] = static_cast<T>(v);
      }
    }
  });
}

std::vector<int64_t> starts_of(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> starts(sizes.size() + 1, 0);
  for (size_t i = 0; i < sizes.size(); ++i) starts[i + 1] = starts[i] + sizes[i];
  return starts;
}

}  // namespace

torch::Tensor quantize_pack(const std::vector<torch::Tensor>& shards, int64_t block) {
  TORCH_CHECK(!shards.empty(), "quantize_pack: no shards");
  TORCH_CHECK(block >= 1, "quantize_pack: block must be >= 1");
  const auto dtype = shards[0].scalar_type();
  std::vector<int64_t> sizes;
  for (const auto& s : shards) {
    TORCH_CHECK(s.device().is_cpu() && s.is_contiguous() && s.scalar_type() == dtype,
                "quantize_pack: shards must be contiguous CPU tensors of one dtype");
    sizes.push_back(s.numel());
  }
  const auto starts = starts_of(sizes);
  const int64_t n = starts.back();
  auto out = torch::zeros({scales_offset(n) + 4 * num_blocks(n, block)}, torch::dtype(torch::kUInt8));
  auto* q = reinterpret_cast<int8_t*>(out.data_ptr<uint8_t>());
  auto* scales = reinterpret_cast<float*>(out.data_ptr<uint8_t>() + scales_offset(n));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "quantize_pack", [&] {
    std::vector<const scalar_t*> src;
    for (const auto& s : shards) src.push_back(s.data_ptr<scalar_t>());
    quantize_blocks<scalar_t>(src, starts, n, block, q, scales);
  });
  return out;
}

std::vector<torch::Tensor> dequantize_unpack(const torch::Tensor& gathered, int64_t world, const std::vector<int64_t>& chunks,
                                             int64_t block, at::ScalarType dtype) {
  TORCH_CHECK(gathered.device().is_cpu() && gathered.is_contiguous() && gathered.scalar_type() == torch::kUInt8,
              "dequantize_unpack: gathered must be a contiguous uint8 CPU tensor");
  const auto starts = starts_of(chunks);
  const int64_t n = starts.back();
  TORCH_CHECK(gathered.numel() == world * (scales_offset(n) + 4 * num_blocks(n, block)),
              "dequantize_unpack: gathered is not world quantized buckets of sum(chunks) elements");
  std::vector<torch::Tensor> outs;
  for (int64_t c : chunks) outs.push_back(torch::empty({world * c}, torch::dtype(dtype)));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "dequantize_unpack", [&] {
    std::vector<scalar_t*> dst;
    for (auto& o : outs) dst.push_back(o.data_ptr<scalar_t>());
    dequantize_rows<scalar_t>(gathered.data_ptr<uint8_t>(), world, n, block, chunks, starts, dst);
  });
  return outs;
}

torch::Tensor quantize_rows(const std::vector<torch::Tensor>& grads, int64_t world, int64_t block) {
  TORCH_CHECK(!grads.empty() && world >= 1 && block >= 1, "quantize_rows: bad arguments");
  const auto dtype = grads[0].scalar_type();
  std::vector<int64_t> sizes;
  for (const auto& g : grads) {
    TORCH_CHECK(g.device().is_cpu() && g.is_contiguous() && g.scalar_type() == dtype && g.numel() % world == 0,
                "quantize_rows: gradients must be contiguous CPU tensors of one dtype, each world * chunk elements");
    sizes.push_back(g.numel() / world);
  }
  const auto starts = starts_of(sizes);
  const int64_t n = starts.back(), row = scales_offset(n) + 4 * num_blocks(n, block);
  auto out = torch::zeros({world * row}, torch::dtype(torch::kUInt8));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "quantize_rows", [&] {
    at::parallel_for(0, world, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        std::vector<const scalar_t*> src;
        for (size_t i = 0; i < grads.size(); ++i) src.push_back(grads[i].data_ptr<scalar_t>() + r * sizes[i]);
        uint8_t* base = out.data_ptr<uint8_t>() + r * row;
        quantize_blocks<scalar_t>(src, starts, n, block, reinterpret_cast<int8_t*>(base),
                                  reinterpret_cast<float*>(base + scales_offset(n)));
      }
    });
  });
  return out;
}

torch::Tensor dequantize_reduce(const torch::Tensor& received, int64_t world, int64_t n, int64_t block,
                                at::ScalarType dtype, double divisor) {
  TORCH_CHECK(received.device().is_cpu() && received.is_contiguous() && received.scalar_type() == torch::kUInt8,
              "dequantize_reduce: received must be a contiguous uint8 CPU tensor");
  TORCH_CHECK(received.numel() == world * (scales_offset(n) + 4 * num_blocks(n, block)),
              "dequantize_reduce: received is not world quantized rows of n elements");
  auto out = torch::empty({n}, torch::dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "dequantize_reduce", [&] {
    reduce_rows<scalar_t>(received.data_ptr<uint8_t>(), world, n, block, static_cast<float>(divisor),
                          out.data_ptr<scalar_t>());
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_pack", &quantize_pack, "Blockwise int8 quantization of shards into one quantized bucket");
  m.def("dequantize_unpack", &dequantize_unpack, "Parameters out of all-gathered quantized buckets");
  m.def("quantize_rows", &quantize_rows, "Gradients into one quantized row per destination rank");
  m.def("dequantize_reduce", &dequantize_reduce, "The sum over ranks of received quantized rows");
}
