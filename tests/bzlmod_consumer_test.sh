#!/usr/bin/env bash
# The README's Bazel recipe with Bzlmod, taken from its text: a project whose
# MODULE.bazel and BUILD.bazel are the README's lines (the module's path is a
# copy of amp) builds the README's Trainer block as app.cc, with the Bazel that
# runs this test (7+), and the program runs. Offline like the rest of the
# build: the stand-in modules of bazel/offline7.
set -euo pipefail
work=${TEST_TMPDIR:-$(mktemp -d)}
amp="$work/amp" app="$work/app"
mkdir -p "$amp" "$app"
# A user's checkout of amp: the source tree the runfiles link to (its
# packages, not just the files this test declares), less tests/.
src=$(dirname "$(readlink -f MODULE.bazel)")
(cd "$src" && cp -r MODULE.bazel BUILD.bazel README.md CMakeLists.txt bazel cmake include tools "$amp"/)
recipe() { bash tests/readme_recipes.sh README.md "$1"; }
recipe app >"$app/app.cc"
recipe build >"$app/BUILD.bazel"
# Only the path changes: the README's third_party/amp is the copy above.
recipe module | sed "s|\"third_party/amp\"|\"$amp\"|" >"$app/MODULE.bazel"
grep -qF "path = \"$amp\"" "$app/MODULE.bazel" || { echo "FAIL: the README's MODULE.bazel lines have no path = \"third_party/amp\""; exit 1; }
echo "MODULE.bazel:"; cat "$app/MODULE.bazel"; echo "BUILD.bazel:"; cat "$app/BUILD.bazel"
off="$amp/bazel/offline7"
flags=(--noenable_workspace --override_module=zlib="$off/zlib" --override_module=protobuf="$off/protobuf"
       --override_module=buildozer="$off/buildozer" --override_module=apple_support="$off/apple_support")
cd "$app"
bazel --batch --output_user_root="$work/bazel" build "${flags[@]}" --spawn_strategy=local \
  --symlink_prefix="$work/out-" //:app >"$work/bazel.log" 2>&1 || { tail -40 "$work/bazel.log"; exit 1; }
# It must exit 0, print the Trainer's progress line at step 200 (on stderr) and write its checkpoint.
out=$("$work/out-bin/app" 2>&1) || { rc=$?; echo "$out"; echo "FAIL: the README's Bazel app exited with $rc"; exit 1; }
echo "$out"
grep -q '^bf16-mixed 200 loss ' <<<"$out" || { echo "FAIL: the README's Bazel app printed no progress line for step 200"; exit 1; }
[ "$(head -c 2 model.pt 2>/dev/null)" = PK ] || { echo "FAIL: the README's Bazel app wrote no model.pt checkpoint"; exit 1; }
echo "PASS: the README's Bzlmod recipe built the Trainer block, which ran"
