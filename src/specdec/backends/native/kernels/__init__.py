"""The native backend's kernels: the linear layers of every weight format (float checkpoints'
precisions, GGUF blocks on int8 activations, the 4-bit int4 path, ONNX Runtime), the
batch-invariant attention, and the wrappers of the numba code in jit/."""
