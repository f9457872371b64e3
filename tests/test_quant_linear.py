"""The GEMMs over GGUF-quantized weights against x @ dequant(W)^T in float64, W dequantized by gguf's
numpy reference, for each block format and each instruction-set build (this machine's, and
tests/test_cpu_kernels.py's AVX2, AVX2 + AVX-VNNI, AVX-512 without VNNI and portable builds):
quant_linear (worker/csrc/quant_linear.cpp) with x as it is, its weights widened for prefill-sized
products through oneDNN (dequantize_quant_weight), quant_linear_int8 (quant_linear_int8.cpp, every
build but the portable one) with x rounded as quantize_activations rounds it."""

import functools

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from metroserve.worker import onednn
from metroserve.worker.cpu_kernels import load_cpu_kernels
from metroserve.worker.model_files import ModelLoadError, default_model_path
from metroserve.worker.quantization import DEQUANTIZE_MIN_ROWS, QuantPart
from tests.test_cpu_kernels import EXTRA_ISA_MARCH, ISA_MARCH, build_for_instruction_set

Q = GGMLQuantizationType
# One block; SmolLM2's hidden and intermediate sizes. The super-block formats need multiples of 256.
SHAPES = [(t, k) for t in (Q.Q4_0, Q.Q4_1, Q.Q8_0) for k in (32, 576, 1536)] + [
    (t, k) for t in (Q.Q4_K, Q.Q6_K) for k in (256, 1536)]
PACKED_OVER_RAW = {Q.Q4_K: 148 / 144, Q.Q6_K: 274 / 210}  # the super-blocks' scales as bytes, Q6_K's quants as int8
N = 203  # output columns: no whole number of strips (16 or 8 wide) nor of 4-strip tiles
WIDEST_STRIP = 16


@pytest.fixture(scope="module", params=["native", *sorted(ISA_MARCH), *sorted(EXTRA_ISA_MARCH)])
def kernels(request):
    if request.param != "native":
        return build_for_instruction_set(request.param)
    k = load_cpu_kernels()
    if k is None:
        pytest.skip("no C++ toolchain for the CPU kernels")
    return k


@functools.cache
def quantized(qtype: GGMLQuantizationType, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Random [N, k] weights as GGML blocks and as their float64 dequantization."""
    rng = np.random.default_rng(k + 1000 * qtype)
    if qtype in PACKED_OVER_RAW:
        raw = random_super_blocks(qtype, k, rng)
    else:
        raw = quantize(rng.standard_normal((N, k)).astype(np.float32), qtype)
    return raw, dequantize(raw, qtype).astype(np.float64)


def random_super_blocks(qtype: GGMLQuantizationType, k: int, rng: np.random.Generator) -> np.ndarray:
    """[N, k / 256 * block bytes] of random Q4_K / Q6_K super-blocks (gguf quantizes neither): any quant and
    sub-block scale bytes are valid; the fp16 super-block scales (Q4_K's d and dmin first, Q6_K's d last)
    are made small and finite."""
    size = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (N, k // 256, size), dtype=np.uint8)
    scales = (rng.random((N, k // 256, 2)) * 0.01).astype(np.float16).view(np.uint8)
    if qtype == Q.Q4_K:
        raw[..., :4] = scales
    else:
        raw[..., size - 2 :] = scales[..., :2]
    return raw.reshape(N, -1)


def assert_matches(y: torch.Tensor, x: torch.Tensor, deq: np.ndarray) -> None:
    """y within float32 rounding of a K-term sum (twice K units of roundoff) of x @ deq^T."""
    xd = x.double().numpy()
    error = np.abs(y.double().numpy() - xd @ deq.T)
    bound = 2 * deq.shape[1] * 2.0**-24 * (np.abs(xd) @ np.abs(deq).T)
    assert y.shape == (x.shape[0], deq.shape[0]) and (error <= bound).all(), (error / bound).max()


@pytest.mark.parametrize("rows", [1, 3, 16, 33, 300])  # decode batches (partial and whole row tiles), prefill
@pytest.mark.parametrize("qtype, k", SHAPES, ids=[f"{t.name}-{k}" for t, k in SHAPES])
def test_quant_linear_matches_dequantized_reference(kernels, qtype, k, rows):
    raw, deq = quantized(qtype, k)
    packed = kernels.pack_quant_weight(torch.from_numpy(raw), int(qtype), k)
    size = raw.size * PACKED_OVER_RAW.get(qtype, 1) * (N + WIDEST_STRIP) / N  # the file's bytes, whole strips
    assert packed.dtype == torch.uint8 and packed.numel() <= size
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    assert_matches(kernels.quant_linear(x, packed, int(qtype), N), x, deq)


@pytest.mark.parametrize("qtype, k", SHAPES, ids=[f"{t.name}-{k}" for t, k in SHAPES])
def test_dequantized_weight_is_the_blocks_weights(kernels, qtype, k):
    """dequantize_quant_weight: d q (+ m) of every block, within one float32 rounding of the
    float64 dequantization; and a QuantPart at prefill size, which multiplies it through oneDNN,
    matches the reference as the kernel does."""
    raw, deq = quantized(qtype, k)
    packed = kernels.pack_quant_weight(torch.from_numpy(raw), int(qtype), k)
    weight = kernels.dequantize_quant_weight(packed, int(qtype), k, N)
    assert weight.shape == (N, k) and weight.dtype == torch.float32
    # A few float32 roundings of the row's weights (scale products, d q + m), as gguf's own float32 has.
    error = np.abs(weight.double().numpy() - deq)
    assert (error <= 2**-21 * np.abs(deq).max(axis=1, keepdims=True)).all()
    if not onednn.available():
        return
    part = QuantPart(packed, int(qtype), N, raw.nbytes, int8_activations=False)
    x = torch.randn(DEQUANTIZE_MIN_ROWS, k, generator=torch.Generator().manual_seed(k))
    assert_matches(part(kernels, x), x, deq)


@pytest.fixture
def int8_kernels(kernels):
    if not kernels.int8_gemm_available():
        pytest.skip("the portable build has no int8-activation GEMM")
    return kernels


def rounded(kernels, x: torch.Tensor) -> torch.Tensor:
    """x as quant_linear_int8 multiplies it: quantize_activations' q times its per-32 scale d."""
    q, d = kernels.quantize_activations(x.contiguous())
    return q.float() * d.repeat_interleave(32, dim=1)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 300])  # every tile height of both widths, prefill
