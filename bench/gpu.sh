#!/usr/bin/env bash
# The GPU checks of docs/benchmarks.md in one run on one GPU (about 10 minutes on an H200):
#   1. nccl, fp16 with its loss scaler, a committed checkpoint and a resume from it, finite loss;
#   2. the GPU-resident input path against the DataLoader path (ResNet-18, CIFAR-shaped data,
#      bf16 + channels_last + torch.compile in both);
#   3. ResNet-50 on ImageNet-shaped data with the recommended GPU settings (bf16, channels_last,
#      torch.compile) against the fp32 hand-written DDP loop;
#   4. ResNet-50 at those settings on a folder of ImageNet-like JPEG files (500x375, ~80 KiB, nvJPEG
#      decoding: --decode auto) against the same run on synthetic 224x224 tensors (goal: >= 0.90), at
#      most 16 CPU cores; then the CPU decoding path (--decode cpu) against synthetic, for the record;
#   5. the input path alone (python -m bench --input): pil, cpu, packed and gpu, images/s per core.
#   6. --strategy fsdp: the largest ViT (bench.usermodel's 4, 8, 12 billion parameters) that trains on one
#      GPU with fsdp + activation checkpointing + CPU offload and not with ddp (+ activation checkpointing);
#   7. fsdp/ddp throughput, ResNet-50 224x224, bf16 + channels_last, one GPU;
#   8. per-rank step timing on CUDA events (GPU memory, utilization), a profiler trace with CUDA
#      kernels, trainer-report, and the defaults (timing on) against --step-timing false;
#   9. the tests that need a CUDA GPU (pytest -m gpu: deselected everywhere else, a skip failing CI), e.g. the
#      returning host's state and the sums over torchft's NCCL replica group (needs pytest in the image).
# Results (the harness's .md/.json and the logs) go to $OUT, or bench/results.
#
#     bash bench/gpu.sh          # all nine
#     bash bench/gpu.sh 1 2      # some
#
# quick: the GPU measurements this stack owes, in one call of at most 7 minutes (420 s, start-up of every run
# included) on one H100 or H200, into one JSON file ($OUT/quick-<time>.json, rewritten after every run). Run it
# first whenever a GPU is lent. bench/quick.py holds the plan: the parts in order of value, one round each, each
# within its budget plus what the earlier parts left.
#
#     bash bench/gpu.sh quick             # on the GPU
#     bash bench/gpu.sh quick --dry-run   # the plan (commands, budgets), anywhere: runs nothing
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/results}
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}

if [[ ${1:-} == quick ]]; then
  exec $python -m bench.quick --out "$out" "${@:2}"
fi

mkdir -p "$out"
sections=${*:-1 2 3 4 5 6 7 8 9}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'

if [[ " $sections " == *" 1 "* ]]; then
  echo "== 1. fp16 + checkpoint, then resume (nccl)"
  work=$(mktemp -d)
  smoke=(--model cifar_resnet18 --amp fp16 --channels-last --synthetic-size 2560 --batch-size 64
         --checkpoint-every 10 --val-every 1 --log-dir "$work/runs" --checkpoint-dir "$work/checkpoints"
         --env-file /dev/null)
  $python -m torch.distributed.run --standalone --nproc-per-node=1 -m trainer "${smoke[@]}" --max-steps 20
  $python -m torch.distributed.run --standalone --nproc-per-node=1 -m trainer "${smoke[@]}" --max-steps 40 \
    2>&1 | tee "$out/resume.log"
  grep -q "resuming from .*step-0*20" "$out/resume.log"
  cp "$work/runs/summary.json" "$out/smoke-summary.json"
  $python -c 'import json, math, sys; loss = json.load(open(sys.argv[1]))["train_loss"]; print("train_loss", loss); assert math.isfinite(loss)' \
    "$work/runs/summary.json"
fi

if [[ " $sections " == *" 2 "* ]]; then
  echo "== 2. GPU-resident input path vs DataLoader path, ResNet-18, 32x32"
  $python -m bench --nproc 1 --stacks trainer baseline --model resnet18 --batch-size 256 --steps 100 --threads 4 \
    --trainer-args '--amp bf16 --channels-last --compile --loader memory' \
    --baseline-args '--amp bf16 --channels-last --compile --loader dataloader' --out "$out"
fi

if [[ " $sections " == *" 3 "* ]]; then
  echo "== 3. ResNet-50, 224x224: bf16 + channels_last + compile vs the fp32 hand-written loop"
  $python -m bench --nproc 1 --stacks trainer handwritten --model resnet50 --image-size 224 --batch-size 256 \
    --steps 25 --threads 4 --trainer-args '--amp bf16 --channels-last --compile' --out "$out"
fi

if [[ " $sections " == *" 4 "* || " $sections " == *" 5 "* ]]; then
  # 20000 training images: one epoch is longer than the timed window (no epoch restart in it).
  jpegs=${JPEG_DIR:-$(mktemp -d)/imagenet-like}
  [[ -d $jpegs/train ]] || $python -m bench --input --make-data "$jpegs" --images 20000
  workers=$(( $(nproc) < 16 ? $(nproc) - 1 : 15 ))
