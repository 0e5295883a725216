"""Trainer backends: `torch_backend` (HF model on CPU or CUDA, FSDP2 across GPUs).

`megatron` (GPU only) is not implemented here.
"""
