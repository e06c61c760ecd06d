"""Graph passes. Each rewriting pass is a function Graph -> PassResult (the new graph and whether it
changed anything) that mutates nothing; checks raise. Each is tested alone."""

from .cse import eliminate_common_subexpressions
from .dce import eliminate_dead_code
from .dtypes import check_dtypes, make_casts_explicit
from .fold import fold_constants
from .fusion import fuse_elementwise
from .pipeline import PASSES, optimize
from .result import PassResult
from .shapes import infer_shapes
from .validate import validate

__all__ = [
    "PASSES",
    "PassResult",
    "check_dtypes",
    "eliminate_common_subexpressions",
    "eliminate_dead_code",
    "fold_constants",
    "fuse_elementwise",
    "infer_shapes",
    "make_casts_explicit",
    "optimize",
    "validate",
]
