#!/usr/bin/env bash
# Every check of this project that needs a CUDA GPU, in one run, most decisive first, with its outputs in one
# folder (at most six files: a log, the benchmarks' --json files, the CUDA training compare's summary):
#
#   bash train/gpu_check.sh pack KIT           # here: what an offline GPU machine needs, into folder KIT
#   bash train/gpu_check.sh run OUT [KIT]      # there: the checks, in order of what they decide
#   bash train/gpu_check.sh run OUT [KIT] --dry-run   # anywhere: every step on the CPU at toy sizes
#
# The checks: the CUDA-only test (a replayed CUDA graph gives the capsule the eager step's gradient);
# `python -m train.bench` on SmolLM2-135M's architecture in bf16, eager and with --cuda-graphs in the same
# run of this script, then --cuda-graphs in fp32 and on a 1.2B Llama shape; `python -m train compare` with every
# method and a stop + --resume on CUDA (20 steps of CB). The architectures run with seeded random weights (a
# step's time does not depend on the weights' values), built from KIT/arch (config and tokenizer only, 3.5 MB),
# so the embedded 98 MB GGUF need not travel. Each step has its own time limit; a failed step is logged
# and the next one runs. train/BENCHMARKS.md says what each number means and holds the runs made so far.
#
# pack writes: KIT/whl (transformers, peft, datasets, dill and multiprocess as Python 3.12 wheels, for
# a machine whose torch is installed but whose other versions differ), KIT/arch (the embedded backbone's
# config and tokenizer) and KIT/superglue/CB (the task the training check uses).
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"

save_arch() {   # the embedded backbone's config and tokenizer, into folder $1
    python3 -c "import sys; from capt import load_backbone; bb = load_backbone('smollm2-135m')
bb.model.config.save_pretrained(sys.argv[1]); bb.tokenizer.save_pretrained(sys.argv[1])" "$1"
}

