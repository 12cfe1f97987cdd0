"""The head's matmuls in FP8 for training: the chunked loss's logits, x gradient and weight gradient through
torch._scaled_mm, with per-tensor scales from each operand's largest magnitude (its amax).

    from gptkit import fp8
    fp8.use_fp8_head(model, device)   # a one-line DeviceError unless CUDA with compute capability >= 8.9
    loss = model(x, y)[1]             # the training loss's head matmuls now run in FP8

The forward's operands (the hidden states x and the head's weight W) are cast to float8_e4m3fn (3 mantissa
bits, up to 448); the gradient of the loss by the logits, which needs range more than precision, to
float8_e5m2 (2 mantissa bits, up to 57344). Each tensor t is scaled by s = max / amax(t) before the cast, so its
largest magnitude lands on the format's largest value, and the cast saturates (values beyond the max become the
max, never inf or NaN); _scaled_mm then multiplies by 1/s after the product, accumulating in float32. The
weights stay what they are (bf16 or fp32 master weights, updated by the optimizer as usual): only their copy for
these three matmuls is FP8, made afresh each micro-batch.

Only the training loss uses it (model.py's linear_cross_entropy, through GPT.head_matmuls): evaluation and
sampling compute the head as before. The tensor cores that multiply FP8 are those of compute capability 8.9
(Ada) and 9.0 (Hopper) on: elsewhere use_fp8_head refuses (torch._scaled_mm also runs on the CPU, slowly, which
is what the CPU tests use). What it gains is measured by `bench.py --fp8_head=False,True` (BENCHMARKS.md).
"""

from __future__ import annotations

import torch

from gptkit.runtime import DeviceError
from model import GPT, HeadMatmuls

FORWARD = torch.float8_e4m3fn  # x and W
GRADIENT = torch.float8_e5m2  # dloss/dlogits
# _scaled_mm needs every dimension of its operands to be a multiple of this.
MULTIPLE = 16


def quantize(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """t cast to the FP8 `dtype` after scaling by max / amax(t): (t8, inverse), where inverse = amax / max is
    the float32 scalar that dequantizes it (t ~= t8.float() * inverse, to the format's relative precision).
    Values are clamped to the format's range before the cast (saturation: e5m2 would otherwise give inf). An
    all-zero t gets a finite scale (its amax is taken as at least 1e-12): zeros stay zeros."""
    top = torch.finfo(dtype).max
    amax = t.detach().abs().amax().float().clamp(min=1e-12)
    scale = top / amax
    t8 = (t.float() * scale).clamp(-top, top).to(dtype)
    return t8, scale.reciprocal()


def scaled_mm(a8: torch.Tensor, b8: torch.Tensor, a_inverse: torch.Tensor, b_inverse: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """(a8 * a_inverse) @ (b8 * b_inverse) in out_dtype, by torch._scaled_mm: a8 (M, K) row-major and b8 (K, N)
    column-major, as the GPU's FP8 matmul requires (checked here, so that the CPU tests hold the GPU's layouts
    too), every dimension a multiple of 16."""
    if a8.stride(1) != 1 or b8.stride(0) != 1:
        raise ValueError(f"scaled_mm needs a row-major left operand and a column-major right one, got strides "
                         f"{a8.stride()} and {b8.stride()}")
    if any(n % MULTIPLE for n in (*a8.shape, b8.size(1))):
        raise ValueError(f"scaled_mm needs dimensions that are multiples of {MULTIPLE}, got {tuple(a8.shape)} @ "
                         f"{tuple(b8.shape)}")
    return torch._scaled_mm(a8, b8, scale_a=a_inverse, scale_b=b_inverse, out_dtype=out_dtype)


class FP8HeadMatmuls(HeadMatmuls):
    """model.HeadMatmuls in FP8: x and W quantized once per call of the loss (e4m3), each slice's dloss/dlogits g
    once (e5m2); the logits come out in float32, the x gradient in the loss' dtype, the weight gradient in
    float32 (added to the loss' float32 accumulator).

    _scaled_mm takes its left operand row-major and its right one column-major, so each matmul is arranged to
    fit: logits = x (r, C) @ W^T, W^T being W (V, C) row-major seen transposed; grad_x = g (r, V) @ W, with a
    column-major copy of W8 made once per call; grad_W = g^T (V, r) @ x (r, C), with g8 transposed (r x V
    bytes, per slice) and x's slice transposed (r x C)."""

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype):
        self.dtype = dtype
        problem = shape_problem(x.size(0), weight.size(1), weight.size(0))
        if problem:
            raise ValueError(problem)
        self.x8, self.x_inverse = quantize(x, FORWARD)  # (N, C) row-major
        self.w8, self.w_inverse = quantize(weight, FORWARD)  # (V, C) row-major
        self.w8_columns = self.w8.t().contiguous().t()  # the same (V, C), column-major

    def logits(self, rows: slice) -> torch.Tensor:
        return scaled_mm(self.x8[rows], self.w8.t(), self.x_inverse, self.w_inverse, torch.float32)

    def gradients(self, g: torch.Tensor, rows: slice, need_x: bool, grad_w: torch.Tensor | None):
        g8, g_inverse = quantize(g, GRADIENT)
        if grad_w is not None:
            x_columns = self.x8[rows].t().contiguous().t()  # (r, C) column-major
            grad_w += scaled_mm(g8.t().contiguous(), x_columns, g_inverse, self.x_inverse, torch.float32)
        if not need_x:
            return None
        return scaled_mm(g8, self.w8_columns, g_inverse, self.w_inverse, self.dtype)


def shape_problem(tokens: int, n_embd: int, n_columns: int) -> str | None:
    """Why the FP8 head cannot multiply these sizes (tokens per micro-batch, n_embd, the head's padded
    vocabulary), or None: _scaled_mm needs multiples of 16."""
    if tokens % MULTIPLE or n_embd % MULTIPLE or n_columns % MULTIPLE:
        return (f"the FP8 head needs the tokens per micro-batch, n_embd and the padded vocabulary to be multiples "
                f"of {MULTIPLE}, got {tokens} tokens, n_embd {n_embd} and {n_columns} columns")
    return None


def fp8_problem(device: torch.device | str) -> str | None:
    """Why the FP8 head cannot run on `device`, or None when it can: FP8 matmuls need a CUDA GPU of compute
    capability 8.9 or higher."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"fp8_head needs a CUDA GPU with compute capability >= 8.9 (Ada, Hopper or later), not {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"fp8_head needs a CUDA GPU with compute capability >= 8.9 (Ada, Hopper or later); "
                f"{torch.cuda.get_device_name(device)} has {major}.{minor}")
    return None


def use_fp8_head(model: GPT, device: torch.device | str, tokens: int | None = None) -> None:
    """From now on the model's training loss computes its head's matmuls in FP8 (FP8HeadMatmuls); a
    DeviceError, saying why, where the device cannot (fp8_problem), or where the sizes cannot (shape_problem:
    `tokens`, the tokens per micro-batch, when given; the model's n_embd and padded vocabulary)."""
    problem = fp8_problem(device)
    if problem is None and tokens is not None:
        problem = shape_problem(tokens, model.config.n_embd, model.config.padded_vocab_size)
    if problem:
        raise DeviceError(f"{problem}: set fp8_head=False")
    model.head_matmuls = FP8HeadMatmuls
