// gptkit/cpu_decode.py's kernels as torch operators, two variants in one library, chosen at run time by
// cpu_decode.py from what the CPU has: torch.ops.gptkit_avx512 (AVX-512 F/BW/VL with VNNI) and
// torch.ops.gptkit_avx2 (AVX2, FMA, F16C). The kernels are written once, in kernels.h; each variant is that
// file compiled inside its own namespace under its own `#pragma GCC target`, so the library itself needs no
// -m flags and loads on any x86-64 CPU (only the variant the CPU has is ever called).
// ATen's per-operator headers for the few operators used, not ATen/ATen.h (all of them): half the compile time
// of this file, the build on a machine's first start.
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace gptkit_avx2 {
#include "kernels.h"
}  // namespace gptkit_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#define GPTKIT_AVX512 1
namespace gptkit_avx512 {
#include "kernels.h"
}  // namespace gptkit_avx512
#undef GPTKIT_AVX512
#pragma GCC pop_options

// The same schema for each variant: the products (so that torch.compile can call them from a compiled decode
// step) and the fused block (for eager steps: it writes the KV cache in place).
static void define_ops(torch::Library& m) {
  m.def("linear_f32(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("linear_f16(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("linear_q8(Tensor x, Tensor w, Tensor ws, Tensor? bias, int n) -> Tensor");
  m.def("linear_q4(Tensor x, Tensor w, Tensor ws, Tensor? bias, int n) -> Tensor");
  m.def("linear_q6k(Tensor x, Tensor w, Tensor ds, Tensor? bias, int n) -> Tensor");
  m.def("block_decode(Tensor x, Tensor?[] p, Tensor(a!) k, Tensor(b!) v, int row0, Tensor pos, int n_head, "
        "float eps) -> Tensor");
}

#define GPTKIT_REGISTER(ns)                          \
  TORCH_LIBRARY(ns, m) { define_ops(m); }            \
  TORCH_LIBRARY_IMPL(ns, CPU, m) {                   \
    m.impl("linear_f32", &ns::linear_f32);           \
    m.impl("linear_f16", &ns::linear_f16);           \
    m.impl("linear_q8", &ns::linear_q8);             \
    m.impl("linear_q4", &ns::linear_q4);             \
    m.impl("linear_q6k", &ns::linear_q6k);           \
    m.impl("block_decode", &ns::block_decode);       \
  }

GPTKIT_REGISTER(gptkit_avx2)
GPTKIT_REGISTER(gptkit_avx512)
