"""Trainer backends: `torch_backend` (an HF model on CPU or CUDA, FSDP2 across ranks) and
`megatron` (megatron-core on CUDA: docs/megatron.md). Both answer `base.Policy`."""
