"""Quantized array formats: ``quantize(x, fmt, **options)`` / ``dequantize(q)`` and the array classes.

Importing this package registers every format (see :func:`formats`).
"""

from jaxlp.formats.base import (QuantizedArray, array_class, concatenate_rows, dequantize, formats, quantize,
                                take_rows)

# --- E2M1 codec, NVFP4, MXFP4, FP8 E4M3 ---
from jaxlp.formats import e2m1, fp8, mxfp4, nvfp4
from jaxlp.formats.fp8 import FP8Array
from jaxlp.formats.mxfp4 import MXFP4Array
from jaxlp.formats.nvfp4 import NVFP4Array

# --- NestedFP, INT4xFP8 (FireQ), DialectFP4 (BlockDialect) ---
from jaxlp.formats import dialect_fp4, int4_fp8, nestedfp
from jaxlp.formats.dialect_fp4 import DialectFP4Array
from jaxlp.formats.int4_fp8 import Int4FP8Array
from jaxlp.formats.nestedfp import NestedFPArray
