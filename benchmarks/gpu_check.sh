#!/usr/bin/env bash
# The prepared device check: the engine's tests on the device, then one speed table
# (benchmarks/gpu_check.py). Needs torch, transformers, pytest and hypothesis; nothing is downloaded.
#
#   bash benchmarks/gpu_check.sh                          # CUDA, a random ~1.1B Llama (target: < 8 minutes on one H200)
#   bash benchmarks/gpu_check.sh --device cpu --tiny      # the same steps on a CPU at tiny sizes
#
# Writes its logs and gpu_check.json to $OUT (default ./gpu_check_out). Exits non-zero when a test fails.
# The tests stop after TESTS_TIMEOUT_S seconds (default 300), so that the speed table still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
device=cuda
tiny=()
while [ $# -gt 0 ]; do
    case "$1" in
        --device) device="$2"; shift 2 ;;
        --tiny) tiny=(--tiny); shift ;;
        *) echo "gpu_check.sh: unknown argument $1 (--device DEVICE, --tiny)" >&2; exit 2 ;;
    esac
done
out=$(realpath -m "${OUT:-gpu_check_out}")
mkdir -p "$out"
repo=$PWD
run_in=$repo  # where pytest starts: with the links, a folder outside the checkout (whose specbatch/ alone is not
              # the whole package)
plugin=()     # specbatch's pytest plugin: registered by the install, named by hand with the links

# specbatch from this checkout: installed if it can be (no index, no build isolation), else a folder of links
# that lays the checkout out as the package (the design card's folders are specbatch's sub-packages)
if ! python3 -c "import specbatch.fast.backend" 2>/dev/null; then
    if ! python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$out/install.log" 2>&1; then
        site=$(mktemp -d)
        mkdir "$site/specbatch"
        ln -s "$repo"/specbatch/* "$site/specbatch/"
        for sub in fast reference invariants; do ln -s "$repo/$sub" "$site/specbatch/$sub"; done
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
        plugin=(-p specbatch.testing)
        run_in=$site
    fi
fi

# the engine's tests on the device: the modules of tests/conftest.py's DEVICE_MODULES, default profile
start=$(date +%s)
modules=()
for name in backend fast_engine bfloat16 sampling invariants proposals conform; do modules+=("$repo/tests/test_$name.py"); done
(cd "$run_in" && timeout "${TESTS_TIMEOUT_S:-300}" python3 -m pytest -q -p no:cacheprovider "${plugin[@]}" --rootdir "$repo" --device "$device" --maxfail=20 \
    "${modules[@]}") >"$out/tests.log" 2>&1
tests=$?
echo "device tests: exit $tests in $(( $(date +%s) - start )) s ($out/tests.log)"
tail -n 3 "$out/tests.log"

python3 "$repo/benchmarks/gpu_check.py" --device "$device" "${tiny[@]}" --tests-log "$out/tests.log" \
    --out "$out/gpu_check.json" | tee "$out/gpu_check.md"
speed=${PIPESTATUS[0]}
echo "total: $(( $(date +%s) - start )) s"
[ "$tests" -eq 0 ] && [ "$speed" -eq 0 ]