fi

if [[ " $sections " == *" 4 "* ]]; then
  echo "== 4. ResNet-50 on JPEG files (GPU decoding) vs synthetic tensors, bf16 + channels_last + compile"
  recommended="--amp bf16 --channels-last --compile"
  $python -m bench --nproc 1 --stacks trainer baseline --model resnet50 --image-size 224 --batch-size 256 \
    --steps 60 --threads 4 --out "$out" \
    --trainer-args "$recommended --dataset imagefolder --data-dir $jpegs --num-workers $workers --decode auto" \
    --baseline-args "$recommended"
  echo "== 4b. the same with CPU decoding (--decode cpu) vs synthetic"
  $python -m bench --nproc 1 --stacks trainer baseline --model resnet50 --image-size 224 --batch-size 256 \
    --steps 60 --threads 4 --out "$out" \
    --trainer-args "$recommended --dataset imagefolder --data-dir $jpegs --num-workers $workers --decode cpu" \
    --baseline-args "$recommended"
fi

if [[ " $sections " == *" 5 "* ]]; then
  echo "== 5. the input path alone: pil, cpu, packed, gpu (images/s per core)"
  $python -m bench --input --data "$jpegs" --workers "$workers" --batch-size 256 --batches 20 --warmup 4 --out "$out"
fi

if [[ " $sections " == *" 6 "* ]]; then
  echo "== 6. largest ViT that trains with fsdp (+ activation checkpointing, CPU offload) and not with ddp"
  # A run that runs out of memory is recorded as failed, not fatal: that is the measurement.
  $python -m bench.fsdp_memory --nproc 1 --image-size 224 --batch-size 8 --steps 3 --keep-going \
    --models bench.usermodel:vit_4b bench.usermodel:vit_8b bench.usermodel:vit_12b \
    --trainer-args='--amp bf16 --activation-checkpointing' --fsdp-args='--fsdp-cpu-offload' --out "$out"
fi

if [[ " $sections " == *" 7 "* ]]; then
  echo "== 7. fsdp/ddp throughput, ResNet-50, 224x224, bf16 + channels_last (trainer/baseline = fsdp/ddp)"
  $python -m bench --nproc 1 --stacks trainer baseline --model resnet50 --image-size 224 --batch-size 256 \
    --steps 25 --threads 4 --trainer-args '--strategy fsdp --amp bf16 --channels-last' \
    --baseline-args '--strategy ddp --amp bf16 --channels-last' --out "$out"
fi

if [[ " $sections " == *" 8 "* ]]; then
  echo "== 8. step timing on CUDA events, a profiler trace, trainer-report; timing on vs off"
  work=$(mktemp -d)
  $python -m torch.distributed.run --standalone --nproc-per-node=1 -m trainer --model cifar_resnet18 \
    --synthetic-size 25600 --batch-size 256 --max-steps 60 --log-every 10 --val-every 0 --profile-steps 40:42 \
    --tracker tensorboard,csv --log-dir "$work/runs" --checkpoint-dir "$work/checkpoints" --env-file /dev/null
  $python -m trainer.cli.report "$work/runs" | tee "$out/report.txt"
  cp "$work/runs/summary.json" "$out/timing-summary.json"
  cp "$work/runs/report.png" "$out/report.png"
  $python - "$work/runs" <<'EOF'
import csv, json, sys
from pathlib import Path
runs = Path(sys.argv[1])
rank = json.loads((runs / "summary.json").read_text())["ranks"][0]
print("rank 0:", rank)
assert rank["compute_ms"] > 0 and rank["max_memory_mb"] > 0, rank
tags = {row["tag"] for row in csv.DictReader((runs / "metrics.csv").open())}
assert "gpu/max_memory_mb/rank0" in tags and "time/compute_ms/rank0" in tags, sorted(tags)
print("utilization logged:", "gpu/utilization_pct/rank0" in tags)
trace = json.loads(next((runs / "profile").glob("rank0.*.json")).read_text())["traceEvents"]
steps = sorted({e["name"] for e in trace if e.get("name", "").startswith("ProfilerStep#")})
kernels = sum(1 for e in trace if e.get("cat") == "kernel")
print("trace:", steps, kernels, "kernels")
assert steps == ["ProfilerStep#40", "ProfilerStep#41", "ProfilerStep#42"] and kernels > 0
EOF
  $python -m bench --nproc 1 --stacks trainer baseline --model resnet18 --batch-size 256 --steps 100 --threads 4 \
    --trainer-args '--log-every 10' --baseline-args '--log-every 10 --step-timing false' --out "$out"
fi

if [[ " $sections " == *" 9 "* ]]; then
  echo "== 9. the tests that need a CUDA GPU (pytest -m gpu)"
  $python -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$out/gpu-tests.log"
fi
