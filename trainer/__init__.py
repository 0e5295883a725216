"""The trainer (docs/architecture.md, "Trainer"): the RL loop and its numerical core.

The core: `algorithms` (advantages and the decoupled PPO-clip loss, pure tensor math),
`batching` (trajectories → validated micro-batches under a token budget) and
`backends.torch_backend` (`TorchPolicy`: an HF model, AdamW, checkpoints).

Importing this package is cheap; torch is imported by the modules that need it.
"""
