"""How optimizer state tensors are stored: full precision or quantized formats."""
