#!/usr/bin/env bash
# Prefix caching on vs off, as a client sees it: `metroserve bench serve` on the shared-prefix
# dataset against `metroserve serve` (default model) once per setting and concurrency, each run on
# a freshly started server so that no run finds what an earlier one cached. Writes one JSON per
# run, the comparison table (compare.md) and plots (compare.png, latency CDFs) into OUT_DIR.
#
#   bash benchmarks/prefix_caching.sh [OUT_DIR]   (default benchmarks/results/prefix_caching)
#
# Environment: CONCURRENCY (default "1 4 16"), PREFIXES (4), SUFFIXES (16), PREFIX_LEN (512),
# SUFFIX_LEN (32), OUTPUT_LEN (32), PORT (first of five loopback ports, default 18600).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/prefix_caching}
CONCURRENCY=${CONCURRENCY:-"1 4 16"}
PORT=${PORT:-18600}
MS=.venv/bin/metroserve
mkdir -p "$OUT"

wait_healthy() {  # $1: pid of serve
    for _ in $(seq 600); do
        kill -0 "$1" 2>/dev/null || { echo "serve exited; see $OUT/serve.log" >&2; exit 1; }
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
        sleep 0.5
    done
    echo "serve did not become ready" >&2
    exit 1
}

for caching in on off; do
    for c in $CONCURRENCY; do
        "$MS" serve "--$([ "$caching" = on ] || echo no-)enable-prefix-caching" --port "$PORT" \
            --grpc-port $((PORT + 1)) --scheduler-port $((PORT + 2)) --metrics-port $((PORT + 3)) \
            --max-num-seqs 16 --kv-cache-memory 1GiB >"$OUT/serve.log" 2>&1 &
        pid=$!
        wait_healthy "$pid"
        "$MS" bench serve --base-url "http://127.0.0.1:$PORT" --metrics-url "http://127.0.0.1:$((PORT + 4))/metrics" \
            --dataset shared-prefix --num-prefixes "${PREFIXES:-4}" --suffixes-per-prefix "${SUFFIXES:-16}" \
            --prefix-len "${PREFIX_LEN:-512}" --suffix-len "${SUFFIX_LEN:-32}" --output-len "${OUTPUT_LEN:-32}" \
            --max-concurrency "$c" --goodput ttft:1000 --label "prefix-caching-$caching" \
            --result-json "$OUT/caching-$caching-c$c.json" --plot-dir "$OUT/c$c"
        kill -TERM "$pid"
        wait "$pid" || true
    done
done
reports=()
for caching in on off; do
    for c in $CONCURRENCY; do reports+=("$OUT/caching-$caching-c$c.json"); done
done
"$MS" bench serve --compare "${reports[@]}" --plot-dir "$OUT"
