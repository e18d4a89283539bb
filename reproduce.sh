#!/usr/bin/env bash
# actwave: the commands.
#   ./reproduce.sh [--profile smoke|cpu|gpu] [--only NN[,NN...]] [--model ID]
#       set up .venv, then run the profile's numbered notebooks in order with papermill
#   ./reproduce.sh --compare [--profile NAME]
#       compare the tables in results/<profile>/ with the committed ones (README: tolerances)
#   ./reproduce.sh lab [jupyter lab options...]
#       set up .venv, then open notebooks/ in JupyterLab (README: "Open and tweak")
#   ./reproduce.sh test [pytest args...]
#       set up .venv, then run the test suite
#   ./reproduce.sh bench [run_all.py args...]
#       set up .venv, train (or resume) the benchmark draft on the pooled text, then run every
#       benchmark into results/benchmarks/ (docs/BENCHMARKS.md; ~3–4 h on 2 idle cores)
set -euo pipefail
cd "$(dirname "$0")"

refuse() { echo "reproduce.sh: $*" >&2; exit 2; }
PROFILE=cpu
ONLY=""
MODEL=""
MODE=run
case "${1:-}" in test|lab|bench) MODE=$1; shift ;; esac
if [[ $MODE == run ]]; then
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --profile|--only|--model)
        # An option's value is required; a following option is not a value.
        [[ $# -ge 2 && -n $2 && $2 != -* ]] || refuse "$1 needs a value (see ./reproduce.sh --help)"
        case "$1" in --profile) PROFILE=$2 ;; --only) ONLY=$2 ;; --model) MODEL=$2 ;; esac
        shift 2 ;;
      --compare) MODE=compare; shift ;;
      -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
      *) refuse "unknown argument: $1 (see ./reproduce.sh --help)" ;;
    esac
  done
  if [[ $MODE == compare && -n $ONLY$MODEL ]]; then
    refuse "--compare takes only --profile"
  fi
fi

# --- environment: create .venv once; reinstall only when the requirements change ---------
PY=.venv/bin/python
stamp_now=$(cat requirements.txt requirements-assets.txt pyproject.toml | sha256sum | cut -c1-16)
if [[ ! -x $PY ]]; then
  echo "[setup] creating .venv"
  python3 -m venv .venv
fi
if [[ "$(cat .venv/.actwave-stamp 2>/dev/null)" != "$stamp_now" ]]; then
  echo "[setup] installing pinned requirements (a few minutes, once)"
  $PY -m pip install -q --disable-pip-version-check -r requirements.txt
  $PY -m pip install -q --disable-pip-version-check --no-deps -r requirements-assets.txt
  $PY -m pip install -q --disable-pip-version-check --no-deps -e .
  echo "$stamp_now" > .venv/.actwave-stamp
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false MPLBACKEND=Agg PYTHONHASHSEED=0
export TQDM_MININTERVAL=${TQDM_MININTERVAL:-30} SOURCE_DATE_EPOCH=0

case $MODE in
  test) exec $PY -m pytest -q "$@" ;;
  # Figures inline in JupyterLab: no MPLBACKEND. .py notebooks open as notebooks by default
  # (jupyter/lab-settings/overrides.json5); jupytext.toml says how they are saved back.
  lab) exec env -u MPLBACKEND -u TQDM_MININTERVAL $PY -m jupyter lab --ServerApp.root_dir=. --LabApp.default_url=/lab/tree/notebooks \
         --LabApp.app_settings_dir=jupyter/lab-settings \
         --KernelManager.transport_encryption=required "$@" ;;
  compare) exec $PY -m actwave.tools.compare --profile "$PROFILE" ;;
  bench) $PY benchmarks/train_draft.py && exec $PY benchmarks/run_all.py "$@" ;;
esac

# --- notebooks: refuse a bad profile, --only or --model before anything runs --------------
plan=$($PY -m actwave.tools.runplan notebooks --profile "$PROFILE" --only "$ONLY" \
         --model "$MODEL") || exit 2
OUT="results/$PROFILE"
mkdir -p "$OUT"
# Only the cpu profile regenerates the committed figures/; others keep theirs beside results.
if [[ $PROFILE != cpu ]]; then export ACTWAVE_FIGURES="$OUT/figures"; fi
for src in $plan; do
  name=$(basename "$src" .py)
  echo "[$(date +%H:%M:%S)] $name ($PROFILE): $(sed -n 's/^# # //p' "$src" | head -1)"
  start=$(date +%s)
  # steplog appends wall time, peak memory of the process tree and cache size to steps.tsv
  $PY -m actwave.tools.steplog "$OUT/steps.tsv" "$name" -- \
    $PY -m actwave.tools.runplan run "$src" --profile "$PROFILE" --model "$MODEL"
  echo "[$(date +%H:%M:%S)] $name done in $(( $(date +%s) - start )) s"
done
echo "done: executed notebooks in $OUT/, figures in ${ACTWAVE_FIGURES:-figures}/," \
     "cost per step in $OUT/steps.tsv"
