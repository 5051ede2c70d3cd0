"""Quantized checkpoints: what their config says (`config`), how their tensors are laid out and
unpack (`formats`), the linear layers and kernels that serve them (`linear`), and a writer that
quantizes a dense checkpoint into those layouts (`write`)."""
