#!/usr/bin/env bash
# amp's layers, lowest first: a header includes only headers of its own layer
# and of the layers below. This list is the one place they are declared; the
# map in docs/maintainers.md ("Where things live") describes them.
#   detail       version shims (compat*.h) and small helpers; version.h
#   core         dtype and device tags, the scaler concept, policies, the static rules, experiments
#   optim        FusedStep: ATen's fused optimizer kernels
#   scaler       NoScaler, StaticScaler, DynamicScaler (LossScalerBase), state dicts
#   precision    Autocast, AllowTF32, StrictCasts, linear routing, Region
#   float8       float8 scaling recipes and the float8 linear
#   train        Stepper, History, checkpoints, Trainer, Fabric
#   capture      CapturedStep: the step as a CUDA graph
#   distributed  ProcessGroup, DataParallel (c10d)
#   (umbrella)   amp.h, distributed.h, testing.h
#
# Also checked: a layer's detail/ folder is included only from that layer; a
# header in a detail/ folder declares names in amp::detail only (public names
# never live in detail) and nothing re-exports detail names into amp; with
# FLAGS_FILE, amp/train/trainer.h's include closure holds no capture or
# distributed code (a Trainer user who never captures does not compile it).
#   layering_test.sh [FLAGS_FILE]      (run from the repository root)
set -u
layers=(detail core precision scaler optim float8 train capture distributed umbrella)
rank_of() {  # the layer rank of a path relative to include/ (amp/...)
  local rel=${1#amp/} name
  case "$rel" in
    version.h) name=detail ;;
    amp.h | distributed.h | testing.h) name=umbrella ;;
    */*) name=${rel%%/*} ;;
    *) echo -1; return ;;
  esac
  local i
  for i in "${!layers[@]}"; do [ "${layers[$i]}" = "$name" ] && { echo "$i"; return; }; done
  echo -1
}
detail_owner() {  # "core" for amp/core/detail/x.h, "detail" for amp/detail/x.h, "" otherwise
  local rel=${1#amp/}
  case "$rel" in
    detail/*) echo detail ;;
    */detail/*) echo "${rel%%/*}" ;;
    *) echo "" ;;
  esac
}

fails=0
fail() { echo "FAIL $*"; fails=$((fails + 1)); }
n=0
while IFS= read -r path; do
  n=$((n + 1))
  h=${path#include/}
  r=$(rank_of "$h")
  if [ "$r" -lt 0 ]; then
    fail "$h: in no layer (add its folder to tools/layering_test.sh and the map in docs/maintainers.md)"
    continue
  fi
  layer=${layers[$r]}
  while IFS= read -r inc; do
    ir=$(rank_of "$inc")
    if [ "$ir" -lt 0 ]; then
      fail "$h includes $inc, which is in no layer"
    elif [ "$ir" -gt "$r" ]; then
      fail "$h ($layer) includes $inc (${layers[$ir]}, a higher layer)"
    fi
    owner=$(detail_owner "$inc")
    if [ -n "$owner" ] && [ "$owner" != detail ] && [ "$owner" != "$layer" ]; then
      fail "$h ($layer) reaches into $inc, the $owner layer's detail"
    fi
  done < <(sed -nE 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"](amp\/[^>"]+)[>"].*/\1/p' "$path")
  if [ -n "$(detail_owner "$h")" ]; then
    # Every `namespace amp {` opens `namespace detail` next (or is amp::detail).
    if awk '/^namespace amp \{/ { want = 1; next }
            want && /^[[:space:]]*($|\/\/)/ { next }
            want { if ($0 !~ /^namespace detail \{/) bad = 1; want = 0 }
            /^namespace amp::[a-z_:]+ \{/ && $0 !~ /^namespace amp::detail/ { bad = 1 }
            END { exit bad ? 0 : 1 }' "$path"; then
      fail "$h: a header in detail/ declares names outside amp::detail (public names never live in detail)"
    fi
  fi
  if grep -nE '^[[:space:]]*using[[:space:]]+(::amp::)?detail::' "$path" >/dev/null; then
    fail "$h: re-exports a detail name with a using-declaration; define the public name outside detail"
  fi
done < <(find include/amp -name '*.h' | sort)
echo "$n headers checked against ${#layers[@]} layers"

if [ $# -ge 1 ]; then
  read -r -a torch_flags < <(tr '\n' ' ' < "$1")
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  printf '#include <amp/train/trainer.h>\n' > "$tmp/tu.cc"
  if ! "${CXX:-g++}" "${torch_flags[@]}" -M -Iinclude "$tmp/tu.cc" > "$tmp/deps"; then
    fail "amp/train/trainer.h does not compile"
  else
    closure=$(tr ' \\' '\n\n' < "$tmp/deps" | grep -E 'amp/(capture|distributed)/' || true)
    if [ -n "$closure" ]; then
      fail "amp/train/trainer.h pulls in capture or distributed code:"; echo "$closure"
    else
      echo "ok   amp/train/trainer.h's include closure has no capture or distributed header"
    fi
  fi
fi
echo "$fails failed"
[ "$fails" -eq 0 ]