@pytest.mark.parametrize("qtype, k", SHAPES, ids=[f"{t.name}-{k}" for t, k in SHAPES])
def test_int8_quant_linear_matches_rounded_reference(int8_kernels, qtype, k, rows):
    raw, deq = quantized(qtype, k)
    packed = int8_kernels.pack_quant_weight_int8(torch.from_numpy(raw), int(qtype), k)
    size = raw.size * PACKED_OVER_RAW.get(qtype, 1) * (N + WIDEST_STRIP) / N
    assert packed.dtype == torch.int8 and packed.numel() <= size  # int8: this layout's tag
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    assert_matches(int8_kernels.quant_linear_int8(x, packed, int(qtype), N), rounded(int8_kernels, x), deq)


def test_int8_quant_linear_strided_rows_and_refusals(int8_kernels):
    qtype, k = Q.Q4_1, 576
    raw, deq = quantized(qtype, k)
    packed = int8_kernels.pack_quant_weight_int8(torch.from_numpy(raw), int(qtype), k)
    x = torch.randn(5, k + 64)[:, :k]  # rows need not be adjacent
    assert_matches(int8_kernels.quant_linear_int8(x, packed, int(qtype), N), rounded(int8_kernels, x), deq)
    with pytest.raises(RuntimeError, match="not packed"):
        int8_kernels.quant_linear_int8(x, packed, int(qtype), N + 64)
    with pytest.raises(RuntimeError, match="not packed"):  # each kernel refuses the other's layout
        int8_kernels.quant_linear(x, packed, int(qtype), N)
    float_packed = int8_kernels.pack_quant_weight(torch.from_numpy(raw), int(qtype), k)
    with pytest.raises(RuntimeError, match="not packed"):
        int8_kernels.quant_linear_int8(x, float_packed, int(qtype), N)
    tiny = torch.full((1, k), 1e-39)  # subnormal: the rounding's scale overflows, the quants stay in range
    q, _ = int8_kernels.quantize_activations(tiny)
    assert q.abs().max() <= 127


