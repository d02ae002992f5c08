"""The run layer: one step and the preflight (loop), the whole run with its phases (training), checkpoints, metrics,
loggers, GPU history, processes (distributed), the memory plan, in-run tau (eval) and fault injection."""
