#!/usr/bin/env bash
# The conformance study on one GPU machine (docs/metrics.md, the conformance check): the check of
# llama3_8b's config_H200x1x1 alone, on the correct alternatives and under each defect, one JSON
# verdict each in $OUT/conformance, then a table. Run from the project root after the wheels
# are installed as docs/gpu-runs.md says. VARIANTS picks the checks (in that order), EACH_S bounds
# each, DEADLINE_S (seconds since the start) skips the checks not started by then.
set -uo pipefail
mkdir -p "$OUT/conformance"
C="run_benchmarks/start_task.py --conformance --vendor nvidia --python python3 --case_name llama3_8b:megatron:H200:1:1 --recipe short --no-cache --json"
run() {  # NAME ARGS...
  local name=$1
  shift
  local t0=$SECONDS
  timeout ${EACH_S:-200} python3 $C "$@" > "$OUT/conformance/$name.json" 2> "$OUT/conformance/$name.err"
  echo "$name rc=$? $((SECONDS - t0)) s" >> "$OUT/conformance/times.txt"
}
n=0
for variant in ${VARIANTS:-intact cudnn math flash liger chunked fused_ce times_zero scale_x4 window rope_base qkv_float8}; do
  if [ -n "${DEADLINE_S:-}" ] && [ "$SECONDS" -ge "$DEADLINE_S" ]; then
    wait
    echo "$variant not started: ${DEADLINE_S} s passed" >> "$OUT/conformance/times.txt"
    continue
  fi
  case $variant in
    intact) run intact ;;
    cudnn) run cudnn --set parallel.attention=cudnn ;;
    math) run math --hook examples.alternatives:sdpa_math ;;
    flash) run flash --hook examples.alternatives:sdpa_flash ;;
    liger) run liger --set parallel.fused_elementwise=liger ;;
    chunked) run chunked --set parallel.fused_linear_loss=chunked ;;
    fused_ce) run fused_ce --set parallel.cross_entropy=fused ;;
    times_zero) run times_zero --hook examples.defects:attention_times_zero ;;
    scale_x4) run scale_x4 --hook examples.defects:softmax_scale_x4 ;;
    window) run window --hook examples.defects:attention_window ;;
    rope_base) run rope_base --hook examples.defects:rope_base_off ;;
    qkv_float8) run qkv_float8 --hook examples.defects:qkv_float8 ;;
  esac &
  n=$((n + 1))
  if [ $((n % ${PARALLEL:-1})) -eq 0 ]; then wait; fi  # PARALLEL checks at once (they share the host's cores)
done
wait
python3 - "$OUT/conformance" <<'PY'
import json, pathlib, sys
d = pathlib.Path(sys.argv[1])
print(open(d / "times.txt").read())
for f in sorted(d.glob("*.err")):
    print(f.stem, " | ".join(l for l in f.read_text().splitlines() if l.startswith(("probe:", "reference:")))[-900:])
for f in sorted(d.glob("*.json")):
    try:
        v = json.loads(f.read_text())
    except ValueError:
        print(f"{f.stem:12s} no verdict: {(d / (f.stem + '.err')).read_text().strip().splitlines()[-1:]}")
        continue
    w = v.get("worst") or {}
    if not v.get("probe_s"):
        print("  ", "\n   ".join((d / (f.stem + ".err")).read_text().strip().splitlines()[-3:]))
    print(f"{f.stem:12s} {v['verdict']:7s} probe {v.get('probe_s', 0):5.1f} s ref {v.get('reference_s', 0):5.1f} s check {v.get('check_s', 0):5.1f} s  {v['message'][:150]}")
PY
