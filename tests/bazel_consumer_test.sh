#!/usr/bin/env bash
# The README's Bazel recipe, taken from its text, with the Bazel that runs this
# test: a project whose BUILD.bazel and MODULE.bazel (--bzlmod: Bazel 7+) or
# WORKSPACE (--workspace: Bazel 4.2.3) are the README's lines, the amp they
# name a copy of this one, builds the README's Trainer block as app.cc, and
# the program runs. Offline like the rest of the build: with Bzlmod the
# stand-in modules of bazel/offline7 (flags), with a WORKSPACE the stand-ins
# of bazel/standins.bzl (lines before the README's).
#   bazel_consumer_test.sh --bzlmod | --workspace
set -euo pipefail
mode=${1:?--bzlmod or --workspace}
work=${TEST_TMPDIR:-$(mktemp -d)}
amp="$work/amp" app="$work/app"
mkdir -p "$amp" "$app"
# A user's checkout of amp: the source tree the runfiles link to (its
# packages, not just the files this test declares), less tests/.
src=$(dirname "$(readlink -f MODULE.bazel)")
(cd "$src" && cp -r MODULE.bazel WORKSPACE BUILD.bazel README.md CMakeLists.txt bazel cmake include tools "$amp"/)
recipe() { bash tests/readme_recipes.sh README.md "$1"; }
recipe app >"$app/app.cc"
recipe build >"$app/BUILD.bazel"
# Only the path changes: the README's third_party/amp is the copy above.
if [ "$mode" = --bzlmod ]; then
  project=MODULE.bazel
  recipe module | sed "s|\"third_party/amp\"|\"$amp\"|" >"$app/MODULE.bazel"
  off="$amp/bazel/offline7"
  flags=(--noenable_workspace --override_module=zlib="$off/zlib" --override_module=protobuf="$off/protobuf"
         --override_module=buildozer="$off/buildozer" --override_module=apple_support="$off/apple_support")
else
  project=WORKSPACE
  cat >"$app/WORKSPACE" <<WS
# Offline here (not the README's): Bazel 4.2.3's downloads, stood in for first.
local_repository(name = "amp_offline", path = "$amp")
load("@amp_offline//bazel:standins.bzl", "remote_coverage_tools_standin", "rules_cc_standin", "rules_java_standin")
rules_cc_standin(name = "rules_cc")
rules_java_standin(name = "rules_java")
remote_coverage_tools_standin(name = "remote_coverage_tools")
# The README's lines:
WS
  recipe workspace | sed "s|\"third_party/amp\"|\"$amp\"|" >>"$app/WORKSPACE"
  flags=()
fi
grep -qF "name = \"amp\", path = \"$amp\"" "$app/$project" || { echo "FAIL: the README's $project lines name no amp at path = \"third_party/amp\""; exit 1; }
echo "$project:"; cat "$app/$project"; echo "BUILD.bazel:"; cat "$app/BUILD.bazel"
cd "$app"
bazel --batch --output_user_root="$work/bazel" build ${flags[@]+"${flags[@]}"} --spawn_strategy=local \
  --symlink_prefix="$work/out-" //:app >"$work/bazel.log" 2>&1 || { tail -40 "$work/bazel.log"; exit 1; }
# It must exit 0, print the Trainer's progress line at step 200 (on stderr) and write its checkpoint.
out=$("$work/out-bin/app" 2>&1) || { rc=$?; echo "$out"; echo "FAIL: the README's Bazel app exited with $rc"; exit 1; }
echo "$out"
grep -q '^bf16-mixed 200 loss ' <<<"$out" || { echo "FAIL: the README's Bazel app printed no progress line for step 200"; exit 1; }
[ "$(head -c 2 model.pt 2>/dev/null)" = PK ] || { echo "FAIL: the README's Bazel app wrote no model.pt checkpoint"; exit 1; }
echo "PASS: the README's Bazel recipe ($project) built the Trainer block, which ran"
