import gguf
import pytest
import torch

from liteinfer.layers.linear import Linear
from liteinfer.layers.quantization import INT4_GROUP_SIZE, INT8_GROUP_SIZE, Int4Weight, Int8Weight, quantize_linears


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


@pytest.mark.parametrize("weight_cls", [Int8Weight, Int4Weight])
def test_quantized_weights_without_the_kernels_multiply_their_dequantized_form(weight_cls, weight, monkeypatch):
    # (no compiler to build kernels/gemv.cpp: the same weights through a float matmul)
    monkeypatch.setattr("liteinfer.layers.quantization.gemv_takes", lambda x, any_rows=False: False)
    quantized = weight_cls.from_float(weight)
    x = torch.randn(3, 128)
    torch.testing.assert_close(quantized(x), x @ weight_cls.dequantize_float(weight).T)


def test_int4_error_is_within_half_a_step(weight):
    dequantized = Int4Weight.dequantize_float(weight)
    groups = weight.view(weight.shape[0], -1, INT4_GROUP_SIZE)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(INT4_GROUP_SIZE, dim=1)
    assert ((dequantized - weight).abs() <= step / 2 + 1e-6).all()


def test_int8_takes_the_nearer_of_its_two_grids(weight):
    """Each group's squared error is the smaller of the two grids' (its range in 255 steps, its largest |w| in 127
    steps either side of zero), and every weight lies within half a step of the coarser grid."""
    groups = weight.view(weight.shape[0], -1, INT8_GROUP_SIZE)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)

    def grid_error(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        scale, zero = scale.half().float(), zero.half().float()
        return ((torch.round((groups - zero) / scale).clamp(-128, 127) * scale + zero - groups) ** 2).sum(-1)

    asymmetric = grid_error((high - low) / 255, low + 128 * (high - low) / 255)
    symmetric = grid_error(torch.maximum(high, -low) / 127, torch.zeros_like(low))
    error = (Int8Weight.dequantize_float(weight).view_as(groups) - groups) ** 2
    torch.testing.assert_close(error.sum(-1), torch.minimum(asymmetric, symmetric))
    assert (symmetric < asymmetric).any() and (asymmetric < symmetric).any()  # both grids serve here
    coarser_step = torch.maximum(high, -low) / 127
    assert (error.sqrt() <= coarser_step / 2 + 2**-11 * coarser_step * 128).all()


def test_int8_reproduces_8_bit_symmetric_levels_in_its_groups():
    """Weights that are 8-bit levels around zero in groups of 32 (a GGUF's Q8_0: d * q, q in -127..127, d in fp16)
    come back exactly: the symmetric grid's step is d."""
    torch.manual_seed(0)
    levels = torch.randint(-127, 128, (64, 4, INT8_GROUP_SIZE))
    levels[..., 0] = 127  # every group reaches its largest level
    d = (torch.rand(64, 4, 1) * 0.01 + 1e-3).half().float()
    weight = (d * levels).view(64, -1)
    assert torch.equal(Int8Weight.dequantize_float(weight), weight)


def test_int8_nearly_reproduces_4_bit_levels_in_its_groups():
    """Weights that are 4-bit levels in groups of 32 (as a GGUF Q4_1 file stores them: d * q + m, q in 0..15)
    come back to within fp16's rounding of the scale and zero: 255 steps hold the 15 exactly (17 steps apart). The
    groups here lie around zero, as trained weights' do (a zero far from it costs a relative 2^-11 of itself), their
    steps in fp16's normal range (above 2^-14; below it a scale is held to fp16's smallest step, 2^-24)."""
    torch.manual_seed(0)
    levels = torch.randint(0, 16, (64, 4, INT8_GROUP_SIZE))
    levels[..., 0], levels[..., 1] = 0, 15  # every group spans all 16 levels
    d = 0.002 + torch.rand(64, 4, 1) * 0.01
    m = -d * (7.5 + 2 * torch.randn(64, 4, 1))
    weight = (d * levels + m).view(64, -1)
    error = (Int8Weight.dequantize_float(weight) - weight).abs().view(64, 4, -1)
    assert (error <= 2**-10 * weight.abs().view(64, 4, -1).amax(-1, keepdim=True)).all()
    assert (error <= 0.3 * (d / 17) / 2).all()  # well inside half of int8's own step: the levels line up


@pytest.mark.parametrize(("gguf_type", "weight_cls"), [("Q4_1", Int4Weight), ("Q8_0", Int8Weight)])
def test_a_gguf_files_4_and_8_bit_groups_come_back_exactly(gguf_type, weight_cls):
    """Weights read from a GGUF file's Q4_1 blocks (d * q + m per group of 32, as SmolLM2's layers are stored) are
    int4's exactly, and its Q8_0 blocks (d * q: SmolLM2's embeddings and tied head) int8's: the quantized engine then
    holds the very values the float engine loads, and in fp32 computes with them to fp32's accuracy
    (kernels/gemv.cpp), not with an approximation of them."""
    torch.manual_seed(0)
    values = (torch.randn(96, 4 * 64) * 0.05).numpy()
    quant_type = getattr(gguf.GGMLQuantizationType, gguf_type)
    weight = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(values, quant_type), quant_type))
    assert not torch.equal(weight, torch.from_numpy(values))  # the file's values, not the ones it was made from
    assert torch.equal(weight_cls.dequantize_float(weight), weight)


def test_int8_keeps_a_group_of_equal_values_and_refuses_values_beyond_fp16():
    weight = torch.full((16, 64), 0.25)
    weight[:, 32:] = torch.linspace(-1, 1, 32)
    torch.testing.assert_close(Int8Weight.dequantize_float(weight), weight, atol=1 / 255 + 1e-3, rtol=0)
    assert Int8Weight.fits(weight)
    assert not Int8Weight.fits(weight * 1e5)  # the zeros could not be held in fp16: the layer stays in floats
    assert not Int8Weight.fits(torch.zeros(16, 48))  # no whole group of 32


def test_quantize_linears_replaces_float_weights_and_skips_unfit_shapes():
    # 48 and 96 inputs: not whole blocks of int4's 64
    model = torch.nn.Sequential(Linear(128, 64, bias=True), Linear(48, 64), Linear(96, 24))
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
    # int8 takes inputs in groups of 32 and any number of outputs: 48 inputs stay in floats
    model = torch.nn.Sequential(Linear(128, 64), Linear(48, 64), Linear(96, 24))
    for module in model:
        module.weight.data.normal_(0, 0.05)
    assert quantize_linears(model, "int8") == 2 and model[1].quantized is None
