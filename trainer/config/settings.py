"""The one typed configuration of a training run.

Every field is a CLI flag (``--batch-size``) and an environment variable (``TRAIN_BATCH_SIZE``).
Precedence: flag > environment > ``.env`` file (never overriding the real environment) > default.
The whole tree is validated once, before any process group forms, so a mistake costs seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import io
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from dotenv import dotenv_values
from dotenv.parser import parse_stream

from trainer.config import catalog
from trainer.core.errors import OneLineErrorParser, UsageError

ENV_PREFIX = "TRAIN_"
DEFAULT_ENV_FILE = ".env"

AUGMENTATIONS = ("auto", "imagenet", "light", "none")
# --auto-augment: torchvision.transforms.v2's policies, by the reference script's names.
AUTO_AUGMENT = ("ta_wide", "ra", "augmix", "imagenet", "cifar10", "svhn")
INTERPOLATIONS = ("nearest", "bilinear", "bicubic")
# --lr-scheduler: the reference's main schedules, by its names (which it lowercases first); the settings of its
# per-epoch schedule, any of which selects it.
LR_SCHEDULERS = ("steplr", "cosineannealinglr", "exponentiallr")
REFERENCE_SCHEDULE = ("lr_scheduler", "lr_warmup_epochs", "lr_warmup_method", "lr_warmup_decay", "lr_step_size",
                      "lr_gamma", "lr_min")
LIGHT_AUGMENT_BELOW = 128  # --augment auto: training crops smaller than this get the light policy
# TRAIN_* names the launcher reads, which are not training options (the worker never sees them as such).
LAUNCHER_VARIABLES = {"TRAIN_SCRIPT": "your own training script instead of the built-in trainer: a path, "
                                      "or -m and a module (trainer-launch --help)"}
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
WEEK_S = 7 * 24 * 3600


def option(default: Any, help: str, choices: Sequence[str] | None = None, loop: bool = False) -> Any:
    """A setting: its flag, TRAIN_* variable, --help line and docs/settings.md row come from here. loop: the built-in
    loop's own (its model, data, augmentation, loss, optimizer and validation), which a script brings for itself:
    api.Run() carries it in run.settings and checks it against nothing."""
    return field(default=default, metadata={"help": help, "choices": choices, "loop": loop})


@dataclass(frozen=True)
class TrainConfig:
    # What to train on what.
    model: str = option("resnet18", "model: built-in (" + ", ".join(catalog.MODELS) + "), any torchvision "
                        "classification model (--list-models), or your own as module:function", loop=True)
    dataset: str = option("synthetic", "training data: " + ", ".join(catalog.DATASETS) + " (synthetic needs no "
                          "files), or your own as module:function", loop=True)
    data_dir: str = option("./data", "dataset root (imagefolder: holds train/ and val/)", loop=True)
    image_size: int = option(224, "imagefolder: side of the training and validation crops in pixels "
                             "(e.g. 32 or 64 for small images; --train-crop-size and --val-crop-size set one "
                             "of the two)", loop=True)
    augment: str = option("auto", "imagefolder augmentation: imagenet (random-resized crop + flip), light "
                          "(random crop with padding + flip, for small images), none (resize + center crop); "
                          f"auto: imagenet for training crops from {LIGHT_AUGMENT_BELOW} px up, else light (the "
                          "run's first line says which)", AUGMENTATIONS, loop=True)
    synthetic_size: int = option(10000, "synthetic training samples (validation gets a fifth as many)", loop=True)
    synthetic_image_size: int = option(32, "synthetic image side in pixels (32: CIFAR-shaped, 224: ImageNet-shaped)",
                                       loop=True)
    # torchvision's reference recipe (references/classification/train.py): its flags, meanings and defaults,
    # mapped onto the options above where they overlap (trainer/data/augment.py, docs/recipes.md).
    train_crop_size: int = option(0, "side of the training crops in pixels (0: --image-size for image folders, "
                                  "the images' own side for synthetic, cifar10 and mnist)", loop=True)
    val_resize_size: int = option(0, "image folders: the validation images' shorter side before the centre crop "
                                  "(0: 8/7 of --val-crop-size, 256 for 224)", loop=True)
    val_crop_size: int = option(0, "side of the validation centre crops in pixels (0: --image-size for image "
                                "folders, the images' own side for synthetic, cifar10 and mnist)", loop=True)
    interpolation: str = option("bilinear", "resampling of the resized crops and of --auto-augment's geometric "
                                "operations (those take nearest or bilinear: bicubic crops get bilinear ones)",
                                INTERPOLATIONS, loop=True)
    auto_augment: str = option("", "a per-sample augmentation policy after the crop and flip: ta_wide "
                               "(TrivialAugmentWide), ra (RandAugment), augmix (AugMix), or AutoAugment's imagenet, "
                               "cifar10 or svhn policy; empty: none", loop=True)
    ra_magnitude: int = option(9, "--auto-augment ra: RandAugment's magnitude (0 to 30)", loop=True)
    augmix_severity: int = option(3, "--auto-augment augmix: AugMix's severity (1 to 10)", loop=True)
    random_erase: float = option(0.0, "probability that a training sample gets a random rectangle erased "
                                 "(RandomErasing, filled with the mean colour)", loop=True)
    ra_sampler: bool = option(False, "repeated augmentation: each epoch's samples come --ra-reps times each, on "
                              "different ranks, under different augmentations; the epoch keeps its length, so it "
                              "holds 1/--ra-reps of the distinct samples")
    ra_reps: int = option(3, "--ra-sampler: the copies of each sample")
    # How long.
    epochs: int = option(5, "passes over the training data")
    max_steps: int = option(0, "stop after this many optimizer steps, the LR schedule ending there too (a later run "
                            "without it resumes on the whole schedule's LR); 0: no limit")
    # Batch and optimizer.
    batch_size: int = option(64, "samples per process per micro-batch")
    global_batch_size: int = option(0, "samples per optimizer step over all processes (0: use --batch-size)")
    grad_accum: int = option(1, "micro-batches accumulated per optimizer step")
    optimizer: str = option("sgd", "optimizer", ("sgd", "adamw"), loop=True)
    lr: float = option(0.1, "peak learning rate", loop=True)
    momentum: float = option(0.9, "SGD momentum (AdamW: beta1)", loop=True)
    weight_decay: float = option(5e-4, "weight decay (norm layers and biases: --norm-weight-decay and "
                                 "--bias-weight-decay)", loop=True)
    norm_weight_decay: float = option(0.0, "weight decay of the norm layers' parameters (BatchNorm, LayerNorm, "
                                      "GroupNorm, InstanceNorm)", loop=True)
    bias_weight_decay: float = option(0.0, "weight decay of the biases (any parameter named bias, norm layers' "
                                      "too)", loop=True)
    lr_schedule: str = option("cosine", "learning-rate schedule after warm-up", ("cosine", "step", "constant"),
                              loop=True)
    warmup_steps: int = option(-1, "linear warm-up steps (-1: 5% of the run's optimizer steps, so that a "
                               "short run or a larger world size is not mostly warm-up)")
    # torchvision's reference schedule (references/classification/train.py), by its flags, meanings and defaults:
    # stepped once per epoch, its warm-up a SequentialLR of LinearLR or ConstantLR before the main schedule. Any of
    # them given selects it in place of --lr-schedule and --warmup-steps (the two mixed: a usage error).
    lr_scheduler: str = option("", "torchvision's reference schedule, stepped once per epoch: steplr, "
                               "cosineannealinglr or exponentiallr (any case); it (or steplr, the reference's default, "
                               "where only the other --lr-* settings below are given) replaces --lr-schedule and "
                               "--warmup-steps; unset: the per-step --lr-schedule", loop=True)
    lr_warmup_epochs: int = option(0, "--lr-scheduler: the epochs of warm-up before it, each at one learning rate "
                                   "(the reference's; 0: none)", loop=True)
    lr_warmup_method: str = option("constant", "--lr-scheduler: the warm-up's rates: linear (from --lr-warmup-decay "
                                   "x lr up by equal steps each epoch) or constant (--lr-warmup-decay x lr "
                                   "throughout)", ("linear", "constant"), loop=True)
    lr_warmup_decay: float = option(0.01, "--lr-scheduler: the warm-up's first epoch trains at this fraction of "
                                    "--lr", loop=True)
    lr_step_size: int = option(30, "--lr-scheduler steplr: multiply the learning rate by --lr-gamma every N epochs "
                               "after the warm-up", loop=True)
    lr_gamma: float = option(0.1, "--lr-scheduler steplr and exponentiallr: the factor (exponentiallr: every epoch "
                             "after the warm-up)", loop=True)
    lr_min: float = option(0.0, "--lr-scheduler cosineannealinglr: the cosine's floor (eta_min), reached after the "
                           "last epoch", loop=True)
    clip_grad_norm: float = option(0.0, "clip the gradients' total L2 norm to this bound before each optimizer "
                                   "step (fp16: after the loss scale is taken out; fsdp: the norm over every "
                                   "shard); logged as Grad/norm; unset: no clipping")
    label_smoothing: float = option(0.0, "cross-entropy's label smoothing, 0 to below 1 (training loss only)",
                                    loop=True)
    mixup_alpha: float = option(0.0, "mixup: each batch blended with itself reversed, by a Beta(alpha, alpha) "
                                "draw (0: off; with --cutmix-alpha, one of the two per batch)")
    cutmix_alpha: float = option(0.0, "cutmix: a Beta(alpha, alpha)-sized box of each image replaced by its "
                                 "neighbour's (0: off)")
    model_ema: bool = option(False, "keep an exponential moving average of the weights (and buffers), "
                             "validated beside the model and kept in every checkpoint")
    model_ema_steps: int = option(32, "--model-ema: update the average every N optimizer steps")
    model_ema_decay: float = option(0.99998, "--model-ema: the decay, adjusted as torchvision's reference does for "
                                    "the global batch, --model-ema-steps and --epochs; during the LR warm-up the "
                                    "average copies the weights (a script's: its first --warmup-steps); the run's "
                                    "first lines say which steps")
    # Speed.
    amp: str = option("off", "mixed precision: bf16 (CUDA and CPUs), fp16 (CUDA, with a loss scaler)",
                     ("off", "bf16", "fp16"))
    channels_last: bool = option(False, "NHWC memory format (faster convolutions on tensor cores)")
    compile: bool = option(False, "torch.compile the model")
    sync_bn: bool = option(False, "synchronise BatchNorm statistics across processes")
    shm_allreduce: bool = option(True, "CPU processes all on one host: exchange gradients (and fsdp's weights) "
                                 "through shared memory instead of gloo's TCP (the same sums)")
    loader: str = option("auto", "input path: memory (batched tensor ops, on the GPU when there is one), "
                         "dataloader (worker processes), auto (memory for in-memory datasets: synthetic, "
                         "cifar10, mnist)",
                         ("auto", "memory", "dataloader"), loop=True)
    num_workers: int = option(2, "DataLoader worker processes per training process", loop=True)
    # Image files (trainer/data/jpeg.py, trainer/data/pack.py).
    decode: str = option("auto", "imagefolder decoding: cpu (worker processes decode no more pixels than the "
                         "crop needs), gpu (nvJPEG batches on the GPU, crops and flips there; other files on "
                         "the CPU), pil (PIL + torchvision transforms, the reference); auto: cpu (gpu is opt-in until "
                         "a GPU run has measured it)", ("auto", "cpu", "gpu", "pil"), loop=True)
    decode_gpu_share: float = option(1.0, "--decode gpu: the share of each batch's JPEGs nvJPEG decodes (0 to 1, "
                                     "as DALI's hw_decoder_load); the rest, chosen by sample, are decoded by the "
                                     "loader's workers on the CPU path, so the two decoders add up", loop=True)
    max_bad_files: str = option("0.001", "imagefolder and packed: image files that do not decode (truncated, not an "
                                "image) are skipped, each with one warning and a black image of its label in its "
                                "place, the same every time; the run stops once an epoch meets more than this many: "
                                "a count (10), or a fraction of the epoch's files (0.001: 0.1%, at least 1)")
    # Observability.
    val_every: int = option(1, "validate every N epochs (0: never)", loop=True)
    log_every: int = option(50, "log every N optimizer steps (the only host sync of the loop)")
    log_dir: str = option("./runs", "TensorBoard events and summary.json")
    tracker: str = option("tensorboard", "experiment trackers, comma-separated: tensorboard, csv (metrics.csv), "
                          "wandb, mlflow (rank 0 only; offline by default: WANDB_MODE=offline into --log-dir, "
                          "an MLflow file store in <log-dir>/mlruns; sync later: docs/performance.md)")
    step_timing: bool = option(True, "per-rank step timing every --log-every steps (data wait, compute, "
                               "collective wait, optimizer) and the slowest rank named")
    profile_steps: str = option("", "torch.profiler traces of optimizer steps A:B (A to B inclusive) into "
                                "<log-dir>/profile/ as Chrome/Perfetto JSON (empty: off)")
    profile_ranks: str = option("all", "ranks that record --profile-steps: all, or a comma-separated list (0,1)")
    # Checkpoints.
    checkpoint_dir: str = option("./checkpoints", "where checkpoints are committed")
    checkpoint_every: int = option(500, "checkpoint every N optimizer steps (0: only at epoch ends)")
    keep_checkpoints: int = option(3, "newest checkpoints kept (at least 2)")
    checkpoint_async: bool = option(False, "write the cadence's checkpoints in the background: rank 0 copies the "
                                    "state to CPU memory and a thread writes it while training goes on (fsdp: every "
                                    "rank copies its shard, DCP's async_save writes them); one write at a time, a "
                                    "stop and the end wait for it")
    resume: str = option("auto", "auto (the newest valid checkpoint), never (start afresh), or a checkpoint path; "
                         "checkpoints in --checkpoint-dir above the step a run starts from are set aside in a folder "
                         "there, not deleted")
    # Distributed.
    seed: int = option(0, "random seed (the same on every rank)")
    backend: str = option("auto", "process-group backend; auto: nccl with a GPU, else gloo", ("auto", "nccl", "gloo"))
    collective_timeout: float = option(300.0, "seconds a collective may wait for a peer before the run fails")
    local_sgd_period: int = option(0, "opt-in, changes numerics: after the LR warm-up, take local steps and "
                                   "average parameters every K steps instead of all-reducing gradients "
                                   "every step (post-local SGD; 0: off)")
    strategy: str = option("ddp", "ddp: every process holds the whole model; fsdp: each of N processes holds 1/N "
                           "of the parameters, gradients and optimizer state (FSDP2), for models whose training "
                           "state does not fit one GPU; checkpoints become directories of shards",
                           ("ddp", "fsdp"))
    activation_checkpointing: bool = option(False, "recompute each block's activations in the backward pass "
                                            "instead of keeping them (less memory, about a third more compute)")
    fsdp_cpu_offload: bool = option(False, "fsdp: keep the sharded parameters, gradients and optimizer state in "
                                    "host memory (slower; the GPU holds only the blocks running)")
    pipeline_stages: int = option(1, "cut the model into P stages, one per process, each passing its activations to "
                                  "the next (pipeline parallelism: each process holds 1/P of the model); the world "
                                  "size is P x the data-parallel replicas, a replica's stages on consecutive ranks "
                                  "(NPROC_PER_NODE a multiple of P keeps them on one host); 1: off")
    pipeline_schedule: str = option("1f1b", "pipeline stages' order of work: gpipe (every micro-batch's forward, then "
                                    "every backward), 1f1b (a forward, a backward: fewer activations held at once) or "
                                    "interleaved-1f1b (each process holds V >= 2 pieces of the model, P apart: a "
                                    "smaller idle share for more messages; --pipeline-split names V x P - 1, "
                                    "default V = 2)",
                                    ("gpipe", "1f1b", "interleaved-1f1b"))
    pipeline_microbatches: int = option(4, "pipeline stages: the micro-batches each process's batch is cut into so "
                                        "that the stages work at once (the idle share of a step is (P - 1) / (M + "
                                        "P - 1)); it must divide the per-process batch")
    pipeline_split: str = option("", "pipeline stages: the modules each later stage begins with, comma-separated "
                                 "(e.g. layer3 for two stages of a ResNet); empty: the cut that balances the stages' "
                                 "parameter counts over the model's blocks")

    # Derived once the world size is known (not options).
    world_size: int = field(default=1, metadata={"derived": True})

    @property
    def pipeline_chunks(self) -> int:
        """The pieces of the model each pipeline process holds: under interleaved-1f1b those pipeline_split names
        (2 if it names none), else 1."""
        if self.pipeline_schedule != "interleaved-1f1b":
            return 1
        names = split_names(self.pipeline_split)
        return (len(names) + 1) // self.pipeline_stages if names else 2

    @property
    def replicas(self) -> int:
        """The data-parallel width: the processes over the pipeline stages each replica of the model spans."""
        return self.world_size // self.pipeline_stages

    @property
    def samples_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.replicas

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


OPTIONS = [f for f in dataclasses.fields(TrainConfig) if not f.metadata.get("derived")]
_FIELDS = {f.name: f for f in OPTIONS}

# Names users type for an option, from other tools (Hugging Face's TrainingArguments, Lightning, torchvision's
# reference scripts, timm): a near miss by spelling would suggest another option (TRAIN_LEARNING_RATE read as
# TRAIN_LOG_DIR). Used only to say "did you mean ...?"; an alias is never read as the option.
ALIASES = {
    "lr": ("learning_rate", "base_lr", "max_lr", "peak_lr"),
    "lr_schedule": ("lr_scheduler_type", "scheduler", "schedule", "sched"),
    "warmup_steps": ("warmup", "num_warmup_steps", "lr_warmup_steps", "warmup_iters"),
    "weight_decay": ("wd", "decay"),
    "optimizer": ("opt", "optim"),
    "batch_size": ("bs", "batch", "per_device_train_batch_size", "train_batch_size", "micro_batch_size"),
    "global_batch_size": ("total_batch_size", "effective_batch_size"),
    "grad_accum": ("gradient_accumulation_steps", "accumulate_grad_batches", "accum_steps", "grad_accumulation"),
    "epochs": ("num_train_epochs", "max_epochs", "n_epochs", "num_epochs"),
    "max_steps": ("steps", "train_steps", "total_steps", "max_iters", "num_steps"),
    "num_workers": ("workers", "dataloader_num_workers", "j", "loader_workers"),
    "model": ("arch", "architecture", "model_name", "network", "net"),
    "data_dir": ("data", "data_path", "data_root", "dataset_dir", "dataset_path", "root"),
    "log_dir": ("output_dir", "logdir", "logging_dir", "tensorboard_dir", "runs_dir"),
    "checkpoint_dir": ("ckpt_dir", "save_dir", "checkpoint_path", "checkpoints_dir", "checkpoints"),
    "checkpoint_every": ("save_steps", "save_every", "ckpt_every", "save_interval", "checkpoint_interval"),
    "keep_checkpoints": ("save_total_limit", "keep", "max_checkpoints"),
    "log_every": ("logging_steps", "print_freq", "log_interval", "log_freq"),
    "val_every": ("eval_every", "eval_steps", "val_interval", "eval_interval", "check_val_every_n_epoch"),
    "resume": ("resume_from_checkpoint", "resume_from", "ckpt_path", "checkpoint"),
    "amp": ("precision", "mixed_precision", "fp16", "bf16", "autocast"),
    "sync_bn": ("sync_batchnorm", "syncbn"),
    "seed": ("random_seed", "manual_seed"),
    "image_size": ("img_size", "input_size", "crop_size", "resolution", "train_crop_size"),
    "collective_timeout": ("timeout", "nccl_timeout", "ddp_timeout"),
    "compile": ("torch_compile",),
    "channels_last": ("memory_format",),
}
_ALIAS_OF = {alias: option for option, aliases in ALIASES.items() for alias in aliases}


def meant(name: str) -> str | None:
    """The option a mistyped name (learning_rate, LEARNING-RATE, logdir) most likely means: a name users type
    for it elsewhere (ALIASES), else the closest spelling; None when nothing is close."""
    key = name.strip().lstrip("-").lower().replace("-", "_")
    if key in _ALIAS_OF:
        return _ALIAS_OF[key]
    close = difflib.get_close_matches(key, [f.name for f in OPTIONS], n=1)
    return close[0] if close else None


def split_names(text: str) -> list[str]:
    """--pipeline-split's module names: comma-separated, blanks around them and empty ones dropped."""
    return [name.strip() for name in text.split(",") if name.strip()]


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def build_parser(environ: Mapping[str, str] | None = None, dotenv: Mapping[str, str] | None = None,
                 env_file: str = DEFAULT_ENV_FILE) -> argparse.ArgumentParser:
    """The trainer's flags. --help shows beside each option the value it has where it runs: `environ`'s (default
    os.environ), else the dotenv file's (`dotenv`, read from `env_file`: read_env_file())."""
    environ = os.environ if environ is None else environ
    dotenv = dotenv or {}
    parser = OneLineErrorParser(
        prog="trainer",
        description="One DistributedDataParallel training worker. Run it under torchrun "
        "(or trainer-launch), under Slurm srun, or alone. Every option is also an environment "
        f"variable ({ENV_PREFIX}<OPTION>) and may stand in a .env file; flags win over the "
        "environment, the environment over .env, .env over defaults.",
    )
    parser.add_argument("--list-models", action=_ListModels, nargs=0,
                        help="list the models and datasets --model and --dataset take, then exit")
    parser.add_argument("--env-file", help="dotenv file read for TRAIN_* values (default: .env, if there is one; "
                        "/dev/null: none)")
    for f in OPTIONS:
        # In a container the compose file sets its profile's values (the cpu profile: cnn, 2 epochs), on bare
        # metal the environment or .env may: --help shows what this run would use, beside the trainer's default.
        name = env_name(f.name)
        here = f"={environ[name]} here" if environ.get(name) else \
            f"={dotenv[name]} here (in {env_file})" if dotenv.get(name) else ""
        # argparse formats help with %
        help_text = f"{f.metadata['help']} [env {name}{here}; default {f.default}]".replace("%", "%%")
        if f.type == "bool":
            parser.add_argument(flag_name(f.name), nargs="?", const="true", default=None,
                                metavar="BOOL", help=help_text)
        else:
            choices = f.metadata["choices"]
            parser.add_argument(flag_name(f.name), default=None, help=help_text,
                                metavar="{" + ",".join(choices) + "}" if choices else None)
    return parser


