# Bookkeeping shared by the emulation scripts (run_haswell.sh, run_aarch64.sh,
# run_aarch64_python.sh). Source it after setting EMU_TAG, the prefix of every line it prints.
# Every script ends with "$EMU_TAG: N passed, M failed" and a non-zero status on any failure.

passed=0
failed=0
t_start=$(date +%s)

finish() {
    echo "$EMU_TAG: total $(($(date +%s) - t_start)) s"
    echo "$EMU_TAG: ${passed} passed, ${failed} failed"
    [ "$failed" -eq 0 ] && [ "$passed" -gt 0 ]
    exit $?
}

fail() {  # message: one failure, then the summary
    echo "$EMU_TAG: $1" >&2
    failed=$((failed + 1))
    finish
}

# tally RC WHAT KIND: adds ok / bad (set by the caller) to the totals; a non-zero status without a
# reported failure (a crash: 132 = SIGILL ends a run without a FAILED line) or a clean run of
# nothing counts as one more failure.
tally() {
    local rc="$1" what="$2" kind="$3"
    passed=$((passed + ok))
    failed=$((failed + bad))
    if [ "$rc" -ne 0 ] && [ "$bad" -eq 0 ]; then
        echo "$EMU_TAG: $what exited with status $rc (signal $((rc > 128 ? rc - 128 : 0)))" \
             "without reporting a failed $kind"
        failed=$((failed + 1))
    fi
    if [ "$rc" -eq 0 ] && [ "$ok" -eq 0 ]; then
        echo "$EMU_TAG: no $kind ran ($what)"
        failed=$((failed + 1))
    fi
}

# count_gtest LOG STATUS WHAT: a GoogleTest run's OK / FAILED lines into the totals (tally). Leaves
# ok, bad and skipped for the caller's summary line.
count_gtest() {
    ok=$(grep -cE '^\[ +OK \] .*\([0-9]+ ms\)' "$1" || true)
    bad=$(grep -cE '^\[ +FAILED +\] .*\([0-9]+ ms\)' "$1" || true)
    skipped=$(grep -cE '^\[ +SKIPPED +\] .*\([0-9]+ ms\)' "$1" || true)
    tally "$2" "$3" "GoogleTest test"
}

# count_checks LOG STATUS WHAT: the same for a smoke test's PASS / FAIL lines (ok, bad left set).
count_checks() {
    ok=$(grep -c '^PASS ' "$1" || true)
    bad=$(grep -c '^FAIL ' "$1" || true)
    tally "$2" "$3" "smoke check"
}

# count_pytest LOG STATUS WHAT: the same for a pytest run, read off its summary line ("N failed,
# M passed, K skipped in T s"; errors count as failures). Leaves ok, bad and skipped set.
count_pytest() {
    local line n
    line=$(grep -E '[0-9]+ (passed|failed|error)' "$1" | tail -1)
    num() { n=$(echo "$line" | grep -oE "[0-9]+ $1" | grep -oE '[0-9]+' | head -1); echo "${n:-0}"; }
    ok=$(num passed)
    bad=$(($(num failed) + $(num error)))
    skipped=$(num skipped)
    tally "$2" "$3" "pytest test"
}
