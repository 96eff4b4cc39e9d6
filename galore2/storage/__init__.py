"""How optimizer state tensors are stored: one :class:`~galore2.storage.format.TensorFormat`
per format — fp32 / bf16 / state dtypes (``format``), int8 / int4 absmax bases (``basis``),
bitsandbytes' dynamic 8-bit blockwise moments (``dynamic8``) — and which tensors use which
(``moments``, ``dtype``)."""