class _ListModels(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        print(catalog.listing())
        parser.exit()


def _convert(raw: str, kind: str, setting: str, choices: Sequence[str] | None) -> Any:
    text = raw.strip()
    if kind == "bool":
        if text.lower() in TRUE_WORDS:
            return True
        if text.lower() in FALSE_WORDS:
            return False
        raise UsageError(setting, f"'{raw}' is not a boolean", "use true or false")
    if kind == "int":
        try:
            return int(text)
        except ValueError:
            raise UsageError(setting, f"'{raw}' is not an integer", "give a whole number") from None
    if kind == "float":
        try:
            value = float(text)
        except ValueError:
            raise UsageError(setting, f"'{raw}' is not a number", "give a number such as 0.1") from None
        if not math.isfinite(value):
            raise UsageError(setting, f"'{raw}' is not a finite number", "give a number such as 0.1")
        return value
    if choices and text not in choices:
        raise UsageError(setting, f"unknown value '{raw}'", "choose one of " + ", ".join(choices))
    return text


# Set by trainer-launch for an elastic job (NNODES=MIN:MAX): the largest world size, whose global batch the run
# keeps at every size.
ELASTIC_WORLD_ENV = "TRAINER_ELASTIC_WORLD"
# Set by trainer-launch for a job on in-place recovery (docs/elastic.md): the torchft lighthouse's address (the path
# is on when it is set), the largest world (hosts x processes) whose micro-batches the run keeps at every size, this
# host's name in the quorum and the address other hosts reach it at.
LIGHTHOUSE_ENV = "TRAINER_LIGHTHOUSE"
# Under LIGHTHOUSE_HOSTS of two hosts or more: every lighthouse's address, in order (trainer.engine.lighthouses).
LIGHTHOUSES_ENV = "TRAINER_LIGHTHOUSES"
# compose.yaml's DATA_DIR (the host folder it mounts at TRAIN_DATA_DIR): a data error names what the user set.
DATA_MOUNT_ENV = "COMPOSE_DATA_MOUNT"
INPLACE_WORLD_ENV = "TRAINER_INPLACE_WORLD"
REPLICA_ENV = "TRAINER_REPLICA"
REPLICA_ADDR_ENV = "TRAINER_REPLICA_ADDR"
# The in-place job's identity (its lighthouse, at the address MASTER_ADDR resolves to): the processes of one job hold
# its checkpoint directory together, and another job's are refused there (trainer.checkpoint.claim).
INPLACE_JOB_ENV = "TRAINER_INPLACE_JOB"
# The settings that shape what is trained: every host of an in-place job must have the job's (a host healed from a
# peer trains the peer's state with its own settings). Not here: where files are, how fast, what is logged.
SHAPES_TRAINING = ("model", "dataset", "image_size", "augment", "synthetic_size", "synthetic_image_size",
                   "train_crop_size", "val_resize_size", "val_crop_size", "interpolation", "auto_augment",
                   "ra_magnitude", "augmix_severity", "random_erase", "ra_sampler", "ra_reps", "epochs", "max_steps",
                   "batch_size", "global_batch_size", "grad_accum", "optimizer", "lr", "momentum", "weight_decay",
                   "norm_weight_decay", "bias_weight_decay", "lr_schedule", "warmup_steps", "lr_scheduler",
                   "lr_warmup_epochs", "lr_warmup_method", "lr_warmup_decay", "lr_step_size", "lr_gamma", "lr_min",
                   "clip_grad_norm", "label_smoothing", "mixup_alpha", "cutmix_alpha", "model_ema", "model_ema_steps",
                   "model_ema_decay", "amp", "sync_bn", "seed", "strategy")


def load_config(argv: Sequence[str] | None, environ: Mapping[str, str], world_size: int | None) -> TrainConfig:
    """Merge flags, environment, .env and defaults into a validated TrainConfig (the built-in loop's). world_size
    None: not known yet (the launcher's first look): the smallest world the settings fit, the pipeline's stages."""
    env_file, named, dotenv = read_env_file(argv)  # before the flags are parsed: --help shows its values
    parser = build_parser(environ, dotenv, env_file)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flag = next((a for a in unknown if a.startswith("-")), unknown[0]).split("=")[0]
        option = meant(flag) if flag.startswith("--") else None
        hint = f"did you mean {flag_name(option)}? " if option else ""
        raise UsageError("arguments", f"unrecognized arguments: {' '.join(unknown)}",
                         f"{hint}see `{parser.prog} --help`")
    flags = {f.name: (getattr(args, f.name), flag_name(f.name)) for f in OPTIONS if getattr(args, f.name) is not None}
    return _merged(flags, environ, args.env_file, world_size, loop=True, dotenv=dotenv)


def read_env_file(argv: Sequence[str] | None) -> tuple[str, bool, dict[str, str]]:
    """(path, named, its TRAIN_* and other values) of the dotenv file the command line names (--env-file), else the
    default .env where there is one: read before the flags are parsed, so that --help can show its values."""
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--env-file")
    named = first.parse_known_args(list(sys.argv[1:] if argv is None else argv))[0].env_file
    path = named or DEFAULT_ENV_FILE
    return path, named is not None, _read_dotenv(path, named=named is not None)


def script_settings(overrides: Mapping[str, Any], environ: Mapping[str, str], world_size: int) -> TrainConfig:
    """What a script's trainer.api.Run(**overrides) runs with: its keyword arguments, then the TRAIN_* environment
    and .env, then the defaults. The run's settings are checked by the built-in loop's code, and a mistake in one
    names the keyword argument (checkpoint_every) where the script gave it; the built-in loop's own (loop=True: its
    model, data, loss, optimizer) are carried in run.settings unchecked: the script brings its own. None: not
    given."""
    names = [f.name for f in OPTIONS]
    given = {}
    for name, value in overrides.items():
        if name not in names:
            close = meant(name)
            hint = f"did you mean {close}? " if close else ""
            raise UsageError(name, "is not a setting of Run()", f"{hint}`trainer --help` lists the settings as "
                             "flags: --checkpoint-every is checkpoint_every")
        if value is not None:
            given[name] = (str(value) if not isinstance(value, bool) else str(value).lower(), name)
    return _merged(given, environ, None, world_size, loop=False)


def _merged(given: Mapping[str, tuple[str, str]], environ: Mapping[str, str], env_file_named: str | None,
            world_size: int | None, loop: bool, dotenv: Mapping[str, str] | None = None) -> TrainConfig:
    """given: {option: (raw value, the setting's name for errors)}, which win over the environment and .env; loop:
    the built-in loop's (its own model and data checked too); dotenv: the file's values, if read already."""
    env_file = env_file_named or DEFAULT_ENV_FILE
    if dotenv is None:
        dotenv = _read_dotenv(env_file, named=env_file_named is not None)
    _reject_unknown_names(environ, "the environment")
    _reject_unknown_names(dotenv, env_file)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}  # option -> the setting the user wrote, for error messages
    for f in OPTIONS:
        if f.name in given:
            raw, setting = given[f.name]
        elif env_name(f.name) in environ:
            raw, setting = environ[env_name(f.name)], env_name(f.name)
        elif env_name(f.name) in dotenv:
            raw, setting = dotenv[env_name(f.name)], f"{env_name(f.name)} (in {env_file})"
        else:
            continue
        # With postponed annotations f.type is the annotation's text: "int", "bool", ...
        values[f.name] = _convert(raw, f.type, setting, f.metadata["choices"])
        sources[f.name] = setting
    if world_size is None:
        world_size = TrainConfig(**values).pipeline_stages
    largest = environ.get(ELASTIC_WORLD_ENV, "").strip()
    if largest.isdigit() and int(largest) != world_size and not values.get("global_batch_size"):
        # Elastic membership: the global batch of the largest world is the run's at every size, so the
        # per-process batch follows the world size and a checkpoint's position stays exact across a change.
        shaped = TrainConfig(**values)
        values["global_batch_size"] = shaped.batch_size * (int(largest) // shaped.pipeline_stages) * shaped.grad_accum
        sources.pop("batch_size", None)
        values.pop("batch_size", None)
        sources["global_batch_size"] = f"the elastic job's global batch ({flag_name('batch_size')} at world size {largest})"
    restarted = environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")
    if values.get("resume") == "never" and restarted:
        # torchrun restarted the workers after a failure: the checkpoints there are this run's own.
        values["resume"] = "auto"
    elif restarted and values.get("resume") not in (None, "auto") and environ.get(RUN_STARTED_ENV, "").strip():
        # An explicit --resume FILE started the run: a restart goes on from what the run committed since (the
        # launcher's agent says when the run started; older checkpoints there are another run's), else from FILE.
        values["resume"] = newest_since(TrainConfig(**values).checkpoint_dir, float(environ[RUN_STARTED_ENV])) or \
            values["resume"]
    return _validated(TrainConfig(**values), world_size, sources, loop)


RUN_STARTED_ENV = "TRAINER_RUN_STARTED"  # the launcher's agent: when this run began (time.time())


def newest_since(directory: str, started: float) -> str | None:
    """The newest committed checkpoint written in the directory since `started` (None: none)."""
    from trainer.config.resume import list_checkpoints  # the one home of the checkpoints' names

    return next((str(p) for p in list_checkpoints(Path(directory)) if p.stat().st_mtime >= started), None)


def _reject_unknown_names(variables: Mapping[str, str], where: str) -> None:
    """A misspelt TRAIN_ name would otherwise be ignored in silence, and the run train with the default."""
    known = [env_name(f.name) for f in OPTIONS] + list(LAUNCHER_VARIABLES)
    for name in variables:
        if name.startswith(ENV_PREFIX) and name not in known:
            # Compared without the prefix: every name shares it, which made TRAIN_LEARNING_RATE "close" to TRAIN_LOG_DIR.
            option = meant(name.removeprefix(ENV_PREFIX))
            launcher = difflib.get_close_matches(name.removeprefix(ENV_PREFIX).lower(),
                                                 [v.removeprefix(ENV_PREFIX).lower() for v in LAUNCHER_VARIABLES], n=1)
            close = env_name(option) if option else env_name(launcher[0]) if launcher else None
            hint = f"did you mean {close}? " if close else ""
            raise UsageError(name, f"in {where} is not a training setting", f"{hint}`trainer --help` lists them")


def _read_dotenv(path: str, named: bool) -> dict[str, str]:
    """named: the user gave the file, so a typo in its name must not drop every setting in it."""
    if not Path(path).exists() or Path(path).is_dir():
        if not named:
            return {}  # the default .env is optional
        problem = "is a directory" if Path(path).is_dir() else "does not exist"
        raise UsageError("--env-file", f"'{path}' {problem}", "give a dotenv file, or /dev/null for none")
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # -sig: editors on Windows start files with a BOM
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError("--env-file", f"cannot read {path}: {err}", "fix or remove the file") from None
    for binding in parse_stream(io.StringIO(text)):
        if binding.error:  # python-dotenv only logs these and drops the line: the setting would be lost
            raise UsageError("--env-file", f"{path} line {binding.original.line} is not KEY=value: "
                             f"{binding.original.string.strip()[:80]!r}", "fix the line (quote values with spaces)")
    return {k: v for k, v in dotenv_values(stream=io.StringIO(text)).items() if v is not None}


def no_step_error(batches_per_rank: int, grad_accum: int) -> UsageError:
    return UsageError("--batch-size", f"{batches_per_rank} batches per rank make no optimizer step of {grad_accum} "
                      "micro-batches", "lower --batch-size or --grad-accum, or use more data")


# --tracker, --profile-steps and --profile-ranks: read here, once; trackers.py and profiling.py use these.
TRACKERS = {"tensorboard": "tensorboard", "csv": None, "wandb": "wandb", "mlflow": "mlflow"}  # -> module needed
TRACKER_EXTRAS = {"wandb": "wandb", "mlflow": "mlflow"}  # pip extras and the image's TRACKERS build argument


def tracker_names(text: str, setting: str = "--tracker") -> list[str]:
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    for name in names:
        if name not in TRACKERS:
            raise UsageError(setting, f"unknown tracker '{name}'", "choose from " + ", ".join(TRACKERS))
        module = TRACKERS[name]
        if module and importlib.util.find_spec(module) is None:
            extra = TRACKER_EXTRAS.get(name, name)
            raise UsageError(setting, f"{name} is not installed", f"pip install 'ddp-trainer[{extra}]', or build "
                             f"the image with --build-arg TRACKERS={extra}; or drop {name} from {setting}")
    return list(dict.fromkeys(names))


def profile_window(text: str, setting: str = "--profile-steps") -> tuple[int, int] | None:
    """--profile-steps A:B as (A, B), optimizer steps counted from 1; None when off."""
    if not text.strip():
        return None
    first, sep, last = text.strip().partition(":")
    try:
        window = (int(first), int(last)) if sep else (int(first), int(first))
    except ValueError:
        raise UsageError(setting, f"'{text}' is not A:B", "give optimizer steps such as 10:15") from None
    if window[0] < 1 or window[1] < window[0]:
        raise UsageError(setting, f"'{text}' is out of order", "give A:B with 1 <= A <= B, such as 10:15")
    return window


def profile_rank_list(text: str, world_size: int, setting: str = "--profile-ranks") -> list[int]:
    if text.strip().lower() == "all":
        return list(range(world_size))
    try:
        ranks = sorted({int(r) for r in text.split(",") if r.strip()})
    except ValueError:
        raise UsageError(setting, f"'{text}' is not a list of ranks", "give all, or ranks such as 0,1") from None
    if not ranks or ranks[0] < 0 or ranks[-1] >= world_size:
        raise UsageError(setting, f"'{text}' names no rank of this world of {world_size}",
                         f"give ranks from 0 to {world_size - 1}, or all")
    return ranks


def bad_file_bound(text: str, epoch_files: int, setting: str = "--max-bad-files") -> int:
    """--max-bad-files as a number of files an epoch of `epoch_files` may skip: a count (10), or a fraction (0.001)
    of the epoch, at least 1 file (a fraction of a file would make any one bad file end the run)."""
    raw = text.strip()
    if raw.isdigit():
        return int(raw)
    try:
        fraction = float(raw)
    except ValueError:
        fraction = math.nan
    if not 0 <= fraction <= 1:  # NaN too
        raise UsageError(setting, f"'{text}' is neither a count of files (10) nor a fraction of the epoch (0.001)",
                         "give a whole number of files, or a fraction from 0 to 1")
    return max(1, math.ceil(fraction * epoch_files)) if fraction else 0


def _check_observability(cfg: TrainConfig, world_size: int, setting) -> None:
    tracker_names(cfg.tracker, setting("tracker"))
    window = profile_window(cfg.profile_steps, setting("profile_steps"))
    if window and cfg.max_steps and window[1] > cfg.max_steps:
        raise UsageError(setting("profile_steps"), f"{cfg.profile_steps} ends beyond --max-steps {cfg.max_steps}",
                         f"profile steps up to {cfg.max_steps}")
    profile_rank_list(cfg.profile_ranks, world_size, setting("profile_ranks"))


def augment_policy(augment: str, side: int) -> str:
    """--augment's policy for crops of `side` pixels (an image folder's, a pack's): auto is imagenet (torchvision's
    reference crop, RandomResizedCrop) from LIGHT_AUGMENT_BELOW px up, else light (the CIFAR recipe's padded crop)."""
    return ("imagenet" if side >= LIGHT_AUGMENT_BELOW else "light") if augment == "auto" else augment


def crop_sizes(cfg: TrainConfig) -> tuple[int, int, int]:
    """(training crop, validation resize, validation crop) in pixels: --train-crop-size, --val-resize-size and
    --val-crop-size where given, else the sides the datasets had before them (--image-size for image folders, the
    images' own for in-memory datasets) and 8/7 of the validation crop (torchvision's 256 for 224)."""
    side = catalog.dataset_image_size(cfg.dataset, cfg.synthetic_image_size, cfg.image_size) \
        if cfg.dataset in catalog.DATASETS else cfg.image_size
    val_crop = cfg.val_crop_size or side
    return cfg.train_crop_size or side, cfg.val_resize_size or int(val_crop * 8 / 7), val_crop


# Each setting's range, checked where its door reads it (a loop=True setting by the built-in loop only).
MINIMA = (("synthetic_size", 1), ("synthetic_image_size", 8), ("image_size", 8), ("epochs", 1), ("max_steps", 0),
          ("batch_size", 1), ("global_batch_size", 0), ("grad_accum", 1), ("lr", 0), ("momentum", 0),
          ("weight_decay", 0), ("warmup_steps", -1), ("num_workers", 0), ("val_every", 0), ("log_every", 1),
          ("checkpoint_every", 0), ("keep_checkpoints", 2), ("collective_timeout", 1), ("local_sgd_period", 0),
          ("seed", 0), ("train_crop_size", 0), ("val_resize_size", 0), ("val_crop_size", 0), ("ra_magnitude", 0),
          ("augmix_severity", 1), ("random_erase", 0), ("ra_reps", 1), ("label_smoothing", 0), ("mixup_alpha", 0),
          ("cutmix_alpha", 0), ("norm_weight_decay", 0), ("bias_weight_decay", 0), ("model_ema_steps", 1),
          ("pipeline_stages", 1), ("pipeline_microbatches", 1), ("lr_warmup_epochs", 0), ("lr_warmup_decay", 0),
          ("lr_step_size", 1), ("lr_min", 0))
MAXIMA = (("synthetic_image_size", 1024), ("image_size", 4096), ("collective_timeout", WEEK_S), ("seed", 2**32 - 1),
          ("train_crop_size", 4096), ("val_resize_size", 4096), ("val_crop_size", 4096), ("ra_magnitude", 30),
          ("augmix_severity", 10), ("random_erase", 1), ("lr_warmup_decay", 1))


def built_in_loop_only(name: str) -> bool:
    """A setting of the built-in loop's own model, data, loss and optimizer (option(..., loop=True))."""
    return bool(_FIELDS[name].metadata.get("loop"))


def _check_ranges(cfg: TrainConfig, setting, loop: bool) -> None:
    def read(name: str) -> bool:  # by this door
        return loop or not built_in_loop_only(name)

    for name, minimum in MINIMA:
        if read(name) and getattr(cfg, name) < minimum:
            raise UsageError(setting(name), f"{getattr(cfg, name)} is below {minimum}", f"use {minimum} or more")
    for name, maximum in MAXIMA:
        value = getattr(cfg, name)
        if read(name) and value > maximum:
            raise UsageError(setting(name), f"{value:g} is above {maximum}" if isinstance(value, float) else
                             f"{value} is above {maximum}", f"use {maximum} or less")
    for name in ("data_dir", "log_dir", "checkpoint_dir"):
        if read(name) and not getattr(cfg, name).strip():
            raise UsageError(setting(name), "is empty", "give a directory path")


def _check_recipe(cfg: TrainConfig, sources: dict[str, str], setting) -> None:
    """The reference recipe's settings a script's Run applies too: clipping, the average of the weights."""
    if "clip_grad_norm" in sources and cfg.clip_grad_norm <= 0:  # nan and inf: _convert refused them
        problem = "0 would scale every gradient to zero" if cfg.clip_grad_norm == 0 else \
            f"{cfg.clip_grad_norm:g} is below 0"
        raise UsageError(setting("clip_grad_norm"), problem, "give a positive bound such as 1.0, or leave it unset "
                         "for no clipping")
    if not 0 < cfg.model_ema_decay < 1:
        raise UsageError(setting("model_ema_decay"), f"{cfg.model_ema_decay:g} is not between 0 and 1",
                         "use a decay such as 0.99998 (the reference's), above 0 and below 1")
    if cfg.model_ema and cfg.strategy == "fsdp":
        raise UsageError(setting("model_ema"), "keeps a whole copy of the weights on every process, which fsdp "
                         "shards", f"drop it, or use {setting('strategy')} ddp")
    if cfg.model_ema and cfg.local_sgd_period:
        raise UsageError(setting("model_ema"), f"averages one model's weights, and {setting('local_sgd_period')} lets "
                         "every process's weights drift apart between averages", "drop one of the two")


def _check_loop_recipe(cfg: TrainConfig, setting) -> None:
    """The reference recipe's settings of the built-in loop's own data and loss (torchvision's
    references/classification/train.py): the policy, the crops against the dataset's images, the mixing."""
    if cfg.label_smoothing >= 1:
        raise UsageError(setting("label_smoothing"), f"{cfg.label_smoothing:g} is not below 1 (1 leaves the true "
                         "class no more weight than the others)", "use a value from 0 to below 1, such as 0.1")
    if cfg.auto_augment and cfg.auto_augment not in AUTO_AUGMENT:
        close = difflib.get_close_matches(cfg.auto_augment, AUTO_AUGMENT, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]}? " if close else ""
        raise UsageError(setting("auto_augment"), f"unknown policy '{cfg.auto_augment}'",
                         f"{hint}choose one of {', '.join(AUTO_AUGMENT)}, or leave it empty for none")
    for name in ("train_crop_size", "val_resize_size", "val_crop_size"):
        if 0 < getattr(cfg, name) < 8:
            raise UsageError(setting(name), f"{getattr(cfg, name)} is below 8", "use 8 or more, or 0 for the default")
    train_crop, val_resize, val_crop = crop_sizes(cfg)
    if catalog.in_memory(cfg.dataset):
        side = catalog.dataset_image_size(cfg.dataset, cfg.synthetic_image_size, cfg.image_size)
        for name in ("train_crop_size", "val_crop_size"):
            if getattr(cfg, name) > side:
                raise UsageError(setting(name), f"{getattr(cfg, name)} is larger than the {side}x{side} images of "
                                 f"{cfg.dataset}", f"use {side} or less (0: the whole image)")
        if cfg.val_resize_size:
            raise UsageError(setting("val_resize_size"), f"{cfg.dataset}'s images all are {side}x{side}, never "
                             "resized", "drop it (--val-crop-size crops their centre)")
    elif cfg.dataset in ("imagefolder", "packed") and val_crop > val_resize:
        raise UsageError(setting("val_crop_size" if cfg.val_crop_size else "val_resize_size"),
                         f"a {val_crop} px centre crop of images resized to {val_resize} px", "make --val-resize-size "
                         "at least --val-crop-size")
    if cfg.interpolation != "bilinear" and cfg.dataset == "imagefolder" and cfg.decode == "gpu":
        raise UsageError(setting("interpolation"), f"{cfg.interpolation}, and --decode gpu resizes bilinearly "
                         "(roi_align)", "use --interpolation bilinear with --decode gpu, or --decode cpu")
    mixing = next((name for name in ("mixup_alpha", "cutmix_alpha") if getattr(cfg, name)), None)
    if mixing and cfg.model in catalog.MODELS and catalog.MODELS[cfg.model].reconstructs:
        raise UsageError(setting(mixing), f"mixes class targets, and {cfg.model} is trained to reconstruct its "
                         "inputs", f"drop {setting(mixing)} for --model {cfg.model}")


