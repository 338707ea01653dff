"""The int8 draft layer: int8 kernel for a few rows, the floating weight's GEMM for many."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdecode.models.quantize import Int8Linear, int8_supported, quantize_int8_

pytestmark = pytest.mark.skipif(not int8_supported(torch.device("cpu")), reason="no int8 kernel on this CPU build")


def _layer(bias: bool = True) -> tuple[nn.Linear, Int8Linear]:
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=bias).to(torch.bfloat16)
    return linear, Int8Linear(linear)


def test_many_rows_use_the_floating_weight_exactly():
    linear, q = _layer()
    x = torch.randn(2, Int8Linear.MAX_INT8_ROWS, 64, dtype=torch.bfloat16)
    assert torch.equal(q(x), F.linear(x, linear.weight) + linear.bias)


def test_few_rows_use_int8_close_to_the_floating_result():
    linear, q = _layer()
    x = torch.randn(Int8Linear.MAX_INT8_ROWS - 1, 64, dtype=torch.bfloat16)
    exact = F.linear(x, linear.weight) + linear.bias
    y = q(x)
    assert not torch.equal(y, exact)  # it really is the quantized path
    torch.testing.assert_close(y.float(), exact.float(), atol=0.05, rtol=0.05)


def test_quantize_replaces_every_linear_and_keeps_shared_weights_shared():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32, bias=False)).to(torch.bfloat16)
    original = model[0].weight
    quantize_int8_(model)
    assert isinstance(model[0], Int8Linear) and isinstance(model[2], Int8Linear)
    assert model[0].weight is original  # tied weights (an LM head and its embedding) are not copied
