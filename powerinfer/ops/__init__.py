"""Weight containers and kernels: dense and quantized linear layers, dequantization."""
