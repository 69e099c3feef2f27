"""flashopm: a fused, exact Outer-Product Mean for PyTorch.

Importing never compiles anything; the CUDA extension is built on the first CUDA call through the
functional API or a module.  Calling `torch.ops.flashopm.*` on CUDA tensors directly needs
`flashopm.load()` first (it builds once, then loads from the cache).
"""
from . import ops  # noqa: F401  (registers the op schemas)
from ._build import load
from .functional import outer_product_mean, outer_product_mean_rows, peak_memory_bound
from .modules import BoltzOuterProductMean, ModelNew, NamedOuterProductMean, OpenFoldOuterProductMean
from .replace import OuterProductMeanLayout, convert_outer_product_mean, replace_outer_product_means
from .reference import (
    BoltzOuterProductMeanReference,
    Model,
    OpenFoldOuterProductMeanReference,
    get_init_inputs,
    get_inputs,
    outer_product_mean_reference,
)

__version__ = "0.1.0"

__all__ = [
    "BoltzOuterProductMean",
    "BoltzOuterProductMeanReference",
    "Model",
    "ModelNew",
    "NamedOuterProductMean",
    "OpenFoldOuterProductMean",
    "OpenFoldOuterProductMeanReference",
    "OuterProductMeanLayout",
    "convert_outer_product_mean",
    "get_init_inputs",
    "get_inputs",
    "load",
    "outer_product_mean",
    "outer_product_mean_rows",
    "outer_product_mean_reference",
    "peak_memory_bound",
    "replace_outer_product_means",
]
