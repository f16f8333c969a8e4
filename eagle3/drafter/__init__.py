"""The drafter: its model, the TTT loss, the attention kernels and the CPU precision choice, and its shape for a target."""
