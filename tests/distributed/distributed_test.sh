#!/usr/bin/env bash
# Runs distributed_test's cases through tools/launch: distributed_test.sh BIN LAUNCH GROUP
set -uo pipefail
bin=$1 launch=$2 group=$3
case "$bin" in /*) ;; *) bin="$PWD/$bin" ;; esac
case "$launch" in /*) ;; *) launch="$PWD/$launch" ;; esac
if [ -n "${TEST_TMPDIR:-}" ]; then work=$TEST_TMPDIR; else work=$(mktemp -d); trap 'rm -rf "$work"' EXIT; fi  # ctest: no TEST_TMPDIR
export AMP_DP_TIMEOUT_MS=${AMP_DP_TIMEOUT_MS:-20000}
fails=0
# run NAME N [launch flags --] CASE ARGS...: every rank must print "PASS CASE".
run() {
  local n=$1; shift
  local t0=$SECONDS out="$work/out.$BASHPID.$RANDOM.txt"
  "$launch" -n "$n" -- "$bin" "$@" >"$out" 2>&1; local rc=$?
  cat "$out"
  local passes; passes=$(grep -c "^\[[0-9]*\] PASS $1" "$out")
  if [ "$rc" -ne 0 ] || [ "$passes" -ne "$n" ]; then
    echo "FAIL: $* on $n processes (status $rc, $passes of $n passed)"; fails=$((fails + 1))
  else
    echo "ok: $* on $n processes ($((SECONDS - t0)) s)"
  fi
}
case "$group" in
  ranks2)
    for c in fp32 bf16 fp16 true_bf16 true_fp16 half_grads compress_fp16 compress_bf16 parity inf accumulate mismatch fit precision float8 float8_rowwise checkpoint; do run 2 "$c"; done
    run 2 rng_resume "$work/rng2.pt"
    ;;
  ranks4)
    for c in fp32 bf16 inf fit; do run 4 "$c"; done
    run 3 rng_resume "$work/rng3.pt"
    # A checkpoint written by 2 processes resumes in 1 and in 4.
    run 2 train "$work/ckpt2.pt" 6
    run 1 resume "$work/ckpt2.pt" 6
    run 4 resume "$work/ckpt2.pt" 6
    ;;
  sharded)
    # BIN is sharded_cases: ShardedOptimizer beside unsharded DataParallel, bitwise.
    for c in sgd adam adamw adamw8bit fp16_inf float8 scaler_sgd scaler_adamw precision memory; do run 2 "$c"; done
    for c in adamw scaler_adamw memory; do run 3 "$c"; run 4 "$c"; done
    # Consolidated checkpoints: sharded -> unsharded, one process, other world
    # sizes; unsharded -> sharded. Bitwise onward at the same world size.
    run 2 ckpt_train "$work/s2.pt" 4 sharded
    for spec in "2 plain" "2 sharded" "1 plain" "1 sharded" "3 sharded" "4 plain"; do
      set -- $spec; run "$1" ckpt_resume "$work/s2.pt" 4 "$2"
    done
    run 2 ckpt_train "$work/p2.pt" 4 plain
    run 2 ckpt_resume "$work/p2.pt" 4 sharded
    run 4 ckpt_resume "$work/p2.pt" 4 sharded
    run 2 bad_load "$work/s2.pt"
    AMP_DP_TIMEOUT_MS=4000 run 2 lonely_save "$work/lonely.pt"
    run 3 fit
    # The last of 3 killed / stopped inside its local step: the two others
    # fail in the parameter all-gather with an amp: error within the timeout.
    for how in kill stop; do
      out="$work/die_$how.txt"
      AMP_DP_TIMEOUT_MS=5000 "$launch" -n 3 --grace 8 -- "$bin" die_in_gather "$how" >"$out" 2>&1
      cat "$out"
      if [ "$(grep -c '^\[[01]\] PASS die_in_gather' "$out")" -eq 2 ]; then
        echo "ok: die_in_gather $how"
      else
        echo "FAIL: die_in_gather $how"; fails=$((fails + 1))
      fi
    done
    # The last of 3 killed / stopped where it should join a checkpoint's
    # gather: both survivors fail within the timeout, the checkpoint before it
    # is intact with no temporary file beside it, and a restart from it at 3
    # continues bitwise (ckpt_resume).
    for how in kill stop; do
      out="$work/save_$how.txt"
      AMP_DP_TIMEOUT_MS=5000 "$launch" -n 3 --grace 8 -- "$bin" die_in_save "$work/d_$how.pt" 3 "$how" >"$out" 2>&1
      cat "$out"
      if [ "$(grep -c '^\[[01]\] PASS die_in_save' "$out")" -eq 2 ]; then
        echo "ok: die_in_save $how"
      else
        echo "FAIL: die_in_save $how"; fails=$((fails + 1))
      fi
      run 3 ckpt_resume "$work/d_$how.pt" 3 sharded
    done
    ;;
  fully_shard)
    # BIN is fully_shard_cases: amp::FullyShard at 1-4 processes.
    for n in 1 2 3 4; do run "$n" memory; run "$n" vs_dp; done
    for n in 2 4; do run "$n" accumulate; done
    for n in 2 3; do run "$n" clip; run "$n" scaler; run "$n" checkpoint; run "$n" autocast; done
    for n in 1 2 3; do run "$n" prefetch; done
    run 2 errors
    # The last of 3 killed / stopped before its forward (the others wait in an
    # all-gather), its backward (in a reduce-scatter), or block 1's forward with
    # prefetch on (in a prefetched all-gather): an amp: error within the timeout.
    for how in kill stop; do
      for where in gather reduce prefetch; do
        out="$work/fsdp_die_${how}_$where.txt"
        AMP_DP_TIMEOUT_MS=5000 "$launch" -n 3 --grace 8 -- "$bin" die "$how" "$where" >"$out" 2>&1
        cat "$out"
        if [ "$(grep -c '^\[[01]\] PASS die' "$out")" -eq 2 ]; then
          echo "ok: die $how $where"
        else
          echo "FAIL: die $how $where"; fails=$((fails + 1))
        fi
      done
    done
    ;;
  fully_shard_ckpt)
    # BIN is fully_shard_ckpt_cases: FullyShard's checkpoints. Train k, save,
    # train k; fresh processes load and train k: bitwise at the saved world
    # size (2 and 3), loaded and trained on at another (re-sharded); a
    # consolidated file also loads into a plain Trainer.
    # The two formats' chains run side by side (one thread per process).
    chain() {
      local kind=$1 fails=0
      for n in 2 3; do
        run "$n" train "$work/$kind$n.pt" 3 "$kind"
        run "$n" resume "$work/$kind$n.pt" 3
      done
      if [ "$kind" = consolidated ]; then
        run 1 resume "$work/consolidated2.pt" 3
        run 4 resume "$work/consolidated3.pt" 3
      else
        run 3 resume "$work/sharded2.pt" 3
        run 2 resume "$work/sharded3.pt" 3
      fi
      echo "$fails" >"$work/fails.$kind"
    }
    chain consolidated & chain sharded & wait
    fails=$((fails + $(cat "$work/fails.consolidated") + $(cat "$work/fails.sharded")))
    mkdir -p "$work/bad"; run 2 bad "$work/bad"
    # The last of 3 killed / stopped where it should join a save: both
    # survivors fail within the timeout, the checkpoint before it is intact
    # with no temporary file beside it, and a restart from it at 3 continues bitwise.
    for spec in "kill consolidated" "stop sharded"; do
      set -- $spec
      out="$work/save_$1.txt" path="$work/die_$1.pt"
      AMP_DP_TIMEOUT_MS=3000 "$launch" -n 3 --grace 5 -- "$bin" die "$path" 2 "$2" "$1" >"$out" 2>&1
      cat "$out"
      if [ "$(grep -c '^\[[01]\] PASS die' "$out")" -eq 2 ]; then
        echo "ok: die $1 in a $2 save"
      else
        echo "FAIL: die $1 in a $2 save"; fails=$((fails + 1))
      fi
      run 3 resume "$path" 2
    done
    ;;
  faults)
    export AMP_DP_TIMEOUT_MS=5000
    # One of 3 dies mid-run (SIGKILL) / stops (SIGSTOP): the others fail with
    # an amp: error within the timeout; the last checkpoint loads.
    for how in kill stop; do
      t0=$SECONDS out="$work/$how.txt"
      "$launch" -n 3 --grace 8 -- "$bin" die "$work/$how.pt" 50 "$how" 4 >"$out" 2>&1; rc=$?
      cat "$out"
      n_err=$(grep -cE "^\[[01]\] peer-failure error after [0-9.e+-]+ s \(timeout 5 s\): amp: " "$out")
      worst=$(grep -oE "^\[[01]\] peer-failure error after [0-9.e+-]+" "$out" | awk '{print $NF}' | sort -g | tail -1)
      if [ "$rc" -ne 0 ] && [ "$n_err" -eq 2 ] && awk -v w="${worst:-99}" 'BEGIN{exit !(w < 5.5)}'; then
        echo "ok: $how: both survivors failed with the amp: error, slowest after ${worst} s ($((SECONDS - t0)) s)"
      else
        echo "FAIL: $how: status $rc, $n_err amp: errors, slowest ${worst:-none} s"; fails=$((fails + 1))
      fi
      run 1 resume "$work/$how.pt" 4
    done
    # Rendezvous errors, without a launcher.
    one() { local expect=$1; shift; local out="$work/env.txt"
      env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT "$@" "$bin" rendezvous_error "$expect" >"$out" 2>&1; local rc=$?
      cat "$out"
      if [ "$rc" -eq 0 ] && grep -q "^PASS" "$out"; then echo "ok: rendezvous error '$expect'"; else echo "FAIL: rendezvous error '$expect'"; fails=$((fails + 1)); fi
    }
    one "WORLD_SIZE is not set" RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29999
    one "WORLD_SIZE=0 is out of range" RANK=0 WORLD_SIZE=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29999
    one "RANK=2 is out of range" RANK=2 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29999
    one "MASTER_PORT=\"x\" is not an integer" RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=x
    one "MASTER_ADDR is not set" RANK=0 WORLD_SIZE=1 MASTER_PORT=29999
    # Nobody serves the port: a bounded wait, then amp:'s error.
    one "could not rendezvous at 127.0.0.1:9" AMP_DP_TIMEOUT_MS=2000 RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=9
    # Two processes given different WORLD_SIZEs (rank 0: 2, rank 1: 3): each gets amp:'s error, naming both.
    port=$("$launch" --free-port)
    pids=()
    for r in 0 1; do
      env -u RANK -u WORLD_SIZE AMP_DP_TIMEOUT_MS=10000 RANK=$r WORLD_SIZE=$((2 + r)) MASTER_ADDR=127.0.0.1 \
        MASTER_PORT=$port "$bin" rendezvous_error "every process must be given the same WORLD_SIZE" \
        >"$work/ws$r.txt" 2>&1 &
      pids+=($!)
    done
    wait "${pids[@]}"
    cat "$work/ws0.txt" "$work/ws1.txt"
    if grep -q "^PASS" "$work/ws0.txt" && grep -q "^PASS" "$work/ws1.txt"; then
      echo "ok: WORLD_SIZE 2 and 3: both ranks got amp:'s error"
    else
      echo "FAIL: WORLD_SIZE 2 and 3"; fails=$((fails + 1))
    fi
    ;;
  *) echo "unknown group $group"; exit 2 ;;
esac
[ "$fails" -eq 0 ] && echo "PASS: distributed $group" || { echo "$fails failed"; exit 1; }
