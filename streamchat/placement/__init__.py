"""Where and in what form the weights run: device and dtype, weight-only quantization, tensor parallelism."""
