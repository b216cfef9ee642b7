"""Suite-wide setup. Triton kernels run on CPU through the interpreter; ``TRITON_INTERPRET``
must be set before anything imports Triton, so it is set here, before any test module loads."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
