"""The judge: what state a job is in, from what its files and processes say. Pure."""
