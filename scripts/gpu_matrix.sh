#!/usr/bin/env bash
# The CUDA token-equivalence run, stage by stage, on a machine with a GPU.
#
#   scripts/gpu_matrix.sh OUTDIR
#   STAGES="env tests glass16" scripts/gpu_matrix.sh OUTDIR      # only these stages, in this order
#
# Stages (default: all, in this order; each stage's wall time goes to OUTDIR/stages.log):
#   env            nvidia-smi, python, torch, CUDA and device name        -> env.txt
#   tests          pytest -q tests/gpu_runner                             -> tests.log
#   cpu            start the CPU matrices in the background (CPU_JOBS single-thread processes,
#                  split by --seed/--workloads), for the summary's CPU columns -> cpu/*.json
#   glass16        glassllm, exact and fast, 16 workloads, --repeat $REPEAT  -> cuda-glass16-{exact,fast}.json
#   glass64        glassllm, exact and fast, 64 workloads                 -> cuda-glass64-*.json
#   smol16         random:like=smollm2, exact and fast, 16 workloads      -> cuda-smol16-*.json
#                  (exact mode on the 30-layer model is launch-bound on a GPU: split it, smol16-exact-s0-n8 ...)
#   smol64         random:like=smollm2, exact and fast, 64 workloads      -> cuda-smol64-*.json
#                  (any of these four also as NAME-exact or NAME-fast: one mode; and NAME-MODE-sSEED-nCOUNT:
#                  one part, e.g. smol16-exact-s0-n8 then smol16-exact-s8-n8; the summary merges parts)
#   hyb16          glassllm with hybrid KV cache groups (--sliding-window $SW, odd layers), exact and fast,
#                  16 workloads (the connector variants included)   -> cuda-hyb16-*.json (not in the default STAGES)
#   cross          exact mode, CUDA against the CPU, baseline tokens (glassllm 16, smollm2 $CROSS_SMOL) -> cross-*.json
#   maxbatch       the largest prefill batch of each model of MAXBATCH_MODELS ("smol"; "smol glass" adds glassllm),
#                  in MAXBATCH_MODES ("fast exact"), prompts of PROMPT_LEN (512) tokens or the model's positions
#                  if fewer (glassllm: 128)                            -> maxbatch-MODEL-MODE.json
#   cpuwait        wait for the background CPU matrices
#   summary        scripts/equivalence_summary.py over what is there (hyb16 included) -> summary.md
#
# Each stage is short enough for one 10-minute command; run the long ones as separate commands
# (e.g. STAGES="env tests glass16", then STAGES="cpu smol16 cpuwait", ...). The background CPU
# jobs only live as long as the command that started them: put "cpuwait" in the same command.
#
# Works from a plain checkout with the wheels in a --target directory: run it from anywhere,
# with PYTHONPATH=/tmp/site (the checkout's root is added). Environment knobs: PYTHON (python3),
# REPEAT (3: repeats of the 16-workload glassllm CUDA matrices), SMOL_REPEAT (1: the smollm2-shape ones), CPU_JOBS (14: leave 2 of 16 cores to the
# GPU process), GPU_THREADS (2), CPU_SETS ("glass64 smol16"), CROSS_SMOL (16), EXTRA (more
# flags for every equivalence run, e.g. --deterministic-algorithms), SW (32: hyb16's sliding window). A rehearsal without a GPU:
# DEVICE=cpu LIMIT=2 (every set cut to 2 workloads).
set -u
OUT=${1:?usage: scripts/gpu_matrix.sh OUTDIR}
MAXBATCH_MODELS=${MAXBATCH_MODELS:-smol}
for m in $MAXBATCH_MODELS; do
  case "$m" in smol|glass) ;; *) echo "scripts/gpu_matrix.sh: MAXBATCH_MODELS: unknown model '$m' (smol, glass)" >&2; exit 2 ;; esac
done
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT" "$OUT/cpu"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT" || exit 2
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$ROOT"
PY=${PYTHON:-python3}
REPEAT=${REPEAT:-3}
SMOL_REPEAT=${SMOL_REPEAT:-1}
CPU_JOBS=${CPU_JOBS:-14}
GPU_THREADS=${GPU_THREADS:-2}
CPU_SETS=${CPU_SETS:-"glass64 smol16"}
CROSS_SMOL=${CROSS_SMOL:-16}
EXTRA=${EXTRA:-}
DEVICE=${DEVICE:-cuda}
STAGES=${STAGES:-"env tests cpu glass16 glass64 smol16 smol64 cross maxbatch cpuwait summary"}
SMOL="random:like=smollm2"
EQ=("$PY" -m schedspec equivalence)

