#!/usr/bin/env bash
# tools/gpu/check.sh: the GPU check, on a CUDA machine with python3 + torch (a pip wheel).
#
#   tools/gpu/stage-deps.sh            # on a Debian machine: Hana, CLI11, GoogleTest, Benchmark into .gpu-deps/
#   tools/gpu/check.sh [.gpu-deps]     # on the CUDA machine, from the checkout (.gpu-deps travels with it)
#
# CMake build against the wheel's LibTorch (torch.utils.cmake_prefix_path), in
# an order that puts what only a GPU can check first, so that a run cut short
# (the device tool's 10-minute calls) still has it:
# 1. builds the CUDA-facing targets (capture_cuda_test, block_scaled_test,
#    parity, the benchmark, distributed_world1_test) and runs capture_cuda_test
#    and block_scaled_test's BlockScaledMm cases (the block-scaled _scaled_mm
#    route: run on compute capability 10.0+, else skipped saying why);
# 2. tests/parity/parity.cc and its Python twin on CUDA: the same 300 training
#    steps with amp and with Python's torch.amp, compared bit for bit;
# 3. with AMP_GPU_BENCH=1, the CUDA benchmarks and right after them their
#    Python twins (bench/fused_step_twin.py, bench/float8_ffn_twin.py), on the same GPU;
# 4. builds everything else and runs every test with ctest.
# Logs go to $OUT when set (the device tool brings that folder back), else
# next to the build folder. Prints one line per stage and a summary; exit 1
# on a failure.
set -u
deps=$(cd "${1:-.gpu-deps}" && pwd); b=${AMP_GPU_BUILD:-/tmp/amp-build}
logs=${OUT:-$b.logs}; mkdir -p "$logs"
export PATH=$PATH:/usr/local/cuda/bin
jobs=$(nproc)
rc=0; summary=()
stage() {  # stage NAME STATUS: one summary line; a non-zero STATUS fails the check
  summary+=("$([ "$2" = 0 ] && echo "ok  " || echo "FAIL") $1")
  [ "$2" = 0 ] || rc=1
  echo "[check] $1: $([ "$2" = 0 ] && echo ok || echo "FAILED ($2)")"
}
{ g++ --version | head -1; cmake --version | head -1
  python3 -c 'import torch;print("torch", torch.__version__, "cuda", torch.version.cuda,
torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")'; nvidia-smi -L 2>/dev/null; } |
  tee "$logs/versions.log"
tp=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
gen=(); keep_going=(-k)  # make's flag; ninja's takes a count
command -v ninja >/dev/null && gen=(-G Ninja) keep_going=(-k 0)
cmake -S . -B "$b" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DAMP_BUILD_BENCHMARKS=ON \
  -DCMAKE_PREFIX_PATH="$tp;$deps/usr" -DCMAKE_CXX_FLAGS="-isystem $deps/usr/include" > "$logs/configure.log" 2>&1 \
  || { tail -30 "$logs/configure.log"; exit 1; }
grep -E "^-- amp" "$logs/configure.log"

# 1. The CUDA-facing targets first.
targets=$(cmake --build "$b" --target help 2>/dev/null)
first=()
for t in capture_cuda_test block_scaled_test parity fused_step_bench float8_ffn_bench distributed_world1_test; do
  grep -qE "(^|[ .:])$t([ :]|$)" <<<"$targets" && first+=("$t")
done
built=0
bin() { find "$b" -name "$1" -type f -perm -u+x | head -1; }  # bench/ targets build in a subfolder
for t in "${first[@]}"; do
  cmake --build "$b" -j "$jobs" --target "$t" >> "$logs/build.log" 2>&1 || built=$?
done
stage "build ${first[*]}" $built
[ "$built" = 0 ] || grep -E 'error|FAILED' "$logs/build.log" | head -30
if [ -n "$(bin capture_cuda_test)" ]; then
  "$(bin capture_cuda_test)" > "$logs/capture_cuda_test.log" 2>&1; s=$?
  grep -E '^\[ *(OK|FAILED|SKIPPED|PASSED) *\]|info' "$logs/capture_cuda_test.log" | tail -40
  stage "capture_cuda_test" $s
fi
if [ -n "$(bin block_scaled_test)" ]; then
  "$(bin block_scaled_test)" --gtest_filter='BlockScaledMm.*' > "$logs/block_scaled_mm.log" 2>&1; s=$?
  grep -E -A1 '^\[ *(OK|FAILED|SKIPPED) *\]|Skipped$' "$logs/block_scaled_mm.log" | tail -20  # a skip's reason follows
  stage "block_scaled_test BlockScaledMm (CUDA's block-scaled _scaled_mm)" $s
fi

# 2. Parity with Python's torch.amp on CUDA.
if [ -n "$(bin parity)" ]; then
  p=$(mktemp -d)
  "$(bin parity)" "$p" cuda 2>&1 | tee "$logs/parity.log"; s=${PIPESTATUS[0]}
  if [ "$s" = 0 ] && ! grep -q "^parity: skipped" "$logs/parity.log"; then
    python3 tests/parity/parity_twin.py "$p" cuda 2>&1 | tee -a "$logs/parity.log"; s=${PIPESTATUS[0]}
  fi
  stage "parity (CUDA, bit for bit with torch.amp)" "$s"
  cp "$p"/python_grad_scaler.pt "$logs/" 2>/dev/null
fi

# 3. With AMP_GPU_BENCH=1: amp's CUDA benchmarks (eager fused, unfused,
#    captured; host syncs per step) and, right after, Python's torch.amp on
#    the same models, for the ratios in docs/performance.md.
if [ "${AMP_GPU_BENCH:-0}" = 1 ] && [ -n "$(bin fused_step_bench)" ]; then
  "$(bin fused_step_bench)" --benchmark_filter=Cuda 2>&1 | tee "$logs/bench.log"
  stage "fused_step_bench (CUDA)" "${PIPESTATUS[0]}"
  python3 bench/fused_step_twin.py 2>&1 | tee -a "$logs/bench.log"
  stage "fused_step_twin.py" "${PIPESTATUS[0]}"
  if [ -n "$(bin float8_ffn_bench)" ]; then  # fp8 against bf16-mixed, then the same in plain Python torch
    "$(bin float8_ffn_bench)" --benchmark_filter=Cuda 2>&1 | tee -a "$logs/bench.log"
    stage "float8_ffn_bench (CUDA)" "${PIPESTATUS[0]}"
    python3 bench/float8_ffn_twin.py 2>&1 | tee -a "$logs/bench.log"
    stage "float8_ffn_twin.py" "${PIPESTATUS[0]}"
  fi
fi

# 4. Everything, then every test.
cmake --build "$b" -j "$jobs" -- "${keep_going[@]}" >> "$logs/build.log" 2>&1; s=$?
stage "build all" $s
[ "$s" = 0 ] || grep -E 'error|FAILED' "$logs/build.log" | head -30
(cd "$b" && ctest -j "$(( jobs / 2 ))" --output-on-failure --timeout 300 > "$logs/ctest.log" 2>&1)
tail -40 "$logs/ctest.log"
grep -q "100% tests passed" "$logs/ctest.log"; stage "ctest" $?

echo "[check] summary (logs in $logs):"
printf '  %s\n' "${summary[@]}"
exit $rc
