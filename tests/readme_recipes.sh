#!/usr/bin/env bash
# Prints one build recipe as README.md gives it, for the tests that run them
# (tests/readme_build_test.sh, tests/bazel_consumer_test.sh):
#   readme_recipes.sh README.md NAME
# NAME: app (the C++ block of "## The Trainer in 10 lines"), and from "## Use amp
# in your project": cmake-install (the install command line), cmake (the
# ```cmake block), gxx (the plain compiler line), gxx-torch (the flags a
# downloaded LibTorch in $TORCH adds), cxx20-since (the LibTorch from which
# the compiler line needs -std=c++20, e.g. 2.14), and from the ```starlark
# block: module, workspace, build (the lines under `# MODULE.bazel:`,
# `# or WORKSPACE:`, `# BUILD:`).
set -euo pipefail
readme=$1 name=$2
# The section's prose (fenced blocks left out), one line: its inline code spans.
spans() {
  awk '/^## /{ in_sec = ($0 == "## Use amp in your project") } in_sec && /^```/{ fence = !fence; next }
       in_sec && !fence { printf "%s ", $0 }' "$readme" |
    awk -v RS='`' 'NR % 2 == 0 { gsub(/[ \t]+/, " "); print }'
}
block() {  # the first ```$2 block of section $1
  awk -v sec="$1" -v lang="$2" '/^## /{ in_sec = ($0 == sec) }
       in_sec && !done && $0 == "```" lang { inb = 1; next }
       inb && /^```/ { inb = 0; done = 1; next }
       inb { print }' "$readme"
}
bazel_part() {  # the starlark block's lines between the comment line $1 and the next `# ...:` line
  block "## Use amp in your project" starlark |
    awk -v head="$1" '/^# [^ ].*:$/ { on = ($0 == head); next } on { print }'
}
# shellcheck disable=SC2016 # the patterns match a literal $TORCH and backquotes
case "$name" in
  app) out=$(block "## The Trainer in 10 lines" cpp) ;;
  cmake) out=$(block "## Use amp in your project" cmake) ;;
  cmake-install) out=$(spans | grep -m1 '^cmake -S ' || true) ;;
  gxx) out=$(spans | grep -m1 '^g++ ' || true) ;;
  gxx-torch) out=$(spans | grep -m1 '^-isystem \$TORCH/include ' || true) ;;
  cxx20-since)
    out=$(awk '/^## /{ in_sec = ($0 == "## Use amp in your project") } in_sec { printf "%s ", $0 }' "$readme" |
      grep -o '`-std=c++20` from LibTorch [0-9]*\.[0-9]*' | grep -o '[0-9]*\.[0-9]*$' || true) ;;
  module) out=$(bazel_part "# MODULE.bazel:") ;;
  workspace) out=$(bazel_part "# or WORKSPACE:") ;;
  build) out=$(bazel_part "# BUILD:") ;;
  *) echo "amp: readme_recipes.sh: unknown recipe '$name'; use app, cmake, cmake-install, gxx, gxx-torch, cxx20-since, module, workspace or build" >&2; exit 2 ;;
esac
[ -n "$out" ] || { echo "amp: $readme has no '$name' recipe where tests/readme_recipes.sh looks for it; keep the README's \"Use amp in your project\" and \"The Trainer in 10 lines\" sections as the script reads them" >&2; exit 1; }
printf '%s\n' "$out"
