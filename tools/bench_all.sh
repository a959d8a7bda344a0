#!/usr/bin/env bash
# Regenerates docs/BENCHMARKS.md: kernel microbenchmarks and `kt-jit bench` for every built method
# (1 thread, the primary figure, and 2 threads for INT8), each against the limits measured in the
# same process, with torch and, where installed (tools/peers/setup_peers.sh), kt-kernel and oneDNN
# as peers in the same run. Takes about 15 minutes on a 2-core machine without the kt-kernel and
# oneDNN peers (they add their own runs); run it on a quiet machine.
#   bash tools/bench_all.sh            (needs the package installed and build/ configured)
#   PEERS=0 bash tools/bench_all.sh    (torch as the only peer)
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
(cd /tmp && "$PYTHON" -m kt_jit.bench_scaling --markdown "$tmp/scaling.md" >/dev/null)
kernels "$isa" >"$tmp/kernels.txt"
[ "$isa" != "avx2" ] && kernels avx2 >>"$tmp/kernels.txt"

# Peers beside torch (bench only; bash tools/peers/setup_peers.sh installs them): kt-kernel from
# PyPI in its own venv and oneDNN matmul. Each is left out when not installed; PEERS=0 leaves both
# out. With oneDNN, the int8 and bf16 runs add T = BIG_T (4096: 256 rows per expert, oneDNN's
# M = 256 check; BIG_T= to skip).
KTK_PYTHON="${KTK_PYTHON:-/opt/ktk-venv/bin/python}"
BIG_T="${BIG_T-4096}"
peers=()
if [ "${PEERS:-1}" != 0 ]; then
  [ -x "$KTK_PYTHON" ] && peers+=(--ktkernel-peer "$KTK_PYTHON")
  [ -f /usr/include/oneapi/dnnl/dnnl.hpp ] && command -v g++ >/dev/null && peers+=(--onednn-peer)
  [ ${#peers[@]} -gt 0 ] && peers+=(--peers-dir "$PWD/tools/peers")
fi
for m in AMXINT8 AMXINT4 BF16 FP8; do
  extra=()
  case " ${peers[*]-} " in
  *" --onednn-peer "*) [ -n "$BIG_T" ] && [[ $m == AMXINT8 || $m == BF16 ]] &&
    extra=(--tokens "1,4,16,64,256,1024,$BIG_T") ;;
  esac
  (cd /tmp && "$PYTHON" -m kt_jit.bench --method "$m" --torch-peer ${peers[@]+"${peers[@]}"} \
    ${extra[@]+"${extra[@]}"} --markdown "$tmp/$m.md" >/dev/null)
done
(cd /tmp && "$PYTHON" -m kt_jit.bench --method AMXINT8 --threads 2 --markdown "$tmp/2t.md" >/dev/null)
# Checkpoint formats on the Qwen3 shape: GGUF types (decode and prefill), the k-group INT4 and MX.
extra_runs=()
# llama.cpp (ggml-cpu) as the GGUF runs' peer where tools/peers/setup_peers.sh built it.
GGML_PREFIX="${GGML_PREFIX:-/opt/ggml-peer}"
lcpp=()
[ "${PEERS:-1}" != 0 ] && [ -f "$GGML_PREFIX/include/ggml.h" ] &&
  lcpp=(--llamacpp-peer "$GGML_PREFIX" --peers-dir "$PWD/tools/peers")
# (T = 256 too, as for MX below: Q4_K's prefill bar holds from 256 tokens)
for g in Q4_K Q6_K Q8_0 Q4_K_M; do
  (cd /tmp && "$PYTHON" -m kt_jit.bench --method LLAMAFILE --gguf-type "$g" --tokens 1,4,64,256,1024 \
    ${lcpp[@]+"${lcpp[@]}"} --markdown "$tmp/gguf_$g.md" >/dev/null)
  extra_runs+=("gguf_$g")
done
# (T = 256 too: issue #5's prefill bar holds from 256 tokens, and MXFP4 at 256 was not measured
# in the full runs before 2026-11-29)
for m in RAWINT4 MXFP4 MXFP8; do
  (cd /tmp && "$PYTHON" -m kt_jit.bench --method "$m" --tokens 1,4,64,256,1024 \
    --markdown "$tmp/$m.md" >/dev/null)
  extra_runs+=("$m")
done
# DeepSeek-V3's expert shape (a 32-expert subset; 2 layers already stream 8 x 44 MB per forward).
for m in AMXINT8 AMXINT4 BF16 FP8 MXFP4; do
  (cd /tmp && "$PYTHON" -m kt_jit.bench --method "$m" --shape deepseek-v3 --layers 2 \
    --tokens 1,4 --markdown "$tmp/ds_$m.md" >/dev/null)
  extra_runs+=("ds_$m")
done

{
  cat docs/benchmarks_intro.md
  echo
  echo "## Scaling: kernel generation, cache hits, resident memory"
  echo
  echo 'Command: `python -m kt_jit.bench_scaling` (run by `tools/bench_all.sh`).'
  echo
  sed 's/^## /### /' "$tmp/scaling.md"
  echo
  echo "## Kernels alone (weights hot in L2/L3, one thread)"
  echo
  echo 'Command: `bash tools/bench_all.sh` (it runs `build/ktjit_kernel_bench ISA M N K EPILOGUE`).'
  echo
  echo '```'
  cat "$tmp/kernels.txt"
  echo '```'
  for f in AMXINT8 AMXINT4 BF16 FP8 2t "${extra_runs[@]}"; do
    echo
    sed 's/^# kt-jit MoE benchmark/## MoE layer/' "$tmp/$f.md"
  done
  # Sections measured by other means (their own commands and machines are inside): the serving
  # overhead (python -m kt_jit.bench_overhead, three runs), the 2026-11-22 Xeon's decode spot
  # runs, the lent AMX host, the 2026-11-27 Zen 5 runs, the Zen 4 VM's tables (the top of this
  # file until 2026-11-28) and its runs, and the 2026-11-25 Zen 3 (AVX2 only) runs.
  for f in docs/evidence/serving_overhead.md docs/evidence/xeon_decode_spot.md \
    docs/evidence/amx_host.md docs/evidence/zen5_avx512.md docs/evidence/zen4_tables.md \
    docs/evidence/zen4_avx512.md docs/evidence/zen3_avx2.md; do
    echo
    cat "$f"
  done
} >"$OUT"
echo "wrote $OUT"
