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
    ffn=64  # the ladder's residual MLP: 256-[64-256]x2-16
    "$bin" --device=cpu --steps=12 --batch-size=64 --hidden=64 --ffn=$ffn --ladder-steps=3 --block-scaled --csv=sweep.csv \
      --plot=sweep.png >out.txt 2>err.txt || { cat out.txt err.txt; fail "exit code"; }
    cat out.txt
    grep -q "^precision *final loss *accuracy *steps/s *speedup *peak memory *skipped *loss scale" out.txt || fail "no table header"
    for p in 32-true bf16-mixed 64-true; do grep -q "^$p " out.txt || fail "no row for $p"; done
    [ "$(grep -c '^32-true,' sweep.csv)" -eq 12 ] || fail "sweep.csv lacks 12 steps of 32-true"
    # The block-scaled Float8 recipes (all_policies' MXFP8<> and NVFP4<>, swept with
    # --block-scaled) need the float8 dtypes: rows, 12 steps each and curves in the
    # plot from LibTorch 2.1, none before.
    read -r major minor < <(sed -nE 's/^precision sweep on cpu \(LibTorch ([0-9]+)\.([0-9]+);.*/\1 \2/p' out.txt) || true
    [ -n "${minor:-}" ] || fail "no LibTorch version in the table's title"
    for p in mxfp8-rceil nvfp4; do
      if [ "$major" -gt 2 ] || { [ "$major" -eq 2 ] && [ "$minor" -ge 1 ]; }; then
        grep -qE "^$p +[0-9]" out.txt || fail "no row for $p"
        [ "$(grep -c "^$p," sweep.csv)" -eq 12 ] || fail "sweep.csv lacks 12 steps of $p"
        grep -q "^$p,[0-9]" sweep.summary.csv || fail "sweep.summary.csv lacks $p"
        if command -v gnuplot >/dev/null; then grep -q "strcol(1) eq '$p'" sweep.png.gp || fail "no curve for $p"; fi
      elif grep -q "^$p" out.txt; then
        fail "$p ran on LibTorch $major.$minor, which has no float8 dtypes"
      fi
    done
    head -1 sweep.csv | grep -qx "precision,step,epoch,loss,scale,skipped,seconds" || fail "csv header"
    # Each policy's run says its optimizer path once (the warm-up run says nothing).
    policies=$(($(wc -l <sweep.summary.csv) - 1))
    paths=$(grep -c ': optimizer path: ' err.txt || true)
    [ "$policies" -ge 3 ] && [ "$paths" -eq "$policies" ] || fail "$paths optimizer path lines for $policies policies"
    # The memory ladder: every configuration's bytes against the formulas of
    # docs/maintainers.md (the demo), exactly; then what the plot draws from.
    grep -q "^configuration *params *grads *optimizer *fixed *activations *total *act B/sample *steps/s *final loss" \
      out.txt || fail "no ladder header"
    configs="32-true AdamW|bf16-mixed AdamW|bf16-mixed AdamW8bit|bf16-mixed AdamW4bit|bf16-true AdamW8bit\\+SR"
    [ "$(grep -cE "^($configs) +[0-9]" out.txt)" -eq 5 ] && [ "$(grep -cE "^($configs) \+ckpt +[0-9]" out.txt)" -eq 5 ] ||
      fail "the ladder lacks a configuration"
    head -1 sweep.ladder.csv | grep -qx "configuration,policy,optimizer,checkpointed,parameters,batch,param_bytes,\
grad_bytes,optimizer_bytes,fixed_bytes,activation_bytes_per_sample,params_bpp,grads_bpp,optimizer_bpp,fixed_bpp,\
activations_bpp,total_bpp,steps_per_s,final_loss" || fail "ladder csv header"
    awk -F, -v F=$ffn 'NR == 1 { next }
      function fail(what) { printf "FAIL (precision_sweep): %s: %s\n", $1, what; bad = 1 }
      function near(a, b) { return (a - b) <= 1e-6 * b && (b - a) <= 1e-6 * b }
      {
        K = 2; W = 256; C = 16; G = 5056        # blocks, width, classes, a CPU generator state
        P = 2 * K * W * F + W * C; T = 2 * K + 1
        bf16true = $2 == "bf16-true"; mixed = $2 == "bf16-mixed"; ckpt = $4 == 1
        pb = bf16true ? 2 : 4                   # parameter (and gradient) bytes
        if ($3 == "AdamW") opt = 2 * pb * P
        else if ($3 ~ /^AdamW8bit/) opt = P * (2 + 8 / 256) + 4 * T
        else if ($3 ~ /^AdamW4bit/) opt = P * (1 + 8 / 128) + 4 * T
        else fail("unknown optimizer " $3)
        fixed = (bf16true ? 4 : 8) + (ckpt ? K * G : 0) + (mixed ? (ckpt ? 2 * C * W : 2 * P) : 0)
        if (!ckpt) act = mixed ? 2 * (K * (F + W) + W) + 4 * C : pb * (K * (F + W) + C)
        else act = mixed ? 4 * (K - 1) * W + 2 * W + 4 * C : pb * (K * W + C)
        n++
        if ($5 != P) fail("parameters " $5 " != " P)
        if ($7 != pb * P || $8 != pb * P) fail("param/grad bytes " $7 "/" $8 " != " pb * P)
        if ($9 != opt) fail("optimizer bytes " $9 " != " opt)
        if ($10 != fixed) fail("fixed bytes " $10 " != " fixed)
        if ($11 != act) fail("activation bytes per sample " $11 " != " act)
        # The plotted columns: the same bytes per parameter, and their sum.
        if (!near($12, $7 / P) || !near($13, $8 / P) || !near($14, $9 / P) || !near($15, $10 / P) ||
            !near($16, $11 * $6 / P)) fail("bytes per parameter do not match the bytes")
        if (!near($17, $12 + $13 + $14 + $15 + $16)) fail("total_bpp is not the sum of the stacked columns")
        if (!($18 > 0) || !($19 > 0 && $19 < 10)) fail("steps/s " $18 " or final loss " $19)
      }
      END { if (n != 10) { print "FAIL (precision_sweep): " n " ladder rows, not 10"; bad = 1 } exit bad }' \
      sweep.ladder.csv || fail "the ladder's bytes"
    if command -v gnuplot >/dev/null; then
      [ -s sweep.png ] && head -c 8 sweep.png | grep -q PNG && ! grep -q "gnuplot failed" err.txt || fail "no PNG plot"
      # The panels drawn from the ladder's CSV: the stacked bytes (columns 12-16) and speed against the total.
      grep -q "^plot 'sweep.ladder.csv' using 12:xtic(1) title 'parameters', '' using 13 .*'' using 14 .*'' using 15 .*\
'' using 16 " sweep.png.gp || fail "no stacked-bytes panel"
      grep -q "'sweep.ladder.csv' every ::0::0 using 17:18 with points" sweep.png.gp || fail "no speed-against-bytes panel"
    fi
    # One policy by its Lightning string (one optimizer path line, no ladder), and a clear error for a bad one.
    "$bin" --device=cpu --precision=bf16 --steps=3 --batch-size=32 --hidden=32 --plot=one.png >one.txt 2>one.err ||
      fail "--precision=bf16"
    grep -q "^bf16-mixed " one.txt || fail "legacy 'bf16' did not run bf16-mixed"
    [ "$(grep -cE '^(32-true|64-true) ' one.txt)" -eq 0 ] || fail "--precision ran more than one policy"
    [ "$(grep -c 'optimizer path' one.err)" -eq 1 ] || { cat one.err; fail "optimizer path not once in one run"; }
    ! grep -q "^memory ladder" one.txt || fail "--precision ran the ladder"
    if command -v gnuplot >/dev/null; then  # without the ladder: the peak RSS panel instead
      [ -s one.png ] && ! grep -q "gnuplot failed" one.err || fail "no PNG plot without the ladder"
    fi
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
  sharded_ladder)
    # The ladder per rank at N = 1 and 2. zero1 (DataParallel + ShardedOptimizer):
    # each rank's optimizer bytes within 1% of s x P / N, the ranks' states
    # adding up to the unsharded one, every rank holding all parameters and
    # gradients. fully (FullyShard): parameters and gradients 4 P / N each,
    # AdamW's state 8 P / N, exactly (no padding at this width), AdamW8bit's
    # within 1.5% (the head's 2048-element shard keeps fp32 states at N = 2).
    launch=$3
    case "$launch" in /*) ;; *) launch="$OLDPWD/$launch" ;; esac
    for n in 1 2; do
      "$launch" -n $n -- "$bin" --steps=3 --batch-size=32 --csv=sharded.csv >out$n.txt 2>&1 || { cat out$n.txt; fail "N = $n: exit code"; }
      cat out$n.txt
      grep -q "^\[0\] sharded ladder: N = $n process" out$n.txt || fail "N = $n: header line"
      for m in zero1 fully; do
        for o in AdamW AdamW8bit; do
          [ "$(grep -cE "^\[0\] [0-9]+ +$m +$o " out$n.txt)" -eq $n ] || fail "N = $n: not $n rank lines for $m $o"
        done
      done
      grep -qE "^\[0\] .*the peak of whole parameters on rank 0: 532480 bytes" out$n.txt || fail "N = $n: peak line"
    done
    head -1 sharded.csv | grep -qx "world,rank,optimizer,parameters,shard_parameters,param_bytes,grad_bytes,\
optimizer_bytes,formula_bytes,steps_per_s,final_loss,mode" || fail "csv header"
    awk -F, 'NR == 1 { next }
      function fail(what) { printf "FAIL (sharded_ladder): N = %d, rank %d, %s %s: %s\n", $1, $2, $12, $3, what; bad = 1 }
      {
        P = 2 * 2 * 256 * 1024 + 256 * 16      # the residual MLP at its default width
        s = $3 == "AdamW" ? 8 : 2 + 8 / 256     # unsharded state bytes per parameter
        rows++
        if ($4 != P) fail("parameters " $4)
        if ($9 < s * P / $1 * (1 - 1e-9) || $9 > s * P / $1 * (1 + 1e-9)) fail("formula " $9 " != s P / N")
        if ($12 == "zero1") {
          if ($6 != 4 * P || $7 != 4 * P) fail("parameter or gradient bytes not 4 per parameter")
          if ($8 < 0.99 * $9 || $8 > 1.01 * $9) fail("optimizer bytes " $8 " not within 1% of " $9)
        } else if ($12 == "fully") {
          if ($5 * $1 != P) fail("shard " $5 " not P / N")
          if ($6 != 4 * P / $1 || $7 != 4 * P / $1) fail("parameter or gradient bytes " $6 ", " $7 " not 4 P / N")
          if ($8 < $9 || $8 > 1.015 * $9) fail("optimizer bytes " $8 " not within 1.5% above " $9)
        } else fail("mode " $12)
        if ($3 == "AdamW" && $8 != 8 * $5) fail("AdamW state " $8 " != 8 x its " $5 " parameters")
        state[$1, $12, $3] += $8; shard[$1, $12, $3] += $5
      }
      END {
        if (rows != 12) { print "FAIL (sharded_ladder): " rows " rows, not 12"; bad = 1 }
        split("AdamW AdamW8bit", os, " ")
        for (i in os) {
          if (state[1, "zero1", os[i]] != state[2, "zero1", os[i]] || shard[2, "zero1", os[i]] != shard[1, "zero1", os[i]]) {
            print "FAIL (sharded_ladder): " os[i] ": the 2 ranks hold " state[2, "zero1", os[i]] " bytes, one process " state[1, "zero1", os[i]]
            bad = 1
          }
          if (state[1, "zero1", os[i]] <= 0 || state[1, "fully", os[i]] <= 0) { print "FAIL (sharded_ladder): no state"; bad = 1 }
        }
        exit bad
      }' sharded.csv || fail "per-rank bytes"
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
    grep -qE '^low_bit_transformer: LibTorch [0-9]+\.[0-9]+, [0-9]+ parameters, 30 steps, batch 32, seed 0, each also with its blocks checkpointed$' \
      out.txt || fail "header line"
    num='[0-9]+\.[0-9]+'
    for o in AdamW AdamW8bit AdamW4bit; do
      line="final loss $num \([+-][0-9.]+% vs AdamW\), [0-9.]+ state bytes/param, [0-9]+ activation bytes/step, $num ms/step \([+-][0-9.]+% vs AdamW\)"
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
    if "$bin" --seed=x >bad.txt 2>&1; then fail "--seed=x accepted"; fi
    grep -q "amp: low_bit_transformer's --seed must be" bad.txt || fail "bad --seed message"
    if "$bin" --batch=0 >bad.txt 2>&1; then fail "--batch=0 accepted"; fi
    grep -q "amp: low_bit_transformer's --batch must be an integer in \[1, 4096\]" bad.txt || fail "bad --batch message"
    # --precision takes amp::dispatch_precision's strings, all checked before any training.
    if "$bin" --precision=fp17 >bad.txt 2>&1; then fail "--precision=fp17 accepted"; fi
    grep -q 'amp: unknown precision "fp17"; valid: .*mxfp8-floor, nvfp4-sr' bad.txt || fail "bad --precision message"
    if grep -q "final loss" bad.txt; then fail "trained before rejecting --precision=fp17"; fi
    ;;
  *)
    "$bin" >out.txt 2>&1 || { cat out.txt; fail "exit code"; }
    cat out.txt
    ;;
esac
echo "PASS: $name"
