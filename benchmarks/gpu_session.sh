#!/usr/bin/env bash
# Every GPU-only claim of evendp checked in one call on a lent GPU machine (no network; its
# own torch, rich, matplotlib, nvidia-ml-py, pytest, hypothesis, transformers). evendp runs
# from this working tree (PYTHONPATH=src, nothing installed). Each step has its own time
# limit and the whole run stays under 5 minutes; a failing step is recorded, the rest run.
#
#   bash benchmarks/gpu_session.sh [--out DIR] [--only STEP[,STEP...]] [--dry-run] [--list]
#
# Writes DIR/summary.json (status, figures and note per step) and DIR/logs/STEP.log; DIR is
# --out, else $OUT, else ./gpu-session-out. --dry-run runs the CPU-capable steps on the CPU
# (about a minute; CI does this) and marks the others "skip". The step bodies live in
# benchmarks/gpu_checks.py. Exit status: 0 when no step failed.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# No network there: a library reaching for the Hugging Face hub fails at once, never waits.
export HF_HUB_OFFLINE=1
out=${OUT:-gpu-session-out}
only=""
dry=""
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out=$2; shift 2 ;;
        --only) only=$2; shift 2 ;;
        --dry-run) dry="--dry-run"; shift ;;
        --list) "$PY" benchmarks/gpu_checks.py list; exit 0 ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "gpu_session.sh: unknown argument '$1'; see --help" >&2; exit 2 ;;
    esac
done

# step:seconds:where, or step+step+...:seconds:where for quick steps run in one process (a
# torch and CUDA start-up, about 5 s on the H200, is more than each of them takes). The limits
# add up to more than the total budget; the budget guard below skips what is left once TOTAL_S
# is spent, so one slow step cannot overrun the lease.
# "cpu" steps also run in the dry run, all in one process (one torch start-up, one limit);
# capped-batch and step-costs import their script there and report "skip": their figures
# need the GPU; mixed-box runs mixed_box.py --smoke (two CPU ranks, a tiny GPT-2). They run
# early: the issue-50 claims come first.
STEPS="env:30:cpu gpu-tests:75:gpu capped-batch:100:cpu mixed-box:90:cpu step-costs:75:cpu
planner-allocator:45:cpu planner-allocator-expandable:45:cpu
exact-repeated+autocast-streams+cuda-events:45:cpu weights-auto+oom-resplit+nvml-vs-cuda:60:gpu
nccl-one-rank:30:gpu gloo-cuda-tensors+grad-buckets:60:cpu overhead:45:gpu
demo+integration:60:cpu"
TOTAL_S=${TOTAL_S:-285}
DRY_LIMIT_S=${DRY_LIMIT_S:-200}

known=$("$PY" benchmarks/gpu_checks.py list) || { echo "cannot run $PY" >&2; exit 2; }
if [ -n "$only" ]; then
    for s in ${only//,/ }; do
        case " $known " in *" $s "*) ;; *) echo "unknown step '$s'; steps: $known" >&2; exit 2 ;; esac
    done
fi

mkdir -p "$out/logs" "$out/steps"
selected() {  # is step $1 asked for (all, or listed in --only)?
    [ -z "$only" ] && return 0
    case ",$only," in *",$1,"*) return 0 ;; esac
    return 1
}
codes=""
start=$(date +%s)
if [ -n "$dry" ]; then
    batch=""
    for entry in $STEPS; do
        group=${entry%%:*}; where=${entry##*:}
        for step in ${group//+/ }; do
            selected "$step" || continue
            rm -f "$out/steps/$step.json"
            if [ "$where" = cpu ]; then
                batch="$batch,$step"
            else
                echo '{"status": "skip", "figures": {}, "note": "GPU only (dry run)"}' \
                    > "$out/steps/$step.json"
                echo "dry run: GPU only" > "$out/logs/$step.log"
            fi
        done
    done
    if [ -n "$batch" ]; then
        echo "== dry run: ${batch#,} (one process, limit ${DRY_LIMIT_S}s)"
        timeout -k 5 "$DRY_LIMIT_S" "$PY" benchmarks/gpu_checks.py run "${batch#,}" \
            --out "$out" --dry-run > "$out/logs/dry-run.log" 2>&1
        rc=$?
        for step in ${batch//,/ }; do
            cp "$out/logs/dry-run.log" "$out/logs/$step.log"
            codes="$codes,$step=$rc"
        done
        grep -E '^[a-z-]+: (pass|fail|skip)' "$out/logs/dry-run.log"
    fi
else
    for entry in $STEPS; do
        group=${entry%%:*}
        limit=${entry#*:}; limit=${limit%%:*}
        names=""
        for step in ${group//+/ }; do
            selected "$step" && names="$names,$step"
        done
        names=${names#,}
        [ -z "$names" ] && continue
        left=$(( TOTAL_S - ($(date +%s) - start) ))
        for step in ${names//,/ }; do
            rm -f "$out/steps/$step.json"
            if [ "$left" -lt 10 ]; then
                echo "== $step: not run, the ${TOTAL_S}s budget is spent" | tee "$out/logs/$step.log"
                codes="$codes,$step=budget"
            fi
        done
        [ "$left" -lt 10 ] && continue
        [ "$limit" -gt "$left" ] && limit=$left
        echo "== $names (limit ${limit}s)"
        log="$out/logs/${names%%,*}.log"
        timeout -k 5 "$limit" "$PY" benchmarks/gpu_checks.py run "$names" --out "$out" \
            > "$log" 2>&1
        rc=$?
        for step in ${names//,/ }; do
            [ "$out/logs/$step.log" = "$log" ] || cp "$log" "$out/logs/$step.log"
            codes="$codes,$step=$rc"
        done
        grep -E '^[a-z-]+: (pass|fail|skip)' "$log"
    done
fi
echo "== summary ($(( $(date +%s) - start ))s)"
"$PY" benchmarks/gpu_checks.py summarize --out "$out" $dry --codes "${codes#,}"
