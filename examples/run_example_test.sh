#!/usr/bin/env bash
# Runs one example the way a user would and checks what it prints and writes.
set -euo pipefail
bin=$1 name=$2
# $(location) is relative to the runfiles root; resolve it before leaving it.
case "$bin" in /*) ;; *) bin="$PWD/$bin" ;; esac
work=${TEST_TMPDIR:-$(mktemp -d)}
cd "$work"
fail() { echo "FAIL ($name): $*"; exit 1; }
case "$name" in
  precision_sweep)
    "$bin" --device=cpu --steps=12 --batch-size=64 --hidden=64 --csv=sweep.csv --plot=sweep.png >out.txt 2>err.txt \
      || { cat out.txt err.txt; fail "exit code"; }
    cat out.txt
    grep -q "^precision *final loss *accuracy *steps/s *speedup *peak memory *skipped *loss scale" out.txt || fail "no table header"
    for p in 32-true bf16-mixed 64-true; do grep -q "^$p " out.txt || fail "no row for $p"; done
    [ "$(grep -c '^32-true,' sweep.csv)" -eq 12 ] || fail "sweep.csv lacks 12 steps of 32-true"
    head -1 sweep.csv | grep -qx "precision,step,epoch,loss,scale,skipped,seconds" || fail "csv header"
    if command -v gnuplot >/dev/null; then
      [ -s sweep.png ] && head -c 8 sweep.png | grep -q PNG || fail "no PNG plot"
    fi
    # One policy by its Lightning string, and a clear error for a bad one.
    "$bin" --device=cpu --precision=bf16 --steps=3 --batch-size=32 --hidden=32 >one.txt 2>/dev/null || fail "--precision=bf16"
    grep -q "^bf16-mixed " one.txt || fail "legacy 'bf16' did not run bf16-mixed"
    [ "$(grep -cE '^(32-true|64-true) ' one.txt)" -eq 0 ] || fail "--precision ran more than one policy"
    if "$bin" --device=cpu --precision=fp17 --steps=2 >bad.txt 2>&1; then fail "unknown precision accepted"; fi
    grep -q 'amp: unknown precision "fp17"; valid: ' bad.txt || { cat bad.txt; fail "unknown precision message"; }
    ;;
  data_parallel)
    launch=$3
    case "$launch" in /*) ;; *) launch="$OLDPWD/$launch" ;; esac
    "$launch" -n 2 -- "$bin" >out.txt 2>&1 || { cat out.txt; fail "exit code"; }
    cat out.txt
    for r in 0 1; do
      grep -qE "^\[$r\] rank $r of 2: loss [0-9.]+ -> [0-9.]+, 100 all-reduces in 1 bucket\(s\)$" out.txt || fail "rank $r's line"
    done
    [ -s data_parallel.pt ] || fail "no checkpoint"
    ;;
  dcgan)
    check_run() {  # out-file precision iterations
      grep -q "^dcgan: $2, " "$1" || fail "$2: header line"
      [ "$(grep -cE '^iteration +[0-9]+  loss_d [0-9.]+  loss_g [0-9.]+$' "$1")" -eq 6 ] || fail "$2: no 6 loss lines"
      grep -q "^checkpoint dcgan.pt: $3 iterations$" "$1" || fail "$2: checkpoint line"
      [ -s dcgan.pt ] || fail "$2: no checkpoint"
    }
    "$bin" >out.txt 2>&1 || { cat out.txt; fail "exit code"; }
    cat out.txt
    check_run out.txt bf16-mixed 300
    # A GAN that trained: its samples are as bright as the data, within 2x.
    awk '/^generated:/ { gsub(/[%()]/, ""); fake = $9; real = $11 }
         END { exit !(real > 0 && fake >= real / 2 && fake <= real * 2) }' out.txt || fail "samples unlike the data"
    # 16-mixed: one GradScaler for both optimizers, where CPU fp16 exists
    # (LibTorch >= 2.3); a short run (CPU fp16 convolutions are slow).
    rm -f dcgan.pt
    rc=0
    "$bin" 16-mixed 24 >fp16.txt 2>&1 || rc=$?
    cat fp16.txt
    if [ "$rc" -eq 0 ]; then
      check_run fp16.txt 16-mixed 24
      grep -qE '^loss scale [0-9.e+]+$' fp16.txt || fail "16-mixed: no loss scale"
    else
      [ "$rc" -eq 2 ] || fail "16-mixed: exit code $rc"
      grep -qE '^amp: 16-mixed on CPU needs LibTorch >= 2.3 \(this is (1\.[0-9]+|2\.[0-2])\)' fp16.txt ||
        fail "16-mixed refused on a LibTorch that has CPU fp16"
    fi
    if "$bin" fp17 >bad.txt 2>&1; then fail "unknown precision accepted"; fi
    grep -q 'amp: dcgan trains under bf16-mixed or 16-mixed, not "fp17"' bad.txt || fail "bad precision message"
    if "$bin" bf16-mixed 0 >bad.txt 2>&1; then fail "0 iterations accepted"; fi
    grep -q "amp: dcgan's iterations must be >= 1" bad.txt || fail "bad iterations message"
    ;;
  low_bit_transformer)
    # One thread: a quality check, not a timing, and OpenMP's spinning threads
    # make a 2-thread run several times slower on a busy 2-core machine.
    # --checkpoint: each optimizer also trains a copy with checkpointed blocks.
    OMP_NUM_THREADS=1 "$bin" --steps=30 --checkpoint >out.txt 2>err.txt || { cat out.txt err.txt; fail "exit code"; }
    cat out.txt
    grep -qE '^low_bit_transformer: LibTorch [0-9]+\.[0-9]+, [0-9]+ parameters, 30 steps, each also with its blocks checkpointed$' \
      out.txt || fail "header line"
    num='[0-9]+\.[0-9]+'
    for o in AdamW AdamW8bit AdamW4bit; do
      line="final loss $num \([+-][0-9.]+% vs AdamW\), [0-9.]+ state bytes/param, [0-9]+ activation bytes/step, $num ms/step"
      grep -qE "^low_bit_transformer: $o $line\$" out.txt || fail "no line for $o"
      grep -qE "^low_bit_transformer: $o checkpointed $line \(${num}x the activations, ${num}x the time; losses bitwise equal\)\$" \
        out.txt || fail "no checkpointed line for $o (or its losses differ)"
      # Checkpointing the blocks keeps fewer activation bytes (counted by amp::ActivationMeter).
      plain=$(sed -nE "s/^low_bit_transformer: $o final loss .*, ([0-9]+) activation bytes\/step.*/\1/p" out.txt)
      ckpt=$(sed -nE "s/^low_bit_transformer: $o checkpointed final loss .*, ([0-9]+) activation bytes\/step.*/\1/p" out.txt)
      [ -n "$plain" ] && [ -n "$ckpt" ] && [ "$ckpt" -gt 0 ] && [ "$ckpt" -lt "$plain" ] ||
        fail "$o: checkpointed activation bytes ($ckpt) not below the plain run's ($plain)"
    done
    if "$bin" --steps=0 >bad.txt 2>&1; then fail "--steps=0 accepted"; fi
    grep -q "amp: low_bit_transformer's --steps must be" bad.txt || fail "bad --steps message"
    ;;
  *)
    "$bin" >out.txt 2>&1 || { cat out.txt; fail "exit code"; }
    cat out.txt
    ;;
esac
echo "PASS: $name"
