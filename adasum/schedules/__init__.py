"""The schedules that run a call: recursive halving, recursive doubling (and the compiled small call), the hierarchical mode."""
