"""The offline tools on a run's checkpoints: consolidate, export, inspect / verify / list, eval and serve
(docs/ARCHITECTURE.md, "Layers")."""
