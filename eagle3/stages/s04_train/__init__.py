"""Stage 04: train the EAGLE-3 drafter.

`run.train_drafter(config.TrainConfig(...))` is the stage; `run.Trainer` builds, steps,
evaluates, checkpoints and loops, and asks the modules below for the rest. Modules, by
what they own:

The loop
    config.py             TrainConfig (the `train:` section of configs/*.yaml)
    run.py                the stage: checked inputs, `Trainer`, the manifest

The data
    data_source.py        what `Trainer` trains on, step by step: the whole split or the rounds
    data.py               batches: the epochs' packing, the plan of each step, the prefetcher
    windows.py            the rounds over stage 02's windows: their schedule, folders, deletion
    loss_positions.py     which positions of the train split carry loss, before the first step

The starting weights
    finetune.py           --init-from: an existing drafter, its lm_head mapped into ours
    target_layer_init.py  --init-layer, --init-head: a fresh drafter from the target's weights

The machine
    distributed.py        the process group and every collective outside DDP
    cuda_alloc.py         the CUDA caching allocator's setting
    memory.py             the predicted peak memory per GPU

Held-out figures and reporting
    evaluation.py         the held-out metrics, the same whatever the process count
    target_mass.py        the draft vocabulary's share of the target's probability (sampling)
    metrics.py            metric sums over batches and ranks, metrics.jsonl, the log lines
    trackers.py           the experiment trackers of --report-to
    summary.py            the words at the end of a run, the run config the trackers record

The checkpoints
    checkpoint.py         what a resume needs, written atomically; the latest readable one
"""
