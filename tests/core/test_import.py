"""``import galore2`` needs only torch: optional backends are imported lazily.

Both checks run in tests/missing_backends.py's one fresh interpreter, where every optional
package is missing (triton among them).
"""

from __future__ import annotations

from ..missing_backends import assert_ok


def test_import_with_optional_backends_missing():
    assert_ok("import")


def test_kernels_without_triton_fall_back_or_fail_clearly():
    """Without triton, automatic kernel selection keeps the torch path, and asking for the
    Triton kernels (GALORE2_KERNELS=triton) is a RuntimeError that names the variable."""
    assert_ok("kernels")
