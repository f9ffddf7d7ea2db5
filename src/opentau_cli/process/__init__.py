"""The life of a launch and of its processes: the launcher (`accelerate launch` and its exit codes), each rank's
runtime, the run lock, and the bookkeeping of automatic restarts (docs/ARCHITECTURE.md, "Layers")."""
