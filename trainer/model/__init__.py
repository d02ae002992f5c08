"""The model layer: the drafter, its attention (guarded flex, the dense reference) and mask, the frozen target and
its sharding, the LM-head loss, the compile policy, and the public DFlash format. Imports only trainer.config and
trainer.errors below it."""