def _reference_schedule(cfg: TrainConfig, sources: dict[str, str], setting) -> str:
    """--lr-scheduler as the built-in loop runs it: the reference's name lowercased, steplr (the reference's default)
    where only its other settings are given, empty where none is (the per-step --lr-schedule); its settings checked
    where torch's schedulers would refuse them mid-run, and refused beside the per-step schedule's own."""
    given = [name for name in REFERENCE_SCHEDULE if name in sources and (name != "lr_scheduler" or
                                                                         cfg.lr_scheduler.strip())]
    if not given:
        return ""
    mixed = next((name for name in ("lr_schedule", "warmup_steps") if name in sources), None)
    if mixed:
        raise UsageError(setting(mixed), f"sets the per-step schedule, and {setting(given[0])} selects torchvision's "
                         "reference schedule, stepped once per epoch", f"give one of the two: drop {setting(mixed)}, "
                         "or the reference's --lr-* settings")
    name = cfg.lr_scheduler.strip().lower() or "steplr"
    if name not in LR_SCHEDULERS:
        close = difflib.get_close_matches(name, LR_SCHEDULERS, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]}? " if close else ""
        raise UsageError(setting("lr_scheduler"), f"unknown schedule '{cfg.lr_scheduler}'",
                         f"{hint}choose one of {', '.join(LR_SCHEDULERS)}")
    if cfg.lr_warmup_epochs and cfg.lr_warmup_method == "linear" and cfg.lr_warmup_decay == 0:
        raise UsageError(setting("lr_warmup_decay"), "0 would make the linear warm-up start from nothing "
                         "(LinearLR's start factor is above 0)", "give a fraction above 0, such as the reference's "
                         "0.01")
    if cfg.lr_gamma <= 0:
        raise UsageError(setting("lr_gamma"), f"{cfg.lr_gamma:g} is not above 0", "give a factor such as the "
                         "reference's 0.1")
    if name == "cosineannealinglr" and cfg.lr_warmup_epochs >= cfg.epochs:
        raise UsageError(setting("lr_warmup_epochs"), f"{cfg.lr_warmup_epochs} of {cfg.epochs} epochs leave the "
                         "cosine none (it anneals over --epochs less the warm-up)",
                         f"use fewer than {cfg.epochs}, or raise --epochs")
    return name