log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/stages.log"; }

model_of() { case "$1" in glass*|hyb*) echo glassllm ;; smol*) echo "$SMOL" ;; esac; }
positions_of() { case "$1" in glass*|hyb*) echo 128 ;; smol*) echo 8192 ;; esac; }  # max_position, held by tests
count_of() { local n="${1//[!0-9]/}"; [ -n "${LIMIT:-}" ] && [ "$n" -gt "$LIMIT" ] && n=$LIMIT; echo "$n"; }

gpu_matrix() {  # NAME MODE [SEED COUNT]: one CUDA matrix, or one part of it
  local name=$1 mode=$2 model n rep=1 seed=${3:-0} f
  model=$(model_of "$name"); n=${4:-$(count_of "$name")}
  [ "$(count_of "$name")" -le 16 ] && rep=$REPEAT
  case "$name" in smol*) rep=$SMOL_REPEAT ;; esac
  f="$OUT/cuda-$name-$mode"; [ -n "${3:-}" ] && f="$f-s$seed-n$n"
  local sw=""; case "$name" in hyb*) sw="--sliding-window ${SW:-32}" ;; esac
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=$GPU_THREADS "${EQ[@]}" --device "$DEVICE" --threads "$GPU_THREADS" --model "$model" --mode "$mode" \
    --seed "$seed" --workloads "$n" --repeat "$rep" --json "$f.json" --png "$f.png" \
    --out "$f.fail" $sw $EXTRA > "$f.txt" 2> "$f.err"
  local rc=$?
  tail -n 4 "$f.txt"
  echo "rc=$rc" >> "$f.txt"
  return 0
}

cpu_parts() {  # one line per CPU part: MODEL MODE SEED COUNT NAME
  local set mode model n step s
  for set in $CPU_SETS; do
    model=$(model_of "$set"); n=$(count_of "$set")
    case "$set" in glass*) step=4 ;; *) step=1 ;; esac
    for mode in exact fast; do
      for ((s = 0; s < n; s += step)); do echo "$model $mode $s $step ${set%%[0-9]*}"; done
    done
  done
}

cpu_part() {  # MODEL MODE SEED COUNT NAME: one single-thread CPU matrix part
  local f="$OUT/cpu/cpu-$5-$2-s$3-n$4"
  CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 "$PY" -m schedspec equivalence --device cpu --threads 1 --model "$1" --mode "$2" --seed "$3" \
    --workloads "$4" --json "$f.json" --out "$f.fail" $EXTRA > "$f.txt" 2> "$f.err"
  echo "rc=$?" >> "$f.txt"
}
export -f cpu_part
export OUT EXTRA PY

