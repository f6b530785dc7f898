#!/usr/bin/env bash
# Precompiles a header for g++ with a LibTorch line's flags (bazel's //tools:torch_pch).
#   make_pch.sh FLAGS_FILE HEADER OUT_HEADER
# Writes OUT_HEADER (a copy of HEADER) and OUT_HEADER.gch beside it; a compile
# with the same FLAGS_FILE and `-include OUT_HEADER` loads the .gch instead of
# parsing the header (g++ parses OUT_HEADER itself where the .gch does not fit).
set -eu
flags_file=$1 header=$2 out=$3
read -r -a torch_flags < <(tr '\n' ' ' < "$flags_file") || true  # no newline at the end: read says 1
cp "$header" "$out"
"${CXX:-g++}" "${torch_flags[@]}" -x c++-header "$header" -o "$out.gch"