def _batch_per_process(cfg: TrainConfig, world_size: int, sources: dict[str, str], setting) -> int:
    """The samples per process per micro-batch: --batch-size, or --global-batch-size over the world (`world_size`:
    its data-parallel replicas, the processes over the pipeline stages)."""
    if not cfg.global_batch_size:
        return cfg.batch_size
    per_step = world_size * cfg.grad_accum
    if cfg.global_batch_size % per_step:
        width = f"{world_size} replicas" if cfg.pipeline_stages > 1 else f"world size {world_size}"
        raise UsageError(setting("global_batch_size"), f"{cfg.global_batch_size} is not divisible by {width} x "
                         f"grad-accum {cfg.grad_accum}", f"use a multiple of {per_step}")
    batch_size = cfg.global_batch_size // per_step
    if "batch_size" in sources and batch_size != cfg.batch_size:
        raise UsageError(setting("global_batch_size"), f"{cfg.global_batch_size} makes {batch_size} samples per "
                         f"process per micro-batch, and {setting('batch_size')} says {cfg.batch_size}",
                         "give one of the two")
    return batch_size


def _check_image_folder(cfg: TrainConfig, setting) -> None:
    """--dataset imagefolder: the folders ImageFolder needs, checked before torchvision is imported (seconds)."""
    train_dir = Path(cfg.data_dir) / "train"
    mounted = os.environ.get(DATA_MOUNT_ENV, "").strip()
    if mounted and setting("data_dir") == env_name("data_dir"):  # compose's: name the host folder the user set
        what, where, docker = "DATA_DIR", f"'{mounted}' (mounted at {cfg.data_dir})", (
            "; a DATA_DIR that did not exist was made by Docker, empty and owned by root: remove it")
    else:
        what, where, docker = setting("data_dir"), f"'{cfg.data_dir}'", ""
    if not Path(cfg.data_dir).exists():
        raise UsageError(what, f"{where} does not exist", "give the folder that holds train/<class>/*.jpg and "
                         "val/<class>/*.jpg")
    if not train_dir.is_dir():
        raise UsageError(what, f"{where} has no train/ folder for imagefolder",
                         f"mount a folder with train/<class>/*.jpg and val/<class>/*.jpg{docker}")
    try:  # the cheap half of ImageFolder's check
        has_class_folders = any(entry.is_dir() for entry in train_dir.iterdir())
    except OSError as err:
        raise UsageError(setting("data_dir"), f"cannot list {train_dir} ({err.strerror})",
                         "make the data folder readable by the trainer's user") from None
    if not has_class_folders:
        raise UsageError(setting("data_dir"), f"{train_dir} has no class folders",
                         f"put images in {train_dir}/<class>/ (.jpg, .png, ...)")
    for split in (train_dir, Path(cfg.data_dir) / "val"):
        if not split.is_dir():
            continue
        try:  # the other half: a class folder without an image, which ImageFolder refuses in every worker
            _, empty = catalog.class_folders(split)
        except OSError as err:
            raise UsageError(setting("data_dir"), f"cannot list {split} ({err.strerror})",
                             "make the data folder readable by the trainer's user") from None
        if empty:
            raise UsageError(setting("data_dir"), f"{len(empty)} class folder(s) of {split} hold no image: "
                             f"{', '.join(empty[:5])}{', ...' if len(empty) > 5 else ''}",
                             f"put images in them ({', '.join(catalog.IMAGE_EXTENSIONS)}) or remove them")