pack() {
    local kit=${1:?usage: bash train/gpu_check.sh pack KIT}
    mkdir -p "$kit/whl" "$kit/superglue" || return
    local pins   # the versions installed here (requirements.txt's, and datasets' two needs)
    pins=$(python3 -c "import importlib.metadata as m
print(*(f'{n}=={m.version(n)}' for n in ('transformers', 'peft', 'datasets', 'dill', 'multiprocess')))") || return
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$kit/whl" $pins || return
    save_arch "$kit/arch" || return
    local data=${CAPT_DATA_DIR:-$(python3 -c "from capt.tasks import DEFAULT_DATA_DIR; print(DEFAULT_DATA_DIR)")}
    cp -r "$data/CB" "$kit/superglue/" || return
    du -sh "$kit"
}

step() {   # step NAME SECONDS COMMAND...: run it with a time limit, log it, go on whatever it returns
    local name=$1 limit=$2; shift 2
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    echo "=== $name: exit ${PIPESTATUS[0]}" | tee -a "$log"
}

run() {
    local out=${1:?usage: bash train/gpu_check.sh run OUT [KIT] [--dry-run]} kit= dry=0 a
    shift
    for a in "$@"; do
        if [ "$a" = --dry-run ]; then dry=1; else kit=$a; fi
    done
    mkdir -p "$out" || return
    out=$(cd "$out" && pwd)
    log=$out/gpu-check.log
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    if [ -n "$kit" ] && [ -d "$kit/whl" ] && [ $dry = 1 ]; then
        echo "dry run: $kit/whl is not installed (its wheels are for the GPU machine's Python 3.12)" | tee -a "$log"
    elif [ -n "$kit" ] && [ -d "$kit/whl" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" \
            "$kit"/whl/*.whl >>"$log" 2>&1 || { echo "installing $kit/whl failed: see $log"; return 1; }
        export PYTHONPATH=$work/site:$here
    fi
    [ -n "$kit" ] && [ -d "$kit/superglue" ] && export CAPT_DATA_DIR=$(cd "$kit/superglue" && pwd)
    export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

    step environment 60 python3 -c "import sys, torch, transformers, peft
print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)
print('cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
    if [ $dry = 0 ] && ! python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
        echo "no CUDA GPU here: run with --dry-run to check the plumbing on the CPU" | tee -a "$log"
        return 1
    fi
    local arch=$work/arch   # config and tokenizer: the kit's, else the embedded backbone's
    if [ -n "$kit" ] && [ -d "$kit/arch" ]; then arch=$(cd "$kit/arch" && pwd)
    else save_arch "$arch" >>"$log" 2>&1 ||
        { echo "no KIT/arch and no embedded smollm2-135m to take the architecture from: see $log"; return 1; }
    fi

    # a 1.2B Llama shape: SmolLM2's config and tokenizer with d 2048, 24 layers, 32 heads, 8 key/value heads
    local big=$work/big-config
    python3 -c "import sys; from transformers import AutoConfig, AutoTokenizer
c = AutoConfig.from_pretrained(sys.argv[1]); c.update(dict(hidden_size=2048, intermediate_size=5632,
    num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=24, head_dim=64))
c.save_pretrained(sys.argv[2]); AutoTokenizer.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2])" \
        "$arch" "$big" >>"$log" 2>&1 || echo "could not write the 1.2B config" | tee -a "$log"

    local b=(python3 -m train.bench --random-weights --warmup 5) graphs=--cuda-graphs
    local r1=51 r2=31 smol=(--backbone "$arch") bigb=(--backbone "$big" --batch-size 8 --seq-len 256)
    if [ $dry = 1 ]; then
        b=(python3 -m train.bench --random-weights --warmup 0 --device cpu) graphs= r1=1 r2=1
        smol=(--backbone "$arch" --batch-size 2 --seq-len 16) bigb=(--backbone tiny-llama)
    fi
    step cuda-test 120 python3 -m pytest -q -rs -p no:cacheprovider tests/test_bench.py -k cuda_graph
    step bench-bf16-graphs 120 "${b[@]}" "${smol[@]}" --dtype bfloat16 --repeats $r1 $graphs \
        --json "$out/bench-bf16-graphs.json"
    step bench-bf16-eager 120 "${b[@]}" "${smol[@]}" --dtype bfloat16 --repeats $r1 --json "$out/bench-bf16-eager.json"

    # training on the GPU: the same architecture with seeded random weights, saved as a backbone folder
    local weights=$work/arch-weights
    python3 -c "import sys; from capt import load_backbone; bb = load_backbone(sys.argv[1], random_weights=True)
bb.model.save_pretrained(sys.argv[2]); bb.tokenizer.save_pretrained(sys.argv[2])" \
        "$arch" "$weights" >>"$log" 2>&1 || echo "could not save random weights" | tee -a "$log"
    local n=20 t=(--backbone "$weights" --task cb --eval-every 5 --max-dev 16 --max-test 16 --quiet)
    [ $dry = 1 ] && n=4 t=(--backbone "$weights" --task cb --eval-every 2 --max-dev 4 --max-test 4 --quiet
                            --batch-size 2 --max-train 16)
    step train-compare 150 python3 -m train compare "${t[@]}" --max-steps $n --out "$work/compare" \
        --methods capt zero-shot majority linear-head p-tuning-v2
    [ -f "$work/compare/compare.json" ] && cp "$work/compare/compare.json" "$out/train-compare.json"
    step train-stop 60 python3 -m train "${t[@]}" --max-steps $((n / 2)) --out "$work/resume"
    step train-resume 60 python3 -m train "${t[@]}" --max-steps $n --resume --out "$work/resume"
    grep -h '"kind": "resume"' "$work"/resume/*/metrics.jsonl "$work"/resume/metrics.jsonl 2>/dev/null | tee -a "$log"

    step bench-fp32-graphs 100 "${b[@]}" "${smol[@]}" --dtype float32 --repeats $r1 $graphs \
        --json "$out/bench-fp32-graphs.json"
    step bench-big-bf16-graphs 150 "${b[@]}" "${bigb[@]}" --dtype bfloat16 --repeats $r2 $graphs \
        --json "$out/bench-big-bf16-graphs.json"
    echo "done: $(ls "$out" | tr '\n' ' ')" | tee -a "$log"
}

case ${1:-} in
    pack) shift; pack "$@" ;;
    run) shift; run "$@" ;;
    *) sed -n 2,19p "$0"; exit 2 ;;
esac
