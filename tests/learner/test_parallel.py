"""A learner rank's process setup (`streamrl.learner.parallel`) on a GPU (marked `gpu`): its CUDA allocations are
expandable segments, unless the user configured the allocator."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif("PYTORCH_CUDA_ALLOC_CONF" in os.environ, reason="the user's allocator settings win")
def test_a_rank_allocates_in_expandable_segments_on_gpu(tp1_world: None) -> None:
    torch.cuda.empty_cache()  # earlier tests' cached segments would serve the request
    tensor = torch.empty(97 << 20, dtype=torch.uint8, device="cuda")  # in a new segment
    address = tensor.data_ptr()
    (segment,) = [
        s for s in torch.cuda.memory._snapshot()["segments"] if s["address"] <= address < s["address"] + s["total_size"]
    ]
    assert segment["is_expandable"]
