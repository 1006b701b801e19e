"""Pure-PyTorch definitions of every op: what the kernels and the extension are tested against."""
