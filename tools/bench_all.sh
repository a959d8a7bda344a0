#!/usr/bin/env bash
# Regenerates docs/BENCHMARKS.md: kernel microbenchmarks and `kt-jit bench` for every built method
# (1 thread, the primary figure, and 2 threads for INT8), each against the limits measured in the
# same process. Takes about 15 minutes on a 2-core machine; run it on a quiet machine.
#   bash tools/bench_all.sh            (needs the package installed and build/ configured)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-docs/BENCHMARKS.md}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

cmake --build build --target ktjit_kernel_bench >/dev/null
kernels() {
  local isa=$1
  for spec in "60 256 2048 store" "60 1536 2048 siluup" "60 2048 768 accum"; do
    # shellcheck disable=SC2086
    build/ktjit_kernel_bench "$isa" $spec
  done
}
isa=$("$PYTHON" -c "from kt_jit import _core; print(_core.isa())")
kernels "$isa" >"$tmp/kernels.txt"
[ "$isa" != "avx2" ] && kernels avx2 >>"$tmp/kernels.txt"

for m in AMXINT8 AMXINT4 BF16 FP8; do
  (cd /tmp && "$PYTHON" -m kt_jit.bench --method "$m" --torch-peer --markdown "$tmp/$m.md" >/dev/null)
done
(cd /tmp && "$PYTHON" -m kt_jit.bench --method AMXINT8 --threads 2 --markdown "$tmp/2t.md" >/dev/null)

{
  cat docs/benchmarks_intro.md
  echo
  echo "## Kernels alone (weights hot in L2/L3, one thread)"
  echo
  echo 'Command: `bash tools/bench_all.sh` (it runs `build/ktjit_kernel_bench ISA M N K EPILOGUE`).'
  echo
  echo '```'
  cat "$tmp/kernels.txt"
  echo '```'
  for f in AMXINT8 AMXINT4 BF16 FP8 2t; do
    echo
    sed 's/^# kt-jit MoE benchmark/## MoE layer/' "$tmp/$f.md"
  done
} >"$OUT"
echo "wrote $OUT"
