"""The run layer: the parts built from a config, one step and the preflight (build), how they are spread over the
devices (parallelize), the whole run with its phases (training), checkpoints, metrics, loggers, GPU history,
processes (distributed), the memory plan, in-run tau (eval) and fault injection."""
