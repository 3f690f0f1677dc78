"""Independent float64 reference model of docs/NUMERICS.md (see numerics.py).

    from tests.reference import numerics as ref
    data, scale = ref.mxfp8_quantize(x.float().numpy())
"""

from . import numerics  # noqa: F401
from .numerics import *  # noqa: F401,F403
