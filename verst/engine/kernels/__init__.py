"""The engine's fused kernels: C for the CPU (`cpu`, built at first use), Triton for CUDA
(`cuda`, `fused_norm`), and oneDNN-packed bf16 linears (`packed_linear`)."""
