import pytest
import torch

from liteinfer.config import EngineConfig


def test_block_size_defaults_to_32_on_cpu_64_with_int8_pools_and_16_on_cuda():
    assert EngineConfig(device="cpu").block_size == 32
    assert EngineConfig(device="cpu", kv_cache_dtype="int8").block_size == 64
    assert EngineConfig(device="cuda").block_size == 16
    assert EngineConfig().block_size == (16 if torch.cuda.is_available() else 32)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_block_size_given_is_kept(device):
    assert EngineConfig(device=device, block_size=8).block_size == 8
