"""Jobs: their files, the registry of launched jobs, launch and kill, and the watcher."""
