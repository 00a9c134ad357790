"""State and checkpoints: the optimizer's state dict (:mod:`.optimizer_state`), checkpoints written once and
read on every rank (:mod:`.checkpoint`), and starting every rank alike (:mod:`.broadcast`)."""