def _check_loop_data(cfg: TrainConfig, world_size: int, batch_size: int, setting) -> None:
    """The built-in loop's model and data: their names, the synthetic set's memory and steps, the files."""
    catalog.check_model_name(cfg.model, setting("model"))
    catalog.check_dataset_name(cfg.dataset, setting("dataset"))
    if cfg.dataset == "synthetic":
        need = round(cfg.synthetic_size * 1.2) * 3 * cfg.synthetic_image_size ** 2  # uint8, train + val
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if need > have:
            raise UsageError(setting("synthetic_size"), f"{cfg.synthetic_size} images of {cfg.synthetic_image_size}"
                             f"x{cfg.synthetic_image_size} need {need / 2**30:.1f} GiB and this host has "
                             f"{have / 2**30:.1f} GiB", "lower --synthetic-size or --synthetic-image-size")
        synthetic_batches = cfg.synthetic_size // world_size // batch_size  # per rank, as the sampler cuts them
        if synthetic_batches < cfg.grad_accum:
            raise no_step_error(synthetic_batches, cfg.grad_accum)
    if not 0 <= cfg.decode_gpu_share <= 1:
        raise UsageError(setting("decode_gpu_share"), f"{cfg.decode_gpu_share:g} is not a share between 0 and 1",
                         "give e.g. 0.65 for two thirds of each batch on the GPU's decoder, or 1 for all")
    if cfg.momentum >= 1:
        raise UsageError(setting("momentum"), f"{cfg.momentum} must be below 1", "use a value such as 0.9")
    if cfg.dataset == "imagefolder":
        _check_image_folder(cfg, setting)
    if cfg.dataset == "packed" and not (Path(cfg.data_dir) / "pack.json").is_file():
        raise UsageError(setting("data_dir"), f"'{cfg.data_dir}' holds no pack.json for --dataset packed",
                         f"pack an image folder into it first: trainer-pack SRC {cfg.data_dir}")
    if cfg.dataset in ("cifar10", "mnist") and Path(cfg.data_dir).exists() and not Path(cfg.data_dir).is_dir():
        raise UsageError(setting("data_dir"), f"'{cfg.data_dir}' is not a directory", "point it at a dataset folder")
    if cfg.loader == "memory" and not catalog.in_memory(cfg.dataset):
        raise UsageError(setting("loader"), f"{cfg.dataset} is read sample by sample, not held in memory",
                         "use --loader dataloader or auto")
    if cfg.model == "autoencoder" and cfg.channels_last:
        raise UsageError(setting("channels_last"), "the MLP autoencoder has no convolutions",
                         "drop --channels-last for --model autoencoder")


