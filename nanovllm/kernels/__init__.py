"""Attention kernels over the paged KV cache.

`reference` holds plain-torch versions (the CPU path and the tests' ground truth);
`triton_attention` holds the Triton kernels used on GPU. This package file imports neither,
so `import nanovllm.kernels` never pulls in triton.
"""
