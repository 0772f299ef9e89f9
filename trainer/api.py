"""The helper API for your own training script: every capability of the built-in loop, around your own loop.

    from trainer import api

    with api.Run() as run:                                  # TRAIN_* settings and .env; keyword arguments win
        model = run.wrap(build_model())                     # strategy ddp or fsdp, on this rank's device
        optimizer = torch.optim.AdamW(model.parameters())   # after wrap(): fsdp shards the parameters in place
        run.resume(model=model, optimizer=optimizer)        # the newest valid checkpoint, at any world size
        loader = DataLoader(data, batch_size=32, sampler=run.sampler(data, 32), drop_last=True)
        for epoch in run.epochs():
            for micro_batches in run.steps(loader):         # one optimizer step each; ends on a stop
                for x, y in micro_batches:                  # grad_accum of them, gradients synced on the last
                    with run.autocast():
                        loss = loss_fn(model(x.to(run.device)), y.to(run.device))
                    run.backward(loss)
                run.optimizer_step(optimizer)

Run it with `trainer-launch my_train.py ARGS`, plain torchrun, Slurm's srun, or `python my_train.py`. The built-in
loop (`python -m trainer`, trainer/engine/loop.py) is written on these very pieces.

Run(checkpoint_dir=None, log_dir=None, **settings)
    Settings: every TRAIN_* setting by its lower-case name (`trainer --help` lists them): keyword arguments win
    over the TRAIN_* environment, which wins over .env, which wins over the defaults. The run's settings
    (checkpoints, logging, strategy, amp, the recipe's clipping, mixing and average: docs/settings.md's first
    table) are checked by the built-in loop's code, a mistake is one line naming the keyword and exit code 2; the
    built-in loop's own (its model, data, crops, augmentation, loss, optimizer: the second table) are carried in
    .settings for the script to read and checked against nothing: the script's data is its own. In the containers TRAIN_CHECKPOINT_DIR and
    TRAIN_LOG_DIR point at the volumes: leave checkpoint_dir and log_dir out and the script's files land there.
    Joins the process group of whichever launcher started the process (torchrun, srun, or none: one process).
    .settings .ctx .rank .local_rank .world_size .device .is_main .is_local_main .distributed
    .barrier() .main_process_first() .local_main_process_first() @.main_process_only .all_or_none(fn)
    .wrap(model, **ddp_options) -> what the step calls: DistributedDataParallel (strategy ddp) or the model
                                 sharded in place (fsdp), with activation_checkpointing, channels_last, sync_bn,
                                 compile and local_sgd_period as set; build the optimizer after it
    .autocast()                  amp's autocast (bf16, fp16) around a forward
    .backward(loss)              fp16's loss scaling, / grad_accum; the loss is kept for Loss/train
    .optimizer_step(optimizer, scheduler=None) -> bool   step (through the scaler), zero_grad, scheduler.step();
                                 with clip_grad_norm the gradients are clipped first (Grad/norm logged); False:
                                 in place abandoned the step (a host came or went), and run.steps() takes it again
    .clip_gradients(optimizer, max_norm=None) -> the norm before clipping: for your own optimizer.step()
    .mixup_cutmix(inputs, targets, num_classes) -> the batch mixed as mixup_alpha and cutmix_alpha say
                                 (torchvision's MixUp/CutMix; targets become probabilities), per micro-batch
    .ema                         with model_ema: the average of the model (torch.optim.swa_utils.AveragedModel:
                                 .ema.module), made by resume(), updated every model_ema_steps steps, in every
                                 checkpoint; api.evaluate(run, run.ema, batches) and api.Validator report it
    .no_sync(last_micro_batch)   accumulating by hand: no gradient exchange but on a step's last micro-batch
    .sampler(dataset_or_size, batch_size, seed=None) -> ResumableSampler (the built-in loop's order)
    .plan(steps_per_epoch, epochs=None) -> total steps (the sampler calls it; the progress bar and checks use it)
    .resume(**objects) -> int    objects with state_dict()/load_state_dict() go into every checkpoint and are
                                 loaded now from the newest valid one (weights_only=True); returns the steps done
    .resume_point                the checkpoint found at start-up (path, step, epoch, door, config, names)
    .epochs(count=None)          the epochs left (count, else the epochs setting); commits at each epoch's end
    .steps(batches)              one optimizer step per item, an iterator over its micro-batches; counts, logs,
                                 checkpoints and votes on a stop at their cadence; ends on a stop or the last step
    .step(**scalars) -> bool     the same for a step you took yourself; True: stopping (committed), leave the loop
    .log(**scalars) .save() .paused() .consistent() .finish()
    .step_count .epoch .position .stopped .total_steps .scaler .checkpointer .observers .strategy
Validator(run, batches, model=None, objective=None, every=1, count=None)
    .epoch_done()                every `every` whole epochs: Loss/val (acc1/val, acc5/val for class logits),
                                 reduced over every rank's shard, to the trackers and summary.json
evaluate(run, model, batches, count=None, objective=None) -> metrics, now (a collective)
eval_shard(size, rank, world_size) -> this rank's validation indices (no padding)
ResumableSampler(size, batch_size, rank=0, world_size=1, seed=0), epoch_shard(...)  (trainer.data.sampling)
                             run.sampler() gives ra_sampler's repeated order (ra_reps) when it is set
parameter_groups(model, weight_decay, norm_weight_decay, bias_weight_decay) -> the optimizer's parameter groups
                             as torchvision's reference (and the built-in loop) builds them
dataloader_worker_init       DataLoader(..., num_workers=N, worker_init_fn=api.dataloader_worker_init): a stop
                             (SIGTERM, Ctrl-C) reaches the training process only, which checkpoints
Objective(model, name, label_smoothing=0.0)   the built-in loop's loss: the model's compute_loss, else
                             cross-entropy on logits (class indices, or mixup_cutmix's probabilities)
UsageError(setting, problem, fix)   raise it for your own settings: one line `error: ...`, exit code 2

Checkpoints are committed atomically as step-<N>.pt (a directory of shards under fsdp), the newest
keep_checkpoints kept; a torn or corrupt newest one is set aside and the one before it used. A stop
checkpoints and ends the loop; the script exits 0, and the next run resumes at the next unseen batch, at
this world size or another. The run writes summary.json (with every rank's step timing) at the end.
"""

from __future__ import annotations

from trainer.core.errors import UsageError
from trainer.data.sampling import ResumableSampler, epoch_shard
from trainer.parallel.supervised import GracefulStop
from trainer.engine.models import Objective
from trainer.engine.optim import parameter_groups
from trainer.engine.run import Run
from trainer.engine.validate import Validator, eval_shard, evaluate

__all__ = ["Run", "Validator", "evaluate", "eval_shard", "Objective", "ResumableSampler", "epoch_shard",
           "dataloader_worker_init", "parameter_groups", "UsageError"]

# DataLoader(..., worker_init_fn=api.dataloader_worker_init): with worker processes, a stop (SIGTERM,
# Ctrl-C) must reach only the training process, which checkpoints; see GracefulStop.
dataloader_worker_init = GracefulStop.dataloader_worker_init
