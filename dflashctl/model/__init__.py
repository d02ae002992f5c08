"""The job model, below every layer that moves jobs: job files (`jobfile`) and the local record of a launched job
(`record`). `remote/` and `jobs/` both build on it; it imports only `config` and `errors`."""
