#!/usr/bin/env bash
# The H200 figures a change must hold, for the current tree and a base tree one after the
# other on one machine: offline throughput and the batch-256 decode step (gpu_e2e.py --no-hf,
# Llama-3.1-8B shapes) and structured outputs against unconstrained (structured.py, SmolLM2 and
# 8B shapes).
#   BASE=.base TOKENIZER=.tok bash benchmarks/h200_recheck.sh   # BASE: `git archive REV engine
#   chatgate_kernels benchmarks | tar -x -C .base`; TOKENIZER: SmolLM2's tokenizer folder;
#   E2E=0 or STRUCTURED=0 leaves that part out
set -uo pipefail
out=${OUT:-benchmarks/out}/h200_recheck; mkdir -p "$out"
run() {  # run <label> <tree> <script args...>
  local label=$1 tree=$2; shift 2
  echo "== $label: $*"
  (cd "$tree" && PYTHONUNBUFFERED=1 TQDM_DISABLE=1 python3 "$@") >"$out/$label.txt" 2>&1
  echo "rc $?"; tail -n 14 "$out/$label.txt"
}
e2e=(benchmarks/gpu_e2e.py --no-hf --no-fp32-check)
if [ "${E2E:-1}" != 0 ]; then
  run e2e_new . "${e2e[@]}" --out /tmp/e2e
  run e2e_base "$BASE" "${e2e[@]}"  # (its own default output folder)
fi
# structured outputs: the trees in turn, base first then new first, so that what runs first on
# a fresh machine (grammar and kernel caches, clocks) weighs on both alike
tok=$(realpath "$TOKENIZER")
orders=("base:$BASE new:." "new:. base:$BASE")
[ "${STRUCTURED:-1}" = 0 ] && orders=()
for order in "${orders[@]}"; do
  round=$(( ${round:-0} + 1 ))
  for tree in $order; do
    run "structured_smollm2_${tree%%:*}_$round" "${tree#*:}" benchmarks/structured.py \
      --device cuda --dtype bfloat16 --repeat 5 --model dummy:smollm2-135m --tokenizer "$tok" \
      --out /tmp/st
    run "structured_llama8b_${tree%%:*}_$round" "${tree#*:}" benchmarks/structured.py \
      --device cuda --dtype bfloat16 --repeat 2 --model dummy:llama-3.1-8b --tokenizer "$tok" \
      --out /tmp/st
  done
done