def test_quantize_activations_rounds_each_32_inputs_to_int8(kernels):
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 3, 96)
    x[2, 32:64] = 0  # an all-zero block: scale 0, quants 0
    q, d = kernels.quantize_activations(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and d.shape == (7, 3)
    blocks = x.view(7, 3, 32)
    amax = blocks.abs().amax(-1)
    torch.testing.assert_close(d, amax / 127, rtol=2**-23, atol=0)
    scaled = blocks * torch.where(amax > 0, 127 / amax, 0)[..., None]
    # round to nearest; a value within float rounding of .5 may go either way
    off = (q.view(7, 3, 32).float() - scaled).abs()
    assert (off <= 0.5 + 1e-4).all() and q.abs().max() <= 127
    assert (q.view(7, 3, 32).abs().amax(-1)[amax > 0] == 127).all() and (q[2, 32:64] == 0).all()


def test_without_integer_products_the_int8_gemm_is_refused(kernels):
    if kernels.int8_gemm_available():
        pytest.skip("this build has integer products (AVX2 or AVX-512)")
    raw, _ = quantized(Q.Q4_1, 576)
    with pytest.raises(RuntimeError, match="no int8 products"):
        kernels.pack_quant_weight_int8(torch.from_numpy(raw), int(Q.Q4_1), 576)
    with pytest.raises(RuntimeError, match="no int8 products"):
        kernels.quant_linear_int8(torch.randn(1, 576), torch.zeros(1, dtype=torch.uint8), int(Q.Q4_1), N)


def test_saturation_prone_products_are_exact(int8_kernels):
    """The largest products each format allows (every quant at its maximum, every input at +-127 in
    runs of one sign): where 16-bit pair sums are used (AVX2 / AVX-512 without VNNI) they must not
    saturate."""
    k = 256
    for qtype, q8 in ((Q.Q4_0, 0), (Q.Q4_1, 0), (Q.Q8_0, 0x7F), (Q.Q8_0, 0x80), (Q.Q4_K, 0), (Q.Q6_K, 0)):
        size = GGML_QUANT_SIZES[qtype][1]
        raw = np.full((N, k // GGML_QUANT_SIZES[qtype][0], size), 0xFF, dtype=np.uint8)
        scale = np.array([2.0**-10], dtype=np.float16).view(np.uint8)
        if qtype == Q.Q6_K:
            raw[..., size - 2 :] = scale
        else:  # the leading fp16 scales (Q4_1's and Q4_K's min too)
            raw[..., : 4 if qtype in (Q.Q4_1, Q.Q4_K) else 2] = np.tile(scale, 2 if qtype in (Q.Q4_1, Q.Q4_K) else 1)
        if qtype == Q.Q8_0:
            raw[..., 2:] = q8  # +127 or -128 (0xFF is -1)
        rows = raw.reshape(N, -1)
        deq = dequantize(rows, qtype).astype(np.float64)
        packed = int8_kernels.pack_quant_weight_int8(torch.from_numpy(rows), int(qtype), k)
        x = torch.ones(3, k) * torch.tensor([1.0, -1.0, 0.5])[:, None]
        assert_matches(int8_kernels.quant_linear_int8(x, packed, int(qtype), N), rounded(int8_kernels, x), deq)


def test_quant_linear_strided_rows_and_refusals(kernels):
    qtype, k = Q.Q4_1, 576
    raw, deq = quantized(qtype, k)
    packed = kernels.pack_quant_weight(torch.from_numpy(raw), int(qtype), k)
    x = torch.randn(5, k + 64)[:, :k]  # rows need not be adjacent
    assert_matches(kernels.quant_linear(x, packed, int(qtype), N), x, deq)
    with pytest.raises(RuntimeError, match="not packed"):
        kernels.quant_linear(x, packed, int(qtype), N + 64)
    with pytest.raises(RuntimeError, match="not packed"):
        kernels.quant_linear(x, packed, int(Q.Q8_0), N)
    with pytest.raises(RuntimeError, match="GGML type 13 is not supported"):
        kernels.pack_quant_weight(torch.from_numpy(raw), int(Q.Q5_K), k)
    with pytest.raises(RuntimeError, match="raw must be"):
        kernels.pack_quant_weight(torch.from_numpy(raw), int(qtype), k + 32)
    with pytest.raises(RuntimeError, match="a multiple of 256"):  # 576 inputs are no whole number of super-blocks
        kernels.pack_quant_weight(torch.from_numpy(raw), int(Q.Q4_K), k)


@pytest.fixture(scope="module")
def default_gguf() -> GGUFReader:
    try:
        return GGUFReader(default_model_path())
    except ModelLoadError as e:
        pytest.skip(str(e))


# The default model's MLP down projection (Q4_1, 1536 inputs) and rows of its tied embedding / LM head (Q8_0).
@pytest.mark.parametrize("name, rows", [("blk.0.ffn_down.weight", None), ("token_embd.weight", 999)])
def test_quant_linear_on_default_model_tensor(kernels, default_gguf, name, rows):
    tensor = next(t for t in default_gguf.tensors if t.name == name)
    k = int(tensor.shape[0])  # GGUF lists the input dimension first
    raw = np.array(tensor.data[:rows])  # a copy: the reader maps the file read-only
    deq = dequantize(raw, tensor.tensor_type).astype(np.float64)
    packed = kernels.pack_quant_weight(torch.from_numpy(raw), int(tensor.tensor_type), k)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(0))
    assert_matches(kernels.quant_linear(x, packed, int(tensor.tensor_type), raw.shape[0]), x, deq)
    if kernels.int8_gemm_available():
        packed = kernels.pack_quant_weight_int8(torch.from_numpy(raw), int(tensor.tensor_type), k)
        y = kernels.quant_linear_int8(x, packed, int(tensor.tensor_type), raw.shape[0])
        assert_matches(y, rounded(kernels, x), deq)
