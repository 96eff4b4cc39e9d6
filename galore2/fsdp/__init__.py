"""FSDP2 / DTensor support lives here (sharded state, distributed refresh, DCP checkpoints).

Not implemented yet: the FSDP issue builds it. Projectors and transforms never
see a DTensor; this package will supply local views to them.
"""
