"""The drafter: the model, its train-time-test loss, and how it runs on each device.

    model.py              DrafterConfig and Eagle3Drafter (modules only: no file I/O, no target)
    ttt_attention.py      the TTT attention: step k against steps 0..k's keys (linear-memory and reference)
    ttt.py                the TTT unroll and its loss (`ttt_loss`)
    attention_kernels.py  the fused attention kernels behind the TTT attention, CPU and CUDA
    cpu.py                what this CPU's kernels do with bf16 (the precision choice)
    shape.py              a new drafter's shape for a target (`drafter_config_for_target`)

Imports: eagle3.core, eagle3.artifacts (the draft vocabulary's arithmetic, `target_ids`) and
eagle3.target (TargetInfo, for the shape); never the serving format, an engine or a stage
(tests/unit/test_layout.py).
"""
