"""numpy arrays and torch tensors over the same memory, bfloat16 included.

numpy has no bfloat16 of its own; Slipstream's is ml_dtypes' (:data:`slipstream.datatypes.BF16`),
which ``torch.from_numpy`` and ``Tensor.numpy`` refuse. The two share the 16-bit
patterns, so each crosses as an int16 view of the other, without a copy.
"""

from __future__ import annotations

import numpy as np
import torch

from slipstream.datatypes import BF16


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """A torch tensor over ``array``'s memory; a bfloat16 one (ml_dtypes', which torch
    cannot wrap) over its 16-bit patterns."""
    if array.dtype == BF16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def as_array(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a numpy array over its memory (bfloat16 as ml_dtypes'); the
    config's declared datatype is applied after (DeclaredOutputs)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(BF16)
    array: np.ndarray = tensor.numpy()
    return array
