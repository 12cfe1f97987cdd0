#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the llama.cpp source that llama-cpp-python vendors, for
# benchmarks/serve_load.py --llama_server: the same llama.cpp as benchmarks/cpu_decode.py's llama-cpp-python.
#
#   bash benchmarks/llama_server.sh                    # -> build/llama-server/bin/llama-server
#   LLAMA_CPP_PYTHON=0.3.36 GGML_NATIVE=ON bash benchmarks/llama_server.sh /tmp/llama
#   LLAMA_CMAKE_ARGS="-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON" bash benchmarks/llama_server.sh build/llama-avx512
#
# Needs pip, cmake, ninja and a C++ compiler; the download is one sdist (~75 MB) through pip. The build took
# 61 minutes at nice 15 on a 2-core machine that other jobs kept busy (JOBS: parallel compiles, default nproc).
# GGML_NATIVE=OFF (the default here) builds ggml for AVX2 + FMA + F16C, the instructions gptkit's CPU kernels
# use, and what the llama-cpp-python package is built with in CI (its native build's AMX kernels crashed
# there). GGML_NATIVE=ON builds for this machine's every instruction (AVX-512, VNNI where it has them); on a CPU
# with AMX, where that build crashes, LLAMA_CMAKE_ARGS adds AVX-512 to the portable build instead (ggml's own
# GGML_AVX512* options), the instructions gptkit's AVX-512 kernels use, and no AMX.
set -euo pipefail

version="${LLAMA_CPP_PYTHON:-0.3.36}"
native="${GGML_NATIVE:-OFF}"
out="$(realpath -m "${1:-build/llama-server}")"
python="${PYTHON:-python}"
jobs="${JOBS:-$(nproc)}"
read -r -a more <<<"${LLAMA_CMAKE_ARGS:-}"

mkdir -p "$out"
if [ ! -d "$out/src/vendor/llama.cpp" ]; then
  # Only llama-cpp-python comes as source (its build tools as wheels), and --no-cache-dir keeps the
  # download and anything pip builds to read its metadata out of pip's caches.
  "$python" -m pip download --no-cache-dir --no-binary llama-cpp-python --no-deps "llama-cpp-python==$version" -d "$out/sdist"
  rm -rf "$out/src" && mkdir -p "$out/src"
  tar xzf "$out/sdist/llama_cpp_python-$version.tar.gz" -C "$out/src" --strip-components=1
fi

cmake -S "$out/src/vendor/llama.cpp" -B "$out/cmake" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE="$native" -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF ${more[@]+"${more[@]}"} \
  >"$out/cmake.log"
cmake --build "$out/cmake" --target llama-server -j "$jobs" >"$out/build.log"
mkdir -p "$out/bin"
cp "$out/cmake/bin/llama-server" "$out/bin/llama-server"
echo "$out/bin/llama-server (llama-cpp-python $version's llama.cpp, GGML_NATIVE=$native${LLAMA_CMAKE_ARGS:+ $LLAMA_CMAKE_ARGS})"
