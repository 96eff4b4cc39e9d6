"""Pre-training recipes (torchrun + FSDP2). Built by the recipe issue; nothing here yet."""