def _check_strategy(cfg: TrainConfig, setting) -> None:
    if cfg.strategy == "fsdp" and cfg.sync_bn:
        raise UsageError(setting("sync_bn"), "SyncBatchNorm is for strategy ddp (fsdp shards the norm layers)",
                         f"drop {setting('sync_bn')}, or use {setting('strategy')} ddp")
    if cfg.strategy == "fsdp" and cfg.local_sgd_period:
        raise UsageError(setting("local_sgd_period"), "averages whole copies of the parameters, which no process "
                         "holds under fsdp", f"drop it, or use {setting('strategy')} ddp")
    if cfg.strategy != "fsdp" and cfg.fsdp_cpu_offload:
        raise UsageError(setting("fsdp_cpu_offload"), "offloads fsdp's shards, and this run is strategy ddp",
                         f"add {setting('strategy')} fsdp, or drop it")


# What pipeline stages do not compose with (yet), and why: one line each.
NOT_WITH_PIPELINE = (
    ("local_sgd_period", "averages whole models now and then"),
    ("model_ema", "averages the whole model's weights"),
    ("sync_bn", "synchronises BatchNorm over every process"),
    ("compile", "compiles the whole model"),
    ("activation_checkpointing", "recomputes the whole model's blocks"),
    ("fsdp_cpu_offload", "offloads the whole model's shards"),
)


