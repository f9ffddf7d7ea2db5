"""A run's files and where they live: file names (layout), the format version, the manifest, lineage, readers of
safetensors / ZeRO / DCP files, the pickle scanner, finding a run's checkpoints, the output convention and the storage
seam. Imports only `config`, `errors` and `units` of opentau (docs/ARCHITECTURE.md, "Layers")."""
