"""The `megatron` trainer backend: megatron-core's GPTModel on CUDA (docs/megatron.md)."""
