#!/usr/bin/env bash
# tools/gpu/check.sh: the GPU check, on a CUDA machine with python3 + torch (a pip wheel).
#
#   tools/gpu/stage-deps.sh            # on a Debian machine: Hana, CLI11, GoogleTest, Benchmark into .gpu-deps/
#   tools/gpu/check.sh [.gpu-deps]     # on the CUDA machine, from the checkout (.gpu-deps travels with it)
#
# 1. builds amp with CMake against the wheel's LibTorch (torch.utils.cmake_prefix_path);
# 2. runs every test with ctest (the CUDA tests run instead of skipping);
# 3. runs tests/parity/parity.cc and its Python twin: the same 300 training steps
#    with amp and with Python's torch.amp, compared bit for bit (losses, loss
#    scales, final parameters).
# 4. with AMP_GPU_BENCH=1, the CUDA benchmarks and their Python twin.
# Prints the versions, ctest's summary and the parity lines; exit 1 on a failure.
set -u
deps=$(cd "${1:-.gpu-deps}" && pwd); b=${AMP_GPU_BUILD:-/tmp/amp-build}
export PATH=$PATH:/usr/local/cuda/bin
g++ --version | head -1; cmake --version | head -1
python3 -c 'import torch;print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")'
tp=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S . -B "$b" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DAMP_BUILD_BENCHMARKS=ON \
  -DCMAKE_PREFIX_PATH="$tp;$deps/usr" -DCMAKE_CXX_FLAGS="-isystem $deps/usr/include" > "$b.cfg.log" 2>&1 \
  || { tail -30 "$b.cfg.log"; exit 1; }
rc=0
cmake --build "$b" -j "$(nproc)" -- -k 0 > "$b.build.log" 2>&1 || { rc=1; grep -E 'error|FAILED' "$b.build.log" | head -30; }
(cd "$b" && ctest -j "$(( $(nproc) / 2 ))" --output-on-failure --timeout 300 2>&1 | tail -40) | tee "$b.ctest.log"
grep -q "100% tests passed" "$b.ctest.log" || rc=1
out=$(mktemp -d)
"$b/parity" "$out" cuda && python3 tests/parity/parity_twin.py "$out" cuda || rc=1
[ -n "${OUT:-}" ] && cp "$out"/python_grad_scaler.pt "$OUT/" 2>/dev/null
# 4. with AMP_GPU_BENCH=1: amp's CUDA benchmarks (eager fused, unfused,
#    captured; host syncs per step) and, right after, Python's torch.amp on
#    the same models, for the ratios in the README.
if [ "${AMP_GPU_BENCH:-0}" = 1 ]; then
  "$b/fused_step_bench" --benchmark_filter=Cuda 2>&1 | tee "$b.bench.log" || rc=1
  python3 bench/fused_step_twin.py 2>&1 | tee -a "$b.bench.log" || rc=1
  [ -n "${OUT:-}" ] && cp "$b.bench.log" "$OUT/" 2>/dev/null
fi
exit $rc
