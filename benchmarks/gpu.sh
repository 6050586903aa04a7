#!/usr/bin/env bash
# The checks and timings of a CUDA machine, run from the repository root with a Python that has torch (CUDA),
# torchvision, scikit-learn, safetensors, tokenizers, onnx, onnxscript and onnxruntime:
#   1. env:      torch, the GPU, ONNX Runtime's providers, NVML
#   2. tests:    tests/test_cuda.py (fp16/bf16 runs, GPU profiles, schedule across precisions, runtime, text, NVML)
#   3. pipeline: the demo's card on the digits trained on the GPU, its fp16 and bf16 runs, a profile of each,
#                real early exit, schedules across precisions, and a profile with NVML energy
#   4. study:    `anytime experiment precision --quick --device cuda`
#   5. cards:    train the CIFAR-10 cards named in CARDS ("CARD:EPOCHS:RUN[:keep] ...", cards from models/) on the GPU,
#                from the images in $ANYTIME_CIFAR10 or CIFAR10_TAR (a tar of the cifar10 folder); the runs marked
#                keep come back as runs-part-* (a tar without checkpoints, in 15 MiB pieces: cat them to unpack),
#                the others as their summaries in results.tar.gz
# Logs and a tarball of the results go to $OUT (default results/gpu); each step has its own time limit, so a slow
# step costs only itself, and BUDGET_S (default 3600) caps the whole run: a step gets at most what is left. The
# script exits 1 when a step failed. Usage:
# OUT=DIR bash benchmarks/gpu.sh [step ...] (default: every step). DEVICE=cpu PRECISIONS=bf16 walks the same
# pipeline on a CPU (to check the script itself).
set -u
export OUT=${OUT:-results/gpu} PY=${PYTHON:-python3} WORK=${GPU_WORK:-/tmp/anytime-gpu}
export DEVICE=${DEVICE:-cuda} PRECISIONS=${PRECISIONS:-fp16 bf16} BUDGET_S=${BUDGET_S:-3600}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 ANYTIME_CACHE="$WORK/cache"
anytime() { "$PY" -m anytime "$@"; }

step() {  # step NAME SECONDS FUNCTION: run it with a time limit, log it, pack what it wrote
    local name=$1 limit=$2 start=$SECONDS rc
    ((limit > BUDGET_S - SECONDS - 15)) && limit=$((BUDGET_S - SECONDS - 15))
    ((limit < 10)) && { echo "$name: skipped, the budget is spent" | tee -a "$OUT/steps.txt"; return; }
    echo "== $name (at most ${limit} s)"
    timeout --kill-after=10 "$limit" bash -c "$(declare -f anytime "$3"); $3" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/steps.txt"
    ((rc == 0)) || failed+=("$name")
    tail -n 5 "$OUT/$name.log"
    tar -czf "$OUT/results.tar.gz" -C "$WORK" --exclude=cache --exclude=data --exclude='*.safetensors' --exclude='*.pt' \
        --exclude='*.pt2' --exclude='*.onnx' --exclude=outputs . 2>/dev/null
}

env_step() {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    "$PY" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for name in ("torchvision", "sklearn", "onnx", "onnxscript", "onnxruntime", "tokenizers", "pynvml", "torchao"):
    try:
        module = __import__(name)
        print(name, getattr(module, "__version__", "?"))
    except ImportError as exc:
        print(name, "missing:", exc)
try:
    import onnxruntime
    print("onnxruntime providers", onnxruntime.get_available_providers())
except ImportError:
    pass
EOF
}

tests_step() {
    "$PY" -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/test_cuda.py
}

pipeline_step() {
    set -e
    local run=$WORK/digits others=() p
    anytime train --card models/digits-resnet20-exits.toml --device "$DEVICE" --out "$run" --no-progress --overwrite
    for p in $PRECISIONS; do  # fp16 compiled (as deployed), the others eager: compiling costs a minute each
        anytime quantize "$run" --precision "$p" --device "$DEVICE" --overwrite $([ "$p" = fp16 ] || echo --no-compile)
        others+=("$run-$p")
    done
    for r in "$run" "${others[@]}"; do
        anytime profile "$r" --device "$DEVICE" --batch-sizes 1,32 --repeats 300 --warmup 20
    done
    anytime collect "${others[0]}"
    anytime calibrate "${others[0]}" --max-drop 1
    anytime evaluate "${others[0]}" --device "$DEVICE" --split test
    for deadline in 0.3 0.5 0.8 1.2 2 5; do
        echo "schedule at $deadline ms:"
        anytime schedule "$run" --deadline-ms "$deadline" --with "$(IFS=,; echo "${others[*]}")" || true
    done
    anytime profile "$run" --device "$DEVICE" --batch-sizes 1,32 --repeats 100 --energy --energy-windows 5 \
        --out "$WORK/digits-energy.json"
}

study_step() {
    anytime experiment precision --quick --device "$DEVICE" --out "$WORK/precision" --overwrite
}

cards_step() {
    set -e
    if [ -n "${CIFAR10_TAR:-}" ]; then
        mkdir -p "$WORK/data" && tar -xf "$CIFAR10_TAR" -C "$WORK/data" && export ANYTIME_CIFAR10="$WORK/data/cifar10"
    fi
    local spec card epochs name keep kept=()
    mkdir -p "$WORK/runs"
    for spec in $CARDS; do
        IFS=: read -r card epochs name keep <<<"$spec"
        anytime train --card "models/$card.toml" --epochs "$epochs" --device "$DEVICE" --workers "${WORKERS:-8}" \
            --pin-memory --out "$WORK/runs/$name" --no-progress --overwrite
        [ "$keep" = keep ] && kept+=("$name")
        if ((${#kept[@]})); then  # packed after every run, so a step cut short still returns what finished
            rm -f "$OUT"/runs-part-*
            tar -cf - -C "$WORK/runs" --exclude=checkpoint.pt --exclude=outputs "${kept[@]}" \
                | split -b 15M -d - "$OUT/runs-part-"
        fi
    done
}

steps=("$@") failed=()
[ ${#steps[@]} -eq 0 ] && steps=(env tests pipeline study)
for s in "${steps[@]}"; do
    case $s in
        env) step env 60 env_step ;;
        tests) step tests 200 tests_step ;;
        pipeline) step pipeline 420 pipeline_step ;;
        study) step study 240 study_step ;;
        cards) step cards "${CARDS_S:-3000}" cards_step ;;
        *) echo "unknown step '$s': env, tests, pipeline, study or cards" >&2; exit 2 ;;
    esac
done
((${#failed[@]} == 0)) || { echo "failed: ${failed[*]}" | tee -a "$OUT/steps.txt"; exit 1; }
