#!/usr/bin/env bash
# A Bzlmod consumer (a MODULE.bazel project with bazel_dep(name = "amp")) builds
# and runs against a copy of amp, with the Bazel that runs this test (7+).
# Offline like the rest of the build: the stand-in modules of bazel/offline7.
set -euo pipefail
work=${TEST_TMPDIR:-$(mktemp -d)}
amp="$work/amp" app="$work/app"
mkdir -p "$amp" "$app"
# A user's checkout of amp: the source tree the runfiles link to (its
# packages, not just the files this test declares), less tests/.
src=$(dirname "$(readlink -f MODULE.bazel)")
(cd "$src" && cp -r MODULE.bazel BUILD.bazel README.md CMakeLists.txt bazel cmake include tools "$amp"/)
cp -L tests/bzlmod_consumer/main.cc "$app"/ && cp -L tests/bzlmod_consumer/BUILD.consumer "$app/BUILD.bazel"
cat >"$app/MODULE.bazel" <<MOD
module(name = "amp_consumer")
bazel_dep(name = "amp", version = "0.2.0")
local_path_override(module_name = "amp", path = "$amp")
MOD
off="$amp/bazel/offline7"
flags=(--noenable_workspace --override_module=zlib="$off/zlib" --override_module=protobuf="$off/protobuf"
       --override_module=buildozer="$off/buildozer" --override_module=apple_support="$off/apple_support")
cd "$app"
bazel --batch --output_user_root="$work/bazel" build "${flags[@]}" --spawn_strategy=local \
  --symlink_prefix="$work/out-" //:consumer >"$work/bazel.log" 2>&1 || { tail -40 "$work/bazel.log"; exit 1; }
out=$("$work/out-bin/consumer")
[ "$out" = "bf16-mixed" ] || { echo "FAIL: consumer printed '$out'"; exit 1; }
echo "PASS: a Bzlmod project depending on amp built and printed $out"
