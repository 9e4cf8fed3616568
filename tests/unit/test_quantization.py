import pytest
import torch

from liteinfer.layers.linear import Linear
from liteinfer.layers.quantization import INT4_GROUP_SIZE, Int4Weight, Int8Weight, quantize_linears


@pytest.fixture
def weight() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(96, 128) * 0.05


@pytest.mark.parametrize("weight_cls", [Int8Weight, Int4Weight])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_matmul_equals_matmul_with_dequantized_weight(weight_cls, dtype, weight):
    quantized = weight_cls.from_float(weight.to(dtype))
    x = torch.randn(5, 128, dtype=dtype)
    expected = x.float() @ weight_cls.dequantize_float(weight.to(dtype)).T
    tolerance = 1e-4 if dtype is torch.float32 else 0.02 * expected.abs().max().item()
    torch.testing.assert_close(quantized(x).float(), expected, atol=tolerance, rtol=0)


@pytest.mark.parametrize(("weight_cls", "levels"), [(Int8Weight, 254), (Int4Weight, 15)])
def test_quantization_error_is_within_half_a_step(weight_cls, levels, weight):
    dequantized = weight_cls.dequantize_float(weight)
    if weight_cls is Int8Weight:  # one step per row: the row's range over 254 levels
        step = 2 * weight.abs().amax(dim=1, keepdim=True) / levels
    else:  # one step per group of inputs
        groups = weight.view(weight.shape[0], -1, INT4_GROUP_SIZE)
        step = ((groups.amax(-1) - groups.amin(-1)) / levels).repeat_interleave(INT4_GROUP_SIZE, dim=1)
    assert ((dequantized - weight).abs() <= step / 2 + 1e-6).all()


def test_quantize_linears_replaces_float_weights_and_skips_unfit_shapes():
    # 48 inputs: no whole int4 group; 24 outputs: not in sixteens
    model = torch.nn.Sequential(Linear(128, 64, bias=True), Linear(48, 64), Linear(64, 24))
    for module in model:
        module.weight.data.normal_(0, 0.05)
        if module.bias is not None:
            module.bias.data.normal_()
    x = torch.randn(3, 128)
    expected = model[0](x)
    assert quantize_linears(model, "int4") == 1
    assert model[0].weight is None and isinstance(model[0].quantized, Int4Weight)
    assert all(m.weight is not None and m.quantized is None for m in model[1:])
    got = model[0](x)  # the bias is still added
    assert (got - expected).abs().max() < 0.1 * expected.abs().max()
