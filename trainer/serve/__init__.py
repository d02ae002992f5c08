"""The serving layer: a run's checkpoint exported in the public DFlash format, and tau of any drafter in that format
on prompt files (bench_tau). Above the run layer; nothing below imports it."""
