"""What is decided before any process starts: the launch plan (every check of `config validate`, `train` and
`resume`) and the memory plan (docs/ARCHITECTURE.md, "Layers")."""
