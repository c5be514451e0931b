"""Array types shared by the pool and its plugins (numpy, one slot per plan)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from scheduler.costmodel import MAX_BATCHED_TOKENS

Floats = npt.NDArray[np.float64]
Bools = npt.NDArray[np.bool_]
CHUNK_TOKENS = MAX_BATCHED_TOKENS  # a prompt is prefilled in chunks of at most this many tokens