stage() {
  local s=$1
  case "$s" in
    env)
      { date -u; uname -a; nvidia-smi || true; nproc; free -g || true
        "$PY" -c 'import sys, torch; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available()); print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")'
        "$PY" -c 'import schedspec, glassllm; print("schedspec", schedspec.__file__); print("glassllm", glassllm.__file__)'
        git -C "$ROOT" rev-parse HEAD 2>/dev/null || true; } > "$OUT/env.txt" 2>&1
      tail -n 4 "$OUT/env.txt" ;;
    tests)
      "$PY" -m pytest -q -p no:cacheprovider tests/gpu_runner > "$OUT/tests.log" 2>&1
      echo "rc=$?" >> "$OUT/tests.log"; tail -n 3 "$OUT/tests.log" ;;
    glass16|glass64|smol16|smol64|hyb16) gpu_matrix "$s" exact; gpu_matrix "$s" fast ;;
    glass16-*-s*-n*|glass64-*-s*-n*|smol16-*-s*-n*|smol64-*-s*-n*|hyb16-*-s*-n*)
      IFS=- read -r name mode sd nn <<< "$s"; gpu_matrix "$name" "$mode" "${sd#s}" "${nn#n}" ;;
    glass16-*|glass64-*|smol16-*|smol64-*|hyb16-*) gpu_matrix "${s%-*}" "${s##*-}" ;;
    cpu)
      cpu_parts > "$OUT/cpu/parts.txt"
      # shellcheck disable=SC2016
      nohup xargs -P "$CPU_JOBS" -L 1 bash -c 'cpu_part "$@"' _ < "$OUT/cpu/parts.txt" > "$OUT/cpu/xargs.log" 2>&1 &
      echo $! > "$OUT/cpu/pid"
      echo "$(wc -l < "$OUT/cpu/parts.txt") CPU parts started in $CPU_JOBS processes (pid $(cat "$OUT/cpu/pid"))" ;;
    cpuwait)
      if [ -f "$OUT/cpu/pid" ]; then
        local pid; pid=$(cat "$OUT/cpu/pid")
        while kill -0 "$pid" 2>/dev/null; do sleep 5; done
      fi
      echo "$(ls "$OUT"/cpu/*.json 2>/dev/null | wc -l) CPU parts done; failed: $(grep -L 'rc=0' "$OUT"/cpu/*.txt 2>/dev/null | wc -l)" ;;
    cross)
      OMP_NUM_THREADS=$GPU_THREADS "${EQ[@]}" --cross-device cpu --device "$DEVICE" --mode exact --model glassllm --workloads "$(count_of glass16)" \
        --json "$OUT/cross-glass16.json" $EXTRA > "$OUT/cross-glass16.txt" 2> "$OUT/cross-glass16.err"; echo "rc=$?" >> "$OUT/cross-glass16.txt"
      OMP_NUM_THREADS=$GPU_THREADS "${EQ[@]}" --cross-device cpu --device "$DEVICE" --mode exact --model "$SMOL" --workloads "$(count_of "smol$CROSS_SMOL")" \
        --json "$OUT/cross-smol.json" $EXTRA > "$OUT/cross-smol.txt" 2> "$OUT/cross-smol.err"; echo "rc=$?" >> "$OUT/cross-smol.txt"
      tail -n 2 "$OUT/cross-glass16.txt" "$OUT/cross-smol.txt" ;;
    maxbatch)
      local m mode cap len
      for m in $MAXBATCH_MODELS; do
        len=${PROMPT_LEN:-512}; [ "$len" -gt "$(positions_of "$m")" ] && len=$(positions_of "$m")
        for mode in ${MAXBATCH_MODES:-fast exact}; do
          # exact mode's fixed tiles cost ~1 s per 512 tokens with the 30-layer model on an H100: cap its steps
          cap=${MAX_STEP_SECONDS:-30}; [ "$mode" = exact ] && cap=${MAX_STEP_SECONDS_EXACT:-3}
          "${EQ[@]}" --max-batch --device "$DEVICE" --mode "$mode" --model "$(model_of "$m")" --prompt-len "$len" \
            --max-batch-tokens "${MAX_BATCH_TOKENS:-262144}" --max-step-seconds "$cap" \
            --json "$OUT/maxbatch-$m-$mode.json" $EXTRA > "$OUT/maxbatch-$m-$mode.txt" 2> "$OUT/maxbatch-$m-$mode.err"
          echo "rc=$?" >> "$OUT/maxbatch-$m-$mode.txt"; tail -n 2 "$OUT/maxbatch-$m-$mode.txt"
        done
      done ;;
    summary)
      local set model cpu_files
      : > "$OUT/summary.md"
      for set in glass16 glass64 smol16 smol64 hyb16; do
        ls "$OUT"/cuda-"$set"-*.json > /dev/null 2>&1 || continue
        n=$(count_of "$set")
        cpu_files=$(ls "$OUT"/cpu/cpu-"${set%%[0-9]*}"-*.json 2>/dev/null | while read -r f; do
          s=${f##*-s}; s=${s%%-n*}; [ "$s" -lt "$n" ] && echo "$f"; done)
        echo "## $set" >> "$OUT/summary.md"
        # shellcheck disable=SC2086
        "$PY" scripts/equivalence_summary.py "$OUT"/cuda-"$set"-*.json $cpu_files >> "$OUT/summary.md" 2>> "$OUT/summary.err"
      done
      ls "$OUT"/cross-*.json "$OUT"/maxbatch-*.json > /dev/null 2>&1 && { echo "## cross-device and largest batch" >> "$OUT/summary.md"
        "$PY" scripts/equivalence_summary.py "$OUT"/cross-*.json "$OUT"/maxbatch-*.json >> "$OUT/summary.md" 2>> "$OUT/summary.err"; }
      cat "$OUT/summary.md" ;;
    *) log "unknown stage $s"; return 2 ;;
  esac
}

for s in $STAGES; do
  t0=$(date +%s)
  log "stage $s: start"
  stage "$s"
  log "stage $s: done in $(( $(date +%s) - t0 )) s"
done