def _check_pipeline(cfg: TrainConfig, world_size: int, setting) -> int:
    """Pipeline stages against the world and what they do not compose with; the data-parallel replicas."""
    stages = cfg.pipeline_stages
    if stages == 1:
        return world_size
    if world_size % stages:
        raise UsageError(setting("pipeline_stages"), f"{stages} stages do not divide world size {world_size}",
                         f"use a divisor of {world_size}, or another NPROC_PER_NODE: the world is the stages times "
                         "the data-parallel replicas")
    for name, what in NOT_WITH_PIPELINE:
        if getattr(cfg, name):
            raise UsageError(setting(name), f"{what}, and each of the {stages} pipeline stages holds a part of it",
                             f"drop it, or use {setting('pipeline_stages')} 1")
    if cfg.amp == "fp16":
        raise UsageError(setting("amp"), "fp16's loss scaler skips an overflowing step on the process that sees it, "
                         "and pipeline stages must skip together", "use bf16")
    names = split_names(cfg.pipeline_split)
    if cfg.pipeline_schedule == "interleaved-1f1b":
        if names and ((len(names) + 1) % stages or (len(names) + 1) // stages < 2):
            raise UsageError(setting("pipeline_split"), f"{len(names)} name{'s' * (len(names) != 1)} cut"
                             f"{'s' * (len(names) == 1)} the model into {len(names) + 1} "
                             f"pieces, and interleaved-1f1b gives each of the {stages} stages 2 or more, as many each",
                             f"name {2 * stages - 1}, {3 * stages - 1}... modules, or use "
                             f"{setting('pipeline_schedule')} 1f1b")
        rounds = max(1, cfg.pipeline_microbatches // stages)  # torch's interleaved schedule runs them in rounds
        if cfg.pipeline_microbatches % rounds:
            raise UsageError(setting("pipeline_microbatches"), f"interleaved-1f1b runs {cfg.pipeline_microbatches} "
                             f"micro-batches in {rounds} rounds of about {stages}, which {cfg.pipeline_microbatches} "
                             "does not divide into", f"use a multiple of {stages}")
    elif names and len(names) != stages - 1:
        raise UsageError(setting("pipeline_split"), f"{len(names)} names for {stages} stages",
                         f"name the {stages - 1} module{'s' * (stages != 2)} that begin{'s' * (stages == 2)} each "
                         "stage after the first, comma-separated; or leave it empty for a balanced cut")
    return world_size // stages


def _validated(cfg: TrainConfig, world_size: int, sources: dict[str, str], loop: bool) -> TrainConfig:
    """The settings checked as their door reads them: the run's everywhere; loop: the built-in loop's own model,
    data, loss and optimizer too (a script brings its own, and its Run checks none of them)."""
    def setting(name: str) -> str:
        return sources.get(name, flag_name(name) if loop else name)

    _check_ranges(cfg, setting, loop)
    _check_observability(cfg, world_size, setting)
    bad_file_bound(cfg.max_bad_files, 0, setting("max_bad_files"))
    _check_recipe(cfg, sources, setting)
    _check_strategy(cfg, setting)
    replicas = _check_pipeline(cfg, world_size, setting)
    batch_size = _batch_per_process(cfg, replicas, sources, setting)
    if cfg.pipeline_stages > 1 and batch_size % cfg.pipeline_microbatches:
        raise UsageError(setting("pipeline_microbatches"), f"{cfg.pipeline_microbatches} does not divide the "
                         f"{batch_size} samples per process", f"use a divisor of {batch_size}")
    if loop:
        _check_loop_recipe(cfg, setting)
        _check_loop_data(cfg, replicas, batch_size, setting)
        cfg = dataclasses.replace(cfg, lr_scheduler=_reference_schedule(cfg, sources, setting))
    if cfg.resume not in ("auto", "never") and not Path(cfg.resume).exists():
        raise UsageError(setting("resume"), f"checkpoint '{cfg.resume}' does not exist",
                         "give a checkpoint (a step-* file or directory), auto or never")
    return dataclasses.replace(cfg, batch_size=batch_size, world_size=world_size)


def check_gpu_options(backend: str, sync_bn: bool, cuda_available: bool, world_size: int,
                      label: Callable[[str], str] = flag_name) -> None:
    """Settings that need a GPU, refused where there is none (the launcher checks before torchrun starts
    ranks that would each fail). label: a setting's name as its user wrote it (a script's keyword argument)."""
    if backend == "nccl" and not cuda_available:
        raise UsageError(label("backend"), "nccl needs a CUDA GPU and none is visible",
                         f"use {label('backend')} gloo (or auto) on CPU hosts, or give the container GPUs")
    if sync_bn and world_size > 1 and not cuda_available:
        raise UsageError(label("sync_bn"), "SyncBatchNorm runs on CUDA GPUs only and none is visible",
                         f"drop {label('sync_bn')} on CPU hosts")
